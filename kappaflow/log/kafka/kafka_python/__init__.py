"""The Kafka log on kafka-python (always installed; `[log.kafka] client = "kafka-python"`).

One module per role, as the confluent client: `connection`, `topics`, `append`, `read`, `groups`;
`log` puts them together as `KafkaLog`; `clients` holds the kafka-python plumbing.
"""

from kappaflow.log.kafka.kafka_python.log import KafkaLog

__all__ = ["KafkaLog"]
