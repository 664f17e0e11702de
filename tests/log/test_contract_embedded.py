"""The shipped log contract suite, run on the embedded (SQLite) backend."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kappaflow.log.base import Log
from kappaflow.log.embedded import EmbeddedLog
from kappaflow.log.testing import LogContract


class TestEmbeddedLogContract(LogContract):
    @pytest.fixture
    def log(self, tmp_path: Path) -> Iterator[Log]:
        log = EmbeddedLog(tmp_path / "log")
        yield log
        log.close()

    def reopen(self, log: Log) -> Log:
        assert isinstance(log, EmbeddedLog)
        log.close()
        return EmbeddedLog(log.path)

    def reader_factory(self, log: Log) -> Callable[[], Log]:
        assert isinstance(log, EmbeddedLog)
        return functools.partial(EmbeddedLog, log.path, read_only=True)
