"""The shipped log contract suite, run on the confluent-kafka (librdkafka) client against the tansu broker."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from kappaflow.log.base import Log

confluent = pytest.importorskip("kappaflow.log.kafka.confluent")
from kappaflow.log.testing import LogContract  # noqa: E402

ConfluentKafkaLog = confluent.ConfluentKafkaLog

pytestmark = pytest.mark.integration


class TestConfluentKafkaLogContract(LogContract):
    # Kafka's log cleaner compacts on the broker's schedule; compact() cannot force it.
    compacts_on_demand: ClassVar[bool] = ConfluentKafkaLog.supports_on_demand_compaction
    # librdkafka reads a timestamp of 0 as "now": such an append is refused, naming the record.
    writes_zero_timestamp: ClassVar[bool] = False

    @pytest.fixture
    def log(self, kafka_broker: Any) -> Iterator[Log]:
        log = ConfluentKafkaLog(kafka_broker.bootstrap)
        yield log
        log.close()

    def reopen(self, log: Log) -> Log:
        assert isinstance(log, ConfluentKafkaLog)
        log.close()
        return ConfluentKafkaLog(log.bootstrap)

    def reader_factory(self, log: Log) -> Callable[[], Log]:
        assert isinstance(log, ConfluentKafkaLog)
        return functools.partial(ConfluentKafkaLog, log.bootstrap, read_only=True)
