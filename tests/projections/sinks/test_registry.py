"""The sink registry: what configures each sink kind, how it opens, and how per-view options are checked."""

from __future__ import annotations

import pytest

from kappaflow.config import ViewsConfig
from kappaflow.errors import ConfigError
from kappaflow.projections.api import SINK_KINDS
from kappaflow.projections.runtime import SINK_SETTINGS
from kappaflow.projections.sinks.redis import RedisSink
from kappaflow.projections.sinks.registry import SINKS, open_sinks, sink_kind
from kappaflow.projections.sinks.search import SearchSink


def test_every_kind_is_configured_by_its_own_views_table() -> None:
    assert SINK_KINDS == tuple(SINKS) == ("postgres", "search", "redis")
    assert SINK_SETTINGS == {"postgres": "views.postgres.dsn", "search": "views.search.url",
                             "redis": "views.redis.url"}
    assert SINKS["search"].setting_env == "KAPPAFLOW_VIEWS__SEARCH__URL"
    for name, kind in SINKS.items():
        assert isinstance(getattr(ViewsConfig(), name), kind.settings)
    with pytest.raises(ConfigError, match=r"unknown sink 'nosuch'; expected one of \['postgres', 'search', 'redis'\]"):
        sink_kind("nosuch")


def test_open_sinks_opens_the_configured_ones_only() -> None:
    # redis-py and opensearch-py connect on first use: nothing is contacted here
    views = ViewsConfig(search={"url": "http://127.0.0.1:9", "flavor": "opensearch"},
                        redis={"url": "redis://127.0.0.1:9/0"})
    sinks = open_sinks(views)
    try:
        assert list(sinks) == ["search", "redis"]
        assert isinstance(sinks["search"], SearchSink) and isinstance(sinks["redis"], RedisSink)
    finally:
        for s in sinks.values():
            s.close()
    with pytest.raises(ConfigError, match=r"no view store configured; set one of views\.postgres\.dsn"):
        open_sinks(ViewsConfig())


def test_per_view_options_go_through_the_kinds_model_and_aliases() -> None:
    redis = SINKS["redis"]
    assert redis.resolve_aliases({"ttl": 5, "format": "hash"}, "here") == {"ttl_s": 5, "value_format": "hash"}
    with pytest.raises(ConfigError, match="'ttl' and 'ttl_s' are the same option"):
        redis.resolve_aliases({"ttl_s": 5, "ttl": 6}, "here")
    with pytest.raises(ConfigError, match=r"here: invalid configuration\n  ttl_s"):
        redis.parse_options({"ttl_s": -1}, "here")
    with pytest.raises(ConfigError, match="the PostgreSQL sink takes no per-view options"):
        SINKS["postgres"].parse_options({"x": 1}, "here")
