"""A Spark Connect client that runs one scenario of the Connect tier; run by tests/connect in a subprocess.

``python connect_client.py SCENARIO '<json args>'``. Each scenario connects with
``SparkSession.builder.remote(url)``, drives the lastagent formats through the Connect client and
prints one ``RESULT <json>`` line, which the test asserts on; it exits 0, or 1 with the traceback.

Why a subprocess: in pyspark 4.2 ``builder.remote(...).getOrCreate()`` refuses to run next to the
classic session of tests/conftest.py (``[SESSION_ALREADY_EXIST]``), and ``builder.remote(...).create()``
sets ``SPARK_CONNECT_MODE_ENABLED`` in ``os.environ``, after which pyspark treats every session of the
process as a Connect one (``F.col`` returns Connect columns; the classic session then fails with
``[NOT_EXPECTED_TYPE] Argument `col` should be Column or str, got Column``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

TIMEOUT_S = 240  # every query of a scenario ends within this (availableNow), or the scenario fails


def _step(what: str) -> None:
    """A progress line on stderr (the test shows it when a scenario fails or is slow)."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def _s(value: Any) -> Any:
    return value.decode() if isinstance(value, (bytes, bytearray)) else value


def _rows(df: Any, columns: list[str]) -> list[list[Any]]:
    return sorted([_s(r[c]) for c in columns] for r in df.select(*columns).collect())


def _run(query: Any, what: str) -> Any:
    """Waits (bounded) for an availableNow query to end; raises its exception, if any."""
    _step(f"{what}: started")
    if not query.awaitTermination(TIMEOUT_S):
        query.stop()
        raise TimeoutError(f"{what} did not end within {TIMEOUT_S} s")
    if query.exception() is not None:
        raise RuntimeError(f"{what} failed: {query.exception()}")
    _step(f"{what}: ended")
    return query


def _error(fn: Any) -> str | None:
    """None when fn() succeeds, else the type and message of its exception (what the user sees)."""
    try:
        fn()
    except Exception as e:  # the test asserts on the text
        return f"{type(e).__name__}: {e}"
    return None


def _kafka_stream(spark: SparkSession, bootstrap: str, topic: str, **options: str) -> Any:
    return (spark.readStream.format("lastagent-kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("subscribe", topic)
            .option("startingOffsets", "earliest")
            .options(**options)
            .load())


def source(spark: SparkSession, a: dict[str, Any]) -> dict[str, Any]:
    """The source: register(), batch read vs Spark's kafka format, and streams into delta, memory and noop."""
    import lastagent

    out: dict[str, Any] = {"register": _error(lambda: lastagent.register(spark))}
    b, topic, work = a["bootstrap"], a["topic"], a["workdir"]
    cols = ["key", "value", "topic", "partition", "offset"]

    ours = spark.read.format("lastagent-kafka").option("kafka.bootstrap.servers", b).option("subscribe", topic).load()
    _step("batch read")
    out["schema"] = ours.schema.simpleString()
    out["batch"] = _rows(ours, cols)
    spark_kafka = (spark.read.format("kafka").option("kafka.bootstrap.servers", b).option("subscribe", topic)
                   .option("kafka.isolation.level", "read_committed").load())
    _step("batch read with Spark's kafka format")
    out["kafka_schema"] = spark_kafka.schema.simpleString()
    out["kafka_batch"] = _rows(spark_kafka, cols)

    # into Delta (the test reads the table with delta-rs)
    _run(_kafka_stream(spark, b, topic).writeStream.format("delta")
         .option("checkpointLocation", f"{work}/ckpt-delta").trigger(availableNow=True).start(f"{work}/delta"), "stream into delta")
    # into the memory sink, read back with SQL
    _run(_kafka_stream(spark, b, topic).writeStream.format("memory")
         .queryName("lastagent_memory").option("checkpointLocation", f"{work}/ckpt-memory")
         .trigger(availableNow=True).start(), "stream into memory")
    out["memory"] = _rows(spark.sql("SELECT CAST(key AS STRING) AS key, CAST(value AS STRING) AS value, topic, partition, offset "
                                    "FROM lastagent_memory"), cols)
    # into noop: the rows the query reports it read
    q = _run(_kafka_stream(spark, b, topic).writeStream.format("noop")
             .option("checkpointLocation", f"{work}/ckpt-noop").trigger(availableNow=True).start(), "stream into noop")
    out["noop_rows"] = sum(p.numInputRows for p in q.recentProgress)
    out["delta_path"] = f"{work}/delta"
    return out


def sinks(spark: SparkSession, a: dict[str, Any]) -> dict[str, Any]:
    """Kafka → lastagent-delta (transformer, dead letters, side topic), then that table → lastagent-kafka; then
    a transformer the server cannot import, and one the client ships with ``spark.addArtifacts``."""
    b, work = a["bootstrap"], a["workdir"]
    out: dict[str, Any] = {}
    _run(_kafka_stream(spark, b, a["topic"])
         .selectExpr("CAST(key AS STRING) AS key", "value", "topic", "partition", "offset")
         .writeStream.format("lastagent-delta")
         .option("link", a["delta_link"])
         .option("checkpointLocation", f"{work}/ckpt-to-delta")
         .option("transformer", "lastagent.examples:enrich")
         .option("deadLetterTopic", a["dead_topic"])
         .option("sideTopics", a["side_topic"])
         .option("kafka.bootstrap.servers", b)
         .trigger(availableNow=True)
         .start(a["table"]), "kafka -> lastagent-delta")
    # The table is read by Spark's Delta source below (its rows end up in out_topic) and by delta-rs in the test.
    _run(spark.readStream.format("delta").load(a["table"])
         .selectExpr("key", "value")
         .writeStream.format("lastagent-kafka")
         .option("link", a["kafka_link"])
         .option("topic", a["out_topic"])
         .option("arbitrationTable", a["arbitration"])
         .option("checkpointLocation", f"{work}/ckpt-to-kafka")
         .option("kafka.bootstrap.servers", b)
         .trigger(availableNow=True)
         .start(), "delta -> lastagent-kafka")

    # A transformer whose module the Connect server cannot import: our error, at query start.
    def with_transformer(spec: str, name: str) -> Any:
        return _run(_kafka_stream(spark, b, a["topic"]).selectExpr("CAST(key AS STRING) AS key", "value")
                    .writeStream.format("lastagent-delta").option("link", f"{a['delta_link']}-{name}")
                    .option("checkpointLocation", f"{work}/ckpt-{name}").option("transformer", spec)
                    .option("kafka.bootstrap.servers", b).trigger(availableNow=True).start(f"{work}/{name}"), name)

    out["missing_transformer"] = _error(lambda: with_transformer("connect_no_such_rules:clean", "missing-transformer"))
    # The Connect way to bring client code: the module shipped to the session as an artifact.
    rules = Path(work) / "connect_rules.py"
    rules.write_text("import pyarrow as pa\n\n\ndef tag(batch):\n"
                     "    return batch.append_column('tagged', pa.array([1] * batch.num_rows, pa.int64()))\n")
    spark.addArtifacts(str(rules), pyfile=True)
    out["artifact_transformer"] = _error(lambda: with_transformer("connect_rules:tag", "artifact-transformer"))
    if out["artifact_transformer"] is None:
        out["artifact_table"] = _rows(spark.read.format("delta").load(f"{work}/artifact-transformer"), ["key", "tagged"])
    return out


def relay(spark: SparkSession, a: dict[str, Any]) -> dict[str, Any]:
    """lastagent-kafka → lastagent-kafka in small epochs, to its end (the recovery test kills the server meanwhile)."""
    b = a["bootstrap"]
    query = (_kafka_stream(spark, b, a["topic"], maxOffsetsPerTrigger=str(a["per_trigger"]))
             .selectExpr("key", "value")
             .writeStream.format("lastagent-kafka")
             .option("link", a["link"])
             .option("topic", a["out_topic"])
             .option("arbitrationTable", a["arbitration"])
             .option("checkpointLocation", a["checkpoint"])
             .option("kafka.bootstrap.servers", b)
             .trigger(availableNow=True)
             .start())
    _run(query, "relay")
    return {"batches": len(query.recentProgress)}


def merge(spark: SparkSession, a: dict[str, Any]) -> dict[str, Any]:
    """foreachBatch with ``lastagent.epoch`` on the server: events to Kafka and an SQL MERGE into a table with an
    identity column and liquid clustering, three epochs; then the last epoch replayed by a second run."""
    b, table, link, events = a["bootstrap"], a["table"], a["link"], a["events"]
    spark.sql(f"CREATE TABLE delta.`{table}` (sk BIGINT GENERATED ALWAYS AS IDENTITY, id BIGINT, amount BIGINT) "
              "USING delta CLUSTER BY (id)")

    def apply(batch: Any, epoch_id: int) -> None:  # runs in the server's foreachBatch process
        import lastagent

        with lastagent.epoch(batch, epoch_id, link=link, table=table, **{"kafka.bootstrap.servers": b}) as e:
            e.to_kafka(batch.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value"),
                       topic=events)
            batch.createOrReplaceTempView(f"changes_{link.replace('-', '_')}")
            batch.sparkSession.sql(
                f"MERGE INTO delta.`{table}` t USING (SELECT id, max(amount) AS amount FROM "
                f"changes_{link.replace('-', '_')} GROUP BY id) s ON t.id = s.id "
                "WHEN MATCHED THEN UPDATE SET amount = s.amount "
                "WHEN NOT MATCHED THEN INSERT (id, amount) VALUES (s.id, s.amount)")

    def run(what: str) -> Any:
        return _run(_kafka_stream(spark, b, a["topic"], maxOffsetsPerTrigger=str(a["per_trigger"]))
                    .selectExpr("CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
                                "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount")
                    .writeStream.foreachBatch(apply).option("checkpointLocation", a["checkpoint"])
                    .trigger(availableNow=True).start(), what)

    first = run("foreachBatch with lastagent.epoch")
    # Spark replays the last epoch when its commit-log entry is missing (a driver lost after the MERGE).
    commits = Path(a["checkpoint"]) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    for name in (str(last), f".{last}.crc"):
        (commits / name).unlink(missing_ok=True)
    second = run("the same query again, replaying its last epoch")
    return {"batches": len(first.recentProgress), "replayed": len(second.recentProgress), "replayed_epoch": last}


def merge_beside(spark: SparkSession, a: dict[str, Any]) -> dict[str, Any]:
    """A lastagent.epoch query started while the same client session runs another query (a rate stream into
    noop): the block's settings would be on the session both queries write through, so it refuses by name."""
    import lastagent

    b, table, link, events = a["bootstrap"], a["table"], a["link"], a["events"]
    spark.sql(f"CREATE TABLE delta.`{table}` (id BIGINT, amount BIGINT) USING delta")
    other = spark.readStream.format("rate").load().writeStream.format("noop").queryName("beside").start()

    def apply(batch: Any, epoch_id: int) -> None:  # runs in the server's foreachBatch process
        with lastagent.epoch(batch, epoch_id, link=link, table=table, **{"kafka.bootstrap.servers": b}) as e:
            e.to_kafka(batch.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value"),
                       topic=events)
            batch.write.format("delta").mode("append").save(table)

    try:
        query = (_kafka_stream(spark, b, a["topic"])
                 .selectExpr("CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
                             "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount")
                 .writeStream.foreachBatch(apply).option("checkpointLocation", a["checkpoint"])
                 .trigger(availableNow=True).start())
        return {"error": _error(lambda: _run(query, "lastagent.epoch beside another query"))}
    finally:
        other.stop()


SCENARIOS = {"source": source, "sinks": sinks, "relay": relay, "merge": merge, "merge_beside": merge_beside}


def main(argv: list[str]) -> int:
    scenario, args = SCENARIOS[argv[1]], json.loads(argv[2])
    started = time.monotonic()
    spark = SparkSession.builder.remote(args["url"]).getOrCreate()
    try:
        result = scenario(spark, args)
    except Exception:  # the test shows the traceback
        traceback.print_exc()
        return 1
    finally:
        with contextlib.suppress(Exception):  # the server may be gone (the recovery test kills it)
            spark.stop()
    result["seconds"] = round(time.monotonic() - started, 1)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
