"""The source registry: every config kind has one entry, and asking for an unknown kind names the source."""

from __future__ import annotations

import pytest

from kappaflow.config import SOURCE_MODELS, LedgerSourceConfig, PostgresSourceConfig
from kappaflow.connectors.registry import kinds, source_kind
from kappaflow.errors import ConfigError


def test_every_config_kind_is_registered_and_no_other() -> None:
    assert set(kinds()) == set(SOURCE_MODELS)
    for kind in kinds():
        assert source_kind(kind).kind == kind


def test_an_entry_is_found_from_a_config() -> None:
    src = LedgerSourceConfig(name="bank", dsn="postgresql://app@localhost/bank")
    entry = source_kind(src)
    assert entry.kind == "ledger" and entry.postgres_slot
    assert entry.captured(src) == ["kappaflow_ledger.events"]
    assert source_kind(PostgresSourceConfig(name="shop", dsn="postgresql://app@localhost/shop")).postgres_slot


def test_unknown_kind_names_the_source_and_the_known_kinds() -> None:
    class Odd:
        name = "legacy"
        kind = "oracle"

    with pytest.raises(ConfigError, match=r"source 'legacy': kind: expected one of postgres, mysql.*got 'oracle'"):
        source_kind(Odd())
