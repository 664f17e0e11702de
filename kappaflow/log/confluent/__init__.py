"""Former import path of the librdkafka client, kept for code that imports it from here.

The client lives in `kappaflow.log.kafka.confluent`.
"""

from kappaflow.log.kafka.confluent import ConfluentKafkaLog

__all__ = ["ConfluentKafkaLog"]
