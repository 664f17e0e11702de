"""The Kafka log on librdkafka through confluent-kafka (`pip install 'kappaflow[kafka]'`).

One module per role: `topics`, `append`, `read`, `groups`, `clients`; `log` puts them together
as `ConfluentKafkaLog`. Chosen with ``[log.kafka] client = "confluent"`` (the default when
confluent-kafka is installed); `kappaflow.log.kafka.KafkaLog` is the kafka-python client.
"""

from kappaflow.log.kafka.confluent.log import ConfluentKafkaLog

__all__ = ["ConfluentKafkaLog"]
