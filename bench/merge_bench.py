"""A CDC epoch in foreachBatch: events to Kafka and a MERGE into Delta, as users build it today and with lastagent.epoch.

Both variants in one run, on the same input (issue 45): BENCH_MERGE_EPOCHS (8) epochs after BENCH_MERGE_WARMUP (2),
each BENCH_MERGE_ROWS (2,000) change records over 4 partitions, read by Spark's `kafka` source under
``Trigger.AvailableNow``. Per epoch the batch function sends one event per change to a topic and MERGEs the newest
amount per key (500 keys) into a Delta table:

* ``user``: Databricks' guidance today: the MERGE under ``txnAppId`` / ``txnVersion`` (a replayed MERGE is
  skipped), the events with Spark's own batch `kafka` writer (at-least-once: lost or doubled when the driver dies);
* ``lastagent``: ``lastagent.epoch``: the events into prepared Kafka transactions, the MERGE as the decision.

Each epoch's time is the query progress's ``triggerExecution``. Prints JSON: per variant the median and p90 epoch
milliseconds, and the ratio of medians. BENCH_MERGE_ORDER sets which variant runs first. Run with
`cd bench && python merge_bench.py` with a broker up (`make kafka-up`).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import uuid

from common import BOOTSTRAP, new_topic
from confluent_kafka import Producer
from kafka.admin import KafkaAdminClient

from lastagent.spark_session import local_session

EPOCHS = int(os.environ.get("BENCH_MERGE_EPOCHS", "8"))
WARMUP = int(os.environ.get("BENCH_MERGE_WARMUP", "2"))
ROWS = int(os.environ.get("BENCH_MERGE_ROWS", "2000"))
KEYS, PARTITIONS = 500, 4
#: The order the variants run in (the later one finds the JVM warmer): BENCH_MERGE_ORDER="lastagent user" reverses it.
ORDER = tuple(os.environ.get("BENCH_MERGE_ORDER", "user lastagent").split())


def _changes(admin: KafkaAdminClient) -> str:
    topic = new_topic(admin, PARTITIONS)
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 20})
    for i in range((WARMUP + EPOCHS) * ROWS):
        producer.produce(topic, key=str(i % KEYS).encode(), value=json.dumps({"id": i % KEYS, "amount": i}).encode(),
                         partition=i % PARTITIONS)
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(120) == 0
    return topic


def _run(spark, variant: str, source: str, events: str, work: str) -> list[float]:
    from delta.tables import DeltaTable

    import lastagent

    table = f"{work}/{variant}-table"
    spark.sql(f"CREATE TABLE delta.`{table}` (id BIGINT, amount BIGINT) USING delta")
    link = f"bench-{variant}-{uuid.uuid4().hex[:6]}"

    def merge(batch) -> None:
        latest = batch.groupBy("id").agg({"amount": "max"}).withColumnRenamed("max(amount)", "amount")
        (DeltaTable.forPath(spark, table).alias("t").merge(latest.alias("s"), "t.id = s.id")
         .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute())

    def events_of(batch):
        return batch.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value")

    def user(batch, epoch_id: int) -> None:
        events_of(batch).write.format("kafka").option("kafka.bootstrap.servers", BOOTSTRAP) \
            .option("topic", events).save()
        spark.conf.set("spark.databricks.delta.write.txnAppId", link)
        spark.conf.set("spark.databricks.delta.write.txnVersion", str(epoch_id))
        try:
            merge(batch)
        finally:
            spark.conf.unset("spark.databricks.delta.write.txnAppId")
            spark.conf.unset("spark.databricks.delta.write.txnVersion")

    def with_lastagent(batch, epoch_id: int) -> None:
        with lastagent.epoch(batch, epoch_id, link=link, table=table, **{"kafka.bootstrap.servers": BOOTSTRAP}) as e:
            e.to_kafka(events_of(batch), topic=events)
            merge(batch)

    query = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", BOOTSTRAP).option("subscribe", source)
             .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", str(ROWS)).load()
             .selectExpr("CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
                         "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount")
             .writeStream.foreachBatch(user if variant == "user" else with_lastagent)
             .option("checkpointLocation", f"{work}/{variant}-ckpt").trigger(availableNow=True).start())
    query.awaitTermination()
    times = [p["durationMs"]["triggerExecution"] for p in query.recentProgress if p["numInputRows"] > 0]
    return [float(t) for t in times[WARMUP:]]


def main() -> None:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("lastagent-merge-bench")
    spark.sparkContext.setLogLevel("ERROR")
    source = _changes(admin)
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as work:
        for variant in ORDER:
            ms = _run(spark, variant, source, new_topic(admin, PARTITIONS), work)
            out[variant] = {"epochs": len(ms), "p50_ms": statistics.median(ms),
                            "p90_ms": sorted(ms)[int(0.9 * (len(ms) - 1))]}
    out["ratio"] = {"lastagent_over_user_p50": out["lastagent"]["p50_ms"] / out["user"]["p50_ms"]}
    print(json.dumps({"rows_per_epoch": ROWS, "keys": KEYS, "partitions": PARTITIONS, **out}, indent=2))
    admin.close()


if __name__ == "__main__":
    main()
