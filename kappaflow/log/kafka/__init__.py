"""The Kafka log backend: one log contract, two clients.

* `common` -- what both clients share: option and security checks, topic configs, the checks an
  append passes before anything is sent;
* `kafka_python/` -- the pure-Python client (`KafkaLog`), one module per role: `connection` (the
  clients), `topics`, `append`, `read`, `groups` (consumer group offsets), `clients` (options,
  bounded connects, error mapping); `log` puts them together;
* `confluent/` -- the librdkafka client (`ConfluentKafkaLog`), one module per role: `topics`,
  `append`, `read`, `groups` (consumer group offsets), `clients`.

`kappaflow.log.open_log` picks the client (`[log.kafka] client`); `KafkaLog` stays importable from
here, its import path before the backends became packages.
"""

from kappaflow.log.kafka.kafka_python import KafkaLog

__all__ = ["KafkaLog"]
