"""`kappaflow ledger ...`: append, read, verify and inspect the ledger.

The database comes from ``--dsn``, else ``KAPPAFLOW_LEDGER_DSN``, else a ``[ledger]`` section of
kappaflow.toml (``dsn``, ``schema``) once the config has one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from kappaflow.cli.common import console, fail
from kappaflow.errors import ConfigError, KappaflowError

app = typer.Typer(help="The ledger: an append-only, hash-chained event store.", no_args_is_help=True)

DsnOpt = Annotated[str | None, typer.Option("--dsn", envvar="KAPPAFLOW_LEDGER_DSN",
                                            help="PostgreSQL URL of the ledger database.")]
SchemaOpt = Annotated[str | None, typer.Option("--schema", envvar="KAPPAFLOW_LEDGER_SCHEMA",
                                               help="PostgreSQL schema of the ledger tables.")]


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except KappaflowError as exc:
        fail(str(exc), transient=exc.transient)


def _target(ctx: typer.Context, dsn: str | None, schema: str | None) -> tuple[str, str]:
    from kappaflow.ledger import DEFAULT_SCHEMA

    if dsn is None or schema is None:
        from kappaflow.cli.common import settings

        cfg = settings(ctx).ledger
        dsn = dsn or cfg.connect_dsn()
        schema = schema or cfg.schema_name
    if not dsn:
        raise ConfigError(
            "ledger dsn: not set; pass --dsn or set KAPPAFLOW_LEDGER_DSN (or [ledger] dsn in kappaflow.toml)"
        )
    return dsn, schema if isinstance(schema, str) and schema else DEFAULT_SCHEMA


def _print_json(value: Any) -> None:
    sys.stdout.write(orjson.dumps(value).decode() + "\n")


@app.command("install")
def install_cmd(ctx: typer.Context, dsn: DsnOpt = None, schema: SchemaOpt = None) -> None:
    """Create or upgrade the ledger tables (Alembic branch `ledger`)."""
    with _errors():
        from kappaflow.ledger import install

        url, sch = _target(ctx, dsn, schema)
        install(url, sch)
        console.print(f"ledger installed in schema {sch!r}", highlight=False, markup=False)


@app.command("append")
def append_cmd(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(help="Stream id, e.g. account-42 (type = part before '-').")],
    event_type: Annotated[str | None, typer.Argument(help="Event type (omit with --jsonl).")] = None,
    data: Annotated[str | None, typer.Argument(help="Event data as a JSON object ('-' reads stdin).")] = None,
    jsonl: Annotated[Path | None, typer.Option(
        "--jsonl", help="Append many events: a file of JSON lines {type, data, metadata?, schema_version?}.")] = None,
    expected_version: Annotated[str, typer.Option(
        "--expected-version", "-e", help="any | no_stream | exists | N")] = "any",
    idempotency_key: Annotated[str | None, typer.Option("--idempotency-key", "-k")] = None,
    stream_type: Annotated[str | None, typer.Option("--stream-type")] = None,
    metadata: Annotated[str | None, typer.Option("--metadata", help="JSON object merged into each event.")] = None,
    schema_version: Annotated[int, typer.Option("--schema-version")] = 1,
    dsn: DsnOpt = None,
    schema: SchemaOpt = None,
) -> None:
    """Append events atomically; prints the result (global position, stream versions) as JSON."""
    with _errors():
        from kappaflow.ledger import Ledger, NewEvent

        events: list[NewEvent] = []
        if jsonl is not None:
            if event_type is not None or data is not None:
                raise ConfigError("append: give either EVENT_TYPE [DATA] or --jsonl, not both")
            text = sys.stdin.read() if str(jsonl) == "-" else jsonl.read_text()
            for n, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                obj = _json(line, f"--jsonl line {n}")
                if not isinstance(obj, dict) or "type" not in obj:
                    raise ConfigError(f"--jsonl line {n}: expected an object with 'type' and 'data'")
                events.append(NewEvent(obj["type"], obj.get("data", {}), obj.get("metadata"),
                                       obj.get("schema_version", 1)))
        else:
            if event_type is None:
                raise ConfigError("append: EVENT_TYPE is required (or --jsonl FILE)")
            raw = sys.stdin.read() if data == "-" else (data or "{}")
            events.append(NewEvent(event_type, _json(raw, "DATA"), None, schema_version))
        meta = _json(metadata, "--metadata") if metadata else None
        url, sch = _target(ctx, dsn, schema)
        with Ledger(url, schema=sch, pool_size=1) as ledger:
            r = ledger.append(stream, events, expected_version, stream_type=stream_type,
                              idempotency_key=idempotency_key, metadata=meta)
        _print_json({"first_position": r.first_position, "position": r.position, "versions": r.versions,
                     "recorded_at": r.recorded_at.isoformat(), "duplicate": r.duplicate})


@app.command("read")
def read_cmd(
    ctx: typer.Context,
    stream: Annotated[str | None, typer.Argument(help="Stream id; omit to read all in global order.")] = None,
    start: Annotated[int, typer.Option("--from", help="First stream version (with STREAM) or position.")] = 1,
    limit: Annotated[int, typer.Option("--limit", "-n")] = 100,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep reading new events (all only).")] = False,
    dsn: DsnOpt = None,
    schema: SchemaOpt = None,
) -> None:
    """Print events as JSON lines."""
    with _errors():
        from kappaflow.ledger import Ledger, TailReader

        url, sch = _target(ctx, dsn, schema)
        with Ledger(url, schema=sch, pool_size=1) as ledger:
            if stream is not None:
                if follow:
                    raise ConfigError("read --follow: only for the whole ledger (omit STREAM)")
                for e in ledger.read_stream(stream, from_version=start, limit=limit, decode=False, hashes=True):
                    _print_json(e.to_dict())
                return
            if not follow:
                for e in ledger.read_all(from_position=start, limit=limit, decode=False, hashes=True):
                    _print_json(e.to_dict())
                return
            reader = TailReader(ledger, next_position=start, decode=False, hashes=True)
            try:
                for e in reader:
                    _print_json(e.to_dict())
                    sys.stdout.flush()
            except KeyboardInterrupt:
                pass


@app.command("verify")
def verify_cmd(
    ctx: typer.Context,
    start: Annotated[int, typer.Option("--from", help="Trust rows before this position.")] = 1,
    anchor: Annotated[list[str] | None, typer.Option(
        "--anchor", help="POSITION:HASH_HEX recorded elsewhere (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    dsn: DsnOpt = None,
    schema: SchemaOpt = None,
) -> None:
    """Check the hash chain, dense positions and stream versions; exit 1 naming the first bad position."""
    with _errors():
        from kappaflow.ledger import Ledger

        anchors = [_anchor(a) for a in anchor or []]
        url, sch = _target(ctx, dsn, schema)
        with Ledger(url, schema=sch, pool_size=1) as ledger:
            report = ledger.verify(from_position=start, anchors=anchors)
        if as_json:
            _print_json(report.to_dict())
        elif report.ok:
            console.print(f"ok: {report.checked} events verified, head position {report.head_position}",
                          highlight=False, markup=False)
        else:
            console.print(f"FAILED at position {report.first_bad_position}: {report.reason}",
                          highlight=False, markup=False)
        if not report.ok:
            raise typer.Exit(1)


@app.command("forget")
def forget_cmd(
    ctx: typer.Context,
    subject: Annotated[str, typer.Argument(help="The data subject's id (the value of its events' subject field).")],
    as_json: Annotated[bool, typer.Option("--json")] = False,
    dsn: DsnOpt = None,
    schema: SchemaOpt = None,
) -> None:
    """Erase a data subject's personal fields by destroying its key (crypto-shredding; idempotent).

    Events stay (verify still passes); their personal fields read as "<forgotten>" from the ledger,
    the log and views replayed afterwards. Views built before keep their copies until replayed.
    """
    with _errors():
        from kappaflow.ledger import Ledger

        url, sch = _target(ctx, dsn, schema)
        with Ledger(url, schema=sch, pool_size=1) as ledger:
            result = ledger.forget(subject)
        if as_json:
            _print_json(result.to_dict())
        elif result.already:
            console.print(f"subject {subject!r} was already forgotten; nothing changed", highlight=False, markup=False)
        else:
            console.print(f"forgot subject {subject!r}: its key is destroyed ({result.snapshots_dropped} snapshots "
                          "dropped); replay views that hold its data", highlight=False, markup=False)


@app.command("stats")
def stats_cmd(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    dsn: DsnOpt = None,
    schema: SchemaOpt = None,
) -> None:
    """Head position and hash (keep them as an external anchor), streams, events per type, sizes."""
    with _errors():
        from kappaflow.ledger import Ledger

        url, sch = _target(ctx, dsn, schema)
        with Ledger(url, schema=sch, pool_size=1) as ledger:
            st = ledger.stats()
        if as_json:
            _print_json(st.to_dict())
            return
        d = st.to_dict()
        lines = [f"{key}: {d[key]}" for key in ("head_position", "head_hash", "streams", "events",
                                                 "idempotency_keys", "first_recorded_at", "last_recorded_at")]
        lines += [f"events[{t}]: {n}" for t, n in st.events_by_stream_type.items()]
        lines += [f"bytes[{t}]: {n}" for t, n in st.table_bytes.items()]
        sys.stdout.write("\n".join(lines) + "\n")


def _json(text: str, what: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{what}: not valid JSON ({exc})") from None


def _anchor(text: str) -> tuple[int, bytes]:
    pos, _, hexhash = text.partition(":")
    try:
        return int(pos), bytes.fromhex(hexhash)
    except ValueError:
        raise ConfigError(f"--anchor {text!r}: expected POSITION:HASH_HEX") from None


@app.command("relay")
def relay_cmd(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="Source name: the relay writes <source>.<stream_type> topics.")],
    dsn: DsnOpt = None,
    schema: SchemaOpt = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Serve Prometheus metrics on this port (/metrics); default [metrics] port.")] = None,
) -> None:
    """Relay the ledger's events into the log until stopped (where wal_level is not logical); SIGINT/SIGTERM
    stop it after the current append, and it resumes from the log on the next start."""
    import signal
    import threading

    from kappaflow.cli.common import err_console, settings
    from kappaflow.cli.progress_log import stamp
    from kappaflow.ledger import Ledger, LedgerRelay
    from kappaflow.metrics.core import new_registry
    from kappaflow.metrics.log import LogCollector, embedded_dir
    from kappaflow.metrics.process import serve
    from kappaflow.metrics.relay import RelayCollector

    def say(line: str) -> None:
        err_console.print(stamp(line), markup=False, highlight=False)

    with _errors():
        url, sch = _target(ctx, dsn, schema)
        s = settings(ctx)
        relays: list[LedgerRelay] = []
        collector = RelayCollector(source, lambda: relays)
        registry = new_registry(collector, LogCollector(appended=collector.appended, log_dir=embedded_dir(s)))
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        delay = 1.0
        with serve(s, registry, port=metrics_port, announce=say):
            say(f"relaying the ledger into {source}.<stream_type> topics; Ctrl-C stops")
            while not stop.is_set():
                log = s.open_log()
                try:
                    relay = LedgerRelay(Ledger(url, schema=sch), log, source, partitions=s.log.partitions)
                    relays.append(relay)
                    relay.run(stop)
                except KappaflowError as exc:
                    collector.error(exc)
                    if not exc.transient:
                        raise
                    say(f"{exc} -- retrying in {delay:.0f}s")
                    if stop.wait(delay):
                        break
                    delay = min(delay * 2, 30.0)
                    collector.restart()
                finally:
                    log.close()
            say(f"stopped: {sum(r.relayed for r in relays):,} events relayed")
