"""The compose stack parses, and every setting it hands kappaflow loads with kappaflow's own config code."""

from __future__ import annotations

import re
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
    assert {"capture-shop", "capture-inventory", "follow-shop"} <= set(services)
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
        if command[1] == "follow":  # the projections load and every store they name is configured
            from kappaflow.projections.follow_runtime import resolve_projections

            targets, args = [], iter(command[2:])
            for a in args:
                if a.startswith("--") and a != "--all":
                    next(args, None)  # an option's value (--trigger 1s)
                elif not a.startswith("-"):
                    targets.append(a)
            specs = resolve_projections(targets, all_="--all" in command, configured=settings.follow.projections)
            keys = {"postgres": settings.views.postgres_dsn, "search": settings.views.search_url,
                    "redis": settings.views.redis_url}
            for spec in specs:
                assert all(keys[s] for s in spec.sinks), f"{name}: {spec.name} names sinks {spec.sinks}"


def test_kappaflow_commands_in_the_stack_exist(resolved: dict[str, Any]) -> None:
    from typer.testing import CliRunner

    from kappaflow.cli.app import app

    for name, svc in _kappaflow_services(resolved).items():
        res = CliRunner().invoke(app, [*svc["command"][1:2], "--help"])
        assert res.exit_code == 0, f"{name}: `kappaflow {svc['command'][1]}` is not a command:\n{res.output}"


# --- monitoring: Prometheus scrapes every long-running service, Grafana's dashboard names real metrics ---------
MONITORING = ROOT / "compose"
LONG_RUNNING = {"capture", "follow", "relay"}


def _exposed_names() -> set[str]:
    from kappaflow.metrics.names import METRICS

    names = {d.exposed for d in METRICS.values()}
    for d in METRICS.values():
        if d.kind == "histogram":
            names |= {f"{d.name}_bucket", f"{d.name}_count", f"{d.name}_sum"}
    return names


def _mount_targets(volumes: list[Any]) -> set[str]:
    """Container paths of a service's volumes (long syntax dicts or short "src:target[:mode]" strings)."""
    return {str(v["target"]) if isinstance(v, dict) else str(v).split(":")[1] for v in volumes}


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(kappaflow_[a-z_]+)\b", expr))


def test_prometheus_scrapes_every_long_running_kappaflow_service(resolved: dict[str, Any]) -> None:
    services = _kappaflow_services(resolved)
    prom = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name, svc in services.items():
        command = svc["command"]
        if command[1] in LONG_RUNNING or command[1:3] == ["ledger", "relay"]:
            port = svc["environment"]["KAPPAFLOW_METRICS__PORT"]
            assert f"{name}:{port}" in targets, f"{name} exports /metrics on {port} but Prometheus does not scrape it"
            assert svc["environment"]["KAPPAFLOW_METRICS__HOST"] == "0.0.0.0", name
            settings = Settings.load(None, environ={k: str(v) for k, v in svc["environment"].items()})
            assert settings.metrics.port == int(port)
    assert {t.split(":")[0] for t in targets} <= set(services)
    assert "/etc/prometheus/alerts.yml" in _mount_targets(resolved["services"]["prometheus"]["volumes"])


def test_prometheus_config_and_alert_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed; scripts/bootstrap.sh installs it")
    rules = MONITORING / "prometheus" / "alerts.yml"
    res = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    # the config as mounted in the container: the rule file at the path it names
    cfg = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())
    cfg["rule_files"] = [str(rules)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    known = _exposed_names()
    for group in yaml.safe_load(rules.read_text())["groups"]:
        for rule in group["rules"]:
            names = _metric_names(rule["expr"])
            assert names and names <= known, f"alert {rule['alert']} names unknown metrics {names - known}"


def test_grafana_dashboard_loads_and_names_only_documented_metrics(resolved: dict[str, Any]) -> None:
    import json

    board = json.loads((MONITORING / "grafana" / "dashboards" / "kappaflow.json").read_text())
    datasources = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
                                 .read_text())["datasources"]
    uids = {d["uid"] for d in datasources}
    assert any(d["url"] == "http://prometheus:9090" for d in datasources)
    provider = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "dashboards" / "kappaflow.yml")
                              .read_text())["providers"][0]
    assert provider["options"]["path"] in _mount_targets(resolved["services"]["grafana"]["volumes"]), \
        "dashboards folder not mounted"
    known = _exposed_names()
    named: set[str] = set()
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            assert names, f"panel {panel['title']!r} names no kappaflow metric"
            assert names <= known, f"panel {panel['title']!r} names unknown metrics {names - known}"
            named |= names
    # the four: lag, throughput, retained WAL, dead letters
    assert {"kappaflow_follow_lag_seconds", "kappaflow_capture_changes_total", "kappaflow_follow_events_total",
            "kappaflow_capture_retained_wal_bytes", "kappaflow_follow_dead_letters_total"} <= named
