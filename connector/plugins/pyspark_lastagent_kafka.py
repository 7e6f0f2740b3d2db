"""Spark discovers this module (name starts with ``pyspark_``) and registers format ``lastagent-kafka``."""

from lastagent.formats import KafkaDataSource as DefaultSource

__all__ = ["DefaultSource"]
