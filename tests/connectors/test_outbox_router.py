"""The outbox router without a database: Debezium's options and defaults, routing, dead letters,
the configuration checks and `kappaflow source add --outbox-*`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from kappaflow.cli.app import app
from kappaflow.config import MySQLSourceConfig, PostgresSourceConfig, Settings
from kappaflow.connectors.outbox import DEBEZIUM_OPTIONS, OutboxRouter, OutboxSettings, outbox_options
from kappaflow.errors import ConfigError

POS = {"kind": "pg", "lsn": 42, "index": 0, "snapshot": False}
ROW = {"id": b"4d47e190-0402-4048-bc2c-89dd54343cdc", "aggregatetype": b"Order", "aggregateid": b"1",
       "type": b"OrderCreated", "payload": b'{"id": 1, "lineItems": []}'}


def route(row: dict[str, Any], **settings: Any) -> Any:
    settings.setdefault("tables", ["public.outbox"])
    return OutboxRouter(OutboxSettings(**settings), "shop").route(row, position=POS, where="WAL 0/2A",
                                                                   table="public.outbox")


def test_debeziums_defaults_and_documented_example() -> None:
    s = OutboxSettings(tables=["public.outbox"])
    assert (s.table_field_event_id, s.table_field_event_key, s.table_field_event_payload, s.route_by_field,
            s.route_topic_regex, s.route_topic_replacement, s.table_op_invalid_behavior,
            s.table_expand_json_payload, s.route_tombstone_on_empty_payload) == (
        "id", "aggregateid", "payload", "aggregatetype", "(?<routedByValue>.*)", "outbox.event.${routedByValue}",
        "warn", False, False)
    r = route(ROW)
    # Debezium's example: topic outbox.event.<aggregatetype>, key the aggregateid, header id, value the payload
    assert r.topic == "outbox.event.Order" and not r.dead
    assert r.record.key == b'"1"'
    assert r.record.value == ROW["payload"]
    h = dict(r.record.headers)
    assert h["id"] == ROW["id"] and h["type"] == b"OrderCreated"
    assert orjson.loads(h["kf.pos"]) == POS and h["kf.outbox"] == b"shop"
    assert set(DEBEZIUM_OPTIONS.values()) <= set(OutboxSettings.model_fields)


def test_regex_groups_and_replacement() -> None:
    r = route(ROW, route_topic_regex="(?<kind>[A-Z])(?<rest>.*)", route_topic_replacement="events.${rest}.$1")
    assert r.topic == "events.rder.O"
    dead = route({**ROW, "aggregatetype": b"order"}, route_topic_regex="(?<routedByValue>[A-Z].*)")
    assert dead.dead and "does not match route_topic_regex" in orjson.loads(dead.record.value)["reason"]
    with pytest.raises(ValidationError, match="refers to"):
        OutboxSettings(tables=["t"], route_topic_replacement="x.$3")


@pytest.mark.parametrize(("change", "reason"), [
    ({"aggregatetype": None}, "aggregatetype (route_by_field) is NULL"),
    ({"aggregateid": None}, "aggregateid (table_field_event_key) is NULL"),
    ({"aggregatetype": b"has space"}, "not a legal event topic"),
])
def test_rows_that_cannot_be_routed_are_dead_letters_naming_the_position(change: dict[str, Any],
                                                                         reason: str) -> None:
    r = route({**ROW, **change})
    assert r.dead and r.topic == "kf.dead_letter.source.shop"
    doc = orjson.loads(r.record.value)
    assert reason in doc["reason"] and "WAL 0/2A" in doc["reason"]
    assert doc["position"] == POS and doc["table"] == "public.outbox" and doc["row"]["id"] == ROW["id"].decode()


def test_payload_options() -> None:
    assert route({**ROW, "payload": None}).record.value is None
    assert route({**ROW, "payload": b""}).record.value == b""
    assert route({**ROW, "payload": b" "}, route_tombstone_on_empty_payload=True).record.value is None
    assert route(ROW, table_expand_json_payload=True).record.value == b'{"id":1,"lineItems":[]}'
    kept = route({**ROW, "payload": b"{broken"}, table_expand_json_payload=True)
    assert kept.record.value == b"{broken" and dict(kept.record.headers)["kf.outbox.payload"] == b"invalid-json"
    env = route(ROW, table_fields_additional_placement="type:envelope:eventType,aggregateid:header:agg")
    assert orjson.loads(env.record.value) == {"payload": {"id": 1, "lineItems": []}, "eventType": "OrderCreated"}
    assert dict(env.record.headers)["agg"] == b"1" and "type" not in dict(env.record.headers)
    ts = route({**ROW, "ts": b"2026-01-02 03:04:05.678+00"}, table_field_event_timestamp="ts")
    assert ts.record.timestamp_ms == 1767323045678
    with pytest.raises(ValidationError, match="partition"):
        OutboxSettings(tables=["t"], table_fields_additional_placement="p:partition")


def test_deletes_are_skipped_and_updates_follow_the_invalid_op_behavior() -> None:
    router = OutboxRouter(OutboxSettings(tables=["t"]), "shop")
    assert router.skip_change("t", "DELETE", "w") and router.skip_change("t", "TRUNCATE", "w")
    assert router.skip_change("t", "UPDATE", "w") and router.skipped_updates == 1
    fatal = OutboxRouter(OutboxSettings(tables=["t"], table_op_invalid_behavior="fatal"), "shop")
    with pytest.raises(Exception, match="table_op_invalid_behavior = 'fatal'"):
        fatal.skip_change("t", "UPDATE", "WAL 0/1")


def test_missing_columns_name_the_table_the_column_and_the_option() -> None:
    router = OutboxRouter(OutboxSettings(tables=["t"], table_field_event_key="agg"), "shop")
    with pytest.raises(ConfigError, match=r"outbox table public\.t has no column 'agg'.*table\.field\.event\.key"):
        router.check_columns("public.t", ["id", "aggregatetype", "type", "payload"])


def test_source_configs() -> None:
    with pytest.raises(ValidationError, match="not among the source's tables"):
        PostgresSourceConfig(name="a", dsn="postgresql://u@h/db", tables=["public.x"],
                             outbox={"tables": ["public.outbox"]})
    with pytest.raises(ValidationError, match="names no outbox"):
        PostgresSourceConfig(name="a", dsn="postgresql://u@h/db", outbox={})
    with pytest.raises(ValidationError, match="PostgreSQL feature"):
        MySQLSourceConfig(name="a", dsn="mysql://u@h/db", outbox={"message_prefix": "x"})
    assert outbox_options(["route.by.field=kind", "table_field_event_key=k"]) == {
        "route_by_field": "kind", "table_field_event_key": "k"}
    with pytest.raises(ConfigError, match="--outbox-option"):
        outbox_options(["nope=1"])


def test_cli_source_add_with_an_outbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["source", "add", "shop", "--postgres", "postgresql://app@localhost/shop",
                                   "--outbox-table", "public.outbox", "--outbox-message-prefix", "outbox",
                                   "--outbox-option", "route.topic.replacement=${routedByValue}.events",
                                   "--no-check"])
    assert res.exit_code == 0, res.output
    src = Settings.load(tmp_path / "kappaflow.toml", environ={}).source("shop")
    assert isinstance(src, PostgresSourceConfig) and src.tables == ["public.outbox"]
    assert src.outbox is not None and src.outbox.tables == ["public.outbox"]
    assert src.outbox.message_prefix == "outbox" and src.outbox.route_topic_replacement == "${routedByValue}.events"
    res = CliRunner().invoke(app, ["source", "add", "led", "--ledger", "postgresql://app@localhost/shop",
                                   "--outbox-table", "public.outbox", "--no-check"])
    assert res.exit_code != 0 and "--outbox-table" in res.output
