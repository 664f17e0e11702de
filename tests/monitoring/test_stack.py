"""A running capture and follower, watched the ways an operator would (issue 21).

One stack per module (Spark start-up is the expensive part): a capture process and a follow
process, each with ``--metrics-port 0``, against the session's PostgreSQL (source and views
databases) and an embedded log. Against it:

- both /metrics scraped over HTTP: counts equal the changes made; when the follower is stopped the
  lag (``kappaflow metrics``, read from the stores) rises in records and seconds, and it falls back
  to 0 on the new follower's /metrics once it runs again; ``status --check`` exit codes on the way;
- a real Prometheus server (Debian's ``prometheus``) scrapes both and PromQL returns the series;
- the status page (``kappaflow ui``) in headless Chromium: every source and projection is listed and
  the lag plot has data points (a screenshot is kept in tests/monitoring/artifacts/);
- the source's and the views database's passwords (given in the environment; the servers trust
  local connections, so any password is accepted) never show up in metrics, the page or the logs.

Every test leaves the stack as it found it: both processes running, the view caught up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests._kill import wait_for
from tests.monitoring._scrape import endpoint_of, fetch, parse, scrape, value

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
SOURCE_SECRET = "src-Secret-7719"
VIEWS_SECRET = "views-Secret-4410"
TOPIC = "shop.public.orders"
PROJECTION = "mon_orders"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float = 90) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Stack:
    dir: Path
    src_dsn: str
    env: dict[str, str]
    capture: subprocess.Popen[bytes] | None = None
    capture_url: str = ""
    follow: subprocess.Popen[bytes] | None = None
    follow_url: str = ""
    logs: list[Path] = field(default_factory=list)
    runs: int = 0

    def cli(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kappaflow.cli", *args], cwd=self.dir,
                              env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)

    def start_follow(self) -> None:
        self.runs += 1
        out = self.dir / f"follow-{self.runs}.log"
        self.logs.append(out)
        with out.open("wb") as f:
            self.follow = subprocess.Popen(
                [sys.executable, "-m", "kappaflow.cli", "follow", "mon_proj:Orders", "--trigger", "0.5s",
                 "--metrics-port", "0"], cwd=self.dir, env=self.env, stdout=f, stderr=subprocess.STDOUT)
        self.follow_url = endpoint_of(out, 300)

    def stop_follow(self) -> None:
        _stop(self.follow)
        self.follow = None

    def log_end(self) -> int:
        from kappaflow.log import open_log

        with open_log(str(self.dir / "log"), read_only=True) as log:
            return sum(log.end_offsets(TOPIC).values())

    def wait_caught_up(self, events: int, timeout: float = 300) -> dict[Any, float]:
        """The follower's /metrics once its lag is 0 in every partition and its batches counted
        ``events``. Both conditions, because the lag is read from the store's positions (committed
        with the batch's rows) while the counters move just after that commit returns: a scrape in
        between sees lag 0 and the previous count."""

        def caught_up() -> dict[Any, float] | None:
            assert self.follow is not None and self.follow.poll() is None, self.logs[-1].read_text()[-3000:]
            s = scrape(self.follow_url)
            lags = [v for (n, _), v in s.items() if n == "kappaflow_follow_lag_records"]
            counted = value(s, "kappaflow_follow_events_total", projection=PROJECTION, sink="postgres")
            return s if lags and not any(lags) and (counted or 0) >= events else None

        return wait_for(caught_up, timeout,
                        f"the follower to catch up (lag 0 and {events} events counted on its /metrics)")

    def change(self, sql: str) -> None:
        with psycopg.connect(self.src_dsn, autocommit=True) as conn:
            conn.execute(sql)


@pytest.fixture(scope="module")
def stack(pg_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp("stack")
    src_db, views_db = f"mon_src_{uuid.uuid4().hex[:8]}", f"mon_views_{uuid.uuid4().hex[:8]}"
    src_dsn = pg_server.create_database(src_db)
    views_dsn = pg_server.create_database(views_db)
    with psycopg.connect(src_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, amount int NOT NULL)")
        conn.execute("INSERT INTO orders SELECT i, i FROM generate_series(1, 20) i")
    (d / "mon_proj.py").write_text(
        "from kappaflow.projections import Projection\n\n\n"
        f"class Orders(Projection):\n    name = {PROJECTION!r}\n    sources = [{TOPIC!r}]\n    key = ['id']\n"
    )
    (d / "kappaflow.toml").write_text(
        f'[log]\nurl = "{d / "log"}"\npartitions = 2\n'
        f'[sources.shop]\nkind = "postgres"\ndsn = "{src_dsn}"\ntables = ["public.orders"]\n'
        "heartbeat_interval_s = 1.0\n"
        f'[views]\npostgres_dsn = "{views_dsn}"\npostgres_password_env = "MON_VIEWS_PW"\n'
        f'[spark]\nmaster = "local[1]"\ncheckpoint_dir = "{d / "ckpt"}"\n'
        '[spark.conf]\n"spark.ui.enabled" = "false"\n"spark.sql.shuffle.partitions" = "2"\n'
        "[metrics]\nprobe_interval_s = 0.5\nhistory_interval_s = 1\n"
        "[ui]\nrefresh_s = 3600\n"
    )
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
           "KAPPAFLOW_SOURCE_SHOP_PASSWORD": SOURCE_SECRET, "MON_VIEWS_PW": VIEWS_SECRET}
    st = Stack(d, src_dsn, env)
    cap_log = d / "capture.log"
    st.logs.append(cap_log)
    try:
        with cap_log.open("wb") as f:
            st.capture = subprocess.Popen(
                [sys.executable, "-m", "kappaflow.cli", "capture", "shop", "--metrics-port", "0", "--log-every", "2"],
                cwd=d, env=env, stdout=f, stderr=subprocess.STDOUT)
        st.capture_url = endpoint_of(cap_log, 120)
        wait_for(lambda: value(scrape(st.capture_url), "kappaflow_capture_changes_total", source="shop") == 20, 120,
                 "the snapshot of 20 rows")
        st.start_follow()
        s = st.wait_caught_up(20)
        assert value(s, "kappaflow_follow_events_total", projection=PROJECTION, sink="postgres") == 20
        yield st
    finally:
        st.stop_follow()
        _stop(st.capture)
        for log in st.logs:  # secrets never reach a process's output
            text = log.read_text(errors="replace") if log.exists() else ""
            assert SOURCE_SECRET not in text and VIEWS_SECRET not in text, log
        pg_server.drop_database(src_db)
        pg_server.drop_database(views_db)


def _oneshot(stack: Stack) -> dict[Any, float]:
    res = stack.cli("metrics")
    assert res.returncode == 0, res.stderr
    assert SOURCE_SECRET not in res.stdout and VIEWS_SECRET not in res.stdout
    return parse(res.stdout)


def _lag(samples: dict[Any, float], name: str) -> list[float]:
    return [v for (n, labels), v in samples.items()
            if n == name and dict(labels).get("projection") == PROJECTION]


def test_lag_rises_while_the_follower_is_stopped_and_falls_after(stack: Stack) -> None:
    s = scrape(stack.follow_url)
    assert value(s, "kappaflow_follow_running", projection=PROJECTION, sink="postgres") == 1
    assert (value(s, "kappaflow_follow_batch_duration_seconds_count", projection=PROJECTION, sink="postgres")
            or 0) >= 1
    assert value(s, "kappaflow_follow_dead_letters_total", projection=PROJECTION, sink="postgres") == 0
    assert stack.cli("status", "--check").returncode == 0
    before = stack.log_end()

    stack.stop_follow()
    stack.change("UPDATE orders SET amount = amount + 1 WHERE id <= 10")  # 10 changes, one transaction
    wait_for(lambda: stack.log_end() == before + 10, 60, "the 10 updates in the log")
    first = _oneshot(stack)
    assert sum(_lag(first, "kappaflow_follow_lag_records")) == 10
    assert value(first, "kappaflow_projection_following", projection=PROJECTION, sink="postgres") == 0
    lag0 = max(_lag(first, "kappaflow_follow_lag_seconds"))
    # the stopped follower falls further behind in time while nothing consumes the log
    wait_for(lambda: max(_lag(_oneshot(stack), "kappaflow_follow_lag_seconds")) >= lag0 + 2, 60,
             "the lag in seconds to rise")
    check = stack.cli("status", "--check")
    assert check.returncode == 4, check.stdout + check.stderr
    assert f"stopped_follower: projection {PROJECTION} in postgres: not followed" in check.stdout
    no_followers = {"KAPPAFLOW_HEALTH__FOLLOWERS": ""}
    lag = stack.cli("status", "--check", env={**no_followers, "KAPPAFLOW_HEALTH__MAX_LAG_SECONDS": "1"})
    assert lag.returncode == 5, lag.stdout + lag.stderr
    assert lag.stdout.startswith(f"lag: projection {PROJECTION} in postgres:")
    wal = stack.cli("status", "--check", env={**no_followers, "KAPPAFLOW_HEALTH__MAX_RETAINED_WAL_BYTES": "1"})
    assert wal.returncode == 6, wal.stdout + wal.stderr
    assert "retained_wal: source shop: slot kappaflow_shop retains" in wal.stdout
    assert stack.cli("status", "--check", env=no_followers).returncode == 0

    stack.start_follow()
    after = stack.wait_caught_up(10)
    assert all(v == 0 for v in _lag(after, "kappaflow_follow_lag_seconds"))
    assert value(after, "kappaflow_follow_events_total", projection=PROJECTION, sink="postgres") == 10
    assert value(after, "kappaflow_log_records_read_total", topic=TOPIC) == 10
    assert stack.cli("status", "--check").returncode == 0
    cap = scrape(stack.capture_url)
    assert value(cap, "kappaflow_capture_changes_total", source="shop") == 30
    assert value(cap, "kappaflow_capture_transactions_total", source="shop") == 1
    for body in (fetch(stack.capture_url), fetch(stack.follow_url)):
        assert SOURCE_SECRET not in body and VIEWS_SECRET not in body


def _promql(base: str, query: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as resp:
        doc = json.loads(resp.read())
    assert doc["status"] == "success", doc
    return list(doc["data"]["result"])


def test_prometheus_scrapes_the_capture_and_the_follower(stack: Stack, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus package is not installed (scripts/bootstrap.sh installs it as root)")
    targets = {"capture": urllib.parse.urlsplit(stack.capture_url).netloc,
               "follow": urllib.parse.urlsplit(stack.follow_url).netloc}
    # the scrape configuration as Prometheus documents it (prometheus.io/docs/prometheus/latest/configuration)
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
        + "".join(f"  - job_name: kappaflow-{job}\n    static_configs:\n      - targets: ['{t}']\n"
                  for job, t in targets.items())
    )
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    out = tmp_path / "prometheus.log"
    with out.open("wb") as f:
        prom = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        def series(query: str) -> list[dict[str, Any]] | None:
            assert prom.poll() is None, out.read_text()[-3000:]
            try:
                res = _promql(base, query)
            except OSError:
                return None  # not listening yet
            return res or None

        up = wait_for(lambda: (lambda r: r if r and len(r) == 2 else None)(series("up == 1")), 120,
                      "Prometheus to scrape both targets")
        assert {r["metric"]["job"] for r in up} == {"kappaflow-capture", "kappaflow-follow"}
        changes = wait_for(lambda: series('kappaflow_capture_changes_total{source="shop"}'), 60, "capture series")
        assert changes[0]["metric"]["job"] == "kappaflow-capture"
        assert float(changes[0]["value"][1]) == value(scrape(stack.capture_url), "kappaflow_capture_changes_total",
                                                      source="shop")
        applied = wait_for(lambda: series(f'kappaflow_follow_events_total{{projection="{PROJECTION}"}}'), 60,
                           "follow series")
        assert applied[0]["metric"]["sink"] == "postgres"
        lag = wait_for(lambda: series("sum by (projection, sink) (kappaflow_follow_lag_records)"), 60, "lag series")
        assert [r["metric"] for r in lag] == [{"projection": PROJECTION, "sink": "postgres"}]
        assert float(lag[0]["value"][1]) == 0
        count = f'kappaflow_follow_batch_duration_seconds_count{{projection="{PROJECTION}"}}'
        buckets = wait_for(lambda: series(count), 60, "the batch duration histogram")
        assert float(buckets[0]["value"][1]) >= 1
        wal = wait_for(lambda: series("kappaflow_capture_retained_wal_bytes > 0"), 60, "retained WAL series")
        assert wal[0]["metric"]["slot"] == "kappaflow_shop"
    finally:
        _stop(prom, 30)


def test_status_page_in_headless_chromium(stack: Stack, tmp_path: Path) -> None:
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_bin is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (scripts/bootstrap.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    port = _free_port()
    out = tmp_path / "ui.log"
    with out.open("wb") as f:
        ui = subprocess.Popen([sys.executable, "-m", "kappaflow.cli", "ui", "--port", str(port)], cwd=stack.dir,
                              env=stack.env, stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert ui.poll() is None, out.read_text()
        try:
            return fetch(f"{base}/healthz") == "ok"
        except OSError:
            return False

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chrome'}", "--window-size=1400,1800"):
        opts.add_argument(flag)
    browser = None
    try:
        wait_for(healthy, 60, "kappaflow ui to answer")
        # history: the follower samples its lag every second; wait for a few points of this stack's
        wait_for(lambda: fetch(base + "/").count("lag over the last hour") == 1, 60, "the page")
        browser = webdriver.Chrome(service=Service(executable_path=driver_bin), options=opts)
        browser.set_page_load_timeout(120)

        def lag_points() -> int:
            browser.get(base + "/")
            n = browser.execute_script(
                "const d = document.getElementById('lag-plot');"
                "return d && d.data ? d.data.reduce((a, t) => a + t.x.length, 0) : 0;")
            drawn = browser.find_elements(By.CSS_SELECTOR, "#lag-plot .scatterlayer .points path")
            return int(n) if n and len(drawn) >= 3 else 0

        points = wait_for(lag_points, 120, "the lag plot to render data points", interval=1.0)
        assert points >= 3
        sources = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#sources td.source")]
        assert sources == ["shop"]
        rows = [(r.find_element(By.CSS_SELECTOR, "td.projection").text,
                 r.find_element(By.CSS_SELECTOR, "td.sink").text)
                for r in browser.find_elements(By.CSS_SELECTOR, "#projections tr")
                if r.find_elements(By.TAG_NAME, "td")]
        assert rows == [(PROJECTION, "postgres")]
        names = browser.execute_script("return document.getElementById('lag-plot').data.map(t => t.name);")
        assert f"view {PROJECTION}/postgres" in names and "source shop" in names
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "status_page.png"))
        page = browser.page_source
        assert SOURCE_SECRET not in page and VIEWS_SECRET not in page
        assert "postgresql://" not in page  # no DSN at all, with or without a password
    finally:
        if browser is not None:
            browser.quit()
        _stop(ui, 30)
    assert SOURCE_SECRET not in out.read_text() and VIEWS_SECRET not in out.read_text()
