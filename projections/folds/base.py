"""The ``FoldStrategy`` protocol every fold kind implements, and the registry (fold class -> strategy).

A strategy is everything kind-specific about a fold, so the engine, follow, replay, verify and the
mirrors call it and never ask which kind a fold is:

- the definition: what goes into the fingerprint, which sinks it may write to (``check_sinks``);
- ``compile``: the view's shape from the source schemas (``Plan.build`` delegates here);
- ``build``: a replay's full fold of [0, end) into an empty target;
- ``fold_batch`` / ``write_batch``: a follow micro-batch (or a replay catch-up): the changes it
  makes, then writing them with the positions;
- its mirror policy (``mirrors``: a sink that copies another sink's view instead of folding the log);
- its state, if any (a grouped fold's keyed state lives in a sink with ``GroupedState``).

The shared plumbing (the records read, dead-letter rows, the latest-row step of declarative folds)
is here too, so strategies stay about their kind.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa
from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from kappaflow.errors import ConfigError
from kappaflow.events import TableSchema
from kappaflow.projections.api import Declaration, FoldSpec, ProjectionSpec
from kappaflow.projections.sinks.base import Positions, Sink, Target, WriteResult

if TYPE_CHECKING:
    from kappaflow.projections.plan import Plan
    from kappaflow.projections.runtime import Offsets, Runtime

BAD_REASON = "value is not a change event (unparseable JSON, or 'op' missing or unknown)"

Located = dict[tuple[str, int], tuple[str, int, bytes | None]]
"""(row key text, version) -> (topic, partition, record key): where a refused view row's change is in the log."""


# --- what the engine hands a strategy, and gets back ---------------------------------------------
def read_metrics() -> list[Any]:
    """Records read through a raw log frame: rows, plus the records ``latestPerKey`` folded into them."""
    return [F.count(F.lit(1)).alias("rows"), F.coalesce(F.sum("superseded"), F.lit(0)).alias("superseded")]


class ReadCounter:
    """Counts the records a build actually reads: after compaction the offset span of a partition
    counts records that are gone, which inflated replay's events and events/s."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.observations: list[Observation] = []

    def __call__(self, df: DataFrame, topic: str) -> DataFrame:
        obs = Observation(f"kf_read_{self.name}_{topic}_{time.monotonic_ns()}")
        self.observations.append(obs)
        return df.observe(obs, *read_metrics())

    @property
    def records(self) -> int:
        return sum(int(o.get.get("rows") or 0) + int(o.get.get("superseded") or 0) for o in self.observations)


@dataclass
class BuildJob:
    """One replay build: fold [0, ``end``) into the empty ``target`` of ``sink``; ``version`` is the
    watermark of ``end``, ``spans`` the offsets per log partition."""

    plan: Plan
    rt: Runtime
    sink: Sink
    target: Target
    end: Offsets
    spans: list[int]
    version: int
    counted: ReadCounter


@dataclass
class Built:
    """What a build did: rows loaded, dead-letter rows (``loader.dead_rows`` shape; rows a sink refused
    have ``topic`` None), records read when the workers read the log themselves (else the engine's
    ``ReadCounter`` counts them), and the folded rows frame that locates refused rows in the log."""

    loaded: int = 0
    dead: list[dict[str, Any]] = field(default_factory=list)
    records_read: int | None = None
    rows: DataFrame | None = None


@dataclass
class FoldedBatch:
    """A micro-batch folded on the driver: ``table`` is what ``write_batch`` writes (view changes,
    or keyed-state changes), ``dead`` its dead letters, ``where_in_log`` (``_kf_topic``,
    ``_kf_partition`` per row of ``table``, when a row's version is its change's offset) and
    ``bad`` the observation counting malformed records (``collect_bad`` reads them when it is > 0)."""

    table: pa.Table
    dead: list[dict[str, Any]] = field(default_factory=list)
    where_in_log: pa.Table | None = None
    bad: Observation | None = None


def dead_rows(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """Dead-letter rows from loader/folder output rows (those with a ``_kf_dl_reason``)."""
    out = []
    for r in rows:
        d = r.asDict() if hasattr(r, "asDict") else dict(r)
        if d.get("_kf_dl_reason") is not None:
            out.append(
                {
                    "topic": d["_kf_dl_topic"],
                    "partition": d["_kf_dl_partition"],
                    "offset": d["_kf_dl_offset"],
                    "key": d.get("_kf_dl_key"),
                    "reason": d["_kf_dl_reason"],
                }
            )
    return out


def collect_bad(plan: Plan, raws: dict[str, DataFrame]) -> list[dict[str, Any]]:
    """Dead letters for records whose value is not a change event (declarative folds)."""
    ev = plan.all_events(raws).where("_kf_bad").select("_kf_topic", "_kf_partition", "_kf_offset", "_kf_key")
    return [{"topic": r[0], "partition": r[1], "offset": r[2], "key": r[3], "reason": BAD_REASON} for r in ev.collect()]


# --- the protocol ----------------------------------------------------------------------------------
class FoldStrategy(abc.ABC):
    """How one fold kind (a ``FoldSpec`` subclass) is compiled, replayed, followed and mirrored."""

    fold: ClassVar[type[FoldSpec]]
    """The ``FoldSpec`` subclass this strategy runs (the registry key)."""

    priority: ClassVar[int] = 0
    """Strategies are asked in decreasing priority whether a class declares their fold (``claims``);
    the latest-row fold, claimed by any class, comes last."""

    reads_event_topics: ClassVar[bool] = False
    """The fold reads event topics (``Source(events=True)``: domain events, not change events)."""

    reads_latest_per_key: ClassVar[bool] = False
    """Only the latest record of each log key matters (declarative folds): the log is read with
    ``latestPerKey``, so a batch or a replay never carries superseded records."""

    folds_events: ClassVar[bool] = False
    """Each event reaches the fold once, in log order (``apply()``; a windowed view's rule), not only
    the current row of its key: what as-of enrichment (``Projection.as_of``: the looked-up row as it
    was at each event) feeds, and what a lookup's current row cannot serve (a replay would differ
    from the follow): ``lookup_advice`` says so when a class declares ``lookups``."""

    holds_nested: ClassVar[bool] = False
    """One view row per driving row, so a nested collection (``Projection.nested``: the child rows of
    that row as a list column) can be attached to it (latest-row views)."""

    evolves_in_place: ClassVar[bool] = False
    """A source column added or widened can reach the live view in place (``on_schema_change =
    "evolve"``: new view columns added, view columns widened by the sink's ``evolve``) because the
    fold keeps no state typed by the source columns beside the view. Folds whose keyed state holds
    source columns (grouped, windowed) need a rebuild for a widened column."""

    def lookup_advice(self) -> str | None:
        """Why ``lookups`` cannot feed this fold and what to use instead (None: not supported yet)."""
        return None

    def default_schema_policy(self, fold: FoldSpec) -> str:
        """``on_schema_change`` when the class sets none: stop for a rebuild when the view would change."""
        return "rebuild"

    # --- the definition -------------------------------------------------------------------------
    @abc.abstractmethod
    def claims(self, decl: Declaration) -> bool:
        """Whether the class declares this kind of fold (e.g. ``aggregates``: grouped)."""

    @abc.abstractmethod
    def declare(self, decl: Declaration) -> FoldSpec:
        """The validated fold the class declares (ConfigError naming the class and the attribute)."""

    def fingerprint(self, spec: ProjectionSpec) -> list[str]:
        """Parts of the definition's fingerprint beyond the common ones (what changes the view)."""
        return []

    def code_fingerprint(self, spec: ProjectionSpec) -> list[str]:
        """Fingerprint parts from the user's code (hashed after everything else)."""
        return []

    def check_sinks(self, where: str, sinks: Sequence[str]) -> None:  # noqa: B027 - optional
        """Refuse (ConfigError naming `where`) sink lists this fold cannot keep consistent."""

    # --- compile --------------------------------------------------------------------------------
    @abc.abstractmethod
    def compile(self, spark: SparkSession, spec: ProjectionSpec, schemas: dict[str, TableSchema]) -> Plan:
        """The plan (view shape, validated expressions) for `spec` over its sources' `schemas`."""

    # --- replay ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def build(self, job: BuildJob) -> Built:
        """Fold the log [0, ``job.end``) into the empty ``job.target`` (Spark executors load it)."""

    # --- follow ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def fold_batch(
        self, plan: Plan, rt: Runtime, sink: Sink, target: Target, raws: dict[str, DataFrame],
        deduped_input: bool | None,
    ) -> FoldedBatch:
        """Fold one bounded slice of the log (already filtered to the unread records) on the driver."""

    def write_batch(
        self, plan: Plan, sink: Sink, target: Target, batch: FoldedBatch, watermark: int, positions: Positions | None
    ) -> WriteResult:
        """Write `batch` to `target` (with `positions` when the sink stores them with the rows)."""
        return sink.write(target, batch.table, positions)

    def locate_refused(
        self, plan: Plan, rows: DataFrame | None, refused: list[tuple[str, int | None, str]]
    ) -> Located:
        """Where in the log the changes of refused view rows are, when a row's version says so."""
        return {}

    # --- mirrors and state ----------------------------------------------------------------------
    def mirror_source(self, spec: ProjectionSpec, sink: str) -> str | None:
        """The projection's sink whose view its sink `sink` copies instead of folding the log
        (``kappaflow.projections.mirror``), or None when `sink` folds the log itself."""
        return None

    def status_details(self, sink: Sink, target: Target) -> dict[str, Any]:
        """What ``kappaflow status`` shows about this fold's state in `sink` beyond positions and lag
        (e.g. a windowed view's watermark, late events and state rows): cheap reads of what the view
        stored, without the projection's class (status does not import user code)."""
        return {}


# --- the registry ----------------------------------------------------------------------------------
_REGISTRY: dict[type[FoldSpec], FoldStrategy] = {}


def register(strategy: FoldStrategy) -> FoldStrategy:
    """Make `strategy` the one for its ``fold`` class (a new fold kind: a module + this call)."""
    if strategy.fold in _REGISTRY and type(_REGISTRY[strategy.fold]) is not type(strategy):
        raise ConfigError(f"fold {strategy.fold.__name__}: a strategy is registered already")
    _REGISTRY[strategy.fold] = strategy
    return strategy


def declared_fold(decl: Declaration) -> FoldSpec:
    """The fold a projection class declares: the first strategy, by priority, that claims it."""
    for strategy in sorted(_REGISTRY.values(), key=lambda s: -s.priority):
        if strategy.claims(decl):
            events = [s.topic for s in decl.sources if s.events]
            if events and not strategy.reads_event_topics:
                raise ConfigError(
                    f"{decl.where}: event topics {events} need an apply() fold (declarative folds read "
                    "change events of captured tables)"
                )
            return strategy.declare(decl)
    raise ConfigError(f"{decl.where}: no fold kind matches what the class declares")


def strategy_of_kind(kind: str) -> FoldStrategy | None:
    """The strategy whose fold has this ``kind`` name (as the projections registry records it), if any."""
    return next((s for f, s in _REGISTRY.items() if f.kind == kind), None)


def strategy_for(fold: FoldSpec | ProjectionSpec) -> FoldStrategy:
    """The strategy of a fold (or of a projection's fold)."""
    f = fold.fold if isinstance(fold, ProjectionSpec) else fold
    for klass in type(f).__mro__:
        s = _REGISTRY.get(klass)
        if s is not None:
            return s
    raise ConfigError(f"fold {type(f).__name__}: no strategy registered (see kappaflow.projections.folds)")


__all__ = [
    "BAD_REASON",
    "BuildJob",
    "Built",
    "FoldStrategy",
    "FoldedBatch",
    "Located",
    "ReadCounter",
    "collect_bad",
    "dead_rows",
    "declared_fold",
    "read_metrics",
    "register",
    "strategy_for",
    "strategy_of_kind",
]
