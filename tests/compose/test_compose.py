"""The compose stack parses, and every setting it hands kappaflow loads with kappaflow's own config code."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kappaflow.config import MySQLSourceConfig, PostgresSourceConfig, Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    """The file as `docker-compose config` resolves it (anchors, defaults, interpolation)."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose (Debian package) is missing; scripts/bootstrap.sh installs it")
    res = subprocess.run([exe, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, f"compose file invalid:\n{res.stderr}"
    data: dict[str, Any] = yaml.safe_load(res.stdout)
    return data


def _kappaflow_services(resolved: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in resolved["services"].items()
            if any(k.startswith("KAPPAFLOW_") for k in (svc.get("environment") or {}))}


def test_stack_has_every_part_with_health_checks(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    for name in ("kafka", "postgres", "mariadb", "elasticsearch", "redis", "spark-master", "spark-worker"):
        assert name in services, f"compose stack lacks {name}"
    for name in ("kafka", "postgres", "mariadb", "elasticsearch", "redis", "spark-master"):
        assert "healthcheck" in services[name], f"{name} has no health check"
    assert "wal_level=logical" in services["postgres"]["command"]
    assert "--binlog-format=ROW" in services["mariadb"]["command"]
    assert services["kafka"]["environment"]["KAFKA_LOG_CLEANER_ENABLE"] == "true"


def test_every_kappaflow_setting_loads(resolved: dict[str, Any], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no kappaflow.toml: the environment alone configures the services
    services = _kappaflow_services(resolved)
    assert {"capture-shop", "capture-inventory", "follow-customer-totals"} <= set(services)
    for name, svc in services.items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        settings = Settings.load(None, environ=env)
        assert settings.log.is_kafka, name
        assert settings.spark.master.startswith("spark://"), name
        shop = settings.source("shop")
        inventory = settings.source("inventory")
        assert isinstance(shop, PostgresSourceConfig) and isinstance(inventory, MySQLSourceConfig)
        # Passwords reach the DSN from the variables the stack names, never from the file.
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert ":kappaflow@" in shop.connect_dsn() and ":kappaflow@" in inventory.connect_dsn()
        assert ":kappaflow@" in settings.views.postgres_connect_dsn()
        command = svc["command"]
        assert command[0] == "kappaflow"
        if command[1] == "capture":
            assert command[2] in settings.sources
        if command[1] == "follow":  # the projection loads and every store it names is configured
            from kappaflow.projections.api import load_projection

            spec = load_projection(command[2])
            keys = {"postgres": settings.views.postgres_dsn, "search": settings.views.search_url,
                    "redis": settings.views.redis_url}
            assert all(keys[s] for s in spec.sinks), f"{name}: {command[2]} names sinks {spec.sinks}"


def test_kappaflow_commands_in_the_stack_exist(resolved: dict[str, Any]) -> None:
    from typer.testing import CliRunner

    from kappaflow.cli.app import app

    for name, svc in _kappaflow_services(resolved).items():
        res = CliRunner().invoke(app, [*svc["command"][1:2], "--help"])
        assert res.exit_code == 0, f"{name}: `kappaflow {svc['command'][1]}` is not a command:\n{res.output}"
