"""The alias lifecycle of a search view: the public alias, one index per build with a private write
alias, shadows, the atomic alias swap, strays; and a target's positions (kept per build index)."""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import secrets
import time
from collections.abc import Mapping
from typing import Any

import orjson

from kappaflow.errors import ConfigError, SinkError
from kappaflow.projections.sinks.base import (
    Target,
    ViewColumn,
    ViewSchemaMismatch,
    ViewSpec,
    evolution,
    evolution_mismatch,
)
from kappaflow.projections.sinks.errors import SinkStateLostError
from kappaflow.projections.sinks.search.client import _HttpError
from kappaflow.projections.sinks.search.mapping import derive_mapping
from kappaflow.projections.sinks.search.positions import PositionsIndex

log = logging.getLogger(__name__)


_ALIAS_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,150}$")


_LABEL_RE = re.compile(r"^[a-z0-9]{1,20}$")


class AliasLifecycle(PositionsIndex):
    """Targets as indexes behind aliases (see the module docstring)."""

    def alias(self, view: ViewSpec) -> str:
        name = self.view_options(view).index or view.name.lower()
        if not _ALIAS_RE.match(name):
            raise ConfigError(f"view {view.name!r}: search index name {name!r}: expected lowercase letters, digits, "
                              f"'_', '.', '-', starting with a letter or digit")
        return name

    def mapping(self, view: ViewSpec) -> dict[str, Any]:
        opts = self.view_options(view)
        return derive_mapping(view, overrides=opts.fields, string_default=opts.string_default)

    def _index_prefix(self, view: ViewSpec) -> str:
        return f"{self.alias(view)}__kf_"

    @staticmethod
    def _write_alias(index: str) -> str:
        return f"{index}__w"

    def physical_index(self, target: Target) -> str | None:
        """The index a target's documents live in (None when a live view has no index)."""
        if target.shadow:
            return target.name
        return self._live_index(target.view)

    def _live_index(self, view: ViewSpec) -> str | None:
        alias = self.alias(view)
        found = sorted(self._call("read alias", lambda: self.client.get_alias(name=alias)))
        if not found:
            return None
        if len(found) > 1:
            raise SinkError(f"search sink: alias {alias!r} points at {len(found)} indexes {found}; expected one "
                            f"(was it changed by hand?)")
        if not found[0].startswith(self._index_prefix(view)):
            raise SinkError(f"search sink: alias {alias!r} points at {found[0]!r}, which kappaflow did not create "
                            f"(expected a name starting with {self._index_prefix(view)!r})")
        return found[0]

    def live(self, view: ViewSpec) -> Target | None:
        return Target(view, self.alias(view)) if self._live_index(view) is not None else None

    def _meta(self, view: ViewSpec, mapping: Mapping[str, Any]) -> dict[str, Any]:
        return {"view": view.name, "projection": view.projection, "key": list(view.key),
                "columns": [c.to_dict() for c in view.columns],
                "mapping_fingerprint": hashlib.sha256(orjson.dumps(mapping, option=orjson.OPT_SORT_KEYS))
                .hexdigest()[:16]}

    def _create_index(self, view: ViewSpec, label: str, *, live: bool) -> str:
        opts = self.view_options(view)
        mapping = self.mapping(view)
        index = f"{self._index_prefix(view)}{label}_{time.strftime('%Y%m%d%H%M%S', time.gmtime())}" \
                f"{secrets.token_hex(3)}"
        body = {**mapping, "_meta": {"kappaflow": self._meta(view, mapping)}}
        settings: dict[str, Any] = dict(opts.settings)
        interval = opts.refresh_interval if live else opts.build_refresh_interval
        if interval is not None:
            settings["index"] = {**settings.get("index", {}), "refresh_interval": interval}
        aliases: dict[str, Any] = {self._write_alias(index): {}}
        if live:
            aliases[self.alias(view)] = {}
        self._ensure_positions_index()
        try:
            self._retrying("create index", lambda: self.client.create_index(
                index, mappings=body, settings=settings, aliases=aliases))
        except _HttpError as exc:
            raise SinkError(f"search sink: cannot create index {index!r} for view {view.name!r}: {exc}") from None
        self._put_positions(view, index, {})
        return index

    def ensure(self, view: ViewSpec) -> Target:
        """Create the alias and a first index if missing; else check the live index fits the view."""
        alias = self.alias(view)
        mapping = self.mapping(view)  # validates overrides before touching the server
        self._positions_ready = False  # check it again: the server may have lost it
        self._drop_strays(view)
        index = self._live_index(view)
        if index is None:
            if self._call("check index", lambda: self.client.index_exists(alias)):
                raise ConfigError(f"search sink: an index named {alias!r} exists; kappaflow needs that name for an "
                                  f"alias over its builds of view {view.name!r}. Rename or delete the index, or set "
                                  f"options['search']['index'] to another name.")
            self._create_index(view, "live", live=True)
            return Target(view, alias)
        self._check_schema(view, index, mapping)
        return Target(view, alias)

    def _check_schema(self, view: ViewSpec, index: str, mapping: Mapping[str, Any]) -> None:
        current = self._call("read mapping", lambda: self.client.get_mapping(index))
        meta = (current.get("_meta") or {}).get("kappaflow") or {}
        have_cols = {c["name"]: c for c in meta.get("columns", [])}
        problems: list[str] = []
        for col in view.columns:
            got = have_cols.get(col.name)
            if got is None:
                problems.append(f"column {col.name!r} is missing (the projection makes {col.type.simpleString()})")
            elif got.get("type") != col.type.jsonValue():
                problems.append(f"column {col.name!r} has type {got.get('type')!r} in the index, the projection "
                                f"makes {col.type.simpleString()}")
        extra = [n for n in have_cols if n not in view.column_names]
        if extra:
            problems.append(f"column(s) {extra} are not produced by the projection")
        if meta.get("key") is not None and list(meta["key"]) != list(view.key):
            problems.append(f"key is {meta['key']}, the projection's key is {list(view.key)}")
        if not problems and meta.get("mapping_fingerprint") != self._meta(view, mapping)["mapping_fingerprint"]:
            problems.append("the field mapping changed (field overrides or string_default)")
        if problems:
            raise ViewSchemaMismatch(
                f"search index {index!r} (alias {self.alias(view)!r}) does not match projection "
                f"{view.projection!r}: " + "; ".join(problems)
                + ". Rebuild it with `kappaflow replay` (a new index is built and the alias swapped).")

    def evolve(self, view: ViewSpec) -> Target:
        """Add the view's new columns to the live index's mapping (``PUT _mapping`` on the build's
        index: new fields only, plus the ``_meta`` columns), in place. A widened column whose field
        mapping stays the same (a decimal keeping its scale, within ``scaled_float``) only updates
        ``_meta``; one whose field mapping would change (``integer`` -> ``long``) cannot change in an
        existing index: ``ViewSchemaMismatch``, the view needs a rebuild (a new index, alias swap)."""
        index = self._live_index(view)
        if index is None:
            raise SinkStateLostError(f"search sink: view {view.name!r} has no live index to evolve (lost?); "
                                     "re-read positions and replay")
        current = self._call("read mapping", lambda: self.client.get_mapping(index))
        meta = (current.get("_meta") or {}).get("kappaflow") or {}
        stored = [ViewColumn.from_dict(c) for c in meta.get("columns", [])]
        evo = evolution(stored, meta.get("key"), view)
        where = f"search index {index!r} (alias {self.alias(view)!r})"
        problems = list(evo.problems)
        new = self.mapping(view)
        if not problems and evo.widened:
            names = {c.name for c in stored}
            before = ViewSpec(view.name, view.projection, view.key,
                              (*stored, *[c for c in view.columns if c.name not in names]), view.namespace,
                              view.options)
            old = self.mapping(before)["properties"]
            problems += [f"field {n.name!r} is mapped as {old[n.name]} in the index, the widened column "
                         f"{n.type.simpleString()} needs {new['properties'][n.name]}, which an existing index "
                         "cannot change to"
                         for _, n in evo.widened if old[n.name] != new["properties"][n.name]]
        if problems:
            raise evolution_mismatch(where, view, type(evo)(evo.added, evo.widened, tuple(problems)))
        if evo.empty:
            return Target(view, self.alias(view))
        body = {"properties": {c.name: new["properties"][c.name] for c in evo.added},
                "_meta": {"kappaflow": self._meta(view, new)}}
        self._check_fence(view, f"updating the mapping of {index!r}")
        self._call("update mapping", lambda: self.client.put_mapping(index, body))
        log.info("search sink: %s: %s", where, evo.describe())
        return Target(view, self.alias(view))

    def _drop_strays(self, view: ViewSpec) -> None:
        """Delete indexes named like a write alias: a bulk delete sent after the server lost the build
        auto-creates one (deletes cannot carry require_alias). They hold nothing of value."""
        pattern = f"{self._index_prefix(view)}*"
        for index in self._call("list indexes", lambda: self.client.get_alias(index=pattern)):
            if index.endswith("__w"):
                log.warning("search sink: deleting stray index %s (auto-created by a write after data loss)", index)
                self._call("delete stray index", functools.partial(self.client.delete_index, index))

    def begin_shadow(self, view: ViewSpec, label: str = "shadow") -> Target:
        if not _LABEL_RE.match(label):
            raise ConfigError(f"search sink: shadow label {label!r}: expected 1-20 lowercase letters or digits")
        self._positions_ready = False
        self._drop_strays(view)
        live = self._live_index(view)
        # a replay killed between the alias swap and dropping the old index leaves that index behind;
        # the old one may be the first build (label "live", from ensure): a replay (which holds the
        # projection lock, so no ensure runs meanwhile) drops those too
        stale = set(self._indexes(view, label)) | set(self._indexes(view, "live") if label == "shadow" else ())
        for index in sorted(stale):
            if index != live:
                self._drop_index(index)
        return Target(view, self._create_index(view, label, live=False), shadow=True)

    def builds(self, view: ViewSpec) -> set[str]:
        """Every index of the view (live, shadows, verify scratches): one index per build."""
        return set(self._indexes(view, "*"))

    def _indexes(self, view: ViewSpec, label: str) -> list[str]:
        pattern = f"{self._index_prefix(view)}{label}_*"
        return sorted(i for i in self._call("list indexes", lambda: self.client.get_alias(index=pattern))
                      if not i.endswith("__w"))

    def swap(self, shadow: Target) -> Target:
        """Refresh the shadow, then move the alias onto it in one atomic `_aliases` call; drop the old index."""
        if not shadow.shadow:
            raise SinkError(f"search sink: swap: {shadow.name!r} is not a shadow target")
        view, index = shadow.view, shadow.name
        alias = self.alias(view)
        opts = self.view_options(view)
        if not self._call("check index", lambda: self.client.index_exists(index)):
            raise SinkStateLostError(f"search sink: the shadow index {index!r} is gone (lost?); rebuild it")
        if opts.build_refresh_interval is not None:
            live_interval = opts.refresh_interval or "1s"
            self._call("restore refresh interval", lambda: self.client.put_settings(
                index, {"index": {"refresh_interval": live_interval}}))
        self._call("refresh", lambda: self.client.refresh(index))
        old = sorted(self._call("read alias", lambda: self.client.get_alias(name=alias)))
        actions: list[dict[str, Any]] = [{"remove": {"index": o, "alias": alias}} for o in old if o != index]
        actions.append({"add": {"index": index, "alias": alias}})
        self._check_fence(view, f"swapping alias {alias!r}")
        self._call("swap alias", lambda: self.client.update_aliases(actions))
        for o in old:
            if o != index and o.startswith(self._index_prefix(view)):
                self._drop_index(o)
        return Target(view, alias)

    def _drop_index(self, index: str) -> None:
        self._call("delete index", lambda: self.client.delete_index(index))
        try:
            self._retrying("delete positions", lambda: self.client.delete_doc(self.options.positions_index, index))
        except (_HttpError, SinkError) as exc:
            log.warning("search sink: could not delete the positions of %s: %s", index, exc)

    def drop(self, target: Target) -> None:
        index = self.physical_index(target)
        if index is not None:
            self._drop_index(index)

    def _positions_home(self, target: Target) -> str | None:
        return self.physical_index(target)
