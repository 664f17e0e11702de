"""The Debezium source reads its topics with the configured Kafka client and its security settings.

Records are Debezium's documented PostgreSQL snapshot read event (fixtures/pg_customers_read.json,
from the Debezium PostgreSQL connector documentation), one per customer id, keyed like Debezium
(``{"id": N}``), spread over three partitions by a plain kafka-python producer.
"""

from __future__ import annotations

import copy
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from kappaflow.cli.capture import make_connector
from kappaflow.config import Settings
from kappaflow.connectors.debezium.source import DebeziumSource
from kappaflow.errors import KappaflowError
from kappaflow.log.embedded import EmbeddedLog

FIXTURES = Path(__file__).parent / "fixtures"
CLIENTS = ["confluent", "kafka-python"]


def _produce(bootstrap: str, topic: str, n: int) -> None:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    finally:
        admin.close()
    doc = orjson.loads((FIXTURES / "pg_customers_read.json").read_bytes())
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    try:
        for i in range(n):
            rec = copy.deepcopy(doc)
            rec["after"]["id"] = i
            rec["source"]["lsn"] = 24023128 + i
            producer.send(topic, key=orjson.dumps({"id": i}), value=orjson.dumps(rec))
        producer.flush(30)
    finally:
        producer.close()


@pytest.mark.integration
@pytest.mark.parametrize("client", CLIENTS)
def test_source_reads_every_partition_once_with_either_client(kafka_broker: Any, tmp_path: Path, client: str) -> None:
    name = "dbz" + uuid.uuid4().hex[:8]
    topic = f"in-{name}.public.customers"
    _produce(kafka_broker.bootstrap, topic, 3000)
    with EmbeddedLog(tmp_path / "log") as log:
        src = DebeziumSource(name=name, log=log, bootstrap=kafka_broker.bootstrap, topics=[topic], partitions=2,
                             kafka_options={"client": client}, batch_records=700)
        assert src.run(until_caught_up=True).events == 3000
        out = f"{name}.public.customers"
        ids = [orjson.loads(r.key)["id"] for p in range(2) for r in log.iter_partition(out, p)]
        assert sorted(ids) == list(range(3000)), "every record once"
        stored = orjson.loads(src.summary.position)[topic]
        assert set(stored) == {"0", "1", "2"} and sum(stored.values()) == 3000, stored
        again = DebeziumSource(name=name, log=log, bootstrap=kafka_broker.bootstrap, topics=[topic], partitions=2,
                               kafka_options={"client": client})
        assert again.run(until_caught_up=True).events == 0


@pytest.mark.integration
@pytest.mark.parametrize("client", CLIENTS)
def test_the_input_stays_on_a_partition_while_it_has_records(kafka_broker: Any, client: str) -> None:
    """Moving the reader to another partition drops the client's prefetch: the input reads a partition
    until it has no records or ``switch_after`` were taken from it, not a partition per poll."""
    from kappaflow.connectors.debezium.kafka_input import DebeziumInput

    topic = f"in-{uuid.uuid4().hex[:8]}.public.customers"
    _produce(kafka_broker.bootstrap, topic, 3000)
    source = DebeziumInput("dbz", kafka_broker.bootstrap, [topic], {"client": client}, switch_after=400)
    try:
        source.assign(None)
        reads: list[tuple[int, int]] = []  # (partition, records) of every read that returned records
        read = source.log.read

        def counting(t: str, p: int, offset: int, max_records: int = 10_000) -> Any:
            recs = read(t, p, offset, max_records)
            assert len(recs) <= max_records <= 400, "a read never asks for more than the partition's budget"
            if recs:
                reads.append((p, len(recs)))
            return recs

        source.log.read = counting  # type: ignore[method-assign]
        got: dict[int, list[int]] = {}
        deadline = time.monotonic() + 60
        while sum(map(len, got.values())) < 3000:
            assert time.monotonic() < deadline, f"only {sum(map(len, got.values()))} of 3000 records read in 60 s"
            for tp, recs in source.poll(200, 150).items():
                assert len(recs) <= 150
                got.setdefault(tp.partition, []).extend(r.offset for r in recs)
        assert all(offs == list(range(len(offs))) for offs in got.values()), "every record once, in offset order"
        runs = [p for i, (p, _n) in enumerate(reads) if i == 0 or reads[i - 1][0] != p]
        sizes = {p: len(offs) for p, offs in got.items()}
        # a partition of m records is left at most ceil(m / 400) times with records still in it
        assert len(runs) <= sum(-(-m // 400) for m in sizes.values()), (runs, sizes)
    finally:
        source.close()


TOML = """
[log]
url = "kafka://127.0.0.1:9"

[log.kafka]
client = "kafka-python"
security_protocol = "SASL_SSL"
sasl_mechanism = "SCRAM-SHA-256"
sasl_username = "kf"
ssl_cafile = "/etc/ca.pem"

[sources.dbz]
kind = "debezium"
bootstrap = "127.0.0.1:9"
topics = ["a.public.t"]

[sources.own]
kind = "debezium"
bootstrap = "127.0.0.1:9"
topics = ["a.public.t"]

[sources.own.kafka]
client = "confluent"
security_protocol = "SSL"
ssl_cafile = "/etc/other-ca.pem"
"""


def test_security_settings_reach_the_debezium_source(tmp_path: Path, embedded_log: Any) -> None:
    """Issue 13 item 13: the Debezium source takes its Kafka client and security from the configuration."""
    cfg = tmp_path / "kappaflow.toml"
    cfg.write_text(TOML)
    s = Settings.load(cfg, environ={"KAPPAFLOW_LOG__KAFKA__SASL_PASSWORD": "s3cret"})
    inherited = make_connector(s.source("dbz"), embedded_log, log_kafka=s.log.kafka)
    assert isinstance(inherited, DebeziumSource)
    assert inherited.kafka_options["client"] == "kafka-python"
    assert inherited.kafka_options["security"] == {
        "protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256", "sasl_username": "kf", "sasl_password": "s3cret",
        "ssl_cafile": "/etc/ca.pem"}
    own = make_connector(s.source("own"), embedded_log, log_kafka=s.log.kafka)
    assert isinstance(own, DebeziumSource)
    assert own.kafka_options["client"] == "confluent"
    assert own.kafka_options["security"] == {"protocol": "SSL", "ssl_cafile": "/etc/other-ca.pem"}


SECURE = {"protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "pw-never-shown"}


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_security_is_applied_by_the_confluent_client(kafka_broker: Any, embedded_log: Any) -> None:
    """TLS towards the plaintext test broker cannot connect: the configured security reached librdkafka,
    and the failure is one bounded error naming the broker (no credential in it)."""
    src = DebeziumSource(name="sec", log=embedded_log, bootstrap=kafka_broker.bootstrap, topics=["x"],
                         kafka_options={"client": "confluent", "connect_attempts": 2, "connect_timeout_s": 1.0,
                                        "request_timeout_s": 3.0, "security": SECURE})
    started = time.monotonic()
    with pytest.raises(KappaflowError) as info:
        src.run(until_caught_up=True)
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert kafka_broker.bootstrap in message and "pw-never-shown" not in message


def test_security_reaches_every_kafka_python_client() -> None:
    """kafka-python's clients get the same settings under its names (no broker: its clients connect lazily;
    against a plaintext broker kafka-python 3.0's bootstrap hangs on the failed TLS handshake)."""
    src = DebeziumSource(name="sec", log=None, bootstrap="127.0.0.1:9", topics=["x"],  # type: ignore[arg-type]
                         kafka_options={"client": "kafka-python", "security": SECURE})
    reader = src._consumer()
    try:
        for role in ("producer", "consumer", "admin"):
            opts = reader.log._options[role]  # type: ignore[attr-defined]
            assert (opts["security_protocol"], opts["sasl_mechanism"], opts["sasl_plain_username"],
                    opts["sasl_plain_password"]) == ("SASL_SSL", "PLAIN", "u", "pw-never-shown"), role
    finally:
        reader.close()


SWITCH = """
[sources.dbz.kafka]
client = "kafka-python"

[sources.dbz]
kind = "debezium"
bootstrap = "127.0.0.1:9"
topics = ["a.public.t"]
"""


def test_switch_after_is_configured_and_checked(tmp_path: Path, embedded_log: Any) -> None:
    """``switch_after`` (records read from one input partition in a row) comes from the source's table, and a
    bad value is refused naming the setting and what it must be -- in the file and when built in code."""
    cfg = tmp_path / "kappaflow.toml"
    cfg.write_text(SWITCH)
    default = make_connector(Settings.load(cfg, environ={}).source("dbz"), embedded_log)
    assert isinstance(default, DebeziumSource) and default.switch_after == 50_000
    cfg.write_text(SWITCH + "switch_after = 400\n")
    src = make_connector(Settings.load(cfg, environ={}).source("dbz"), embedded_log)
    assert isinstance(src, DebeziumSource) and src.switch_after == 400
    reader = src._consumer()  # (kafka-python connects lazily: no broker needed)
    try:
        assert reader.switch_after == 400
    finally:
        reader.close()
    env = Settings.load(cfg, environ={"KAPPAFLOW_SOURCES__DBZ__SWITCH_AFTER": "1000"}).source("dbz")
    assert env.switch_after == 1000  # type: ignore[union-attr]
    for bad, expected in (("0", "greater than or equal to 1"), ("-3", "greater than or equal to 1"),
                          ('"many"', "valid integer"), ("2.5", "valid integer"), ("true", "got a boolean")):
        cfg.write_text(SWITCH + f"switch_after = {bad}\n")
        with pytest.raises(KappaflowError) as info:
            Settings.load(cfg, environ={})
        assert "sources.dbz" in str(info.value) and "switch_after" in str(info.value), str(info.value)
        assert expected in str(info.value) and str(cfg) in str(info.value), str(info.value)
    for value in (0, -1, True, 2.0, "5"):
        with pytest.raises(KappaflowError, match=r"sources\.dbz\.switch_after: expected an integer >= 1 .*got "):
            DebeziumSource(name="dbz", log=embedded_log, bootstrap="127.0.0.1:9", topics=["a.public.t"],
                           switch_after=value)  # type: ignore[arg-type]
