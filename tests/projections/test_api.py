"""Projection classes are validated once, with errors naming the class and the attribute."""

from __future__ import annotations

from typing import Any

import pytest

from kappaflow.errors import ConfigError
from kappaflow.projections import Avg, Count, Projection, ProjectionSpec, Source, Sum
from kappaflow.projections.api import CustomFold, GroupFold, LatestFold
from kappaflow.projections.follow import parse_trigger


def spec(**attrs: Any) -> ProjectionSpec:
    base = {"name": "p", "sources": ["s.public.t"], "key": ["id"]}
    base.update(attrs)
    return ProjectionSpec.from_class(type("P", (Projection,), base))


def test_fold_kind_follows_the_declaration() -> None:
    assert isinstance(spec().fold, LatestFold)
    assert isinstance(spec(aggregates={"n": Count(), "t": Sum("x")}, key=["g"]).fold, GroupFold)

    def apply(self: Any, row: Any, event: Any) -> Any:
        return row

    custom = spec(apply=apply, schema="id bigint")
    assert isinstance(custom.fold, CustomFold) and custom.kind == "custom"
    assert custom.fingerprint() != spec(apply=lambda self, row, event: None, schema="id bigint").fingerprint()


@pytest.mark.parametrize(
    ("attrs", "words"),
    [
        ({"key": None}, ["'key'", "P"]),
        ({"key": []}, ["'key'"]),
        ({"name": "bad name"}, ["'name'"]),
        ({"sources": []}, ["'sources'"]),
        ({"sources": [1]}, ["'sources'"]),
        ({"aggregates": {"n": "count"}}, ["'aggregates'", "Count()"]),
        ({"aggregates": {"t": Sum()}}, ["Sum needs a column"]),
        ({"aggregates": {"id": Count()}}, ["also a key column"]),
        ({"columns": ["name"]}, ["'columns'", "key"]),
        ({"where": ""}, ["'where'"]),
        ({"apply": lambda self, row, event: row}, ["'schema'", "custom fold"]),
        ({"apply": lambda self, row: row, "schema": "id bigint"}, ["apply(self, row, event)"]),
    ],
)
def test_bad_declarations_are_refused_clearly(attrs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        spec(**attrs)
    for w in words:
        assert w in str(err.value)


def test_sources_and_triggers() -> None:
    s = spec(sources=["a.public.t", Source("b.public.t", key={"id": "id"})])
    assert s.topics == ["a.public.t", "b.public.t"]
    with pytest.raises(ConfigError, match="twice"):
        spec(sources=["a.public.t", "a.public.t"])
    assert parse_trigger("0.5s") == "500 milliseconds"
    assert parse_trigger("2 seconds") == "2000 milliseconds"
    assert parse_trigger("250ms") == "250 milliseconds"
    with pytest.raises(ConfigError, match="--trigger"):
        parse_trigger("soon")
    assert Avg("x").func == "avg"


def test_sinks_default_to_postgres_and_options_map_onto_the_sinks_view_options() -> None:
    assert spec().sinks == ("postgres",) and spec().view_options() == {}
    s = spec(sinks=("postgres", "search", "redis"),
             sink_options={"search": {"fields": {"name": "text"}}, "redis": {"ttl_s": 3600, "format": "hash"}})
    assert s.sinks == ("postgres", "search", "redis")
    assert s.view_options() == {
        "search": {"fields": {"name": "text"}}, "redis": {"ttl_s": 3600, "value_format": "hash"}
    }
    assert spec(sinks="redis").sinks == ("redis",)


def test_the_fingerprint_changes_with_options_that_shape_the_view_only() -> None:
    base = spec(sinks=("postgres", "search", "redis"))
    assert base.fingerprint() == spec().fingerprint()  # adding a sink does not invalidate existing views
    fields = spec(sinks=("search",), sink_options={"search": {"fields": {"name": "text"}}})
    assert fields.fingerprint() != base.fingerprint()
    fmt = spec(sinks=("redis",), sink_options={"redis": {"format": "hash"}})
    assert fmt.fingerprint() != base.fingerprint()
    ttl = spec(sinks=("redis",), sink_options={"redis": {"ttl_s": 60}})
    assert ttl.fingerprint() == base.fingerprint()  # a TTL does not change what is stored


@pytest.mark.parametrize(
    ("attrs", "words"),
    [
        ({"sinks": ("pg",)}, ["'sinks'", "'pg'", "P"]),
        ({"sinks": ()}, ["'sinks'"]),
        ({"sinks": ("redis", "redis")}, ["'sinks'", "twice"]),
        ({"sink_options": {"redis": {"ttl_s": 5}}}, ["'sink_options'", "does not write to 'redis'"]),
        ({"sinks": ("redis",), "sink_options": {"redis": {"ttl_s": -1}}}, ["'sink_options'['redis']", "ttl_s"]),
        ({"sinks": ("search",), "sink_options": {"search": {"bogus": 1}}}, ["'sink_options'['search']", "bogus"]),
        ({"sink_options": {"postgres": {"x": 1}}}, ["'sink_options'['postgres']", "no per-view options"]),
        ({"sinks": ("search", "redis"), "aggregates": {"n": Count()}, "key": ["g"]},
         ["'sinks'", "grouped", "['search', 'redis']", "only together with 'postgres'", "apply_grouped",
          "mirrors"]),
    ],
)
def test_bad_sink_declarations_are_refused_clearly(attrs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        spec(**attrs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_on_schema_change_defaults_by_fold_and_refuses_unknown_values() -> None:
    """``on_schema_change``: "evolve" for a latest-row view of every column, "rebuild" for the other
    folds; a bad value is a ConfigError naming the projection class and the field."""
    assert spec().on_schema_change == "evolve" and spec().auto_rebuild is False
    assert spec(columns=["id", "x"]).on_schema_change == "rebuild"
    assert spec(aggregates={"n": Count()}, key=["g"]).on_schema_change == "rebuild"
    assert spec(apply=lambda self, row, event: row, schema="id bigint").on_schema_change == "rebuild"
    for policy in ("evolve", "rebuild", "fail"):
        assert spec(on_schema_change=policy).on_schema_change == policy
    assert spec(on_schema_change="rebuild", auto_rebuild=True).auto_rebuild is True
    # the policy decides how a view meets a change, never what a replay gives: not in the fingerprint
    assert spec(on_schema_change="fail").fingerprint() == spec().fingerprint()
    for attrs, words in (
        ({"on_schema_change": "sometimes"}, ["P", "'on_schema_change'", "'sometimes'", "evolve", "rebuild", "fail"]),
        ({"on_schema_change": "EVOLVE"}, ["'on_schema_change'", "'EVOLVE'"]),
        ({"on_schema_change": 1}, ["'on_schema_change'"]),
        ({"auto_rebuild": "yes"}, ["P", "'auto_rebuild'", "'yes'"]),
        ({"on_schema_change": "fail", "auto_rebuild": True}, ["'auto_rebuild'", "'fail'"]),
    ):
        with pytest.raises(ConfigError) as err:
            spec(**attrs)
        assert all(w in str(err.value) for w in words), (attrs, str(err.value))
