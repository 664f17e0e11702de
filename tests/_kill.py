"""The capture kill -9 harness for the tests, importable as ``tests._kill`` from every test folder.

The harness itself ships with the package, as the capture contract suite
``kappaflow.connectors.testing`` (the kill trials, the source driver, the exactly-once check);
this module re-exports what other tests use from it (a bounded polling wait, the stored offset).
"""

from __future__ import annotations

import os

from kappaflow.connectors.testing import (
    BackgroundWriter,
    kill_trials,
    open_for_check,
    run_until_caught_up,
    stored_offset,
    wait_for,
)

__all__ = ["BackgroundWriter", "kill_trials", "open_for_check", "run_until_caught_up", "stored_offset",
           "thorough_kills", "trial_count", "wait_for"]


def trial_count(quick: int, thorough: int) -> int:
    """How many kill -9 trials a follower kill test runs: `quick` by default, `thorough` with
    ``KF_THOROUGH_KILLS=1`` in the environment.

    Why two numbers: every trial kills a follower process and starts a new one with its own Spark
    driver (~20 s on the 2-core machine), so these tests were the top of ``--durations`` and the suite's
    time budget (~20 min) cannot hold the larger counts. Each kill lands at a seeded random moment, so
    more trials reach more moments; run the thorough counts after changing a commit protocol.
    """
    return thorough if thorough_kills() else quick


def thorough_kills() -> bool:
    """``KF_THOROUGH_KILLS=1``: the kill tests run their larger trial counts (see `trial_count`)."""
    return os.environ.get("KF_THOROUGH_KILLS", "") not in ("", "0")
