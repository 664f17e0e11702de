"""The documented metric set: every name kappaflow exports, its type, labels and meaning.

Why one table: the collectors build their families from it (a metric cannot be exported
without being documented here), the README's "Monitoring" table is checked against it, and
the compose Grafana dashboard may only name metrics listed here (tests/compose). Names follow
Prometheus conventions: a ``kappaflow_`` prefix, base units (``_seconds``, ``_bytes``), counters
end in ``_total``, labels are low-cardinality names (source, table, projection, sink, topic,
partition) and never carry a DSN, a host or a password.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["METRICS", "MetricDef", "metric"]

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricDef:
    name: str  # without the _total suffix a counter gets on the wire
    kind: Kind
    labels: tuple[str, ...]
    help: str
    process: str  # who exports it: capture, follow, relay, log, status (any process / `kappaflow metrics`)

    @property
    def exposed(self) -> str:
        """The name a scrape shows (counters carry ``_total``)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


_DEFS = [
    # --- capture (one process per source) -------------------------------------------------------
    MetricDef("kappaflow_capture_changes", "counter", ("source",),
              "Change events written to the log (snapshot reads included).", "capture"),
    MetricDef("kappaflow_capture_transactions", "counter", ("source",),
              "Source transactions whose changes are durable in the log.", "capture"),
    MetricDef("kappaflow_capture_snapshot_rows", "counter", ("source", "table"),
              "Rows read by the snapshot, per table.", "capture"),
    MetricDef("kappaflow_capture_snapshot_progress_ratio", "gauge", ("source", "table"),
              "Snapshot rows read / the table's estimated row count (1 when the table is done).", "capture"),
    MetricDef("kappaflow_capture_ondemand_rows", "gauge", ("source",),
              "Rows written by the current (or last) on-demand snapshot of the running capture.", "capture"),
    MetricDef("kappaflow_capture_ondemand_rows_per_second", "gauge", ("source",),
              "On-demand snapshot rate: rows written / seconds spent running (pauses excluded).", "capture"),
    MetricDef("kappaflow_capture_ondemand_eta_seconds", "gauge", ("source",),
              "On-demand snapshot: estimated seconds left at the current rate (from the planner's row estimate).",
              "capture"),
    MetricDef("kappaflow_capture_ondemand_state", "gauge", ("source", "state"),
              "1 for the on-demand snapshot's state (idle, running, paused, stopped, done), 0 for the others.",
              "capture"),
    MetricDef("kappaflow_capture_phase", "gauge", ("source", "phase"),
              "1 for the capture's current phase (starting, snapshot, streaming, stopped), 0 for the others.",
              "capture"),
    MetricDef("kappaflow_capture_source_lag_seconds", "gauge", ("source",),
              "Source commit to log append of the last durable transaction; when idle, the round trip of the "
              "capture's heartbeat through the source's log.", "capture"),
    MetricDef("kappaflow_capture_confirmed_position", "gauge", ("source",),
              "Last source position acknowledged upstream as a number: PostgreSQL the confirmed LSN (a WAL byte "
              "offset); MySQL/MariaDB binlog file sequence number * 2^32 + byte position.", "capture"),
    MetricDef("kappaflow_capture_retained_wal_bytes", "gauge", ("source", "slot"),
              "WAL the source's replication slot keeps on the server (current LSN - restart_lsn).", "capture"),
    MetricDef("kappaflow_capture_unconfirmed_wal_bytes", "gauge", ("source", "slot"),
              "WAL written on the server that the slot has not confirmed yet (current LSN - confirmed_flush_lsn).",
              "capture"),
    MetricDef("kappaflow_capture_binlog_files_behind", "gauge", ("source",),
              "MySQL/MariaDB: binlog files on the server after the one the capture reads.", "capture"),
    MetricDef("kappaflow_capture_binlog_bytes_behind", "gauge", ("source",),
              "MySQL/MariaDB: binlog bytes on the server after the capture's position.", "capture"),
    MetricDef("kappaflow_capture_errors", "counter", ("source", "kind"),
              "Capture failures (kind: transient, retried; terminal, the capture stops).", "capture"),
    MetricDef("kappaflow_capture_restarts", "counter", ("source",),
              "Restarts of the capture after a transient failure.", "capture"),
    # --- follow (one process per projection, one follower per sink) ------------------------------
    MetricDef("kappaflow_follow_events", "counter", ("projection", "sink"),
              "Log records the follower's batches read and folded into the view.", "follow"),
    MetricDef("kappaflow_follow_batches", "counter", ("projection", "sink"),
              "Micro-batches applied to the view.", "follow"),
    MetricDef("kappaflow_follow_rows_written", "counter", ("projection", "sink", "op"),
              "View rows written (op: upsert, delete).", "follow"),
    MetricDef("kappaflow_follow_batch_duration_seconds", "histogram", ("projection", "sink"),
              "Time to apply one micro-batch (read, fold, write, positions).", "follow"),
    MetricDef("kappaflow_follow_lag_records", "gauge", ("projection", "sink", "topic", "partition"),
              "Log end offset minus the view's stored position.", "follow"),
    MetricDef("kappaflow_follow_lag_seconds", "gauge", ("projection", "sink", "topic", "partition"),
              "How long the oldest record the view has not applied has been in the log (0 when caught up).",
              "follow"),
    MetricDef("kappaflow_follow_dead_letters", "counter", ("projection", "sink"),
              "Records sent to the dead-letter topic by this process's batches.", "follow"),
    MetricDef("kappaflow_follow_restarts", "counter", ("projection", "sink"),
              "Follower restarts after a failed batch (and rebuilds after the store lost the view).", "follow"),
    MetricDef("kappaflow_follow_running", "gauge", ("projection", "sink"),
              "1 while the follower's query runs, 0 between a failure and its restart or after it gave up.",
              "follow"),
    MetricDef("kappaflow_follow_last_batch_timestamp_seconds", "gauge", ("projection", "sink"),
              "Unix time of the follower's last applied batch.", "follow"),
    # --- the ledger relay -----------------------------------------------------------------------
    MetricDef("kappaflow_relay_events", "counter", ("source",),
              "Ledger events appended to the log by the relay.", "relay"),
    MetricDef("kappaflow_relay_position", "gauge", ("source",),
              "Last ledger position relayed.", "relay"),
    MetricDef("kappaflow_relay_errors", "counter", ("source", "kind"),
              "Relay failures (kind: transient, retried; terminal).", "relay"),
    MetricDef("kappaflow_relay_restarts", "counter", ("source",),
              "Relay restarts after a transient failure.", "relay"),
    # --- the log --------------------------------------------------------------------------------
    MetricDef("kappaflow_log_records_appended", "counter", ("topic",),
              "Records this process appended to the log.", "log"),
    MetricDef("kappaflow_log_records_read", "counter", ("topic",),
              "Offsets this process's readers moved past (follow: per batch, compaction gaps included).", "log"),
    MetricDef("kappaflow_log_end_offset", "gauge", ("topic", "partition"),
              "Offset the next record appended to the partition gets.", "status"),
    MetricDef("kappaflow_log_disk_bytes", "gauge", ("topic",),
              "Bytes on disk of the topic's files (embedded log only).", "log"),
    # --- status (`kappaflow metrics`, `kappaflow ui`): read from the stores, any process -----------
    MetricDef("kappaflow_projection_following", "gauge", ("projection", "sink"),
              "1 when a process holds the projection's lock in the sink (a follower or a replay runs).",
              "status"),
    MetricDef("kappaflow_projection_dead_letters", "gauge", ("projection",),
              "Records in the projection's dead-letter topic kf.dead_letter.projection.<projection>.", "status"),
]

METRICS: dict[str, MetricDef] = {d.name: d for d in _DEFS}


def metric(name: str) -> MetricDef:
    """The definition of ``name`` (KeyError for an undocumented metric: document it first)."""
    return METRICS[name]
