"""Example pipelines and an example transformer. Each pipeline is a driver program of its own.

``python -m lastagent.examples sink-driver BOOTSTRAP SOURCE CHECKPOINT ARBITRATION LINK TOPIC``,
``python -m lastagent.examples kafka-driver BOOTSTRAP SOURCE_TOPIC CHECKPOINT ARBITRATION LINK TOPIC [PER_TRIGGER]`` and
``python -m lastagent.examples delta-driver BOOTSTRAP TOPIC TABLE CHECKPOINT LINK DEAD_LETTERS SIDE
[PER_TRIGGER [DEAD_LETTER_TABLE]]`` run a query with ``trigger(availableNow=True)`` to its end;
``python -m lastagent.examples links-driver BOOTSTRAP BASE LINK DELTA_SOURCE ORDERS SINK_TOPIC COPY_TOPIC
DEAD_LETTERS SIDE [PER_TRIGGER]`` runs the three links as three queries of one application. The
demo kills and restarts them; the crash tests run them with a crash hook installed.
``python -m lastagent.examples groups-driver BOOTSTRAP TOPIC TABLE CHECKPOINT LINK DEAD_LETTER_TABLE STOP_FILE
METRICS_FILE`` runs Kafka → reliable groups → ``lastagent-delta`` until ``STOP_FILE`` exists.
``python -m lastagent.examples merge-driver BOOTSTRAP SOURCE_TOPIC EVENTS_TOPIC TABLE CHECKPOINT LINK [PER_TRIGGER]``
runs change records (JSON ``{"id", "amount"}``) through ``foreachBatch`` with :func:`lastagent.epoch`: one event per
change to ``EVENTS_TOPIC``, then a ``MERGE`` of the newest amount per id into the Delta table ``TABLE``.
``python -m lastagent.examples every-link-driver BOOTSTRAP BASE LINK DELTA_SOURCE ORDERS SINK_TOPIC COPY_TOPIC DEAD_LETTERS
SIDE CHANGES EVENTS [PER_TRIGGER]`` runs the three links and the merge pipeline as four queries of one application.
``python -m lastagent.examples shared-driver BOOTSTRAP BASE SOURCE_A EVENTS_A LINK_A SOURCE_B EVENTS_B LINK_B SOURCE_C
[PER_TRIGGER]`` runs two such pipelines (tables ``BASE/a``, ``BASE/b``) and a plain ``foreachBatch`` appending
``SOURCE_C`` to ``BASE/c`` through the global session, as three queries of one driver.
``LASTAGENT_RUN_UNTIL`` names a file: the pipelines then run every second until it exists, then drain
their sources and stop (the broker-loss tests feed them meanwhile).
``LASTAGENT_SPARK_MASTER`` and ``LASTAGENT_SPARK_CONF`` (``key=value;key=value``) shape the session;
``LASTAGENT_KAFKA_CONFIG`` names a properties file of Kafka client settings (a secured cluster's
``security.protocol``, ``sasl.jaas.config``, stores) given to every Kafka reader and writer as ``kafka.*``;
``LASTAGENT_STORAGE_CONFIG`` one of storage settings (``aws_endpoint_url``, ...) given to both sinks as
``storage.*`` (tables and checkpoints on an object store).
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa


def _env_conf() -> dict[str, str]:
    """Spark settings for a driver process from ``LASTAGENT_SPARK_CONF`` (``key=value;key=value``).

    The tests run the pipelines where users run them too, e.g. ``spark.python.use.daemon=false``.
    """
    pairs = [p.partition("=") for p in os.environ.get("LASTAGENT_SPARK_CONF", "").split(";") if p.strip()]
    return {k.strip(): v.strip() for k, _, v in pairs}


def _file_options(variable: str, prefix: str) -> dict[str, str]:
    """``<prefix>*`` options from the properties file the environment variable names, if any."""
    from lastagent.cli import read_properties

    path = os.environ.get(variable, "")
    return {f"{prefix}{k}": v for k, v in read_properties(path).items()} if path else {}


def _kafka_options() -> dict[str, str]:
    """``kafka.*`` options from the properties file ``LASTAGENT_KAFKA_CONFIG`` names, if any."""
    return _file_options("LASTAGENT_KAFKA_CONFIG", "kafka.")


def _storage_options() -> dict[str, str]:
    """``storage.*`` options from the properties file ``LASTAGENT_STORAGE_CONFIG`` names, if any."""
    return _file_options("LASTAGENT_STORAGE_CONFIG", "storage.")


def _session(name: str) -> Any:
    from lastagent.spark_session import local_session

    # LASTAGENT_SPARK_MASTER lets crash tests allow task retries (local[2,4]) or use a cluster.
    spark = local_session(name, master=os.environ.get("LASTAGENT_SPARK_MASTER", "local[2]"), extra_conf=_env_conf())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _trigger(writer: Any) -> Any:
    """``availableNow`` (run to the source's end), or a micro-batch every second while
    ``LASTAGENT_RUN_UNTIL`` names a file that does not exist yet (:func:`_run`)."""
    if os.environ.get("LASTAGENT_RUN_UNTIL"):
        return writer.trigger(processingTime="1 second")
    return writer.trigger(availableNow=True)


def _run(name: str, *queries: Callable[[Any], Any]) -> int:
    """Starts each query in one session and waits for every one to end (availableNow).

    With ``LASTAGENT_RUN_UNTIL`` the queries run until that file exists, then each processes what
    its source holds and stops; a query that fails before ends the program with its error.
    """
    spark = _session(name)
    started = [start(spark) for start in queries]
    until = os.environ.get("LASTAGENT_RUN_UNTIL")
    if until:
        while not os.path.exists(until):
            for query in started:
                query.awaitTermination(0.2)  # raises the query's error if it failed
        for query in started:
            query.processAllAvailable()
            query.stop()
    for query in started:
        query.awaitTermination()
    spark.stop()
    return 0


def _to_lastagent_kafka(rows: Any, bootstrap: str, checkpoint: str, arbitration: str, link: str, topic: str) -> Any:
    """Starts ``rows`` (key, value) into ``lastagent-kafka`` until the source's end; the started query."""
    return _trigger(
        rows.writeStream.format("lastagent-kafka")
        .options(**_kafka_options())
        .options(**_storage_options())
        .option("kafka.bootstrap.servers", bootstrap)
        .option("topic", topic)
        .option("link", link)
        .option("arbitrationTable", arbitration)
        .option("checkpointLocation", checkpoint)
    ).start()


def delta_to_kafka(spark: Any, bootstrap: str, source: str, checkpoint: str, arbitration: str, link: str,
                   topic: str) -> Any:
    """Delta table → ``lastagent-kafka``: one file per micro-batch, until the table's end; the started query."""
    rows = spark.readStream.format("delta").option("maxFilesPerTrigger", "1").load(source).selectExpr("key", "value")
    return _to_lastagent_kafka(rows, bootstrap, checkpoint, arbitration, link, topic)


def kafka_to_kafka(spark: Any, bootstrap: str, source_topic: str, checkpoint: str, arbitration: str, link: str,
                   topic: str, per_trigger: str = "1000") -> Any:
    """``lastagent-kafka`` → ``lastagent-kafka``: a topic copied to another, until the source's end; the started query."""
    rows = (
        spark.readStream.format("lastagent-kafka")
        .options(**_kafka_options())
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", source_topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", per_trigger)
        .load()
        .selectExpr("key", "value")
    )
    return _to_lastagent_kafka(rows, bootstrap, checkpoint, arbitration, link, topic)


def kafka_to_delta(spark: Any, bootstrap: str, topic: str, table: str, checkpoint: str, link: str, dead_letters: str,
                   side: str, per_trigger: str = "1000", dead_letter_table: str = "") -> Any:
    """Kafka → :func:`enrich` → ``lastagent-delta``, until the topic's end; the started query.

    Dead letters and follow-up messages (side topic) are committed in the same epoch as the table.
    An empty ``dead_letters`` topic with a ``dead_letter_table`` sends dead letters to that table.
    """
    return _trigger(
        spark.readStream.format("lastagent-kafka")
        .options(**_kafka_options())
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", per_trigger)
        .load()
        .selectExpr("CAST(key AS STRING) AS key", "value", "topic", "partition", "offset")
        .writeStream.format("lastagent-delta")
        .options(**_storage_options())
        .option("link", link)
        .option("checkpointLocation", checkpoint)
        .option("transformer", "lastagent.examples:enrich")
        .option("deadLetterTopic", dead_letters)
        .option("deadLetterTable", dead_letter_table)
        .option("sideTopics", side)
        .options(**_kafka_options())
        .option("kafka.bootstrap.servers", bootstrap)
    ).start(table)


def sink_driver(*args: str) -> int:
    """:func:`delta_to_kafka` as a driver program."""
    return _run("lastagent-sink-driver", lambda spark: delta_to_kafka(spark, *args))


def kafka_driver(*args: str) -> int:
    """:func:`kafka_to_kafka` as a driver program."""
    return _run("lastagent-kafka-driver", lambda spark: kafka_to_kafka(spark, *args))


def delta_driver(*args: str) -> int:
    """:func:`kafka_to_delta` as a driver program."""
    return _run("lastagent-delta-driver", lambda spark: kafka_to_delta(spark, *args))


def _three_links(bootstrap: str, base: str, link: str, delta_source: str, orders: str, sink_topic: str,
                 copy_topic: str, dead_letters: str, side: str, per_trigger: str) -> list[Callable[[Any], Any]]:
    """The starts of the three links: Delta → Kafka (``<link>-sink``), Kafka → Kafka (``<link>-copy``, from
    ``orders``) and Kafka → Delta (``<link>-delta``, from ``orders`` into ``<base>/orders``); checkpoints and
    arbitration tables under ``base``."""
    return [
        lambda spark: delta_to_kafka(spark, bootstrap, delta_source, f"{base}/ckpt-sink", f"{base}/arb-sink",
                                     f"{link}-sink", sink_topic),
        lambda spark: kafka_to_kafka(spark, bootstrap, orders, f"{base}/ckpt-copy", f"{base}/arb-copy",
                                     f"{link}-copy", copy_topic, per_trigger),
        lambda spark: kafka_to_delta(spark, bootstrap, orders, f"{base}/orders", f"{base}/ckpt-delta",
                                     f"{link}-delta", dead_letters, side, per_trigger),
    ]


def links_driver(bootstrap: str, base: str, link: str, delta_source: str, orders: str, sink_topic: str,
                 copy_topic: str, dead_letters: str, side: str, per_trigger: str = "100") -> int:
    """The three links (:func:`_three_links`) as three queries of one application."""
    return _run("lastagent-links-driver", *_three_links(bootstrap, base, link, delta_source, orders, sink_topic,
                                                         copy_topic, dead_letters, side, per_trigger))


def every_link_driver(bootstrap: str, base: str, link: str, delta_source: str, orders: str, sink_topic: str,
                      copy_topic: str, dead_letters: str, side: str, changes: str, events: str,
                      per_trigger: str = "100") -> int:
    """The three links (:func:`_three_links`) and the epoch block of :func:`merge_changes` (``<link>-merge``, from
    ``changes`` into ``<base>/merged``, one event per change to ``events``) as four queries of one application."""
    return _run(
        "lastagent-every-link-driver",
        *_three_links(bootstrap, base, link, delta_source, orders, sink_topic, copy_topic, dead_letters, side,
                      per_trigger),
        lambda spark: merge_changes(spark, bootstrap, changes, events, f"{base}/merged", f"{base}/ckpt-merge",
                                    f"{link}-merge", per_trigger),
    )


def reliable_kafka_to_delta(spark: Any, bootstrap: str, topic: str, table: str, checkpoint: str, link: str,
                           dead_letter_table: str, per_trigger: str = "40", trigger: str = "1 second") -> Any:
    """Kafka → :func:`lastagent.reliable_groups` → ``lastagent-delta``, running until stopped; the started query.

    Each new message once (ordered groups in order), refusals in the dead-letter table with their rule.
    The step's counts are the query's observed metrics ``lastagent_reliable_groups``.
    """
    from lastagent import reliable_groups

    # transformWithState keeps its state in RocksDB; a SQL setting, fixed for the checkpoint at its first run.
    spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                   "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    rows = (
        spark.readStream.format("lastagent-kafka")
        .options(**_kafka_options())
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("includeHeaders", "true")
        .option("maxOffsetsPerTrigger", per_trigger)
        .load()
        .selectExpr("CAST(key AS STRING) AS key", "value", "headers", "topic", "partition", "offset", "timestamp")
    )
    return (
        reliable_groups(rows).writeStream.format("lastagent-delta")
        .options(**_storage_options())
        .option("link", link)
        .option("checkpointLocation", checkpoint)
        .option("deadLetterTable", dead_letter_table)
        .trigger(processingTime=trigger)
        .start(table)
    )


def groups_driver(bootstrap: str, topic: str, table: str, checkpoint: str, link: str, dead_letter_table: str,
                  stop_file: str, metrics_file: str) -> int:
    """:func:`reliable_kafka_to_delta` as a driver program that runs until ``stop_file`` exists, appending
    each batch's observed metrics to ``metrics_file`` (a JSON line per progress report)."""
    import json

    from pyspark.sql.streaming import StreamingQueryListener

    class Metrics(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            pass

        def onQueryProgress(self, event: Any) -> None:
            p = event.progress
            metrics = {k: v.asDict() for k, v in (p.observedMetrics or {}).items()}
            with open(metrics_file, "a") as f:
                f.write(json.dumps({"batchId": p.batchId, "metrics": metrics}) + "\n")

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            pass

    spark = _session("lastagent-groups-driver")
    spark.streams.addListener(Metrics())
    query = reliable_kafka_to_delta(spark, bootstrap, topic, table, checkpoint, link, dead_letter_table)
    while not os.path.exists(stop_file):
        if query.awaitTermination(1):  # raises when the query failed
            break
    query.stop()
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


def _changes(spark: Any, bootstrap: str, source: str, per_trigger: str) -> Any:
    """Change records (JSON ``{"id", "amount"}``) read from ``source`` with ``lastagent-kafka``: (id, amount)."""
    return (spark.readStream.format("lastagent-kafka").options(**_kafka_options())
            .option("kafka.bootstrap.servers", bootstrap).option("subscribe", source)
            .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", per_trigger).load()
            .selectExpr("CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
                        "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount"))


def merge_changes(spark: Any, bootstrap: str, source: str, events: str, table: str, checkpoint: str, link: str,
                  per_trigger: str = "40") -> Any:
    """Kafka change records → ``foreachBatch``: events to Kafka and a MERGE into Delta as one epoch; the started query."""
    from delta.tables import DeltaTable

    import lastagent

    def apply(batch: Any, epoch_id: int) -> None:
        with lastagent.epoch(batch, epoch_id, link=link, table=table,
                             **{**_kafka_options(), **_storage_options(), "kafka.bootstrap.servers": bootstrap}) as e:
            e.to_kafka(batch.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value"),
                       topic=events)
            latest = batch.groupBy("id").agg({"amount": "max"}).withColumnRenamed("max(amount)", "amount")
            # The batch's own session: the one the block's Delta settings are on (docs/foreach_batch.md).
            (DeltaTable.forPath(batch.sparkSession, table).alias("t").merge(latest.alias("s"), "t.id = s.id")
             .whenMatchedUpdate(set={"amount": "s.amount"})
             .whenNotMatchedInsert(values={"id": "s.id", "amount": "s.amount"}).execute())

    return _trigger(_changes(spark, bootstrap, source, per_trigger).writeStream.foreachBatch(apply)
                    .option("checkpointLocation", checkpoint)).start()


def merge_driver(*args: str) -> int:
    """:func:`merge_changes` as a driver program."""
    return _run("lastagent-merge-driver", lambda spark: merge_changes(spark, *args))


def plain_appends(spark: Any, bootstrap: str, source: str, table: str, checkpoint: str,
                  per_trigger: str = "40") -> Any:
    """Kafka change records appended to ``table`` by a plain ``foreachBatch`` (no lastagent) through the driver's
    global session, as many notebooks write; at least once, as Spark's own ``foreachBatch`` is. The started query."""
    query = uuid.uuid4().hex[:8]  # global temp views are the driver's: one name per query and batch

    def append(batch: Any, epoch_id: int) -> None:
        view = f"plain_{query}_{epoch_id}"
        batch.createOrReplaceGlobalTempView(view)
        try:
            spark.sql(f"INSERT INTO delta.`{table}` SELECT id, amount FROM global_temp.{view}")
        finally:
            spark.catalog.dropGlobalTempView(view)

    return _trigger(_changes(spark, bootstrap, source, per_trigger).writeStream.foreachBatch(append)
                    .option("checkpointLocation", checkpoint)).start()


def shared_driver(bootstrap: str, base: str, source_a: str, events_a: str, link_a: str, source_b: str, events_b: str,
                  link_b: str, source_c: str, per_trigger: str = "40") -> int:
    """Three queries in one driver: two :func:`merge_changes` (tables ``BASE/a``, ``BASE/b``) and one
    :func:`plain_appends` (``BASE/c``) through the global session beside them."""
    return _run("lastagent-shared-driver",
                lambda spark: merge_changes(spark, bootstrap, source_a, events_a, f"{base}/a", f"{base}/a-ckpt",
                                            link_a, per_trigger),
                lambda spark: merge_changes(spark, bootstrap, source_b, events_b, f"{base}/b", f"{base}/b-ckpt",
                                            link_b, per_trigger),
                lambda spark: plain_appends(spark, bootstrap, source_c, f"{base}/c", f"{base}/c-ckpt", per_trigger))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="lastagent example pipelines")
    pipelines: dict[str, Callable[..., int]] = {"sink-driver": sink_driver, "kafka-driver": kafka_driver,
                                                "delta-driver": delta_driver, "links-driver": links_driver,
                                                "groups-driver": groups_driver, "merge-driver": merge_driver,
                                                "shared-driver": shared_driver, "every-link-driver": every_link_driver}
    parser.add_argument("pipeline", choices=sorted(pipelines))
    parser.add_argument("args", nargs="*")
    args = parser.parse_args(argv)
    return pipelines[args.pipeline](*args.args)


if __name__ == "__main__":
    from lastagent.cli import exit_now

    exit_now(main())
