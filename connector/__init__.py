"""lastagent: exactly-once Spark Structured Streaming between Apache Kafka and Delta Lake.

Formats ``lastagent-kafka`` and ``lastagent-delta`` are discovered by Spark 4 from the installed
``pyspark_lastagent_*`` modules. Where a runtime does not scan for them, call :func:`register`.
"""

from typing import TYPE_CHECKING, Any

from lastagent.errors import DataLossError, KafkaProtocolError, LastAgentError, OptionError, UnsupportedSparkError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from lastagent.foreach_batch import Epoch

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
    from lastagent.spark_versions import require_supported

    require_supported()  # as the formats do at a query's start
    return step(df, **kwargs)


def epoch(batch: "DataFrame", epoch_id: int, *, link: str, table: str, **options: str) -> "Epoch":
    """One exactly-once epoch inside ``foreachBatch``: Kafka outputs and the block's one Delta write decided as one.

    ``with lastagent.epoch(batch, epoch_id, link="orders-cdc", table="/data/orders", **kafka) as e:``, then
    ``e.to_kafka(df, topic=...)`` for every Kafka output, then the block's one Delta write through the batch's own
    session (``batch.write``, ``batch.sparkSession.sql("MERGE ...")``, ``DeltaTable.forPath(batch.sparkSession,
    ...)``). See :func:`lastagent.foreach_batch.epoch` and docs/foreach_batch.md. Driver side.

    Args:
        batch: the micro-batch DataFrame foreachBatch passes.
        epoch_id: its batch id.
        link: the link's stable name (it names the transactional ids and the Delta app ids).
        table: the Delta table of the block's write: a path, ``delta.`path``` or a catalog name.
        options: ``kafka.*`` client settings (``kafka.bootstrap.servers`` required) and, for a table on object
            storage, ``storage.*`` settings.

    Raises:
        UnsupportedSparkError: a pyspark lastagent does not run on.
        OptionError: a bad option or table.
    """
    from lastagent.foreach_batch import epoch as block

    return block(batch, epoch_id, link=link, table=table, **options)
__version__ = "0.1.0"
