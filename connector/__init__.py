"""lastagent: exactly-once Spark Structured Streaming between Apache Kafka and Delta Lake.

Formats ``lastagent-kafka`` and ``lastagent-delta`` are discovered by Spark 4 from the installed
``pyspark_lastagent_*`` modules. Where a runtime does not scan for them, call :func:`register`.
"""

from typing import Any

from lastagent.errors import DataLossError, KafkaProtocolError, LastAgentError, OptionError, UnsupportedSparkError

__all__ = ["DataLossError", "KafkaProtocolError", "LastAgentError", "OptionError", "UnsupportedSparkError", "epoch",
           "register", "reliable_groups"]


def register(spark: Any) -> None:
    """Registers formats ``lastagent-kafka`` and ``lastagent-delta`` with ``spark``. Driver side.

    Needed where the runtime does not discover installed ``pyspark_*`` data source modules, and before a
    driver starts two or more queries: it fills in the environment map Spark's Python streaming sources add to
    at their first start, so that queries starting at the same moment cannot damage it (a Spark race:
    :mod:`lastagent.worker_env`). A format Spark already resolves (discovered, or registered before) is left
    as it is, so calling it twice, or where Spark discovers the formats, is harmless.

    Raises:
        UnsupportedSparkError: pyspark is older than 4.0 (no Python Data Source API for streaming), or newer
            than every Spark minor lastagent was tested on (:mod:`lastagent.spark_versions`).
    """
    from lastagent.spark_versions import require_supported

    require_supported()
    from lastagent import worker_env
    from lastagent.formats import DeltaDataSource, KafkaDataSource

    known = worker_env.resolved(spark)
    for source in (KafkaDataSource, DeltaDataSource):
        if source.name() not in known:  # Spark 4.0 refuses to register a name it discovered
            spark.dataSource.register(source)
    worker_env.fill(spark, worker_env.env_maps(spark))


def reliable_groups(df: Any, **kwargs: Any) -> Any:
    """Duplicate elimination and ordered delivery by WS-Reliability's group rules: see
    :func:`lastagent.groups.step.reliable_groups` for the arguments. Driver side."""
    from lastagent.groups.step import reliable_groups as step

    return step(df, **kwargs)


def epoch(batch: Any, epoch_id: int, **kwargs: Any) -> Any:
    """One exactly-once epoch inside ``foreachBatch``: Kafka outputs and the block's Delta write decided as one
    (experimental): see :func:`lastagent.foreach_batch.epoch` for the arguments. Driver side."""
    from lastagent.foreach_batch import epoch as block

    return block(batch, epoch_id, **kwargs)
__version__ = "0.1.0"
