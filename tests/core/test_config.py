"""Configuration: file, profile and environment layering; clear errors; no secrets in messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from kappaflow.config import PostgresSourceConfig, SecurityProtocol, Settings, redact
from kappaflow.errors import ConfigError

TOML = """
[log]
url = "data/log"
partitions = 8

[spark]
master = "local[2]"

[sources.shop]
kind = "postgres"
dsn = "postgresql://app@db.example:5432/shop"
tables = ["public.orders", "public.customers"]
password_env = "SHOP_PW"

[profile.cluster.log]
url = "kafka://k1:9092,k2:9092"

[profile.cluster.log.kafka]
security_protocol = "SASL_SSL"
sasl_mechanism = "SCRAM-SHA-512"
sasl_username = "kf"

[profile.cluster.spark]
master = "spark://spark-master:7077"
"""


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    path = tmp_path / "kappaflow.toml"
    path.write_text(TOML)
    return path


def test_file_values_and_defaults(cfg_file: Path) -> None:
    s = Settings.load(cfg_file, environ={})
    assert s.log.partitions == 8 and s.spark.master == "local[2]"
    src = s.source("shop")
    assert isinstance(src, PostgresSourceConfig)
    assert src.slot_name == "kappaflow_shop" and src.publication_name == "kappaflow_shop"
    assert s.resolve(s.log.url) == cfg_file.parent / "data/log"


def test_profile_overlays_and_env_wins(cfg_file: Path) -> None:
    env = {"KAPPAFLOW_LOG__KAFKA__SASL_PASSWORD": "pw", "KAPPAFLOW_SPARK__MASTER": "spark://other:7077"}
    s = Settings.load(cfg_file, profile="cluster", environ=env)
    assert s.log.is_kafka and s.log.url == "kafka://k1:9092,k2:9092"
    assert s.log.kafka.security_protocol is SecurityProtocol.SASL_SSL
    assert s.spark.master == "spark://other:7077"
    security = s.log.kafka.security()
    assert (security.protocol, security.sasl_mechanism, security.sasl_password) == ("SASL_SSL", "SCRAM-SHA-512", "pw")
    assert "pw" not in repr(security)
    opts = s.log.open_options()
    assert opts["security"]["sasl_mechanism"] == "SCRAM-SHA-512" and opts["security"]["sasl_password"] == "pw"


def test_list_settings_from_the_environment_are_comma_separated(cfg_file: Path) -> None:
    """`KAPPAFLOW_SOURCES__SHOP__KEEP_HISTORY=a,b` is a list, like `...__TABLES` (docker-compose sets both)."""
    env = {"KAPPAFLOW_SOURCES__SHOP__TABLES": "public.orders,public.products",
           "KAPPAFLOW_SOURCES__SHOP__KEEP_HISTORY": "public.products"}
    src = Settings.load(cfg_file, environ=env).source("shop")
    assert isinstance(src, PostgresSourceConfig)
    assert src.tables == ["public.orders", "public.products"] and src.keep_history == ["public.products"]


def test_unknown_profile_is_named(cfg_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"--profile 'prod'.*known: cluster"):
        Settings.load(cfg_file, profile="prod", environ={})


def test_password_comes_from_the_environment_and_never_shows(cfg_file: Path) -> None:
    s = Settings.load(cfg_file, environ={})
    src = s.source("shop")
    assert isinstance(src, PostgresSourceConfig)
    with pytest.raises(ConfigError, match="SHOP_PW"):
        src.connect_dsn()
    import os

    os.environ["SHOP_PW"] = "p@ss:w/rd"
    try:
        assert src.connect_dsn() == "postgresql://app:p%40ss%3Aw%2Frd@db.example:5432/shop"
        assert "p@ss" not in repr(s) and "p@ss" not in str(src)
    finally:
        del os.environ["SHOP_PW"]


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[log]\npartitions = "many"', "log.partitions"),
        ('[log]\nnope = 1', "log.nope"),
        ('[sources.a]\nkind = "postgres"\ndsn = "mysql://x"', "sources.a.postgres.dsn"),
        ('[sources.a]\nkind = "oracle"\ndsn = "x"', "sources.a"),
        ('[sources."bad name"]\nkind = "postgres"\ndsn = "postgresql://x/y"', "name"),
        ('[sources.a]\nkind = "postgres"\ndsn = "postgresql://x/y"\nsnapshot_mode = "sometimes"', "snapshot_mode"),
    ],
)
def test_bad_values_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "kappaflow.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        Settings.load(path, environ={})
    assert field in str(info.value) and str(path) in str(info.value)


def test_password_in_dsn_is_refused_and_masked(tmp_path: Path) -> None:
    path = tmp_path / "kappaflow.toml"
    path.write_text('[sources.a]\nkind = "postgres"\ndsn = "postgresql://u:hunter2@h/db"')
    with pytest.raises(ConfigError) as info:
        Settings.load(path, environ={})
    assert "hunter2" not in str(info.value) and "password" in str(info.value)


def test_not_toml(tmp_path: Path) -> None:
    path = tmp_path / "kappaflow.toml"
    path.write_text("[log\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Settings.load(path, environ={})


def test_save_round_trip_without_secrets(tmp_path: Path) -> None:
    s = Settings.load(tmp_path / "missing.toml" if False else None, environ={})
    s.base_dir = tmp_path
    s.sources["x"] = PostgresSourceConfig(name="x", dsn="postgresql://u@h/db", password="secret",
                                          tables=["public.t"])
    path = s.save()
    assert "secret" not in path.read_text()
    again = Settings.load(path, environ={})
    assert again.source("x").tables == ["public.t"]


def test_redact() -> None:
    assert redact("failed: postgresql://u:pw@h:5/db and redis://:tok@r") == (
        "failed: postgresql://u:***@h:5/db and redis://:***@r")


# --- [views]: one table per sink, the old flat keys still read ----------------------------------------
def test_views_per_sink_tables_and_the_old_flat_keys(tmp_path: Path) -> None:
    new = tmp_path / "new.toml"
    new.write_text('[views.postgres]\ndsn = "postgresql://app@db/views"\npassword_env = "VIEWS_PW"\n'
                   '[views.search]\nurl = "http://search:9200"\nflavor = "elasticsearch"\n'
                   '[views.redis]\nurl = "redis://cache:6379/0"\n')
    old = tmp_path / "old.toml"
    old.write_text('[views]\npostgres_dsn = "postgresql://app@db/views"\npostgres_password_env = "VIEWS_PW"\n'
                   'search_url = "http://search:9200"\nsearch_flavor = "elasticsearch"\nredis_url = "redis://cache:6379/0"\n')
    a, b = Settings.load(new, environ={}).views, Settings.load(old, environ={}).views
    assert a == b
    assert (a.postgres.dsn, a.postgres.password_env, a.search.url, a.search.flavor, a.redis.url) == (
        "postgresql://app@db/views", "VIEWS_PW", "http://search:9200", "elasticsearch", "redis://cache:6379/0")
    # the old names still read as attributes (code written against them keeps working)
    assert (b.postgres_dsn, b.search_url, b.search_flavor, b.redis_url) == (
        a.postgres.dsn, a.search.url, a.search.flavor, a.redis.url)


def test_views_environment_overrides_the_file_whichever_spelling_each_uses(tmp_path: Path) -> None:
    old = tmp_path / "old.toml"
    old.write_text('[views]\npostgres_dsn = "postgresql://app@file/views"\n')
    env = {"KAPPAFLOW_VIEWS__POSTGRES__DSN": "postgresql://app@env/views"}
    assert Settings.load(old, environ=env).views.postgres.dsn == "postgresql://app@env/views"
    new = tmp_path / "new.toml"
    new.write_text('[views.postgres]\ndsn = "postgresql://app@file/views"\n')
    env = {"KAPPAFLOW_VIEWS__POSTGRES_DSN": "postgresql://app@env/views"}
    assert Settings.load(new, environ=env).views.postgres.dsn == "postgresql://app@env/views"


def test_views_old_and_new_key_disagreeing_in_one_file_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "both.toml"
    f.write_text('[views]\nredis_url = "redis://a:6379/0"\n[views.redis]\nurl = "redis://b:6379/0"\n')
    with pytest.raises(ConfigError, match=r"views\.redis_url and views\.redis\.url are the same setting"):
        Settings.load(f, environ={})
    f.write_text('[views.search]\nflavour = "opensearch"\n')
    with pytest.raises(ConfigError, match=r"views\.search\.flavour"):
        Settings.load(f, environ={})
