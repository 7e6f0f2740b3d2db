"""Example pipelines and an example transformer. Each pipeline is a driver program of its own.

``python -m lastagent.examples sink-driver BOOTSTRAP SOURCE CHECKPOINT ARBITRATION LINK TOPIC``,
``python -m lastagent.examples kafka-driver BOOTSTRAP SOURCE_TOPIC CHECKPOINT ARBITRATION LINK TOPIC [PER_TRIGGER]`` and
``python -m lastagent.examples delta-driver BOOTSTRAP TOPIC TABLE CHECKPOINT LINK DEAD_LETTERS SIDE
[PER_TRIGGER [DEAD_LETTER_TABLE]]`` run a query with ``trigger(availableNow=True)`` to its end. The
demo kills and restarts them; the crash tests run them with a crash hook installed.
``LASTAGENT_SPARK_MASTER`` and ``LASTAGENT_SPARK_CONF`` (``key=value;key=value``) shape the session;
``LASTAGENT_KAFKA_CONFIG`` names a properties file of Kafka client settings (a secured cluster's
``security.protocol``, ``sasl.jaas.config``, stores) given to every Kafka reader and writer as ``kafka.*``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import pyarrow as pa


def _env_conf() -> dict[str, str]:
    """Spark settings for a driver process from ``LASTAGENT_SPARK_CONF`` (``key=value;key=value``).

    The tests run the pipelines where users run them too, e.g. ``spark.python.use.daemon=false``.
    """
    pairs = [p.partition("=") for p in os.environ.get("LASTAGENT_SPARK_CONF", "").split(";") if p.strip()]
    return {k.strip(): v.strip() for k, _, v in pairs}


def _kafka_options() -> dict[str, str]:
    """``kafka.*`` options from the properties file ``LASTAGENT_KAFKA_CONFIG`` names, if any."""
    from lastagent.cli import read_properties

    path = os.environ.get("LASTAGENT_KAFKA_CONFIG", "")
    return {f"kafka.{k}": v for k, v in read_properties(path).items()} if path else {}


def sink_driver(bootstrap: str, source: str, checkpoint: str, arbitration: str, link: str, topic: str) -> int:
    """Delta table → ``lastagent-kafka``: one file per micro-batch, until the table's end."""
    from lastagent.spark_session import local_session

    # LASTAGENT_SPARK_MASTER lets crash tests allow task retries, e.g. local[2,4].
    spark = local_session("lastagent-sink-driver", master=os.environ.get("LASTAGENT_SPARK_MASTER", "local[2]"),
                          extra_conf=_env_conf())
    spark.sparkContext.setLogLevel("ERROR")
    query = (
        spark.readStream.format("delta").option("maxFilesPerTrigger", "1").load(source)
        .selectExpr("key", "value")
        .writeStream.format("lastagent-kafka")
        .options(**_kafka_options())
        .option("kafka.bootstrap.servers", bootstrap)
        .option("topic", topic)
        .option("link", link)
        .option("arbitrationTable", arbitration)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    spark.stop()
    return 0


def kafka_driver(bootstrap: str, source_topic: str, checkpoint: str, arbitration: str, link: str, topic: str,
                 per_trigger: str = "1000") -> int:
    """``lastagent-kafka`` → ``lastagent-kafka``: a topic copied to another, until the source's end."""
    from lastagent.spark_session import local_session

    spark = local_session("lastagent-kafka-driver", master=os.environ.get("LASTAGENT_SPARK_MASTER", "local[2]"),
                          extra_conf=_env_conf())
    spark.sparkContext.setLogLevel("ERROR")
    query = (
        spark.readStream.format("lastagent-kafka")
        .options(**_kafka_options())
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", source_topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", per_trigger)
        .load()
        .selectExpr("key", "value")
        .writeStream.format("lastagent-kafka")
        .options(**_kafka_options())
        .option("kafka.bootstrap.servers", bootstrap)
        .option("topic", topic)
        .option("link", link)
        .option("arbitrationTable", arbitration)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    spark.stop()
    return 0


def enrich(batch: pa.RecordBatch) -> pa.RecordBatch:
    """An example transformer (executors): ``order-<t>-<i>`` values get an amount; others are poison.

    Used as ``.option("transformer", "lastagent.examples:enrich")``; a record it rejects goes to the
    dead-letter topic with the exception text.
    """
    import pyarrow as pa

    amounts = []
    for v in batch.column("value").to_pylist():
        text = v.decode() if isinstance(v, bytes) else str(v)
        kind, t, i = text.split("-")  # a poison record fails here
        if kind != "order":
            raise ValueError(f"not an order: {text!r}")
        amounts.append(int(t) * 1000 + int(i))
    return batch.append_column("amount", pa.array(amounts, pa.int64()))


def delta_driver(bootstrap: str, topic: str, table: str, checkpoint: str, link: str, dead_letters: str,
                 side: str, per_trigger: str = "1000", dead_letter_table: str = "") -> int:
    """Kafka → :func:`enrich` → ``lastagent-delta``, until the topic's end.

    Dead letters and follow-up messages (side topic) are committed in the same epoch as the table.
    An empty ``dead_letters`` topic with a ``dead_letter_table`` sends dead letters to that table.
    """
    from lastagent.spark_session import local_session

    spark = local_session("lastagent-delta-driver", master=os.environ.get("LASTAGENT_SPARK_MASTER", "local[2]"),
                          extra_conf=_env_conf())
    spark.sparkContext.setLogLevel("ERROR")
    query = (
        spark.readStream.format("lastagent-kafka")
        .options(**_kafka_options())
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", per_trigger)
        .load()
        .selectExpr("CAST(key AS STRING) AS key", "value", "topic", "partition", "offset")
        .writeStream.format("lastagent-delta")
        .option("link", link)
        .option("checkpointLocation", checkpoint)
        .option("transformer", "lastagent.examples:enrich")
        .option("deadLetterTopic", dead_letters)
        .option("deadLetterTable", dead_letter_table)
        .option("sideTopics", side)
        .options(**_kafka_options())
        .option("kafka.bootstrap.servers", bootstrap)
        .trigger(availableNow=True)
        .start(table)
    )
    query.awaitTermination()
    spark.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="lastagent example pipelines")
    pipelines: dict[str, Callable[..., int]] = {"sink-driver": sink_driver, "kafka-driver": kafka_driver, "delta-driver": delta_driver}
    parser.add_argument("pipeline", choices=sorted(pipelines))
    parser.add_argument("args", nargs="*")
    args = parser.parse_args(argv)
    return pipelines[args.pipeline](*args.args)


if __name__ == "__main__":
    from lastagent.cli import exit_now

    exit_now(main())
