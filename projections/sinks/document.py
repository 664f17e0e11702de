"""The document sinks' shared part (search, Redis): one JSON document per view key, in a store
without transactions across keys and without session-bound locks.

:class:`DocumentSink` holds what both stores do the same way, so each store only says how it
talks to its server:

- **options**: a pydantic model per store (:class:`DocumentSinkOptions` carries the retry and
  lease fields both have), sink-wide and per view under ``view.options[<kind>]``;
- **backoff**: exponential with jitter (:class:`Backoff`); the store says which failures are
  worth retrying (``_retryable``) and translates the others;
- **the lease**: the projection lock is a :class:`~kappaflow.projections.sinks.lease.Lease` the
  store takes (``try_lock``); holding, releasing and fencing it is shared;
- **positions**: kept next to the data, per build (an index, a namespace), so a store that lost
  its data loses its positions with it; the store reads and writes them at the build
  (``_positions_home``, ``_read_positions``, ``_write_positions``);
- **rejects**: rows the store refused come back in ``WriteResult.rejected``; a bulk load logs
  them by key and returns them (``load_batches``; ``load``, which returns only a count, keeps
  them in ``rejected_in_load``).
"""

from __future__ import annotations

import abc
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, cast

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from kappaflow.errors import ConfigError, Retry, SinkError
from kappaflow.projections.sinks.base import LoadResult, Positions, Sink, Target, TopicPartition, ViewSpec
from kappaflow.projections.sinks.errors import SinkStateLostError
from kappaflow.projections.sinks.lease import Lease

log = logging.getLogger(__name__)


class DocumentSinkOptions(BaseModel):
    """Options every document sink has (each store's model adds its own and may change defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_retries: int = Field(8, ge=0)
    """Retries of a failed call (connection lost, server busy) before the write fails as transient."""
    backoff_initial_s: float = Field(0.2, gt=0)
    backoff_max_s: float = Field(20.0, gt=0)
    lock_ttl_s: float = Field(30.0, ge=1)
    """Lease of the projection lock (try_lock): renewed every third of it, expires after a kill -9."""


def parse_options(model: type[BaseModel], data: Mapping[str, Any], where: str) -> Any:
    """Options from a mapping; a bad value is a ConfigError naming the field and what was given."""
    import pydantic

    from kappaflow.config import format_validation_error

    try:
        return model(**data)
    except pydantic.ValidationError as exc:
        raise ConfigError(format_validation_error(exc, where)) from None


class Backoff:
    """Exponential backoff with jitter for one operation: each ``wait`` counts a failed attempt,
    raises a transient :class:`SinkError` once ``max_retries`` are spent, else sleeps."""

    def __init__(self, sink: DocumentSink, opts: DocumentSinkOptions) -> None:
        self._sink = sink
        self._opts = opts
        self.delay = opts.backoff_initial_s
        self.attempt = 0

    def wait(self, what: str, error: object, *, exhausted: Callable[[int], str] | None = None,
             warn: bool = True) -> None:
        self.attempt += 1
        if self.attempt > self._opts.max_retries:
            text = (exhausted(self.attempt) if exhausted is not None
                    else f"{self._sink.label}: {what} failed after {self.attempt} attempts: {error}")
            raise SinkError(text, retry=Retry.TRANSIENT) from None
        if warn:
            log.warning("%s: %s failed (%s); retry %d in %.2fs", self._sink.label, what, error, self.attempt,
                        self.delay)
        self._sink._sleep(self.delay * (0.5 + random.random()))
        self.delay = min(self.delay * 2, self._opts.backoff_max_s)


class DocumentSink(Sink):
    """Options, backoff, the lease, positions and rejects of a document store (see the module docstring)."""

    label: ClassVar[str]
    """How messages name the sink, e.g. ``"search sink"``."""
    options_model: ClassVar[type[DocumentSinkOptions]]
    client: Any
    build_noun: ClassVar[str] = "build"
    """What one build of a view is in this store (messages): an index, a namespace."""

    def __init__(self, options: DocumentSinkOptions | Mapping[str, Any] | None) -> None:
        self.options: Any = (options if isinstance(options, self.options_model)
                             else self.parse_options(cast(Mapping[str, Any], options or {}), f"{self.label} options"))
        self._sleep: Callable[[float], None] = time.sleep
        self._leases: dict[str, Lease] = {}
        self._fences: dict[str, str] = {}  # projection -> the token this sink's writes are fenced with
        self.rejected_in_load: list[tuple[tuple[Any, ...], str]] = []

    @classmethod
    def parse_options(cls, data: Mapping[str, Any], where: str) -> Any:
        return parse_options(cls.options_model, data, where)

    def view_options(self, view: ViewSpec) -> Any:
        """The sink's options with the view's own (``view.options[<kind>]``) laid over them."""
        extra = view.options.get(self.kind) if view.options else None
        if not extra:
            return self.options
        if not isinstance(extra, Mapping):
            raise ConfigError(f"view {view.name!r}: options[{self.kind!r}]: expected a table of {self.label} options")
        return self.parse_options({**self.options.model_dump(), **extra}, f"view {view.name!r}: options[{self.kind!r}]")

    def close(self) -> None:
        for name in list(self._leases):
            self.unlock(name)
        try:
            self.client.close()
        except Exception:  # closing is best effort
            pass

    # --- backoff ------------------------------------------------------------------------------
    @abc.abstractmethod
    def _retryable(self, what: str, exc: Exception) -> bool:
        """Whether a failed call is worth retrying (connection lost, server busy). Raise the error
        to report instead (e.g. a fencing refusal), or return False to let `exc` through."""

    def _retrying(self, what: str, fn: Callable[[], Any], opts: DocumentSinkOptions | None = None) -> Any:
        backoff = Backoff(self, opts or self.options)
        while True:
            try:
                return fn()
            except Exception as exc:
                if not self._retryable(what, exc):
                    raise
                error = exc
            backoff.wait(what, error)

    # --- the lease ------------------------------------------------------------------------------
    def _hold(self, projection: str, lease: Lease) -> None:
        """Keep a lease just taken by ``try_lock``; its token fences this sink's writes."""
        self._leases[projection] = lease
        self._fences[projection] = lease.token

    def unlock(self, projection: str) -> None:
        lease = self._leases.pop(projection, None)
        if lease is not None:
            if self._fences.get(projection) == lease.token:
                del self._fences[projection]
            lease.release()

    def holds_lock(self, projection: str) -> bool:
        lease = self._leases.get(projection)
        return lease is not None and lease.held

    def lock_fence(self, projection: str) -> str | None:
        lease = self._leases.get(projection)
        return lease.token if lease is not None and lease.held else None

    def fence(self, projection: str, token: str | None) -> None:
        if token is None:
            self._fences.pop(projection, None)
        else:
            self._fences[projection] = token

    # --- positions -------------------------------------------------------------------------------
    @abc.abstractmethod
    def _positions_home(self, target: Target) -> str | None:
        """The build a target's positions live in (None: the view has none, e.g. lost)."""

    @abc.abstractmethod
    def _read_positions(self, view: ViewSpec, home: str) -> dict[TopicPartition, int]: ...

    @abc.abstractmethod
    def _write_positions(self, view: ViewSpec, home: str, positions: Positions) -> None:
        """Store `positions` at the build, never moving one back."""

    def build_of(self, target: Target) -> str | None:
        """The build a target writes to (where its positions live): state kept beside the store is keyed by it."""
        return self._positions_home(target)

    def read_positions(self, target: Target) -> dict[TopicPartition, int]:
        """Stored next offsets of the target's build; {} when there is none (or it was lost), which
        makes the runner replay from the start of the log."""
        home = self._positions_home(target)
        return {} if home is None else self._read_positions(target.view, home)

    def store_positions(self, target: Target, positions: Positions) -> None:
        if not positions:
            return
        home = self._positions_home(target)
        if home is None:
            raise SinkStateLostError(f"{self.label}: view {target.view.name!r} has no live {self.build_noun} "
                                     f"(lost?); re-read positions and replay")
        self._write_positions(target.view, home, positions)

    # --- rejects -------------------------------------------------------------------------------
    def load_batches(self, target: Target, batches: Iterable[pa.Table | pa.RecordBatch]) -> LoadResult:
        """``Sink.load_batches``: batch by batch through ``write``; refused rows are logged and returned."""
        res = self.load_by_write(target, batches)
        if res.rejected:
            log_rejected(self.label, target, [(k, reason) for k, _, reason in res.rejected])
        return res

    def load(self, target: Target, batches: Iterable[pa.Table | pa.RecordBatch]) -> int:
        """Bulk-load a replay's rows (one Spark partition) batch by batch; refused rows are logged by key
        and reason (``load`` returns a count only), the rest is loaded."""
        n = 0
        for b in batches:
            res = self.write(target, b if isinstance(b, pa.Table) else pa.Table.from_batches([b]))
            n += res.upserted
            if res.rejected:
                self.rejected_in_load.extend(res.rejected)
                log_rejected(self.label, target, res.rejected)
        return n


def log_rejected(sink: str, target: Target, rejected: list[tuple[tuple[Any, ...], str]]) -> None:
    """Bulk loads return only a count (``Sink.load``): name every refused row in the log instead of
    dropping it silently (the write path hands them back in ``WriteResult.rejected``)."""
    logger = logging.getLogger("kappaflow.projections.sinks")
    for key, reason in rejected[:100]:
        logger.error("%s: loading %s: refused key %s: %s", sink, target.name, key, reason)
    if len(rejected) > 100:
        logger.error("%s: loading %s: %d more refused rows", sink, target.name, len(rejected) - 100)


__all__ = ["Backoff", "DocumentSink", "DocumentSinkOptions", "log_rejected", "parse_options"]
