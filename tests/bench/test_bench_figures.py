"""The benchmarks report what they measure (issue 13, item 14).

* ``bench/events_codec.py`` labelled a ``perf_counter`` rate as ``process_time``: the JSON's
  ``timer`` must name the clock the rates were taken with.
* ``bench/replay.py`` divided log records (a delete's tombstone included) by the replay time and
  called it events/s: its rates count change events only.

No timing assertions: the figures themselves are the integrator's to measure on a quiet machine.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from itertools import count
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_events_codec_names_the_clock_its_rates_come_from(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench("events_codec")
    ticks = count()

    def fake_clock() -> float:  # one second per reading: every pass over n items takes exactly 1 s
        return float(next(ticks))

    monkeypatch.setattr(bench, "TIMER", fake_clock)
    result = bench.main(["--n", "300"])
    assert result["timer"] == "fake_clock", result
    rates = {k: v for k, v in result.items() if k.endswith("_per_s")}
    assert rates and all(v == 300 for v in rates.values()), rates  # measured with that clock and no other


def test_events_codec_default_clock_is_named_as_measured() -> None:
    bench = _bench("events_codec")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "events_codec.py"), "--n", "500"],
                         capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["timer"] == bench.TIMER.__name__ == "perf_counter", result


@pytest.mark.integration
def test_replay_bench_rates_count_change_events_not_tombstones(pg_dsn: str, tmp_path: Path) -> None:
    events = 6000
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "replay.py"), "--events", str(events), "--keys", "100",
         "--skip-follow", "--skip-cli", "--skip-kafka", "--warmup-events", "0", "--dsn", pg_dsn,
         "--master", "local[1]"],
        capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["events"] == events
    tombstones = result["log_records"] - events
    assert tombstones > 0.01 * events, result  # the log holds deletes' tombstones: the test can tell them apart
    for kind in ("declarative", "grouped", "custom_fold"):
        rate, secs = result[f"{kind}_events_per_s"], result[f"{kind}_seconds"]
        counted = rate * secs
        # the seconds are rounded to 1 ms and the rate to an integer: well under the tombstones' share
        assert abs(counted - events) < 0.004 * events + 1, (kind, counted, events, result)
