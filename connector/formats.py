"""The Spark data source classes behind the ``lastagent-*`` formats. Driver side."""

from pyspark.sql.datasource import DataSource


class KafkaDataSource(DataSource):
    """Format ``lastagent-kafka``: streaming source and exactly-once streaming sink."""

    @classmethod
    def name(cls) -> str:
        return "lastagent-kafka"

    def streamWriter(self, schema, overwrite):  # noqa: ANN001, ANN201, N802 — Spark's API
        """Driver: the exactly-once sink's writer (pickled to executors for ``write``)."""
        from lastagent.sinks.kafka_sink import KafkaStreamWriter

        return KafkaStreamWriter(self.options, schema)
