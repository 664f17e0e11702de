"""`kappaflow source add|list|remove|status`: register capture sources in kappaflow.toml."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.table import Table

from kappaflow.cli.common import console, fail, settings
from kappaflow.config import CONFIG_FILE, SOURCE_MODELS, SnapshotMode, format_validation_error
from kappaflow.config_file import remove_source, write_source
from kappaflow.connectors.outbox import outbox_options
from kappaflow.connectors.registry import source_kind
from kappaflow.errors import ConfigError, KappaflowError

app = typer.Typer(help="Register and inspect capture sources.", no_args_is_help=True)


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _key_columns(specs: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for spec in specs:
        table, sep, cols = spec.partition("=")
        if not sep or not table.strip() or not _csv(cols):
            raise ConfigError(f"--key-columns {spec!r}: expected TABLE=COL[,COL...], e.g. public.events=id,seq")
        out[table.strip()] = _csv(cols)
    return out


def _config_path(ctx: typer.Context) -> Path:
    """The file `--config` names, else ./kappaflow.toml (where Settings.load read it from)."""
    given = (ctx.find_root().obj or {}).get("config")
    return Path(given) if given else Path.cwd() / CONFIG_FILE


def _check_tables(src: Any) -> None:
    """Refuse a source whose tables capture would refuse (keys, replica identity, NULL or duplicate keys)."""
    try:
        checks = source_kind(src).tables(src, True)
    except KappaflowError as exc:
        fail(f"source {src.name!r} not saved: cannot check its tables: {exc}\nFix the connection (or the password "
             "variable), or save it unchecked with --no-check (`kappaflow doctor` checks the tables later)")
    if checks is None:
        return
    bad = [c for c in checks if c.problem]
    for c in checks:
        if not c.problem:
            console.print(f"  {c.table}: {c.detail}", markup=False, highlight=False)
    if bad:
        lines = [f"source {src.name!r} not saved: {len(bad)} table(s) cannot be captured:"]
        lines += [f"  {c.table}: {c.detail}.\n    Fix: {c.fix}" for c in bad]
        fail("\n".join(lines))


@app.command("add")
def add(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Source name; becomes the topic prefix.")],
    postgres: Annotated[str | None, typer.Option("--postgres", help="postgresql://user@host:port/db")] = None,
    mysql: Annotated[str | None, typer.Option("--mysql", help="mysql://user@host:port/db")] = None,
    debezium: Annotated[str | None, typer.Option("--debezium", help="Kafka bootstrap host:port")] = None,
    ledger: Annotated[str | None, typer.Option(
        "--ledger", help="postgresql://user@host:port/db holding a kappaflow ledger (captures its events)")] = None,
    ledger_schema: Annotated[str | None, typer.Option(
        "--ledger-schema", help="Schema of the ledger tables (default kappaflow_ledger)")] = None,
    tables: Annotated[str | None, typer.Option("--tables", help="Comma list: schema.table / db.table")] = None,
    topics: Annotated[str | None, typer.Option("--topics", help="Debezium topics, comma list")] = None,
    key_columns: Annotated[
        list[str] | None, typer.Option("--key-columns", help="TABLE=COL,... for tables without a primary key")
    ] = None,
    password_env: Annotated[
        str | None, typer.Option("--password-env", help="Environment variable holding the password")
    ] = None,
    keep_history: Annotated[str | None, typer.Option(
        "--keep-history", help="Comma list of tables whose topics keep every version (cleanup.policy=delete): "
        "what an as-of enrichment needs")] = None,
    snapshot_mode: Annotated[SnapshotMode, typer.Option("--snapshot-mode")] = SnapshotMode.INITIAL,
    outbox_table: Annotated[str | None, typer.Option(
        "--outbox-table", help="Comma list of outbox tables routed like Debezium's outbox event router "
        "(captured too)")] = None,
    outbox_message_prefix: Annotated[str | None, typer.Option(
        "--outbox-message-prefix", help="PostgreSQL: route pg_logical_emit_message messages with this prefix "
        "as outbox events")] = None,
    outbox_option: Annotated[list[str] | None, typer.Option(
        "--outbox-option", help="KEY=VALUE outbox router option, Debezium's name or ours "
        "(e.g. route.by.field=aggregate_type)")] = None,
    replace: Annotated[bool, typer.Option("--replace", help="Overwrite an existing source of that name")] = False,
    check: Annotated[bool, typer.Option(
        "--check/--no-check", help="Connect and check every table's key before saving (default: check)")] = True,
) -> None:
    """Add a source to kappaflow.toml (passwords stay in the environment); its tables are checked first.

    Only the source's own table is written: the file's comments, order and other values stay as they are.
    """
    given = {kind: value for kind, value in (("postgres", postgres), ("mysql", mysql), ("debezium", debezium),
                                             ("ledger", ledger)) if value}
    if len(given) != 1:
        fail("give exactly one of --postgres DSN, --mysql DSN, --debezium BOOTSTRAP or --ledger DSN")
    if ledger_schema is not None and not ledger:
        fail("--ledger-schema goes with --ledger DSN")
    if ledger and (tables or key_columns):
        fail("--tables/--key-columns do not apply to --ledger: a ledger source captures <schema>.events")
    s = settings(ctx)
    if name in s.sources and not replace:
        fail(f"source {name!r} already exists; use --replace to overwrite it")
    [(kind, address)] = given.items()
    model = SOURCE_MODELS[kind]
    fields = model.model_fields
    data: dict[str, object] = {"name": name, "tables": _csv(tables),
                               "key_columns": _key_columns(key_columns or []), "snapshot_mode": snapshot_mode}
    # the address is a DSN, or the bootstrap servers of a Debezium cluster (which reads topics, not tables)
    data["bootstrap" if "bootstrap" in fields else "dsn"] = address
    if "password_env" in fields:
        data["password_env"] = password_env
    if "topics" in fields:
        data["topics"] = _csv(topics)
    if keep_history:
        if kind not in ("postgres", "mysql"):
            fail("--keep-history goes with --postgres or --mysql (a ledger's stream topics keep every event already)")
        data["keep_history"] = _csv(keep_history)
    if ledger_schema is not None:
        data["schema_name"] = ledger_schema
    if outbox_table or outbox_message_prefix or outbox_option:
        if "outbox" not in fields:
            fail("--outbox-table/--outbox-message-prefix/--outbox-option go with --postgres or --mysql")
        outbox: dict[str, object] = {"tables": _csv(outbox_table), **outbox_options(outbox_option or [])}
        if outbox_message_prefix:
            outbox["message_prefix"] = outbox_message_prefix
        listed = data["tables"]
        assert isinstance(listed, list)
        # an outbox table is captured: added to --tables; without --tables only the outbox tables are
        # (Debezium: a connector applying the outbox router should capture the outbox table only)
        listed += [t for t in _csv(outbox_table) if t not in listed]
        data["outbox"] = outbox
    try:
        src = model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"source {name!r}")) from None
    if check:
        _check_tables(src)
    path = _config_path(ctx)
    write_source(path, name, src)
    console.print(f"source [bold]{name}[/] ({src.kind}) saved to {path}")


@app.command("list")
def list_(ctx: typer.Context) -> None:
    """List registered sources."""
    s = settings(ctx)
    table = Table("name", "kind", "where", "tables/topics", "snapshot")
    for name, src in sorted(s.sources.items()):
        where = getattr(src, "dsn", None) or getattr(src, "bootstrap", "")
        table.add_row(name, src.kind, where, ", ".join(source_kind(src).captured(src)), src.snapshot_mode.value)
    console.print(table)


@app.command("remove")
def remove(
    ctx: typer.Context,
    name: str,
    keep_slot: Annotated[bool, typer.Option(
        "--keep-slot", help="Keep the replication slot and publication on the server (they retain WAL)")] = False,
) -> None:
    """Remove a source from kappaflow.toml and drop its replication slot and publication (log topics stay)."""
    s = settings(ctx)
    src = s.source(name)
    path = _config_path(ctx)
    try:
        lines = source_kind(src).release(src, [o for n, o in s.sources.items() if n != name], keep_slot)
    except KappaflowError as exc:
        fail(f"source {name!r} not removed: {exc}\n(--keep-slot removes it from the configuration and leaves the "
             "slot, which retains WAL until dropped)", transient=exc.transient)
    if not remove_source(path, name):
        fail(f"source {name!r} is not in {path}: it comes from the environment (KAPPAFLOW_SOURCES__"
             f"{name.upper()}__...); unset those variables")
    for line in lines:
        console.print(f"  {line}", markup=False, highlight=False)
    console.print(f"source [bold]{name}[/] removed from {path} (log topics and stored offsets kept)")


@app.command("status")
def status(
    ctx: typer.Context,
    name: str,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object (machine-readable)")] = False,
) -> None:
    """Source lag (slot / binlog), confirmed position, events captured, topic end offsets."""
    from kappaflow.cli.capture import source_status

    s = settings(ctx)
    src = s.source(name)
    with s.open_log(read_only=True) as log:
        info = source_status(src, log)
        if src.kind in ("postgres", "mysql"):  # on-demand snapshot progress (rows, rows/s, ETA)
            from kappaflow.cli.snapshot import ondemand_status

            info["ondemand"] = ondemand_status(src, log)
        if getattr(src, "keep_history", None):  # whether those topics really keep every version
            from kappaflow.connectors.history import history_state, history_topic_names

            topics = log.list_topics()
            info["keep_history"] = {topic: history_state(topics.get(topic))
                                    for topic in history_topic_names(src).values()}
    if as_json:
        typer.echo(json.dumps(info, default=str))
        return
    table = Table("field", "value")
    for key, value in info.items():
        table.add_row(str(key), value if isinstance(value, str) else json.dumps(value, default=str))
    console.print(table)
