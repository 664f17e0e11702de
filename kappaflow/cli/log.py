"""`kappaflow log ...`: inspect the log (topics, end offsets, records) and compact it."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from kappaflow.cli.common import console, settings

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


@app.command("compact")
def compact(ctx: typer.Context, topic: str) -> None:
    """Compact a topic now (embedded log; Kafka compacts on the broker)."""
    s = settings(ctx)
    with s.open_log() as log:
        stats = log.compact(topic)
        console.print(f"{topic}: kept {stats.kept}, removed {stats.removed} "
                      f"(tombstones removed {stats.tombstones_removed})")
