"""The capture contract suite's own parts that need no server: the exactly-once check's verdicts
and the registered writer fault hook (``kappaflow.connectors.testing``, ``SourceKind.fault_hook``)."""

from __future__ import annotations

import pytest

from kappaflow.config import DebeziumSourceConfig
from kappaflow.connectors.registry import kinds, source_kind
from kappaflow.connectors.testing import check_exactly_once
from kappaflow.errors import ConfigError

COMMITTED = {("acct", 1): [(10, "c"), (20, "u")], ("acct", 2): [(10, "c")]}


def test_exactly_once_in_commit_order_passes() -> None:
    check_exactly_once({k: list(v) for k, v in COMMITTED.items()}, COMMITTED)


@pytest.mark.parametrize(("logged", "message"), [
    ({("acct", 1): [(10, "c")], ("acct", 2): [(10, "c")]}, r"key \('acct', 1\): committed but missing.*\(20, 'u'\)"),
    ({**COMMITTED, ("acct", 2): [(10, "c"), (10, "c")]}, r"key \('acct', 2\): written twice: \[\(10, 'c'\)\]"),
    ({**COMMITTED, ("acct", 3): [(30, "c")]}, r"key \('acct', 3\): in the log but never committed"),
    ({**COMMITTED, ("acct", 1): [(20, "u"), (10, "c")]}, r"key \('acct', 1\): out of commit order"),
])
def test_exactly_once_names_the_key_and_what_is_wrong(logged: dict, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_exactly_once(logged, COMMITTED)


def test_a_trial_without_changes_fails() -> None:
    with pytest.raises(AssertionError, match="no changes"):
        check_exactly_once({}, {})


def test_fault_hook_is_registered_per_source_kind() -> None:
    assert {k for k in kinds() if source_kind(k).fault_hook} == {"postgres", "mysql", "ledger"}
    config = DebeziumSourceConfig(name="dbz", bootstrap="127.0.0.1:9", topics=["dbserver.inventory.customers"])
    with pytest.raises(ConfigError, match="'debezium': its connector takes no writer fault hook"):
        source_kind(config).open(config, None, fault=lambda step: None)  # type: ignore[arg-type]
