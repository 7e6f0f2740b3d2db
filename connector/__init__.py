"""lastagent: exactly-once Spark Structured Streaming between Apache Kafka and Delta Lake.

Formats ``lastagent-kafka`` and ``lastagent-delta`` are discovered by Spark 4 from the installed
``pyspark_lastagent_*`` modules. Where a runtime does not scan for them, call :func:`register`.
"""

from typing import Any

from lastagent.errors import DataLossError, KafkaProtocolError, LastAgentError, OptionError

__all__ = ["DataLossError", "KafkaProtocolError", "LastAgentError", "OptionError", "register", "reliable_groups"]


def register(spark: Any) -> None:
    """Registers formats ``lastagent-kafka`` and ``lastagent-delta`` with ``spark``. Driver side.

    Needed only where the runtime does not discover installed ``pyspark_*`` data source
    modules; registering twice is harmless.

    Raises:
        LastAgentError: pyspark is older than 4.0, which has no Python Data Source API.
    """
    import pyspark

    major = int(str(pyspark.__version__).split(".")[0])
    if major < 4:
        raise LastAgentError(f"lastagent needs Spark 4.0 or newer (Python Data Source API); this runtime has "
                             f"pyspark {pyspark.__version__}")
    from lastagent.formats import DeltaDataSource, KafkaDataSource

    spark.dataSource.register(KafkaDataSource)
    spark.dataSource.register(DeltaDataSource)


def reliable_groups(df: Any, **kwargs: Any) -> Any:
    """Duplicate elimination and ordered delivery by WS-Reliability's group rules: see
    :func:`lastagent.groups.step.reliable_groups` for the arguments. Driver side."""
    from lastagent.groups.step import reliable_groups as step

    return step(df, **kwargs)
__version__ = "0.1.0"
