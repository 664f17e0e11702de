"""Typed configuration, parsed once at the boundary.

Sources, in order of precedence (later wins):
1. `kappaflow.toml` (or `--config PATH`), with an optional `[profile.NAME]` overlay
   chosen by `--profile NAME` / `KAPPAFLOW_PROFILE`;
2. environment variables `KAPPAFLOW_<SECTION>__<FIELD>` (nested with `__`), e.g.
   `KAPPAFLOW_LOG__URL`, `KAPPAFLOW_SOURCES__SHOP__PASSWORD`;
3. for source passwords also `KAPPAFLOW_SOURCE_<NAME>_PASSWORD` or the variable named
   by `password_env`.
Secrets are `SecretStr` and never rendered in errors or logs.
"""

from __future__ import annotations

import os
import re
import tomllib
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import quote, urlsplit, urlunsplit

import pydantic
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from kappaflow.connectors.history import check_keep_history, default_schema
from kappaflow.connectors.outbox import OutboxSettings, check_outbox_tables
from kappaflow.errors import ConfigError
from kappaflow.projections.sinks.postgres.settings import PostgresSettings
from kappaflow.projections.sinks.redis.settings import RedisSettings
from kappaflow.projections.sinks.search.settings import SearchSettings

CONFIG_FILE = "kappaflow.toml"
ENV_PREFIX = "KAPPAFLOW_"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=False)


class SnapshotMode(str, Enum):
    INITIAL = "initial"
    NEVER = "never"
    ALWAYS = "always"
    INITIAL_ONLY = "initial_only"


class SecurityProtocol(str, Enum):
    PLAINTEXT = "PLAINTEXT"
    SSL = "SSL"
    SASL_PLAINTEXT = "SASL_PLAINTEXT"
    SASL_SSL = "SASL_SSL"


class SaslMechanism(str, Enum):
    PLAIN = "PLAIN"
    SCRAM_SHA_256 = "SCRAM-SHA-256"
    SCRAM_SHA_512 = "SCRAM-SHA-512"


DecimalMode = Literal["string", "precise", "double"]


KafkaClientName = Literal["auto", "confluent", "kafka-python"]


class KafkaClientConfig(_Model):
    """Client settings for a Kafka cluster (`[log.kafka]`, or a Debezium source's `[sources.NAME.kafka]`).

    `client` picks the implementation: "confluent" (librdkafka, `pip install 'kappaflow[kafka]'`),
    "kafka-python", or "auto" (confluent when installed). Security settings are the same for
    both; `producer` / `consumer` hold extra options for the producer only / the consumers only,
    in the chosen client's spelling (librdkafka: `linger.ms`; kafka-python: `linger_ms`).
    """

    client: KafkaClientName = "auto"
    security_protocol: SecurityProtocol = SecurityProtocol.PLAINTEXT
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    client_id: str = "kappaflow"
    request_timeout_ms: int = Field(30_000, ge=1000)
    producer: dict[str, Any] = Field(default_factory=dict)  # producer-only options (batching, compression..)
    consumer: dict[str, Any] = Field(default_factory=dict)  # consumer-only options (fetch sizes..)

    def security(self) -> Any:
        """The settings as a `kappaflow.log.kafka.common.KafkaSecurity` (ConfigError when incomplete)."""
        from kappaflow.log.kafka.common import KafkaSecurity

        sasl = self.security_protocol in (SecurityProtocol.SASL_PLAINTEXT, SecurityProtocol.SASL_SSL)
        if sasl and (self.sasl_mechanism is None or not self.sasl_username or self.sasl_password is None):
            raise ConfigError("log.kafka: SASL needs sasl_mechanism, sasl_username and sasl_password")
        return KafkaSecurity(
            protocol=self.security_protocol.value,
            sasl_mechanism=self.sasl_mechanism.value if sasl and self.sasl_mechanism else None,
            sasl_username=self.sasl_username if sasl else None,
            sasl_password=self.sasl_password.get_secret_value() if sasl and self.sasl_password else None,
            ssl_cafile=self.ssl_cafile, ssl_certfile=self.ssl_certfile, ssl_keyfile=self.ssl_keyfile)

    def open_options(self) -> dict[str, Any]:
        """Keyword arguments of `kappaflow.log.open_log` for a kafka:// URL (both clients take them).

        The producer and consumer tables stay apart: an option meant for the producer never
        reaches a consumer (and the other way round).
        """
        opts: dict[str, Any] = {
            "client": self.client,
            "client_id": self.client_id,
            "request_timeout_s": self.request_timeout_ms / 1000,
            "security": self.security().to_dict(),
        }
        if self.producer:
            opts["producer_options"] = dict(self.producer)
        if self.consumer:
            opts["consumer_options"] = dict(self.consumer)
        return opts


class LogConfig(_Model):
    url: str = ".kappaflow/log"
    partitions: int = Field(4, ge=1, le=10_000)
    replication_factor: int = Field(-1, ge=-1)  # -1: the broker default
    kafka: KafkaClientConfig = Field(default_factory=KafkaClientConfig)
    # Embedded log only (Kafka's broker compacts on its own): the writer -- the capture --
    # compacts compact-policy topics in the background every `compact_interval_s` seconds
    # when enough was appended (0: never on its own; `kappaflow log compact` still works), and
    # leaves every record uncompacted for `min_compaction_lag_s` after its append, so a
    # follower that is at most that far behind sees every change (Kafka's min.compaction.lag.ms).
    compact_interval_s: float = Field(30.0, ge=0)
    min_compaction_lag_s: float = Field(300.0, ge=0)

    @property
    def is_kafka(self) -> bool:
        return self.url.startswith("kafka://")

    def open_options(self) -> dict[str, Any]:
        """`open_log` keyword arguments for this log ({} for the embedded log): what readers on
        other processes (Spark executors, dead-letter writers) need to open the same Kafka log."""
        if not self.is_kafka:
            return {}
        return {**self.kafka.open_options(), "replication_factor": self.replication_factor}

    def open(self, base_dir: Path | None = None, *, read_only: bool = False, **options: Any) -> Any:
        """Open the configured log (relative embedded paths resolve against `base_dir`).

        `read_only` opens the embedded log as a reader, which never conflicts with a running
        capture (the single writer); Kafka clients are always shared. For Kafka, the client named
        by `[log.kafka] client` is opened with `open_options()`.
        """
        from kappaflow.log import open_log

        if self.is_kafka:
            return open_log(self.url, **{**self.open_options(), **options})
        path = self.embedded_path(base_dir)
        if not read_only:
            options.setdefault("compact_interval_s", self.compact_interval_s or None)
            options.setdefault("min_compaction_lag_ms", int(self.min_compaction_lag_s * 1000))
        return open_log(str(path), read_only=read_only, **options)

    def embedded_path(self, base_dir: Path | None = None) -> Path:
        """The embedded log's directory (relative paths resolve against `base_dir`)."""
        path = Path(self.url.removeprefix("file:"))
        return base_dir / path if not path.is_absolute() and base_dir is not None else path


class _SourceBase(_Model):
    name: str
    tables: list[str] = Field(default_factory=list)
    key_columns: dict[str, list[str]] = Field(default_factory=dict)
    snapshot_mode: SnapshotMode = SnapshotMode.INITIAL
    snapshot_chunk_rows: int = Field(10_000, ge=1)
    heartbeat_interval_s: float = Field(10.0, gt=0)
    decimal_mode: DecimalMode = "string"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("expected letters, digits, '_' or '-' (max 63), starting with a letter or digit")
        return v


class _DbSource(_SourceBase):
    dsn: str
    # Debezium's provide.transaction.metadata: BEGIN/END records on <name>.transaction
    provide_transaction_metadata: bool = False
    password: SecretStr | None = None
    password_env: str | None = None
    # tables whose topics keep every version (cleanup.policy=delete, no retention limit) instead of
    # being compacted: what an as-of enrichment (projections/joins/asof.py) needs of a looked-up table
    keep_history: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _keep_history_captured(self) -> Self:
        if self.keep_history:
            check_keep_history(self.name, self.tables, self.keep_history, default_schema(self))
        return self

    @field_validator("dsn")
    @classmethod
    def _no_inline_password(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.password:
            # Keep the file free of secrets: move the password to the environment.
            raise ValueError("the DSN holds a password; put it in the environment (password_env or "
                             "KAPPAFLOW_SOURCE_<NAME>_PASSWORD) instead")
        return v

    def resolved_password(self) -> str | None:
        if self.password is not None:
            return self.password.get_secret_value()
        if self.password_env:
            value = os.environ.get(self.password_env)
            if value is None:
                raise ConfigError(f"sources.{self.name}.password_env: environment variable "
                                  f"{self.password_env!r} is not set")
            return value
        env = f"{ENV_PREFIX}SOURCE_{self.name.upper().replace('-', '_')}_PASSWORD"
        return os.environ.get(env)

    def connect_dsn(self) -> str:
        """The DSN with the password applied. Never log the result."""
        password = self.resolved_password()
        if not password:
            return self.dsn
        parts = urlsplit(self.dsn)
        user = parts.username or ""
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}{port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class _PgLogicalSource(_DbSource):
    """A source read by PostgreSQL logical decoding: a postgresql:// DSN, a slot and a publication."""

    slot: str | None = None
    publication: str | None = None

    @field_validator("dsn")
    @classmethod
    def _pg_scheme(cls, v: str) -> str:
        if not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("expected a postgresql://user@host:port/db URL")
        return v

    @property
    def slot_name(self) -> str:
        return self.slot or f"kappaflow_{self.name.replace('-', '_')}"

    @property
    def publication_name(self) -> str:
        return self.publication or f"kappaflow_{self.name.replace('-', '_')}"


class PostgresSourceConfig(_PgLogicalSource):
    kind: Literal["postgres"] = "postgres"
    # Debezium's xmin.fetch.interval.ms: how often the slot's xmin (source.xmin) is read; 0 = never (null)
    xmin_fetch_interval_s: float = Field(0.0, ge=0)
    # outbox tables / logical messages routed like Debezium's outbox event router (connectors/outbox.py)
    outbox: OutboxSettings | None = None

    @model_validator(mode="after")
    def _outbox_tables(self) -> PostgresSourceConfig:
        check_outbox_tables(self.name, self.tables, self.outbox)
        return self


class MySQLSourceConfig(_DbSource):
    kind: Literal["mysql"] = "mysql"
    server_id: int = Field(5401, ge=1, le=2**32 - 1)
    # outbox tables routed like Debezium's outbox event router (connectors/outbox.py)
    outbox: OutboxSettings | None = None

    @model_validator(mode="after")
    def _outbox_tables(self) -> MySQLSourceConfig:
        if self.outbox is not None and self.outbox.message_prefix:
            raise ValueError("outbox.message_prefix: logical messages are a PostgreSQL feature "
                             "(pg_logical_emit_message); MySQL/MariaDB outboxes are tables")
        check_outbox_tables(self.name, self.tables, self.outbox)
        return self

    @field_validator("dsn")
    @classmethod
    def _mysql_scheme(cls, v: str) -> str:
        if not v.startswith(("mysql://", "mariadb://")):
            raise ValueError("expected a mysql://user@host:port/db URL")
        return v


class LedgerSourceConfig(_PgLogicalSource):
    """The ledger's events captured from PostgreSQL's WAL (``kappaflow.connectors.ledger``).

    One topic per stream type, ``<name>.<stream_type>``, keyed by stream id, the domain event
    as the value. The captured table is always ``<schema_name>.events``: ``tables`` and
    ``key_columns`` are not settable.
    """

    kind: Literal["ledger"] = "ledger"
    schema_name: str = "kappaflow_ledger"

    @field_validator("schema_name")
    @classmethod
    def _schema(cls, v: str) -> str:
        if not v or len(v.encode()) > 63 or "\x00" in v or "." in v:
            raise ValueError("expected a PostgreSQL schema name of 1..63 bytes without '.'")
        return v

    @field_validator("tables", "key_columns")
    @classmethod
    def _fixed_tables(cls, v: Any) -> Any:
        if v:
            raise ValueError("a ledger source always captures <schema_name>.events; remove this setting")
        return v

    @field_validator("keep_history")
    @classmethod
    def _history_kept(cls, v: list[str]) -> list[str]:
        if v:
            raise ValueError("a ledger source's stream topics keep every event already (cleanup.policy=delete); "
                             "remove this setting")
        return v

    @property
    def events_table(self) -> str:
        return f"{self.schema_name}.events"

    def postgres_config(self) -> PostgresSourceConfig:
        """The PostgreSQL source the ledger connector runs (publication on the events table only)."""
        return PostgresSourceConfig(
            name=self.name, dsn=self.dsn, password=self.password, password_env=self.password_env,
            tables=[self.events_table], slot=self.slot, publication=self.publication,
            snapshot_mode=self.snapshot_mode, snapshot_chunk_rows=self.snapshot_chunk_rows,
            heartbeat_interval_s=self.heartbeat_interval_s)


class DebeziumSourceConfig(_SourceBase):
    kind: Literal["debezium"] = "debezium"
    bootstrap: str
    topics: list[str] = Field(min_length=1)
    schemas_enabled: bool | None = None  # None: detect per record
    # The Debezium cluster's client settings (security, client); None: the same as [log.kafka].
    kafka: KafkaClientConfig | None = None
    # the connector's unavailable.value.placeholder (unchanged TOAST values, Oracle LOBs)
    unavailable_placeholder: str = Field("__debezium_unavailable_value", min_length=1)
    # records read from one input partition in a row before the next partition's turn (a partition
    # read to its end hands over at once); moving the Kafka reader drops the client's prefetch
    switch_after: int = Field(50_000, ge=1)

    @field_validator("switch_after", mode="before")
    @classmethod
    def _switch_after_not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # pydantic would read true as 1
            raise ValueError("expected an integer >= 1 (records read from a partition in a row), got a boolean")
        return v


SourceConfig = Annotated[
    PostgresSourceConfig | MySQLSourceConfig | DebeziumSourceConfig | LedgerSourceConfig,
    Field(discriminator="kind"),
]

#: Source kind -> its config model (the members of the ``SourceConfig`` union, by their ``kind``).
SOURCE_MODELS: dict[str, type[PostgresSourceConfig | MySQLSourceConfig | DebeziumSourceConfig | LedgerSourceConfig]] = {
    m.model_fields["kind"].default: m
    for m in (PostgresSourceConfig, MySQLSourceConfig, DebeziumSourceConfig, LedgerSourceConfig)
}


# ``[views]`` keys before the per-sink tables, still read: old key -> (sink, setting).
LEGACY_VIEWS_KEYS = {
    "postgres_dsn": ("postgres", "dsn"),
    "postgres_password_env": ("postgres", "password_env"),
    "search_url": ("search", "url"),
    "search_flavor": ("search", "flavor"),
    "redis_url": ("redis", "url"),
}


def _nest_legacy_views(views: Any) -> Any:
    """``[views] postgres_dsn = ...`` (the old flat keys, also ``KAPPAFLOW_VIEWS__POSTGRES_DSN``) ->
    ``[views.postgres] dsn = ...``. Applied to each layer (file, profile, environment) before they are
    merged, so a later layer overrides an earlier one whichever spelling each uses."""
    if not isinstance(views, dict) or not any(k in views for k in LEGACY_VIEWS_KEYS):
        return views
    out = {k: v for k, v in views.items() if k not in LEGACY_VIEWS_KEYS}
    for old, (sink, key) in LEGACY_VIEWS_KEYS.items():
        if old not in views:
            continue
        table = out.get(sink)
        table = dict(table) if isinstance(table, dict) else {}
        if key in table and table[key] != views[old]:
            raise ConfigError(f"views.{old} and views.{sink}.{key} are the same setting and differ; "
                              f"keep views.{sink}.{key} ([views.{sink}] {key} = ...)")
        table[key] = views[old]
        out[sink] = table
    return out


def _nest_legacy_layer(layer: dict[str, Any]) -> dict[str, Any]:
    if isinstance(layer.get("views"), dict):
        return {**layer, "views": _nest_legacy_views(layer["views"])}
    return layer


class ViewsConfig(_Model):
    """``[views]``: one table per sink kind (``[views.postgres]``, ``[views.search]``, ``[views.redis]``);
    a sink is configured when its table says where the store is. The models live with the sinks
    (``projections/sinks/<kind>/settings.py``) and the sink registry names them. The old flat keys
    (``postgres_dsn``, ``search_url``, ...) are still read, and still readable as attributes."""

    postgres: PostgresSettings = Field(default_factory=PostgresSettings)
    search: SearchSettings = Field(default_factory=SearchSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        try:
            return _nest_legacy_views(data)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @property
    def postgres_dsn(self) -> str | None:
        return self.postgres.dsn

    @property
    def postgres_password_env(self) -> str | None:
        return self.postgres.password_env

    @property
    def search_url(self) -> str | None:
        return self.search.url

    @property
    def search_flavor(self) -> str:
        return self.search.flavor

    @property
    def redis_url(self) -> str | None:
        return self.redis.url

    def postgres_connect_dsn(self) -> str:
        return self.postgres.connect_dsn()


class LedgerConfig(_Model):
    """Where the ledger lives (`kappaflow ledger ...`, the bank example, ledger capture)."""

    dsn: str | None = None
    password_env: str | None = None
    schema_name: str = "kappaflow_ledger"
    max_event_bytes: int = Field(1_048_576, ge=1)
    group_commit: bool = True

    def connect_dsn(self) -> str | None:
        if not self.dsn or not self.password_env:
            return self.dsn
        return PostgresSourceConfig(name="ledger", dsn=self.dsn, password_env=self.password_env).connect_dsn()


class SparkConfig(_Model):
    master: str = "local[*]"
    app_name: str = "kappaflow"
    conf: dict[str, str] = Field(default_factory=dict)
    checkpoint_dir: str = ".kappaflow/checkpoints"
    # Spark's own logging (driver JVM log4j, py4j): off by default, kappaflow reports failures itself.
    log_level: str = "off"

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        from kappaflow.logs import check_spark_level

        return check_spark_level(v)


class MetricsConfig(_Model):
    """``[metrics]``: the ``/metrics`` endpoint of capture, follow and the ledger relay, and the history
    they keep for the status page. One process per port: give each service its own
    (``--metrics-port`` or ``KAPPAFLOW_METRICS__PORT``)."""

    port: int | None = Field(None, ge=0, le=65_535)  # None: no endpoint; 0: any free port (logged)
    host: str = "127.0.0.1"  # 0.0.0.0 to let a Prometheus on another host scrape it
    probe_interval_s: float = Field(5.0, gt=0)  # source-side figures (retained WAL) read at most this often
    history: bool = True  # keep a sample every history_interval_s in the views database (status page plots)
    history_interval_s: float = Field(10.0, ge=1)
    history_retention_s: float = Field(3600.0, ge=60)


class HealthConfig(_Model):
    """``[health]``: thresholds of ``kappaflow status --check`` (and of doctor's retained WAL warning)."""

    max_lag_seconds: float = Field(300.0, ge=0)
    max_retained_wal_bytes: int = Field(1 << 30, ge=0)
    max_dead_letters: int = Field(0, ge=0)
    # projections that must be followed in every sink holding their view ("*": every registered one)
    followers: list[str] = Field(default_factory=lambda: ["*"])


class FollowConfig(_Model):
    """``[follow]``: what ``kappaflow follow --all`` runs in one Spark application."""

    # "module:Class" or "module" (every projection class it offers), as on the command line
    projections: list[str] = Field(default_factory=list)
    # what a follower does at start when a projection's definition changed since its view was built
    # (its fingerprint differs): "fail" (stop, say to replay) or "rebuild" (rebuild it blue/green, then
    # follow); a projection's own ``on_definition_change`` wins
    on_definition_change: Literal["fail", "rebuild"] = "fail"


class UiConfig(_Model):
    """``[ui]``: where ``kappaflow ui`` serves the status page (localhost unless configured)."""

    host: str = "127.0.0.1"
    port: int = Field(8050, ge=0, le=65_535)
    refresh_s: int = Field(10, ge=1)


class Settings(_Model):
    log: LogConfig = Field(default_factory=LogConfig)
    spark: SparkConfig = Field(default_factory=SparkConfig)
    views: ViewsConfig = Field(default_factory=ViewsConfig)
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    follow: FollowConfig = Field(default_factory=FollowConfig)
    ui: UiConfig = Field(default_factory=UiConfig)
    sources: dict[str, SourceConfig] = Field(default_factory=dict)
    profile: dict[str, dict[str, Any]] = Field(default_factory=dict, exclude=True)

    # Where the file was read from; relative paths resolve against its folder.
    base_dir: Path = Field(default_factory=Path.cwd, exclude=True)
    active_profile: str | None = Field(None, exclude=True)

    @classmethod
    def load(cls, path: Path | str | None = None, *, profile: str | None = None,
             environ: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if environ is None else environ)
        file = Path(path) if path else Path.cwd() / CONFIG_FILE
        data: dict[str, Any] = {}
        if file.exists():
            try:
                data = tomllib.loads(file.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{file}: not valid TOML: {exc}") from None
        elif path:
            raise ConfigError(f"config file {file} does not exist")
        profile = profile or env.get(f"{ENV_PREFIX}PROFILE")
        profiles = data.get("profile", {})
        if profile:
            if profile not in profiles:
                known = ", ".join(sorted(profiles)) or "none defined"
                raise ConfigError(f"--profile {profile!r}: no [profile.{profile}] in {file} (known: {known})")
            data = _deep_merge(_nest_legacy_layer(data), _nest_legacy_layer(profiles[profile]))
        data = _deep_merge(_nest_legacy_layer(data), _nest_legacy_layer(_env_overrides(env)))
        for name, src in (data.get("sources") or {}).items():
            if isinstance(src, dict):
                src.setdefault("name", name)
        try:
            settings = cls.model_validate({**data, "base_dir": file.parent.resolve(), "active_profile": profile})
        except pydantic.ValidationError as exc:
            raise ConfigError(format_validation_error(exc, str(file))) from None
        for name, src in settings.sources.items():
            if src.name != name:
                raise ConfigError(f"{file}: sources.{name}.name: expected {name!r} (the table key), got {src.name!r}")
        return settings

    def save(self, path: Path | str | None = None) -> Path:
        """Write the settings back (secrets are never written)."""
        import tomlkit

        file = Path(path) if path else self.base_dir / CONFIG_FILE
        data = self.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
        for src in data.get("sources", {}).values():
            src.pop("password", None)
            src.setdefault("kind", "postgres")
        for sname, src in self.sources.items():
            data.setdefault("sources", {}).setdefault(sname, {})["kind"] = src.kind
            data["sources"][sname]["name"] = sname
        if self.profile:
            data["profile"] = self.profile
        file.write_text(tomlkit.dumps(data))
        return file

    def source(self, name: str) -> PostgresSourceConfig | MySQLSourceConfig | DebeziumSourceConfig | LedgerSourceConfig:
        if name not in self.sources:
            known = ", ".join(sorted(self.sources)) or "none registered"
            raise ConfigError(f"unknown source {name!r} (known: {known}); add one with `kappaflow source add`")
        return self.sources[name]

    def resolve(self, path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else self.base_dir / p

    def open_log(self, *, read_only: bool = False) -> Any:
        return self.log.open(self.base_dir, read_only=read_only)


def format_validation_error(exc: pydantic.ValidationError, where: str) -> str:
    """One line per problem: field path, what was wrong, what was given (secrets masked)."""
    lines = [f"{where}: invalid configuration"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        given = err.get("input")
        secret = any(s in loc for s in ("password", "secret", "token"))
        shown = "***" if secret else redact(repr(given))
        if isinstance(given, dict):
            shown = "a table"
        lines.append(f"  {loc}: {err['msg']} (got {shown})")
    return "\n".join(lines)


_URL_PASSWORD = re.compile(r"(?P<pre>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)[^@\s]*@")


def redact(text: str) -> str:
    """Mask passwords inside URLs (scheme://user:PASSWORD@host) anywhere in `text`."""
    return _URL_PASSWORD.sub(lambda m: m.group("pre") + "***@", text)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _env_overrides(env: dict[str, str]) -> dict[str, Any]:
    """`KAPPAFLOW_A__B__C=v` -> {"a": {"b": {"c": v}}}; lists accept comma-separated values."""
    out: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX):].split("__")]
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        leaf = path[-1]
        lists = ("tables", "topics", "followers", "projections", "keep_history")
        node[leaf] = [v for v in value.split(",") if v] if leaf in lists else value
    return out
