"""Transaction metadata records, as Debezium's ``provide.transaction.metadata`` writes them.

For every captured transaction that produced change events, two records on the source's
transaction topic ``<source>.transaction`` (one partition, cleanup policy ``delete``; Debezium's
``<topic.prefix>.transaction``), keyed ``{"id": "<transaction id>"}``::

    {"status": "BEGIN", "id": "571:53195829", "ts_ms": 1486500577125, "event_count": null, "data_collections": null}
    {"status": "END", "id": "571:53195829", "ts_ms": 1486500577691, "event_count": 2,
     "data_collections": [{"data_collection": "s1.a", "event_count": 1}, {"data_collection": "s2.a", "event_count": 1}]}

(https://debezium.io/documentation/reference/stable/connectors/postgresql.html#postgresql-transaction-metadata).
``data_collections`` lists the tables in the order the transaction first changed them. Both
records carry the transaction's position in the ``kf.pos`` header, so a connector restarted
after a crash recognises them as already written like any other record.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from kappaflow.connectors.base import POSITION_HEADER, TrustedRecord
from kappaflow.log.base import CleanupPolicy, TopicConfig

__all__ = ["TRANSACTION_TOPIC_CONFIG", "transaction_records", "transaction_topic"]

TRANSACTION_TOPIC_CONFIG = TopicConfig(partitions=1, cleanup_policy=CleanupPolicy.DELETE)


def transaction_topic(source: str) -> str:
    return f"{source}.transaction"


def transaction_records(tx_id: str, begin_ts_ms: int, end_ts_ms: int, counts: Mapping[str, int],
                        begin_pos: bytes, end_pos: bytes) -> list[TrustedRecord]:
    """The BEGIN and END records of one transaction; ``counts``: data collection -> events, in order.

    ``begin_pos``/``end_pos``: the ``kf.pos`` header values (the position dicts as JSON)."""
    key = orjson.dumps({"id": tx_id})
    begin = orjson.dumps({"status": "BEGIN", "id": tx_id, "ts_ms": begin_ts_ms, "event_count": None,
                          "data_collections": None})
    end = orjson.dumps({"status": "END", "id": tx_id, "ts_ms": end_ts_ms, "event_count": sum(counts.values()),
                        "data_collections": [{"data_collection": c, "event_count": n} for c, n in counts.items()]})
    return [TrustedRecord(key, begin, ((POSITION_HEADER, begin_pos),)),
            TrustedRecord(key, end, ((POSITION_HEADER, end_pos),))]
