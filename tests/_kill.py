"""The capture kill -9 harness for the tests, importable as ``tests._kill`` from every test folder.

The harness itself ships with the package, as the capture contract suite
``kappaflow.connectors.testing`` (the kill trials, the source driver, the exactly-once check);
this module re-exports what other tests use from it (a bounded polling wait, the stored offset).
"""

from __future__ import annotations

from kappaflow.connectors.testing import (
    BackgroundWriter,
    kill_trials,
    open_for_check,
    run_until_caught_up,
    stored_offset,
    wait_for,
)

__all__ = ["BackgroundWriter", "kill_trials", "open_for_check", "run_until_caught_up", "stored_offset", "wait_for"]
