"""A CDC pipeline in foreachBatch with its driver SIGKILLed: events lost or sent twice, today's way and lastagent's.

The issue-45 measurement, side by side in one run: BENCH_KILLS_CHANGES (4,000) change records (500 keys, 4
partitions), each pipeline a driver process of its own (Spark's `kafka` source or lastagent's, 400 changes per
epoch, ``Trigger.AvailableNow``) killed with SIGKILL BENCH_KILLS (5) times at a random moment (seeded:
BENCH_KILLS_SEED) and restarted from its checkpoint, then run to the end. Per epoch each MERGEs the newest amount per
key into a Delta table under ``txnAppId`` / ``txnVersion`` (a replayed MERGE is skipped) and publishes events:

* ``events-first``: one event per change with Spark's batch `kafka` writer, then the MERGE (what most pipelines do);
* ``cdf-after``: the MERGE, then one event per row it changed, read from the table's change data feed (the MERGE's
  own version; nothing when Delta skipped it);
* ``lastagent``: ``lastagent.epoch`` (``lastagent.examples.merge_changes``): events into prepared transactions, the
  MERGE as the decision.

Checked for each: the table against the last change per key, and the events a read_committed consumer reads
against what should have been published once (every change; for ``cdf-after`` every row of the table's change data
feed). Prints JSON. Run on its own: `cd bench && python merge_kills.py` with a broker up (`make kafka-up`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from typing import Any

CHANGES = int(os.environ.get("BENCH_KILLS_CHANGES", "4000"))
KILLS = int(os.environ.get("BENCH_KILLS", "5"))
SEED = int(os.environ.get("BENCH_KILLS_SEED", "45"))
KEYS, PARTITIONS, PER_TRIGGER = 500, 4, "400"
VARIANTS = ("events-first", "cdf-after", "lastagent")
#: A run of a driver before it is killed: long enough for the JVM to start and some epochs to run.
KILL_AFTER_S = (8.0, 20.0)


def _driver(variant: str, bootstrap: str, source: str, events: str, table: str, checkpoint: str, link: str) -> None:
    """One run of a pipeline, to the end of the source (killed before, mostly). A process of its own."""
    from lastagent.spark_session import local_session

    spark = local_session(f"merge-kills-{variant}")
    spark.sparkContext.setLogLevel("ERROR")
    cdf = "TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')" if variant == "cdf-after" else ""
    spark.sql(f"CREATE TABLE IF NOT EXISTS delta.`{table}` (id BIGINT, amount BIGINT) USING delta {cdf}")
    if variant == "lastagent":
        from lastagent.examples import merge_changes

        merge_changes(spark, bootstrap, source, events, table, checkpoint, link, PER_TRIGGER).awaitTermination()
        return
    from delta.tables import DeltaTable

    def merge(batch: Any, epoch_id: int) -> None:
        spark.conf.set("spark.databricks.delta.write.txnAppId", link)
        spark.conf.set("spark.databricks.delta.write.txnVersion", str(epoch_id))
        try:
            latest = batch.groupBy("id").agg({"amount": "max"}).withColumnRenamed("max(amount)", "amount")
            (DeltaTable.forPath(spark, table).alias("t").merge(latest.alias("s"), "t.id = s.id")
             .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute())
        finally:
            spark.conf.unset("spark.databricks.delta.write.txnAppId")
            spark.conf.unset("spark.databricks.delta.write.txnVersion")

    def send(df: Any) -> None:
        df.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value").write.format("kafka") \
            .option("kafka.bootstrap.servers", bootstrap).option("topic", events).save()

    def events_first(batch: Any, epoch_id: int) -> None:
        send(batch)
        merge(batch, epoch_id)

    def cdf_after(batch: Any, epoch_id: int) -> None:
        before = DeltaTable.forPath(spark, table).history(1).collect()[0].version
        merge(batch, epoch_id)
        after = DeltaTable.forPath(spark, table).history(1).collect()[0].version
        if after > before:  # Delta skipped a replayed MERGE: nothing new to publish
            send(spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", after)
                 .option("endingVersion", after).load(table).where("_change_type != 'update_preimage'"))

    (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", source)
     .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", PER_TRIGGER).load()
     .selectExpr("CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
                 "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount")
     .writeStream.foreachBatch(events_first if variant == "events-first" else cdf_after)
     .option("checkpointLocation", checkpoint).trigger(availableNow=True).start().awaitTermination())


def _run(variant: str, args: list[str], work: str, kill_after_s: float | None) -> int:
    """A driver run; SIGKILLed (its process group: the JVM too) after ``kill_after_s`` unless it ends first."""
    with open(f"{work}/{variant}.log", "a") as log:
        proc = subprocess.Popen([sys.executable, __file__, "driver", variant, *args], stdout=log, stderr=log,
                                start_new_session=True)
        try:
            return proc.wait(kill_after_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(60)


def _read_committed(bootstrap: str, topic: str) -> list[dict[str, int]]:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"kills-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    out, quiet_until = [], time.monotonic() + 5
    while time.monotonic() < quiet_until:
        for m in consumer.consume(1000, 0.5):
            if m.error() is None:
                out.append(json.loads(m.value()))
                quiet_until = time.monotonic() + 5
    consumer.close()
    return out


def main() -> None:
    from common import BOOTSTRAP, new_topic
    from confluent_kafka import Producer
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    source = new_topic(admin, PARTITIONS)
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 20})
    for i in range(CHANGES):
        producer.produce(source, key=str(i % KEYS).encode(), value=json.dumps({"id": i % KEYS, "amount": i}).encode(),
                         partition=i % PARTITIONS)
    assert producer.flush(120) == 0
    oracle = {k: max(i for i in range(k, CHANGES, KEYS)) for k in range(KEYS)}
    rng = random.Random(SEED)
    kills = [rng.uniform(*KILL_AFTER_S) for _ in range(KILLS)]  # the same moments for every pipeline
    out: dict[str, Any] = {"changes": CHANGES, "kills": KILLS, "kill_after_s": [round(k, 1) for k in kills]}
    with tempfile.TemporaryDirectory() as work:
        for variant in VARIANTS:
            events = new_topic(admin, PARTITIONS)
            args = [BOOTSTRAP, source, events, f"{work}/{variant}-table", f"{work}/{variant}-ckpt",
                    f"kills-{variant}-{uuid.uuid4().hex[:6]}"]
            killed = sum(1 for k in kills if _run(variant, args, work, k) == -signal.SIGKILL)
            code = _run(variant, args, work, None)
            if code != 0:
                raise SystemExit(f"{variant}: the last run failed (exit {code}); see {work}/{variant}.log")
            out[variant] = _verify(variant, args, oracle, killed)
    print(json.dumps(out, indent=2))
    admin.close()


def _verify(variant: str, args: list[str], oracle: dict[int, int], killed: int) -> dict[str, Any]:
    from deltalake import DeltaTable

    bootstrap, _, events, table = args[:4]
    rows = DeltaTable(table).to_pyarrow_table().to_pylist()
    sent = Counter((e["id"], e["amount"]) for e in _read_committed(bootstrap, events))
    if variant == "cdf-after":  # every row the MERGEs changed, once: the table's own change data feed
        import pyarrow as pa

        feed = pa.table(DeltaTable(table).load_cdf(starting_version=0).read_all()).to_pylist()
        due = Counter((r["id"], r["amount"]) for r in feed if r["_change_type"] != "update_preimage")
    else:
        due = Counter((i % KEYS, i) for i in range(CHANGES))
    return {"killed": killed, "table_matches": {r["id"]: r["amount"] for r in rows} == oracle,
            "events_due": sum(due.values()), "events_read": sum(sent.values()),
            "never_sent": sum(1 for e in due if e not in sent), "sent_twice": sum(1 for e, n in sent.items() if n > 1)}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "driver":
        _driver(*sys.argv[2:])
    else:
        main()
