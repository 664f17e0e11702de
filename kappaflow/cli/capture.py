"""`kappaflow capture NAME` and the data behind `kappaflow source status NAME`.

Wiring (in ``kappaflow/cli/app.py``)::

    from kappaflow.cli import capture as capture_cli
    app.command("capture")(capture_cli.capture)
    # and in `source status NAME`:  capture_cli.source_status(source_config, log) -> dict

``capture`` runs until stopped. SIGINT/SIGTERM ask for a clean stop: the batch being
built is written, the offset saved, the source acknowledged, then the process exits
(a second signal exits at once; everything durable stays consistent, see
``kappaflow.connectors.base``). Transient failures (PostgreSQL restarting, a broker
down, the slot held by a dying process) are retried with backoff; terminal ones end
the command with one clear line.

``--resnapshot`` recovers a source whose position the database no longer has (a PostgreSQL slot
invalidated or dropped, MySQL/MariaDB binlogs or GTIDs purged): a new position, a full snapshot
through the log, deletes for rows removed meanwhile (``kappaflow.connectors.resnapshot``). It
refuses a healthy source unless ``--force``.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from kappaflow.config import Settings
from kappaflow.connectors.base import CaptureSummary, Connector, StopSignal
from kappaflow.connectors.registry import source_kind
from kappaflow.connectors.resnapshot import ResnapshotRequest
from kappaflow.errors import ConfigError, KappaflowError
from kappaflow.log.base import Log

__all__ = ["capture", "capture_command", "make_connector", "source_status"]


def make_connector(source: Any, log: Log, *, partitions: int = 4, progress: bool | None = None,
                   log_kafka: Any = None) -> Connector:
    """The connector for a source config, from its kind in the source registry (PostgreSQL WAL,
    MySQL/MariaDB binlog, Debezium topics, a kappaflow ledger). ``log_kafka``: the configuration's
    ``[log.kafka]`` (a Debezium source without Kafka settings of its own reads with them)."""
    return source_kind(source).open(source, log, partitions=partitions, progress=progress, log_kafka=log_kafka)


def attach_resnapshot(connector: Connector, request: ResnapshotRequest, kind: str) -> None:
    """Hand ``--resnapshot`` to a connector that can lose its position (PostgreSQL, MySQL/MariaDB, and a
    ledger through the PostgreSQL connector it wraps)."""
    inner = getattr(connector, "postgres", None)
    if "resnapshot" not in dir(type(connector)) and inner is not None and "resnapshot" in dir(type(inner)):
        connector = inner
    if "resnapshot" not in dir(type(connector)):
        raise ConfigError(f"--resnapshot: a {kind} source has no database position that can be lost (it applies "
                          "to postgres and mysql sources); run `kappaflow capture` without it")
    connector.resnapshot = request  # type: ignore[attr-defined]


def source_status(config: Any, log: Log) -> dict[str, Any]:
    """Slot lag (bytes), confirmed LSN, stored offset, events captured, topic sizes.

    ``log`` may be opened read-only (a running capture holds the embedded log's writer lock).
    """
    return source_kind(config).status(config, log)


class _CaptureMetrics:
    """The capture's collectors and the source probe its progress lines share (one query per interval)."""

    def __init__(self, settings: Settings, source: Any, connectors: list[Connector], *,
                 progress_every_s: float = 0.0) -> None:
        from kappaflow.metrics.capture import CaptureCollector
        from kappaflow.metrics.core import new_registry
        from kappaflow.metrics.log import LogCollector, embedded_dir
        from kappaflow.metrics.probes import CachedProbe, open_probe

        self.settings = settings
        raw = open_probe(source)
        every = settings.metrics.probe_interval_s
        if progress_every_s > 0:  # each progress line shows a fresh figure
            every = min(every, progress_every_s)
        self.probe = CachedProbe(raw, every) if raw is not None else None
        self.collector = CaptureCollector(source, lambda: connectors, probe=self.probe)
        self.registry = new_registry(self.collector,
                                     LogCollector(appended=self.collector.appended, log_dir=embedded_dir(settings)))

    @contextmanager
    def serve(self, port: int | None, say: Callable[[str], None]) -> Iterator[None]:
        from kappaflow.metrics.process import serve

        try:
            with serve(self.settings, self.registry, port=port, announce=say):
                yield
        finally:
            if self.probe is not None:
                self.probe.close()


def capture_metrics(settings: Settings, source: Any, connectors: list[Connector], *,
                    progress_every_s: float = 0.0) -> _CaptureMetrics:
    return _CaptureMetrics(settings, source, connectors, progress_every_s=progress_every_s)


def open_log_for(settings: Settings) -> Log:
    """The configured log (kept as a seam for tests and the runners)."""
    log: Log = settings.open_log()
    return log


@contextmanager
def _stop_on_signals(stop: StopSignal, on_signal: Callable[[str], None] | None = None) -> Iterator[None]:
    """First SIGINT/SIGTERM: clean stop. Second: leave at once (KeyboardInterrupt)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            raise KeyboardInterrupt(f"second {name}: stopping now")
        stop.set(f"{name} received")
        if on_signal is not None:
            on_signal(name)

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def capture_command(name: str, until_caught_up: bool = False, config_path: Path | None = None, *,
                    profile: str | None = None, progress: bool | None = None,
                    max_retries: int | None = None, echo: Callable[[str], None] | None = None,
                    log_every_s: float = 0.0, metrics_port: int | None = None, resnapshot: bool = False,
                    force: bool = False) -> CaptureSummary:
    """Run the capture of source ``name`` from ``kappaflow.toml`` until stopped (or caught up).

    Returns the summary of the last run. Raises KappaflowError for terminal failures
    (and for transient ones once ``max_retries`` is exhausted; None retries forever).
    ``log_every_s`` > 0: a timestamped progress line to ``echo`` at that interval
    (``kappaflow.cli.progress_log``). ``metrics_port`` (else ``[metrics] port``): ``/metrics`` there
    (``kappaflow.metrics.capture``). ``resnapshot`` / ``force``: ``--resnapshot [--force]`` (module docstring).
    """
    from kappaflow.cli.progress_log import ProgressLog
    settings = Settings.load(config_path, profile=profile)
    source = settings.sources.get(name)
    if source is None:
        known = ", ".join(sorted(settings.sources)) or "none registered"
        raise ConfigError(f"unknown source {name!r} (sources: {known}); add it with `kappaflow source add`")
    say = echo or (lambda _m: None)
    if force and not resnapshot:
        raise ConfigError("--force only applies with --resnapshot")
    request = ResnapshotRequest(force=force) if resnapshot else None
    stop = StopSignal()
    attempt = 0
    delay = 1.0
    current: list[Connector] = []
    metrics = capture_metrics(settings, source, current, progress_every_s=log_every_s)
    reporter = ProgressLog(source, lambda: current[-1] if current else None, say, interval_s=log_every_s,
                           probe=metrics.probe) if log_every_s > 0 else contextlib.nullcontext()
    with _stop_on_signals(stop, lambda sig: say(f"{sig}: finishing the current batch, then stopping")), \
            metrics.serve(metrics_port, say), reporter:
        while True:
            log = open_log_for(settings)
            try:
                connector = make_connector(source, log, partitions=settings.log.partitions, progress=progress,
                                           log_kafka=settings.log.kafka)
                current.append(connector)
                if request is not None:
                    attach_resnapshot(connector, request, str(getattr(source, "kind", type(source).__name__)))
                try:
                    summary = connector.run(stop, until_caught_up=until_caught_up)
                finally:
                    if request is not None:
                        for line in request.said:
                            say(line)
                        request.said.clear()
                return summary
            except KappaflowError as exc:
                metrics.collector.error(exc)
                if not exc.transient or stop.is_set() or (max_retries is not None and attempt >= max_retries):
                    raise
                attempt += 1
                metrics.collector.restart()
                say(f"{exc} — retrying in {delay:.0f}s (attempt {attempt})")
                if stop.wait(delay):
                    raise
                delay = min(delay * 2, 30.0)
            finally:
                log.close()


def capture(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Source name from kappaflow.toml.")],
    until_caught_up: Annotated[bool, typer.Option(
        "--until-caught-up", help="Exit once the log holds everything committed when the capture started.")] = False,
    progress: Annotated[bool | None, typer.Option(
        "--progress/--no-progress", help="Snapshot progress bar (default: when stderr is a terminal).")] = None,
    log_every: Annotated[float, typer.Option(
        "--log-every", help="Seconds between progress lines (changes/s, position, lag) when stderr is not a "
        "terminal; 0: none.")] = 10.0,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Serve Prometheus metrics on this port (/metrics); default [metrics] port.")] = None,
    resnapshot: Annotated[bool, typer.Option(
        "--resnapshot", help="Recover a lost position (slot invalidated/dropped, binlog purged): new position, "
        "full snapshot through the log, deletes for rows removed meanwhile. Refuses a healthy source.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="With --resnapshot: re-snapshot even though the position is not lost.")] = False,
) -> None:
    """Capture a source into the log: consistent snapshot, then streaming; Ctrl-C and kill -9 safe.

    Every line it logs on stderr starts with the UTC time; without a terminal a progress line
    follows every --log-every seconds.
    """
    from kappaflow.cli.common import console, err_console
    from kappaflow.cli.progress_log import stamp

    obj = ctx.find_root().obj or {}
    started = time.monotonic()
    terminal = err_console.is_terminal
    summary = capture_command(name, until_caught_up, obj.get("config"), profile=obj.get("profile"),
                              progress=progress, echo=lambda m: err_console.print(stamp(m), markup=False,
                                                                                  highlight=False, soft_wrap=True),
                              log_every_s=0.0 if terminal else log_every, metrics_port=metrics_port,
                              resnapshot=resnapshot, force=force)
    took = time.monotonic() - started
    line = (f"{summary.source}: {summary.events:,} events ({summary.snapshot_rows:,} snapshot rows), "
            f"{summary.records:,} records, {summary.duplicates_skipped:,} duplicates skipped; "
            f"position {summary.position}, acknowledged {summary.acknowledged or '-'}; "
            f"{summary.stopped_reason} after {took:.1f}s")
    # soft_wrap: a log line stays one line whatever width the console believes it has (COLUMNS set by
    # a parent, a forced terminal): readers and tests match whole lines
    console.print(line if console.is_terminal else stamp(line), markup=False, highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m kappaflow.cli.capture NAME [--config PATH] [--until-caught-up] [--log-every S]``
    (same as ``kappaflow capture``)."""
    from kappaflow.cli.common import fail

    standalone = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @standalone.command()
    def _main(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument()],
        config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
        profile: Annotated[str | None, typer.Option("--profile")] = None,
        until_caught_up: Annotated[bool, typer.Option("--until-caught-up")] = False,
        progress: Annotated[bool | None, typer.Option("--progress/--no-progress")] = None,
        log_every: Annotated[float, typer.Option("--log-every")] = 10.0,
        metrics_port: Annotated[int | None, typer.Option("--metrics-port")] = None,
        resnapshot: Annotated[bool, typer.Option("--resnapshot")] = False,
        force: Annotated[bool, typer.Option("--force")] = False,
    ) -> None:
        ctx.obj = {"config": config, "profile": profile}
        try:
            capture(ctx, name, until_caught_up, progress, log_every, metrics_port, resnapshot, force)
        except KappaflowError as exc:
            fail(str(exc), transient=exc.transient)

    standalone(argv)


if __name__ == "__main__":
    main()
