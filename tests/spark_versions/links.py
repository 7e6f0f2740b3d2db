"""The three formats on one Spark minor, as a user runs them: run by tests/spark_versions with the Python of a fresh
virtualenv that has one pyspark and the installed lastagent wheel, from a directory outside the repository.

    python links.py PHASE WORKDIR

PHASE is one of:

- ``links``: Kafka -> ``lastagent-kafka`` -> ``lastagent-delta`` (with a side topic) and Kafka -> ``lastagent-kafka``
  -> ``lastagent-kafka``, both with ``maxOffsetsPerTrigger``, on a processing-time trigger. Prints one line
  ``progress <query> <json>`` per batch; the test SIGKILLs this process mid-run, then runs ``resume``.
- ``resume``: the same two queries from the same checkpoints, until both have read every record; then prints
  ``envmaps <json>`` (the formats' Spark environment maps as ``lastagent.register`` filled them, and whether the
  queries' starts left them unchanged) and ``done``. The test reads the outputs with its own readers.
- ``admission``: ``Trigger.AvailableNow`` with and without ``maxOffsetsPerTrigger`` (noop sink), and
  ``minOffsetsPerTrigger`` / ``maxTriggerDelay`` on a processing-time trigger; prints what each did.
- ``connect``: a Spark Connect client of the server at CONNECT_URL (this virtualenv's Spark, started by the test):
  Kafka -> ``lastagent-kafka`` -> ``lastagent-kafka`` (CONNECT_OUT_TOPIC) and -> ``lastagent-delta``, AvailableNow.
- ``epoch``: ``lastagent.epoch`` in foreachBatch, with this minor's Delta (DELTA_JARS: ``delta-spark_<minor>_2.13``
  and what it needs, resolved by the test): every record of TOPIC as an event to EPOCH_TOPIC and an SQL MERGE into
  a Delta table made by SQL, one AvailableNow run. Prints ``epoch <json>`` (batches, the table's path) and ``done``.

Settings come from the environment (BOOTSTRAP, TOPIC, SIDE_TOPIC, OUT_TOPIC, ROWS, CAP, LATE_TOPIC, CONNECT_URL,
CONNECT_OUT_TOPIC, EPOCH_TOPIC, DELTA_JARS). Standard library, pyspark and lastagent only: this runs where
the repository is not.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import time

from pyspark.sql import SparkSession

PHASE, WORK = sys.argv[1], sys.argv[2]
ENV = os.environ
BOOT, ROWS, CAP = ENV["BOOTSTRAP"], int(ENV["ROWS"]), int(ENV["CAP"])
DEADLINE_S = 240


def session() -> SparkSession:
    if PHASE == "connect":
        return SparkSession.builder.remote(ENV["CONNECT_URL"]).getOrCreate()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (SparkSession.builder.master("local[2]").appName(f"spark-versions-{PHASE}")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.sql.shuffle.partitions", "2").config("spark.databricks.delta.snapshotPartitions", "2"))
    if PHASE == "epoch":  # Spark's own Delta writer is the block's last agent: this minor's build of Delta
        builder = (builder.config("spark.jars", ENV["DELTA_JARS"])
                   .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
                   .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog"))
    return builder.getOrCreate()


def source(spark: SparkSession, topic: str, **options: str):
    reader = (spark.readStream.format("lastagent-kafka").option("kafka.bootstrap.servers", BOOT)
              .option("subscribe", topic).option("startingOffsets", "earliest"))
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def links(spark: SparkSession) -> dict:
    """Starts both links; returns {name: query}."""
    cap = {"maxOffsetsPerTrigger": str(CAP)}
    delta = (source(spark, ENV["TOPIC"], **cap).selectExpr("CAST(value AS STRING) AS v", "partition", "offset")
             .writeStream.format("lastagent-delta").option("link", "versions-delta")
             .option("checkpointLocation", f"{WORK}/ckpt-delta").option("kafka.bootstrap.servers", BOOT)
             .option("sideTopics", ENV["SIDE_TOPIC"]).trigger(processingTime="500 milliseconds")
             .start(f"{WORK}/table"))
    kafka = (source(spark, ENV["TOPIC"], **cap).selectExpr("key", "value")
             .writeStream.format("lastagent-kafka").option("kafka.bootstrap.servers", BOOT)
             .option("topic", ENV["OUT_TOPIC"]).option("link", "versions-kafka")
             .option("arbitrationTable", f"{WORK}/arb").option("checkpointLocation", f"{WORK}/ckpt-kafka")
             .trigger(processingTime="500 milliseconds").start())
    return {"delta": delta, "kafka": kafka}


def read_to(progress: dict) -> int:
    """Records up to the batch's end offsets (every partition starts at offset 0)."""
    end = progress["sources"][0]["endOffset"]
    if isinstance(end, str):  # pyspark shows a Python source's offset as the dict's repr
        end = ast.literal_eval(end)
    return sum(int(o) for parts in (end or {}).values() for o in parts.values())


def watch(queries: dict, until_all_read: bool) -> None:
    """Prints each new batch's progress; returns once every query has read all ROWS (if asked)."""
    seen = {name: -1 for name in queries}
    read = {name: 0 for name in queries}
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        # Idle first, then print: a batch that ends between the two is printed before the loop can end.
        idle = {name: not q.status["isTriggerActive"] for name, q in queries.items()}
        for name, q in queries.items():
            if q.exception() is not None:
                raise SystemExit(f"query {name} failed: {q.exception()}")
            for p in q.recentProgress:
                if p["batchId"] > seen[name]:
                    seen[name] = p["batchId"]
                    read[name] = max(read[name], read_to(p))
                    print("progress", name, json.dumps({"batchId": p["batchId"], "rows": p["numInputRows"],
                                                        "readTo": read_to(p)}), flush=True)
        if until_all_read and all(read[name] >= ROWS and idle[name] for name in queries):
            return
        time.sleep(0.2)
    raise SystemExit(f"not every record read after {DEADLINE_S} s: {seen}")


def admission(spark: SparkSession) -> None:
    """Trigger.AvailableNow and minOffsetsPerTrigger on this Spark; prints one JSON line per case."""
    def available_now(name: str, **options: str) -> None:
        q = (source(spark, ENV["TOPIC"], **options).writeStream.format("noop")
             .option("checkpointLocation", f"{WORK}/ckpt-{name}").trigger(availableNow=True).start())
        q.awaitTermination(DEADLINE_S)
        assert not q.isActive and q.exception() is None, q.exception()
        batches = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
        print("admission", json.dumps({"case": name, "batches": batches}), flush=True)

    available_now("available-now")
    available_now("available-now-capped", maxOffsetsPerTrigger=str(CAP))

    # minOffsetsPerTrigger: the first trigger runs (nothing before it); afterwards fewer new records than the
    # minimum wait for maxTriggerDelay, then run.
    late = ENV["LATE_TOPIC"]
    q = (source(spark, late, minOffsetsPerTrigger="1000", maxTriggerDelay="10s").writeStream.format("noop")
         .option("checkpointLocation", f"{WORK}/ckpt-min").trigger(processingTime="200 milliseconds").start())
    deadline = time.monotonic() + DEADLINE_S
    while not [p for p in q.recentProgress if p["numInputRows"]] and time.monotonic() < deadline:
        time.sleep(0.2)
    first_at = time.monotonic()
    print("admission", json.dumps({"case": "min-first", "rows": sum(p["numInputRows"] for p in q.recentProgress)}),
          flush=True)
    print("produce-late", flush=True)  # the test produces a few more records now
    sys.stdin.readline()
    produced_at = time.monotonic()
    while sum(p["numInputRows"] for p in q.recentProgress) <= ROWS and time.monotonic() < deadline:
        time.sleep(0.1)
    waited = time.monotonic() - produced_at
    print("admission", json.dumps({"case": "min-late", "rows": sum(p["numInputRows"] for p in q.recentProgress),
                                   "waited_s": round(waited, 1), "since_first_s": round(time.monotonic() - first_at, 1)}),
          flush=True)
    q.stop()


def connect(spark: SparkSession) -> None:
    """Both sinks through a Connect client: the formats run in the server's Python, found there by discovery."""
    def run(query, name: str) -> None:
        query.awaitTermination(DEADLINE_S)
        assert not query.isActive and query.exception() is None, (name, query.exception())
        print("connect", json.dumps({"query": name, "rows": sum(p.get("numInputRows") or 0 for p in query.recentProgress)}),
              flush=True)

    run(source(spark, ENV["TOPIC"]).selectExpr("key", "value").writeStream.format("lastagent-kafka")
        .option("kafka.bootstrap.servers", BOOT).option("topic", ENV["CONNECT_OUT_TOPIC"])
        .option("link", "versions-connect-kafka").option("arbitrationTable", f"{WORK}/arb-connect")
        .option("checkpointLocation", f"{WORK}/ckpt-connect-kafka").trigger(availableNow=True).start(), "kafka")
    run(source(spark, ENV["TOPIC"]).selectExpr("CAST(value AS STRING) AS v").writeStream.format("lastagent-delta")
        .option("link", "versions-connect-delta").option("checkpointLocation", f"{WORK}/ckpt-connect-delta")
        .trigger(availableNow=True).start(f"{WORK}/table-connect"), "delta")


def epoch(spark: SparkSession) -> None:
    """Every record of TOPIC once as an event and once in a Delta table, decided together by lastagent.epoch."""
    import lastagent

    table, events, link = f"{WORK}/table-epoch", ENV["EPOCH_TOPIC"], "versions-epoch"
    spark.sql(f"CREATE TABLE delta.`{table}` (v STRING, n BIGINT) USING delta")

    def apply(batch, epoch_id: int) -> None:
        with lastagent.epoch(batch, epoch_id, link=link, table=table, **{"kafka.bootstrap.servers": BOOT}) as e:
            e.to_kafka(batch.selectExpr("v AS value"), topic=events)
            batch.createOrReplaceTempView("epoch_rows")
            batch.sparkSession.sql(f"MERGE INTO delta.`{table}` t USING epoch_rows s ON t.v = s.v "
                                   "WHEN MATCHED THEN UPDATE SET n = t.n + 1 WHEN NOT MATCHED THEN INSERT (v, n) VALUES (s.v, 1)")

    query = (source(spark, ENV["TOPIC"]).selectExpr("CAST(value AS STRING) AS v").writeStream.foreachBatch(apply)
             .option("checkpointLocation", f"{WORK}/ckpt-epoch").trigger(availableNow=True).start())
    query.awaitTermination(DEADLINE_S)
    assert not query.isActive and query.exception() is None, query.exception()
    print("epoch", json.dumps({"batches": len([p for p in query.recentProgress if p["numInputRows"]]),
                               "table": table}), flush=True)
    print("done", flush=True)


def main() -> None:
    import pyspark

    import lastagent

    assert lastagent.__file__.startswith(sys.prefix), lastagent.__file__
    print("pyspark", pyspark.__version__, flush=True)
    spark = session()
    if PHASE == "admission":
        admission(spark)
    elif PHASE == "connect":
        connect(spark)
    elif PHASE == "epoch":
        epoch(spark)
    else:
        from lastagent import worker_env

        # Two queries start at once here: register first, as docs/install.md says ("Several queries in one driver").
        lastagent.register(spark)
        maps = worker_env.env_maps(spark)
        filled = [dict(m) for m in maps]
        queries = links(spark)
        watch(queries, until_all_read=PHASE == "resume")
        for q in queries.values():
            q.stop()
        # What the sources' starts added to the maps the tasks carry: nothing, when register filled them in.
        print("envmaps", json.dumps({"filled": filled, "unchanged": [dict(m) for m in maps] == filled}), flush=True)
        print("done", flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
