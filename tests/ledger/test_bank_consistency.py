"""Transactionally consistent views over the ledger (issue 17): a transfer is never half visible.

Transfers run at full rate (each one multi-stream append: the debit and the credit are two
keys, usually in two log partitions) while the ledger connector captures and a follower folds
the balances view; a reader polls the view inside its own transactions and checks the bank
invariant, sum(balance) == sum(deposits) - sum(withdrawals), on every read. Follow micro-
batches end at the newest consistent cut of the source, so no read may break it; with
``consistency = "per_key"`` (micro-batches end at whatever each partition holds) reads do.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from examples.bank.account import BankError
from examples.bank.bank import Bank
from examples.bank.events import registry
from examples.bank.invariant import check_balances_view
from examples.bank.projections import Balances
from kappaflow.config import LedgerSourceConfig
from kappaflow.connectors.base import StopSignal
from kappaflow.connectors.ledger import LedgerConnector
from kappaflow.ledger import Ledger
from kappaflow.projections.api import Source
from tests._consistency import InvariantReader, wait_until

pytestmark = pytest.mark.integration

ACCOUNTS = [f"a{i}" for i in range(8)]


def balances_for(source: str, consistency: str | None = None) -> type:
    """Balances over this test's own source (the Kafka broker is shared by the session)."""
    attrs: dict[str, Any] = {"sources": [Source(f"{source}.account", events=True, key={"stream_id": "stream_id"})],
                             "__module__": Balances.__module__}
    if consistency is not None:
        attrs["consistency"] = consistency
    return type("BalancesT", (Balances,), attrs)


def transfers(dsn: str, seed: int, stop: threading.Event, errors: list[BaseException]) -> None:
    rnd = random.Random(seed)
    try:
        with Ledger(dsn, registry=registry, pool_size=1) as led:
            bank = Bank(led)
            while not stop.is_set():
                a, b = rnd.sample(ACCOUNTS, 2)
                try:
                    bank.transfer(a, b, rnd.randint(1, 80))
                except BankError:
                    pass
    except BaseException as exc:
        errors.append(exc)


def capture_with_kills(cmd: list[str], cwd: Path, stop: StopSignal, kills: int, killed: list[int],
                       errors: list[BaseException]) -> None:
    """The capture as a real process, SIGKILLed `kills` times at seeded random moments, then run until `stop`."""
    rng = random.Random(17)
    try:
        for trial in range(kills + 1):
            out = cwd / f"capture-{trial}.out"
            with out.open("wb") as sink:
                proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=str(cwd))
            try:
                if trial < kills:
                    stop.wait(rng.uniform(2.0, 6.0))  # a random moment of the run, not a synchronisation
                    if proc.poll() is not None:
                        raise AssertionError(f"capture ended before its kill: {out.read_text()[-2000:]}")
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
                else:
                    while not stop.wait(0.5):
                        if proc.poll() is not None:
                            raise AssertionError(f"capture ended: {out.read_text()[-2000:]}")
                    proc.terminate()
            finally:
                proc.wait(timeout=60)
    except BaseException as exc:
        errors.append(exc)


def run_bank(ledger_dsn: str, log: Any, log_url: str, spark: Any, tmp_path: Path, *, consistency: str | None,
             batches: int = 12, kills: int = 0) -> tuple[Any, Any]:
    """Transfers + capture + follower + invariant reader for `batches` follow micro-batches; returns
    (the reader's result, the ledger) after the view caught up with the last transfer. `kills`: the
    capture runs as a process, SIGKILLed that many times during the run."""
    from kappaflow.ledger import LogProjectionPositions, wait_for_projection
    from kappaflow.projections.follow import Follower
    from kappaflow.projections.runtime import Runtime
    from kappaflow.projections.sinks.postgres import PostgresSink

    source = f"bk{uuid.uuid4().hex[:8]}"
    proj = balances_for(source, consistency)
    led = Ledger(ledger_dsn, registry=registry)
    bank = Bank(led)
    for a in ACCOUNTS:
        bank.open_account(a, a.upper())
        bank.deposit(a, 5_000)
    cfg = LedgerSourceConfig(name=source, dsn=ledger_dsn, slot=f"kf_{uuid.uuid4().hex[:12]}", heartbeat_interval_s=0.5)
    LedgerConnector(cfg, log, partitions=3, progress=False).run(until_caught_up=True)  # topics exist

    stop_capture = StopSignal()
    errors: list[BaseException] = []
    killed: list[int] = []

    def capture() -> None:
        try:
            LedgerConnector(cfg, log, partitions=3, progress=False, linger_s=0.005).run(stop_capture)
        except BaseException as exc:
            errors.append(exc)

    rt = Runtime(spark, log_url, PostgresSink(ledger_dsn), checkpoint_dir=tmp_path / "ckpt")
    if kills:
        config = tmp_path / "kappaflow.toml"
        config.write_text(f'[log]\nurl = "{log_url}"\npartitions = 3\n\n[sources.{source}]\nkind = "ledger"\n'
                          f'dsn = "{ledger_dsn}"\nslot = "{cfg.slot}"\nheartbeat_interval_s = 0.5\n')
        cmd = [sys.executable, "-m", "kappaflow.cli.capture", source, "--config", str(config), "--no-progress"]
        capturing = threading.Thread(target=capture_with_kills, daemon=True,
                                     args=(cmd, tmp_path, stop_capture, kills, killed, errors))
    else:
        capturing = threading.Thread(target=capture, daemon=True)
    capturing.start()
    follower = Follower(proj, rt, trigger="0.05s").start()
    query = sql.SQL("SELECT sum(balance), sum(deposits) - sum(withdrawals), max(last_position) FROM {}").format(
        sql.Identifier("public", "balances"))
    reader = InvariantReader(
        ledger_dsn, query,
        check=lambda r: None if r[0] == r[1] else f"sum(balance) {r[0]} != deposits - withdrawals {r[1]} "
                                                  f"(view at ledger position {r[2]})",
        state=lambda r: r[2]).start()
    stop_writers = threading.Event()
    writers = [threading.Thread(target=transfers, args=(ledger_dsn, s, stop_writers, errors), daemon=True)
               for s in (1, 2)]
    for w in writers:
        w.start()
    positions = LogProjectionPositions(ledger_dsn, log, led, source)
    try:
        wait_until(lambda: (follower.stats.batches >= batches and len(killed) >= kills) or errors or follower.failed,
                   300, f"{batches} follow micro-batches and {kills} capture kills")
        assert not errors, errors
        assert follower.failed is None, follower.failed
        stop_writers.set()
        for w in writers:
            w.join(timeout=60)
        last = led.head().position
        wait_for_projection(positions, "balances", last, timeout=120)
    finally:
        stop_writers.set()
        stop_capture.set("test")
        result = reader.stop()
        follower.stop()
        capturing.join(timeout=60)
        positions.close()
        rt.close()
    assert not errors, errors
    return result, led


@pytest.mark.parametrize("backend", ["embedded", "kafka"])
def test_no_half_transfer_is_ever_visible(backend: str, ledger_dsn: str, spark: Any, tmp_path: Path,
                                          request: pytest.FixtureRequest) -> None:
    log = request.getfixturevalue(f"{backend}_log")
    url = str(log.path) if backend == "embedded" else f"kafka://{request.getfixturevalue('kafka_broker').bootstrap}"
    result, led = run_bank(ledger_dsn, log, url, spark, tmp_path, consistency=None)
    try:
        assert result.reads > 0 and len(result.states) > 3, (result.reads, len(result.states))
        assert not result.bad, (f"{len(result.bad)} of {result.reads} reads of the balances view showed a half-applied "
                                f"transfer; first: {result.bad[0]}")
        with psycopg.connect(ledger_dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            rows = list(cur.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier("public", "balances"))))
        check_balances_view(rows, led.iter_all(decode=False))
    finally:
        led.close()



@pytest.mark.slow
def test_no_half_transfer_across_capture_kills(ledger_dsn: str, spark: Any, tmp_path: Path, kafka_log: Any,
                                               kafka_broker: Any) -> None:
    """kill -9 of the capture three times during the run: still no half transfer in any read, nothing lost
    (the view equals a replay of the ledger at the end)."""
    result, led = run_bank(ledger_dsn, kafka_log, f"kafka://{kafka_broker.bootstrap}", spark, tmp_path,
                           consistency=None, batches=15, kills=3)
    try:
        assert not result.bad, (f"{len(result.bad)} of {result.reads} reads of the balances view showed a "
                                f"half-applied transfer; first: {result.bad[0]}")
        with psycopg.connect(ledger_dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            rows = list(cur.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier("public", "balances"))))
        check_balances_view(rows, led.iter_all(decode=False))
    finally:
        led.close()
