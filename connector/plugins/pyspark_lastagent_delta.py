"""Spark discovers this module (name starts with ``pyspark_``) and registers format ``lastagent-delta``."""

from lastagent.formats import DeltaDataSource as DefaultSource

__all__ = ["DefaultSource"]
