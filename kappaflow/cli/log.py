"""`kappaflow log ...`: inspect the log (topics, end offsets, records) and compact it."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from kappaflow.cli.common import console, fail, settings

app = typer.Typer(help="Inspect and maintain the log.", no_args_is_help=True)


@app.command("topics")
def topics(ctx: typer.Context) -> None:
    """Topics with partitions, cleanup policy and end offsets."""
    s = settings(ctx)
    with s.open_log(read_only=True) as log:
        table = Table("topic", "partitions", "cleanup", "end offsets")
        for name, cfg in sorted(log.list_topics().items()):
            ends = log.end_offsets(name)
            table.add_row(name, str(cfg.partitions), cfg.cleanup_policy.value,
                          " ".join(f"{p}:{o}" for p, o in sorted(ends.items())))
        console.print(table)


@app.command("tail")
def tail(
    ctx: typer.Context,
    topic: str,
    partition: Annotated[int | None, typer.Option("--partition", "-p")] = None,
    start: Annotated[int, typer.Option("--from", help="First offset")] = 0,
    limit: Annotated[int, typer.Option("--limit", "-n")] = 20,
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON object per record: topic, partition, offset, key, value (parsed when JSON)")] = False,
) -> None:
    """Print records of a topic, one per line (key and value as text; never wrapped, so lines can be piped)."""
    s = settings(ctx)
    with s.open_log(read_only=True) as log:
        parts = [partition] if partition is not None else range(log.partitions(topic))
        for p in parts:
            for rec in log.read(topic, p, start, limit):
                if as_json:
                    typer.echo(json.dumps({"topic": topic, "partition": p, "offset": rec.offset,
                                           "key": _decoded(rec.key), "value": _decoded(rec.value)}))
                    continue
                key = rec.key.decode(errors="replace") if rec.key is not None else "null"
                value = rec.value.decode(errors="replace") if rec.value is not None else "null (tombstone)"
                typer.echo(f"{topic}[{p}]@{rec.offset} {key} {value}")


def _decoded(raw: bytes | None) -> Any:
    """JSON bytes as the JSON value they hold, other bytes as text, None (a tombstone's value) as null."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


@app.command("delete")
def delete(
    ctx: typer.Context,
    topics: Annotated[list[str], typer.Argument(help="Topics to delete, with every record they hold.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete topics and their records (and the consumer groups' positions on them).

    A topic's cleanup policy is fixed when it is created: to give a table's topic another one (e.g.
    after adding the table to ``keep_history``), stop the capture, delete the topic, start the capture
    (it creates the topic anew) and re-read the table with ``kappaflow snapshot``. The embedded log
    refuses while a capture holds its writer lock.
    """
    from kappaflow.errors import KappaflowError

    s = settings(ctx)
    if not yes and not typer.confirm(f"delete {', '.join(topics)} and every record they hold?"):
        fail("nothing deleted")
    try:
        with s.open_log() as log:
            known = log.list_topics()
            unknown = [t for t in topics if t not in known]
            if unknown:
                fail(f"unknown topic(s) {unknown}; nothing deleted (`kappaflow log topics` lists them)")
            for topic in topics:
                log.delete_topic(topic)
                console.print(f"deleted {topic}", highlight=False, markup=False)
    except KappaflowError as exc:
        fail(str(exc), transient=exc.transient)


@app.command("compact")
def compact(
    ctx: typer.Context,
    topic: Annotated[str | None, typer.Argument(help="A topic; every compact-policy topic when omitted.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for a running writer's answer.")] = 600.0,
) -> None:
    """Compact now and give the disk space back (embedded log; Kafka compacts on the broker).

    While a capture writes the log, the capture does it (asked through the log directory)
    and this prints what it did.
    """
    from kappaflow.errors import KappaflowError
    from kappaflow.log.embedded.control import compact_embedded

    s = settings(ctx)
    if s.log.is_kafka:
        console.print("the Kafka log is compacted by the brokers' log cleaner (cleanup.policy=compact topics); "
                      "nothing to do here", highlight=False)
        return
    path = s.log.embedded_path(s.base_dir)
    try:
        if topic is not None:
            with s.open_log(read_only=True) as reader:
                reader.topic_config(topic)  # an unknown topic fails here, not inside the writer
        report = compact_embedded(path, topic, open_writer=s.open_log, timeout_s=timeout)
    except KappaflowError as exc:
        fail(str(exc), transient=exc.transient)
    who = f"the running writer (pid {report.writer_pid})" if report.writer_pid is not None else "this process"
    console.print(f"compacted by {who} in {report.seconds:.1f} s", highlight=False)
    if not report.topics:
        console.print("  no compact-policy topics", highlight=False)
    for name, st in sorted(report.topics.items()):
        size = ""
        if st.get("bytes_before") is not None and st.get("bytes_after") is not None:
            size = f", {_bytes(st['bytes_before'])} -> {_bytes(st['bytes_after'])} on disk"
            if st.get("full_vacuum"):
                size += " (file rewritten)"
        console.print(f"  {name}: kept {st['kept']:,}, removed {st['removed']:,} "
                      f"(tombstones {st['tombstones_removed']:,}){size}", highlight=False, markup=False)


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
