"""The Spark data source classes behind the ``lastagent-*`` formats. Driver side.

Each entry point first checks that this pyspark is one lastagent runs on (:mod:`lastagent.spark_versions`), so an
unsupported Spark is named at query start rather than met as an import error inside a pyspark traceback.
"""

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, DataSourceStreamWriter
from pyspark.sql.types import StructType


class KafkaDataSource(DataSource):
    """Format ``lastagent-kafka``: batch and streaming source, exactly-once streaming sink."""

    @classmethod
    def name(cls) -> str:
        return "lastagent-kafka"

    def schema(self) -> StructType:  # Spark's API
        """The row schema of Spark's built-in kafka source (``headers`` with includeHeaders=true)."""
        from lastagent.sources.kafka_source import kafka_schema

        return kafka_schema(str(self.options.get("includeHeaders", "false")).strip().lower() == "true")

    def reader(self, schema: StructType) -> DataSourceReader:  # Spark's API
        """Driver: a batch read (``spark.read``) between the starting and ending offsets."""
        from lastagent.spark_versions import require_supported

        require_supported()
        from lastagent.sources.kafka_source import KafkaBatchReader
        from lastagent.sources.kafka_source_options import KafkaSourceOptions

        return KafkaBatchReader(KafkaSourceOptions.parse(self.options, batch=True))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:  # Spark's API
        """Driver: the source's reader; options are checked here, once, at query start."""
        from lastagent.errors import LastAgentError
        from lastagent.sources.kafka_source import FailedStreamReader, KafkaStreamReader
        from lastagent.sources.kafka_source_options import KafkaSourceOptions
        from lastagent.spark_versions import require_supported

        try:
            require_supported()
            return KafkaStreamReader(KafkaSourceOptions.parse(self.options))
        except LastAgentError as e:
            return FailedStreamReader(e)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # Spark's API
        """Driver: the exactly-once sink's writer (pickled to executors for ``write``)."""
        from lastagent.spark_versions import require_supported

        require_supported()
        from lastagent.sinks.kafka_sink import KafkaStreamWriter

        return KafkaStreamWriter(dict(self.options), schema)


class DeltaDataSource(DataSource):
    """Format ``lastagent-delta``: exactly-once streaming sink to a Delta table (the last agent)."""

    @classmethod
    def name(cls) -> str:
        return "lastagent-delta"

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # Spark's API
        """Driver: the sink's writer; options and the table's schema are checked here, at query start."""
        from lastagent.errors import OptionError
        from lastagent.spark_versions import require_supported

        require_supported()
        from lastagent.sinks.delta_sink import DeltaStreamWriter

        if overwrite:
            # Spark asks to overwrite in complete mode; an epoch here is an append (txn(link, epoch)).
            raise OptionError("outputMode", "lastagent-delta appends each epoch; use outputMode('append')")
        return DeltaStreamWriter(dict(self.options), schema)
