"""The sink registry: every sink kind, what configures it and how to open it.

One entry per kind names

- its **settings** model: the ``[views.<kind>]`` table of ``kappaflow.toml`` (where the store is);
- its **options** model: what a projection may set per view (``sink_options = {"<kind>": {...}}``,
  stored under ``view.options[<kind>]``), the option aliases it accepts and the options that change
  the stored view's shape (part of the definition's fingerprint);
- its **opener**: settings -> an open :class:`~kappaflow.projections.sinks.base.Sink` (also what a
  Spark executor opens: ``Sink.config()`` is the kind, its settings and constructor arguments);
- its **capabilities** the planner asks before a sink is open: ``grouped_state`` (it keeps a grouped
  view's keyed state) and the ``worker_args`` executors open it with.

Settings models are plain pydantic (``<kind>/settings.py``), read by ``kappaflow.config`` without
loading any sink; options models and sinks are imported when first used. A new sink kind adds its
package (``sinks/<kind>/``), registers here and adds its settings to ``ViewsConfig``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from kappaflow.errors import ConfigError
from kappaflow.projections.sinks.postgres.settings import PostgresSettings
from kappaflow.projections.sinks.redis.settings import RedisSettings
from kappaflow.projections.sinks.search.settings import SearchSettings

if TYPE_CHECKING:
    from kappaflow.projections.sinks.base import Sink


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class SinkKind:
    """One sink kind (see the module docstring). ``opener`` and ``options`` are ``module:attribute``
    paths, imported on first use."""

    name: str
    title: str
    """How messages name the store, e.g. ``PostgreSQL``."""
    settings: type[BaseModel]
    setting: str
    """The settings field that says where the store is (a sink is configured when it is set)."""
    opener: str
    options: str | None = None
    """The per-view options model; None: the sink takes no per-view options."""
    no_options_hint: str = ""
    option_aliases: Mapping[str, str] = field(default_factory=dict)
    shape_options: tuple[str, ...] = ()
    worker_args: Mapping[str, Any] = field(default_factory=dict)
    """Constructor arguments a Spark worker opens the sink with (``SinkConfig.for_worker``)."""
    grouped_state: bool = False
    """The sink keeps a grouped view's keyed state (``Sink.grouped_state()``); a grouped projection's
    view in any other sink mirrors the one in such a sink."""
    holds_nested: bool = False
    """A view column may hold a list of rows (a document store: search ``nested`` fields, Redis JSON):
    what a nested collection (``Projection.nested``) needs."""

    @property
    def setting_key(self) -> str:
        """The ``kappaflow.toml`` key that configures the sink, e.g. ``views.search.url``."""
        return f"views.{self.name}.{self.setting}"

    @property
    def setting_env(self) -> str:
        return "KAPPAFLOW_" + self.setting_key.upper().replace(".", "__")

    def configured(self, settings: BaseModel | None) -> bool:
        return settings is not None and bool(getattr(settings, self.setting, None))

    def open(self, settings: BaseModel, **kwargs: Any) -> Sink:
        """The sink at ``settings``; ``kwargs`` go to the sink's constructor (see ``SinkConfig``)."""
        sink: Sink = _load(self.opener)(settings, **kwargs)
        return sink

    def parse_options(self, options: Mapping[str, Any], where: str) -> BaseModel:
        """Validate per-view options with the sink's options model (errors name the option and what
        was given). Friendly aliases must be resolved first (:meth:`resolve_aliases`)."""
        if self.options is None:
            raise ConfigError(f"{where}: the {self.title} sink takes no per-view options (got {sorted(options)})"
                              + (f"; {self.no_options_hint}" if self.no_options_hint else ""))
        from kappaflow.projections.sinks.document import parse_options

        model: BaseModel = parse_options(_load(self.options), options, where)
        return model

    def resolve_aliases(self, options: Mapping[str, Any], where: str) -> dict[str, Any]:
        """Options with friendly names (e.g. Redis ``ttl``) replaced by the sink's own."""
        mapped: dict[str, Any] = {}
        for k, v in options.items():
            real = str(self.option_aliases.get(k) or k)
            if real in mapped:
                raise ConfigError(f"{where}: {k!r} and {real!r} are the same option")
            mapped[real] = v
        return mapped


SINKS: dict[str, SinkKind] = {}
"""Every registered sink kind by name, in the order they were registered."""


def register(kind: SinkKind) -> SinkKind:
    if kind.name in SINKS:
        raise ConfigError(f"sink kind {kind.name!r} is registered twice")
    SINKS[kind.name] = kind
    return kind


register(SinkKind(
    "postgres", "PostgreSQL", PostgresSettings, "dsn",
    "kappaflow.projections.sinks.postgres.sink:PostgresSink.from_settings",
    no_options_hint="the table name is 'view' and the schema 'namespace'",
    worker_args={"migrate": False},
    grouped_state=True,
))
register(SinkKind(
    "search", "search", SearchSettings, "url", "kappaflow.projections.sinks.search.sink:SearchSink.from_settings",
    options="kappaflow.projections.sinks.search.options:SearchSinkOptions",
    shape_options=("index", "fields", "string_default", "settings"),
    holds_nested=True,
))
register(SinkKind(
    "redis", "Redis", RedisSettings, "url", "kappaflow.projections.sinks.redis.sink:RedisSink.from_settings",
    options="kappaflow.projections.sinks.redis.options:RedisSinkOptions",
    option_aliases={"format": "value_format", "ttl": "ttl_s"},
    shape_options=("prefix", "value_format"),
    holds_nested=True,
))


def sink_kind(name: str, where: str = "sink") -> SinkKind:
    """The registered kind `name`, or a ConfigError listing the known ones."""
    kind = SINKS.get(name)
    if kind is None:
        raise ConfigError(f"{where}: unknown sink {name!r}; expected one of {list(SINKS)}")
    return kind


def open_sinks(views: Any) -> dict[str, Sink]:
    """A sink for every store configured in ``[views]`` (``views.<kind>``), in registry order."""
    sinks: dict[str, Sink] = {}
    for name, kind in SINKS.items():
        settings = getattr(views, name, None)
        if settings is not None and kind.configured(settings):
            sinks[name] = kind.open(settings)
    if not sinks:
        keys = ", ".join(k.setting_key for k in SINKS.values())
        raise ConfigError(f"views: no view store configured; set one of {keys} in kappaflow.toml "
                          f"(or e.g. {SINKS['postgres'].setting_env})")
    return sinks


__all__ = ["SINKS", "SinkKind", "open_sinks", "register", "sink_kind"]
