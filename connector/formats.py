"""The Spark data source classes behind the ``lastagent-*`` formats. Driver side."""

from pyspark.sql.datasource import DataSource


class KafkaDataSource(DataSource):
    """Format ``lastagent-kafka``: streaming source and exactly-once streaming sink."""

    @classmethod
    def name(cls) -> str:
        return "lastagent-kafka"
