"""The shipped log contract suite, run on the Kafka backend against the session's tansu broker."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from kappaflow.log.base import Log
from kappaflow.log.kafka import KafkaLog
from kappaflow.log.testing import LogContract

pytestmark = pytest.mark.integration


class TestKafkaLogContract(LogContract):
    # Kafka's log cleaner compacts on the broker's schedule; compact() cannot force it.
    compacts_on_demand: ClassVar[bool] = KafkaLog.supports_on_demand_compaction

    @pytest.fixture
    def log(self, kafka_broker: Any) -> Iterator[Log]:
        log = KafkaLog(kafka_broker.bootstrap)
        yield log
        log.close()

    def reopen(self, log: Log) -> Log:
        assert isinstance(log, KafkaLog)
        log.close()
        return KafkaLog(log.bootstrap)

    def reader_factory(self, log: Log) -> Callable[[], Log]:
        assert isinstance(log, KafkaLog)
        return functools.partial(KafkaLog, log.bootstrap, read_only=True)
