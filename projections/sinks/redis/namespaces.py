"""A Redis view's namespaces: the pointer, one namespace per build with its marker (which also holds
the build's positions), shadows and the pointer switch; with the connection, the options, retries and
the projection lock's lease that every other part of the sink uses."""

from __future__ import annotations

import functools
import logging
import re
import secrets
import time
from collections.abc import Mapping
from typing import Any

import orjson

from kappaflow.errors import ConfigError, SinkError
from kappaflow.projections.sinks.base import (
    Positions,
    Target,
    TopicPartition,
    ViewColumn,
    ViewSchemaMismatch,
    ViewSpec,
    evolution,
    evolution_mismatch,
)
from kappaflow.projections.sinks.document import DocumentSink
from kappaflow.projections.sinks.errors import SinkStateLostError
from kappaflow.projections.sinks.keys import key_str
from kappaflow.projections.sinks.lease import Lease
from kappaflow.projections.sinks.redis.codec import _s
from kappaflow.projections.sinks.redis.options import RedisSinkOptions
from kappaflow.projections.sinks.redis.scripts import _evalsha, _fenced

log = logging.getLogger(__name__)


_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")


_LABEL_RE = re.compile(r"^[a-z0-9]{1,20}$")


_RETRYABLE = ("BUSY", "LOADING", "OOM", "TRYAGAIN", "MASTERDOWN", "READONLY")


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class RedisNamespaces(DocumentSink):
    """Connection, options, retries, the lock, builds and their positions (see the module docstring)."""

    label = "redis sink"
    options_model = RedisSinkOptions

    def __init__(self, url_or_client: Any, *, options: RedisSinkOptions | Mapping[str, Any] | None = None) -> None:
        import redis

        if isinstance(url_or_client, str):
            self._url: str | None = url_or_client
            self.client = redis.Redis.from_url(url_or_client)
        else:
            self._url = None
            self.client = url_or_client
        super().__init__(options)
        self.options: RedisSinkOptions
        if not _PREFIX_RE.match(self.options.prefix):
            raise ConfigError(f"redis sink option 'prefix': expected letters, digits, '_', '.', '-', got "
                              f"{self.options.prefix!r}")

    # --- the projection lock (one replay or follow at a time) ---------------------------
    def _lock_key(self, projection: str) -> str:
        return f"{self.options.prefix}:~lock:{projection}"  # '~' never occurs in view names

    def try_lock(self, projection: str) -> bool:
        """Take the projection's lock if free: a lease (``lock_ttl_s``) renewed in the background, so a
        holder killed with -9 releases it when the lease runs out. Each take is a new generation; the
        lease's token fences this sink's writes to the projection's views (see the module docstring)."""
        if projection in self._leases:
            return False
        key = self._lock_key(projection)
        gen_key = f"{self.options.prefix}:~lockgen:{projection}"
        ttl_ms = int(self.options.lock_ttl_s * 1000)
        sent = time.monotonic()
        raw = self._retrying("take lock", lambda: _evalsha(
            self.client, "take", [key, gen_key], [secrets.token_hex(16), ttl_ms]))
        if not raw:
            return False
        token = _s(raw)
        self._hold(projection, Lease(
            f"redis:{projection}", self.options.lock_ttl_s,
            renew=lambda: bool(_evalsha(self.client, "renew", [key], [token, ttl_ms])),
            release=lambda: _evalsha(self.client, "release", [key], [token]), token=token, taken_at=sent))
        return True

    def _fence_args(self, view: ViewSpec) -> tuple[bytes, bytes]:
        """The fence every view-changing script call ends with: (lock key, token), or ('', '')."""
        token = self._fences.get(view.projection)
        if token is None:
            return b"", b""
        return self._lock_key(view.projection).encode(), token.encode()

    def is_locked(self, projection: str) -> bool:
        return bool(self._retrying("read lock", lambda: self.client.exists(self._lock_key(projection))))

    # --- names and per-view options -----------------------------------------------------
    def base(self, view: ViewSpec) -> str:
        if not _NAME_RE.match(view.name):
            raise ConfigError(f"redis sink: view name {view.name!r}: expected letters, digits, '_', '.', '-'")
        return f"{self.view_options(view).prefix}:{view.name}"

    def pointer_key(self, view: ViewSpec) -> str:
        return f"{self.base(view)}:current"

    def _registry(self, view: ViewSpec) -> str:
        return f"{self.base(view)}:builds"

    def marker_key(self, view: ViewSpec, build: str) -> str:
        return f"{self.base(view)}:{build}"

    def row_key(self, view: ViewSpec, build: str, key: tuple[Any, ...] | Any) -> str:
        return f"{self.base(view)}:{build}:{key_str(key)}"

    def _build_of(self, target: Target) -> str | None:
        """The build a target writes to: the shadow's own, or the one the pointer names now."""
        if target.shadow:
            return target.name.rsplit(":", 1)[1]
        return self.live_build(target.view)

    def live_build(self, view: ViewSpec) -> str | None:
        raw = self._retrying("read pointer", lambda: self.client.get(self.pointer_key(view)))
        return None if raw is None else _s(raw)

    # --- retries ------------------------------------------------------------------------
    def _retryable(self, what: str, exc: Exception) -> bool:
        import redis

        if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
            return True
        if not isinstance(exc, redis.ResponseError):
            return False
        text = str(exc)
        if text.startswith("KFFENCED"):
            raise _fenced(what, text) from None
        if text.startswith("KFLOST"):
            raise SinkStateLostError(f"redis sink: {text[7:]} (the server lost its data?); re-read "
                                     f"positions and replay") from None
        if not text.startswith(_RETRYABLE):
            raise SinkError(f"redis sink: {what} failed: {text}") from None
        return True

    # --- targets ------------------------------------------------------------------------
    def _marker(self, view: ViewSpec, build: str) -> dict[str, str]:
        raw = self._retrying("read marker", lambda: self.client.hgetall(self.marker_key(view, build)))
        return {_s(k): _s(v) for k, v in raw.items()}

    def _columns_json(self, view: ViewSpec) -> str:
        return orjson.dumps({"key": list(view.key), "columns": [c.to_dict() for c in view.columns]}).decode()

    def _create_build(self, view: ViewSpec, label: str) -> str:
        build = f"{label}-{time.strftime('%Y%m%d%H%M%S', time.gmtime())}{secrets.token_hex(3)}"
        opts = self.view_options(view)
        mapping: dict[Any, Any] = {"format": opts.value_format, "created_ms": str(int(time.time() * 1000)),
                   "view": self._columns_json(view)}
        marker = self.marker_key(view, build)

        def create() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(marker, mapping=mapping)
            pipe.sadd(self._registry(view), build)
            pipe.execute()

        self._retrying("create build", create)
        return build

    def live(self, view: ViewSpec) -> Target | None:
        build = self.live_build(view)
        for _ in range(10):
            if build is None:
                return None
            if self._marker(view, build):
                return Target(view, self.base(view))
            again = self.live_build(view)  # switched meanwhile (the old marker goes first)? look again
            if again == build:
                return None  # the live build lost its marker: the view is gone (see ensure)
            build = again
        return None

    def ensure(self, view: ViewSpec) -> Target:
        """Create the pointer and a first, empty build if missing; else check the live build fits the view.

        A pointer whose build marker is gone (the server lost data) is replaced by a fresh
        build: the view then reads as empty with no positions, and is rebuilt from the log."""
        opts = self.view_options(view)
        target = Target(view, self.base(view))
        live = self.live_build(view)
        if live is not None:
            marker = self._marker(view, live)
            if marker:
                self._check_schema(view, live, marker, opts)
                return target
            log.warning("redis sink: view %s: the live build %s lost its marker (server lost data?); starting "
                        "an empty view to rebuild from the log", view.name, live)
            self._retrying("clear pointer", lambda: self.client.delete(self.pointer_key(view)))
        build = self._create_build(view, "live")
        won = self._retrying("set pointer", lambda: self.client.set(self.pointer_key(view), build, nx=True))
        if not won:  # another process created the view first: use theirs
            self._drop_build(view, build)
            return self.ensure(view)
        return target

    def _check_schema(self, view: ViewSpec, build: str, marker: Mapping[str, str], opts: RedisSinkOptions) -> None:
        problems: list[str] = []
        if marker.get("format") != opts.value_format:
            problems.append(f"values are stored as {marker.get('format')!r}, the sink is configured for "
                            f"{opts.value_format!r}")
        try:
            stored = orjson.loads(marker.get("view", "{}"))
        except orjson.JSONDecodeError:
            stored = {}
        have = {c["name"]: c for c in stored.get("columns", [])}
        for col in view.columns:
            got = have.get(col.name)
            if got is None:
                problems.append(f"column {col.name!r} is missing (the projection makes {col.type.simpleString()})")
            elif got.get("type") != col.type.jsonValue():
                problems.append(f"column {col.name!r} has type {got.get('type')!r} in Redis, the projection makes "
                                f"{col.type.simpleString()}")
        extra = [n for n in have if n not in view.column_names]
        if extra:
            problems.append(f"column(s) {extra} are not produced by the projection")
        if stored.get("key") is not None and list(stored["key"]) != list(view.key):
            problems.append(f"key is {stored['key']}, the projection's key is {list(view.key)}")
        if problems:
            raise ViewSchemaMismatch(
                f"Redis view {self.base(view)!r} (build {build}) does not match projection {view.projection!r}: "
                + "; ".join(problems) + ". Rebuild it with `kappaflow replay` (a new namespace is built and the "
                "pointer switched).")

    def evolve(self, view: ViewSpec) -> Target:
        """Record `view`'s columns in the live build's marker (added columns, widened types): rows are
        JSON or hash fields, so a new column simply appears in the values written from now on, and a
        widened type reads the same text. Fenced like every write; raises ``ViewSchemaMismatch`` for
        what cannot change in place and ``SinkStateLostError`` when the build is gone."""
        build = self.live_build(view)
        marker = self._marker(view, build) if build is not None else {}
        if build is None or not marker:
            raise SinkStateLostError(f"redis sink: view {view.name!r} has no live build to evolve (lost?); "
                                     "re-read positions and replay")
        try:
            stored = orjson.loads(marker.get("view", "{}"))
        except orjson.JSONDecodeError:
            stored = {}
        evo = evolution([ViewColumn.from_dict(c) for c in stored.get("columns", [])], stored.get("key"), view)
        if evo.problems:
            raise evolution_mismatch(f"Redis view {self.base(view)!r} (build {build})", view, evo)
        if not evo.empty:
            columns = self._columns_json(view)
            self._retrying("evolve view", lambda: _evalsha(
                self.client, "evolve", [self.marker_key(view, build)], [columns, *self._fence_args(view)]))
            log.info("redis sink: view %s (build %s): %s", view.name, build, evo.describe())
        return Target(view, self.base(view))

    def builds(self, view: ViewSpec) -> set[str]:
        """Every build of the view (the registry set: live, shadows, verify scratches)."""
        return {_s(b) for b in self._retrying("list builds", lambda: self.client.smembers(self._registry(view)))}

    def begin_shadow(self, view: ViewSpec, label: str = "shadow") -> Target:
        if not _LABEL_RE.match(label):
            raise ConfigError(f"redis sink: shadow label {label!r}: expected 1-20 lowercase letters or digits")
        live = self.live_build(view)
        builds = self._retrying("list builds", lambda: self.client.smembers(self._registry(view)))
        # a replay killed between the pointer switch and dropping the old build leaves that build behind;
        # the old one may be the first build (label "live", from ensure): a replay (which holds the
        # projection lock, so no ensure runs meanwhile) drops those too
        stale = (f"{label}-", "live-") if label == "shadow" else (f"{label}-",)
        for b in sorted(_s(x) for x in builds):
            if b != live and b.startswith(stale):
                self._drop_build(view, b)
        build = self._create_build(view, label)
        return Target(view, self.marker_key(view, build), shadow=True)

    def swap(self, shadow: Target) -> Target:
        """Switch the pointer to the shadow's build atomically, then remove the old namespace incrementally."""
        if not shadow.shadow:
            raise SinkError(f"redis sink: swap: {shadow.name!r} is not a shadow target")
        view = shadow.view
        build = shadow.name.rsplit(":", 1)[1]
        old = self._retrying("switch pointer", lambda: _evalsha(
            self.client, "switch", [self.pointer_key(view), self.marker_key(view, build)],
            [build, *self._fence_args(view)]))
        if old is not None and _s(old) != build:
            self._drop_build(view, _s(old))
        return Target(view, self.base(view))

    def drop(self, target: Target) -> None:
        view = target.view
        if target.shadow:
            self._drop_build(view, target.name.rsplit(":", 1)[1])
            return
        build = self.live_build(view)
        self._retrying("delete pointer", lambda: self.client.delete(self.pointer_key(view)))
        if build is not None:
            self._drop_build(view, build)

    def _drop_build(self, view: ViewSpec, build: str) -> int:
        """Marker first (writers to this build fail fast), then SCAN + UNLINK the rows in chunks."""
        self._retrying("drop marker", lambda: self.client.unlink(self.marker_key(view, build)))
        pattern = _glob_escape(f"{self.base(view)}:{build}:") + "*"
        removed = 0
        cursor = 0
        count = self.options.scan_count
        while True:
            cursor, keys = self._retrying("scan", functools.partial(
                self.client.scan, cursor=cursor, match=pattern, count=count))
            if keys:
                removed += int(self._retrying("unlink", functools.partial(self.client.unlink, *keys)))
            if int(cursor) == 0:
                break
        self._retrying("forget build", lambda: self.client.srem(self._registry(view), build))
        return removed

    # --- positions (in the build's marker) ----------------------------------------------
    def _positions_home(self, target: Target) -> str | None:
        return self._build_of(target)

    def _read_positions(self, view: ViewSpec, home: str) -> dict[TopicPartition, int]:
        out: dict[TopicPartition, int] = {}
        for name, value in self._marker(view, home).items():
            if name.startswith("p:"):
                topic, _, part = name[2:].rpartition(":")
                out[(topic, int(part))] = int(value)
        return out

    def _write_positions(self, view: ViewSpec, home: str, positions: Positions) -> None:
        self._store(view, home, positions)

    def _store(self, view: ViewSpec, build: str, positions: Positions) -> None:
        if not positions:
            return
        args: list[Any] = []
        for (topic, partition), offset in sorted(positions.items()):
            args += [f"p:{topic}:{partition}", int(offset)]
        args += self._fence_args(view)
        self._retrying("store positions", lambda: _evalsha(
            self.client, "positions", [self.marker_key(view, build)], args))
