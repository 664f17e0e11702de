"""The Kafka log on kafka-python (always installed; `[log.kafka] client = "kafka-python"`).

`log` maps the log contract onto the brokers (`KafkaLog`); `clients` holds the client plumbing.
"""

from kappaflow.log.kafka.kafka_python.log import KafkaLog

__all__ = ["KafkaLog"]
