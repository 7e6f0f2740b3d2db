"""A CDC epoch in foreachBatch: a MERGE into Delta, alone, with events as users send them today, and with lastagent.epoch.

Three variants in one run, interleaved epoch by epoch (issue 45): each variant has its own running query (Spark's
`kafka` source, a 1 s processing-time trigger: the idle queries poll seldom), source topic, events topic and Delta
table; in each round every variant in turn gets BENCH_MERGE_ROWS (2,000) change records over 4 partitions, the same
records for each, and the round waits for that variant's epoch before the next one starts, so the variants share
the JVM's warm-up and the machine's drift. The order rotates every round. BENCH_MERGE_EPOCHS (8) rounds are
measured after BENCH_MERGE_WARMUP (2). Per epoch the batch function MERGEs the newest amount per key (500 keys):

* ``merge``: the issue's baseline: the MERGE under ``txnAppId`` / ``txnVersion`` (a replayed MERGE is skipped), no
  Kafka output;
* ``user``: Databricks' guidance today with events: the same MERGE, and one event per change with Spark's own batch
  `kafka` writer (at-least-once: lost or doubled when the driver dies);
* ``lastagent``: ``lastagent.epoch``: the events into prepared Kafka transactions, the MERGE as the decision, then
  phase 2.

Each epoch's time is the query progress's ``triggerExecution``. Prints JSON: per variant the median and p90 epoch
milliseconds, and the ratios of medians. Run with `cd bench && python merge_bench.py` with a broker up
(`make kafka-up`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid

from common import BOOTSTRAP, new_topic
from confluent_kafka import Producer
from kafka.admin import KafkaAdminClient

from lastagent.spark_session import local_session

EPOCHS = int(os.environ.get("BENCH_MERGE_EPOCHS", "8"))
WARMUP = int(os.environ.get("BENCH_MERGE_WARMUP", "2"))
ROWS = int(os.environ.get("BENCH_MERGE_ROWS", "2000"))
KEYS, PARTITIONS = 500, 4
VARIANTS = ("merge", "user", "lastagent")
#: How long one epoch may take before the benchmark gives up.
EPOCH_TIMEOUT_S = 300


def _produce(producer: Producer, topic: str, round_no: int) -> None:
    for j in range(ROWS):
        i = round_no * ROWS + j
        producer.produce(topic, key=str(i % KEYS).encode(), value=json.dumps({"id": i % KEYS, "amount": i}).encode(),
                         partition=i % PARTITIONS)
    assert producer.flush(120) == 0


def _start(spark, variant: str, source: str, events: str, work: str):
    from delta.tables import DeltaTable

    import lastagent

    table = f"{work}/{variant}-table"
    spark.sql(f"CREATE TABLE delta.`{table}` (id BIGINT, amount BIGINT) USING delta")
    link = f"bench-{variant}-{uuid.uuid4().hex[:6]}"

    def merge(batch) -> None:
        latest = batch.groupBy("id").agg({"amount": "max"}).withColumnRenamed("max(amount)", "amount")
        (DeltaTable.forPath(batch.sparkSession, table).alias("t").merge(latest.alias("s"), "t.id = s.id")
         .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute())

    def events_of(batch):
        return batch.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value")

    def idempotent_merge(batch, epoch_id: int) -> None:
        session = batch.sparkSession  # the query's own session, as lastagent.epoch sets it
        session.conf.set("spark.databricks.delta.write.txnAppId", link)
        session.conf.set("spark.databricks.delta.write.txnVersion", str(epoch_id))
        try:
            merge(batch)
        finally:
            session.conf.unset("spark.databricks.delta.write.txnAppId")
            session.conf.unset("spark.databricks.delta.write.txnVersion")

    def user(batch, epoch_id: int) -> None:
        events_of(batch).write.format("kafka").option("kafka.bootstrap.servers", BOOTSTRAP) \
            .option("topic", events).save()
        idempotent_merge(batch, epoch_id)

    def with_lastagent(batch, epoch_id: int) -> None:
        with lastagent.epoch(batch, epoch_id, link=link, table=table, **{"kafka.bootstrap.servers": BOOTSTRAP}) as e:
            e.to_kafka(events_of(batch), topic=events)
            merge(batch)

    body = {"merge": idempotent_merge, "user": user, "lastagent": with_lastagent}[variant]
    return (spark.readStream.format("kafka").option("kafka.bootstrap.servers", BOOTSTRAP).option("subscribe", source)
            .option("startingOffsets", "earliest").load()
            .selectExpr("CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
                        "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount")
            .writeStream.foreachBatch(body).option("checkpointLocation", f"{work}/{variant}-ckpt")
            .trigger(processingTime="1 second").start())


def _batches_with_rows(query) -> dict[int, dict]:
    return {p["batchId"]: p for p in query.recentProgress if p["numInputRows"] > 0}


def _read_through(query) -> int:
    """How many records the query has read in all: its newest batch's end offsets, summed.

    (Not the batches' ``numInputRows``: in foreachBatch Spark counts the source rows once per action on the batch.)
    """
    done = _batches_with_rows(query)
    if not done:
        return 0
    end = done[max(done)]["sources"][0]["endOffset"]
    offsets = json.loads(end) if isinstance(end, str) else end
    return sum(int(o) for partitions in offsets.values() for o in partitions.values())


def _round(query, seen: set[int], expected_rows: int) -> float:
    """Waits until the query has read ``expected_rows`` in all; the milliseconds of the batches new since ``seen``."""
    deadline = time.monotonic() + EPOCH_TIMEOUT_S
    while _read_through(query) < expected_rows:
        if query.exception() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"an epoch did not finish within {EPOCH_TIMEOUT_S} s: {query.exception()}")
        time.sleep(0.05)
    new = {b: p for b, p in _batches_with_rows(query).items() if b not in seen}
    seen.update(new)
    if os.environ.get("BENCH_MERGE_DEBUG"):
        print("round", expected_rows, {b: (p["numInputRows"], p["durationMs"]["triggerExecution"]) for b, p in new.items()},
              file=sys.stderr, flush=True)
    # Spark's source may split one round's records over two batches: the round's time is theirs together.
    return float(sum(p["durationMs"]["triggerExecution"] for p in new.values()))


def main() -> None:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("lastagent-merge-bench")
    spark.sparkContext.setLogLevel("ERROR")
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 20})
    sources = {v: new_topic(admin, PARTITIONS) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    seen: dict[str, set[int]] = {v: set() for v in VARIANTS}
    with tempfile.TemporaryDirectory() as work:
        queries = {v: _start(spark, v, sources[v], new_topic(admin, PARTITIONS), work) for v in VARIANTS}
        try:
            for round_no in range(WARMUP + EPOCHS):
                shift = round_no % len(VARIANTS)
                for v in VARIANTS[shift:] + VARIANTS[:shift]:
                    _produce(producer, sources[v], round_no)
                    ms = _round(queries[v], seen[v], (round_no + 1) * ROWS)
                    if round_no >= WARMUP:
                        times[v].append(ms)
        finally:
            for q in queries.values():
                q.stop()
    out: dict[str, dict[str, float]] = {
        v: {"epochs": len(ms), "p50_ms": statistics.median(ms), "p90_ms": sorted(ms)[int(0.9 * (len(ms) - 1))]}
        for v, ms in times.items()}
    p50 = {v: out[v]["p50_ms"] for v in VARIANTS}
    out["ratio"] = {"lastagent_over_merge_p50": p50["lastagent"] / p50["merge"],
                    "lastagent_over_user_p50": p50["lastagent"] / p50["user"],
                    "user_over_merge_p50": p50["user"] / p50["merge"]}
    print(json.dumps({"rows_per_epoch": ROWS, "keys": KEYS, "partitions": PARTITIONS, **out}, indent=2))
    admin.close()


if __name__ == "__main__":
    main()
