# Databricks notebook source
# MAGIC %md
# MAGIC # Change data from Kafka MERGEd into Delta, with events out, as one exactly-once epoch
# MAGIC
# MAGIC The pipeline most Kafka → Delta users run: Debezium-style change records (`op` c/u/d, the row `after`
# MAGIC the change, `ts_ms`) applied with `MERGE` inside `foreachBatch`, and one event per applied change
# MAGIC published for the services downstream ("order 7 is now shipped"). Delta's `txnAppId`/`txnVersion`
# MAGIC make the `MERGE` idempotent, but not the events: a batch replayed after its `MERGE` committed is
# MAGIC skipped by Delta and its events are lost; one that dies after sending sends them again.
# MAGIC
# MAGIC Wrapping the batch body in `lastagent.epoch` makes the two one step. The events go into Kafka
# MAGIC transactions that are prepared, not yet visible; Spark's own `MERGE` commit is the decision (it carries
# MAGIC the epoch's record); the transactions are committed after it, or rolled back if the body fails. A
# MAGIC replayed epoch finds its record: Delta skips the `MERGE`, the events are finished from the record.
# MAGIC
# MAGIC This notebook runs the query, makes it die right after one epoch's `MERGE` committed (the worst
# MAGIC moment: the table has the epoch, its events are still open), restarts it, and checks the table and
# MAGIC the events. Install the wheel with `%pip install lastagent` (next cell); see `docs/foreach_batch.md`.

# COMMAND ----------

# MAGIC %pip install lastagent

# COMMAND ----------

import lastagent  # noqa: E402

lastagent.register(spark)  # noqa: F821 — the notebook's SparkSession

# COMMAND ----------

dbutils.widgets.text("bootstrap", "127.0.0.1:39092")  # noqa: F821 — notebook globals
dbutils.widgets.text("base", "/tmp/lastagent-notebook")  # noqa: F821
dbutils.widgets.text("topic", "orders-cdc")  # noqa: F821
dbutils.widgets.text("send_examples", "true")  # noqa: F821
dbutils.widgets.text("die_after_merge_of_epoch", "1")  # noqa: F821
BOOTSTRAP = dbutils.widgets.get("bootstrap")  # noqa: F821
BASE = dbutils.widgets.get("base")  # noqa: F821
TOPIC = dbutils.widgets.get("topic")  # noqa: F821
SEND = dbutils.widgets.get("send_examples").lower() == "true"  # noqa: F821
DIE_AT = int(dbutils.widgets.get("die_after_merge_of_epoch"))  # noqa: F821
EVENTS, DEAD_LETTERS, LINK = f"{TOPIC}-events", f"{TOPIC}-dead-letters", f"{TOPIC}-merge"
TABLE, CHECKPOINT = f"{BASE}/tables/{TOPIC}", f"{BASE}/checkpoints/{TOPIC}-merge"
KAFKA = {"kafka.bootstrap.servers": BOOTSTRAP}

# COMMAND ----------

# MAGIC %md
# MAGIC The change topic, the events topic and a dead-letter topic (on a shared cluster your administrators create
# MAGIC them), and, with `send_examples`, 43 changes to 12 orders: each created, paid and shipped, a quarter of them
# MAGIC deleted, 4 changes sent twice (a connector that restarts sends again what it was not sure of), and one
# MAGIC record that is no change at all.

# COMMAND ----------

import json  # noqa: E402

from confluent_kafka import Producer  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
missing = [t for t in (TOPIC, EVENTS, DEAD_LETTERS) if t not in admin.list_topics(timeout=30).topics]
if missing:
    for topic, created in admin.create_topics([NewTopic(t, 2, 1) for t in missing]).items():
        created.result(30)
        print(f"created topic {topic}")


def example_changes():
    """(order id, Debezium-style change) in the order a connector would send them."""
    changes, ts = [], 1_700_000_000_000
    for step, status in enumerate(["created", "paid", "shipped"]):
        for order in range(12):
            ts += 1
            changes.append((order, {"op": "c" if step == 0 else "u", "after": {"id": order, "status": status},
                                    "ts_ms": ts}))
            if step == 1 and order % 3 == 0:  # sent twice
                changes.append(changes[-1])
    for order in range(0, 12, 4):
        ts += 1
        changes.append((order, {"op": "d", "before": {"id": order}, "after": None, "ts_ms": ts}))
    return changes


if SEND:
    producer = Producer({"bootstrap.servers": BOOTSTRAP})
    sent = example_changes()
    for order, change in sent:
        producer.produce(TOPIC, key=str(order).encode(), value=json.dumps(change).encode())
    producer.produce(TOPIC, key=b"?", value=b"order 5 shipped?")  # a poison record: no change record
    producer.flush(30)
    print(f"sent {len(sent)} changes and 1 poison record to {TOPIC}")

# COMMAND ----------

# MAGIC %md
# MAGIC The table: made with SQL, with the features new tables carry (an identity column for a surrogate key,
# MAGIC liquid clustering, deletion vectors). Spark's own writer makes every commit here, so every feature is
# MAGIC honoured.

# COMMAND ----------

spark.sql(f"CREATE TABLE IF NOT EXISTS delta.`{TABLE}` (sk BIGINT GENERATED ALWAYS AS IDENTITY, "  # noqa: F821
          "id BIGINT, status STRING, ts_ms BIGINT) USING delta CLUSTER BY (id) "
          "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")

# COMMAND ----------

# MAGIC %md
# MAGIC The batch body. The only lastagent line is the `with`: the events go to Kafka with `e.to_kafka` before
# MAGIC the `MERGE`, and the `MERGE` is the block's one Delta write. Duplicates and out-of-order changes are
# MAGIC the `MERGE`'s business as always: the newest change per order in the batch, applied only when newer
# MAGIC than the row's; an event goes out for each change newer than the row. A record that is no change goes
# MAGIC to the dead-letter topic with its reason in a header: a second `e.to_kafka`, so it is decided with the
# MAGIC epoch too (never dropped, never sent twice).

# COMMAND ----------

from delta.tables import DeltaTable  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.window import Window  # noqa: E402


def apply(batch, epoch_id):
    valid = "id IS NOT NULL AND op IN ('c', 'u', 'd') AND ts_ms IS NOT NULL"
    poison = batch.where(f"NOT coalesce({valid}, false)")
    changes = batch.where(valid).dropDuplicates(["id", "ts_ms"])
    table = DeltaTable.forPath(batch.sparkSession, TABLE)
    with lastagent.epoch(batch, epoch_id, link=LINK, table=TABLE, **KAFKA) as e:
        e.to_kafka(poison.selectExpr("key", "raw AS value", "array(named_struct('key', 'lastagent.dlq.reason', "
                                     "'value', CAST('not a change record' AS BINARY))) AS headers"),
                   topic=DEAD_LETTERS)
        current = table.toDF().select("id", F.col("ts_ms").alias("row_ts"))
        applied = changes.join(current, "id", "left").where("row_ts IS NULL OR ts_ms > row_ts")
        e.to_kafka(applied.selectExpr("CAST(id AS STRING) AS key",
                                      "to_json(named_struct('id', id, 'op', op, 'status', status, "
                                      "'ts_ms', ts_ms)) AS value"), topic=EVENTS)
        newest = (changes.withColumn("n", F.row_number().over(Window.partitionBy("id").orderBy(F.desc("ts_ms"))))
                  .where("n = 1").drop("n"))
        (table.alias("t").merge(newest.alias("s"), "t.id = s.id")
         .whenMatchedDelete("s.op = 'd' AND s.ts_ms > t.ts_ms")
         .whenMatchedUpdate("s.op != 'd' AND s.ts_ms > t.ts_ms", {"status": "s.status", "ts_ms": "s.ts_ms"})
         .whenNotMatchedInsert("s.op != 'd'", {"id": "s.id", "status": "s.status", "ts_ms": "s.ts_ms"})
         .execute())


def start():
    change = "STRUCT<op: STRING, after: STRUCT<id: BIGINT, status: STRING>, before: STRUCT<id: BIGINT>, ts_ms: BIGINT>"
    return (spark.readStream.format("lastagent-kafka").options(**KAFKA)  # noqa: F821
            .option("subscribe", TOPIC).option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", "16").load()
            .select("key", F.col("value").cast("string").alias("raw"),
                    F.from_json(F.col("value").cast("string"), change).alias("c"))
            .selectExpr("key", "raw", "coalesce(c.after.id, c.before.id) AS id", "c.op AS op",
                        "c.after.status AS status", "c.ts_ms AS ts_ms")
            .writeStream.foreachBatch(apply).option("checkpointLocation", CHECKPOINT)
            .trigger(availableNow=True).start())

# COMMAND ----------

# MAGIC %md
# MAGIC The first run, and the driver lost right after epoch `die_after_merge_of_epoch`'s `MERGE` committed.
# MAGIC A notebook cannot kill its own driver, so lastagent's crash-test hook stands in: it raises at that
# MAGIC point, which leaves what a killed driver leaves (the `MERGE` committed with the epoch's record, the
# MAGIC epoch's events prepared but not visible, the epoch missing from Spark's commit log). The crash tests
# MAGIC (`tests/chaos/test_merge_epoch_crash.py`) do it with SIGKILL at each point.

# COMMAND ----------

from lastagent import faults  # noqa: E402


class DriverLost(RuntimeError):
    pass


def die_after_merge(point):
    if point == "after_arbitration" and merged[-1] == DIE_AT:
        raise DriverLost(f"the driver was lost right after epoch {DIE_AT}'s MERGE")


merged = [-1]
apply_once = apply


def apply(batch, epoch_id):  # the same body, noting the epoch for the hook
    merged.append(epoch_id)
    apply_once(batch, epoch_id)


faults.install(die_after_merge)
try:
    first = start()
    first.awaitTermination()
    print(f"run 1 read {sum(p['numInputRows'] for p in first.recentProgress)} changes from {TOPIC} and ended")
except Exception as died:  # the query ends with the stand-in's error, as a lost driver's would
    print(f"run 1 stopped: {'the driver was lost' if 'DriverLost' in str(died) else str(died).splitlines()[0]}")
finally:
    faults.install(None)

# COMMAND ----------

# MAGIC %md
# MAGIC Between the runs: the table already has the epoch's `MERGE`, but a `read_committed` consumer (every
# MAGIC downstream service) does not see its events yet: they are in prepared transactions. `lastagent status`
# MAGIC (here from a cell) lists them and what recovery does with each: the `MERGE`'s record names them, so
# MAGIC they will be committed.

# COMMAND ----------

import uuid  # noqa: E402

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition  # noqa: E402


def committed(topic):
    """Every record a read_committed consumer (any service downstream) reads from topic, until 3 s pass quietly."""
    import time

    consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"nb-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    partitions = admin.list_topics(topic, timeout=30).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    out, quiet_until = [], time.monotonic() + 3
    while time.monotonic() < quiet_until:
        for message in consumer.consume(500, 0.5):
            if message.error() is None:
                out.append(message)
                quiet_until = time.monotonic() + 3
    consumer.close()
    return out


def committed_events():
    return [json.loads(m.value()) for m in committed(EVENTS)]


if DeltaTable.isDeltaTable(spark, TABLE):  # noqa: F821
    rows = spark.read.format("delta").load(TABLE).count()  # noqa: F821
    print(f"after run 1: the table holds {rows} orders; a read_committed consumer sees {len(committed_events())} "
          "events")
if len(merged) > 1:  # run 1 began an epoch
    from lastagent.cli import link_status

    doc = link_status(LINK, BOOTSTRAP, table=TABLE)
    decisions = sorted({b["decision"] for b in doc["in_doubt"]})
    print(f"lastagent status: {len(doc['in_doubt'])} branch(es) in doubt, of epoch(s) "
          f"{sorted({b['epoch'] for b in doc['in_doubt']})}; recovery will {' or '.join(decisions) or 'do nothing'}")

# COMMAND ----------

# MAGIC %md
# MAGIC The restart, as a user recovers: start the same query again. It finishes what the lost run decided
# MAGIC (the epoch's events are committed from the record its `MERGE` carries), Spark replays the epoch (Delta
# MAGIC skips its `MERGE`, nothing is sent again) and goes on to the end of the topic.

# COMMAND ----------

second = start()
second.awaitTermination()
print(f"run 2 read {sum(p['numInputRows'] for p in second.recentProgress)} changes from {TOPIC} "
      f"in {len(second.recentProgress)} epochs")

# COMMAND ----------

# MAGIC %md
# MAGIC The check: the table against the last change per order (read from the change topic itself), and the
# MAGIC events: each change once, none twice, none missing.

# COMMAND ----------

from collections import Counter  # noqa: E402


def all_changes():
    consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"nb-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    partitions = admin.list_topics(TOPIC, timeout=30).topics[TOPIC].partitions
    consumer.assign([TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in partitions])
    ends = {p: consumer.get_watermark_offsets(TopicPartition(TOPIC, p), timeout=30)[1] for p in partitions}
    out, done = [], {p for p, end in ends.items() if end == 0}
    while len(done) < len(partitions):
        for message in consumer.consume(500, 1.0):
            if message.error() is None:
                try:
                    out.append(json.loads(message.value()))
                except ValueError:
                    pass  # the poison record: in the dead-letter topic
                if message.offset() + 1 >= ends[message.partition()]:
                    done.add(message.partition())
    consumer.close()
    return out


changes = {((c["after"] or c["before"])["id"], c["ts_ms"]): c for c in all_changes()}  # duplicates once
last = {}
for (order, _ts), c in sorted(changes.items(), key=lambda kv: kv[0][1]):
    last[order] = c
expected = {order: c["after"]["status"] for order, c in last.items() if c["op"] != "d"}
if DeltaTable.isDeltaTable(spark, TABLE) and changes:  # noqa: F821
    table = {r.id: r.status for r in spark.read.format("delta").load(TABLE).collect()}  # noqa: F821
    events = Counter((e["id"], e["ts_ms"]) for e in committed_events())
    print(f"the table matches the last change per order: {table == expected} ({len(table)} orders)")
    print(f"events: {sum(events.values())} read, {len(events)} distinct changes of {len(changes)}, "
          f"sent twice: {sum(1 for n in events.values() if n > 1)}, missing: {len(set(changes) - set(events))}")
    dead = [(m.value(), dict(m.headers() or [])) for m in committed(DEAD_LETTERS)]
    print(f"dead letters: {len(dead)}: " + "; ".join(f"{v.decode(errors='replace')!r} "
                                                      f"({h.get('lastagent.dlq.reason', b'').decode()})"
                                                      for v, h in dead))
    display(spark.sql(f"DESCRIBE HISTORY delta.`{TABLE}`")  # noqa: F821
            .selectExpr("version", "operation", "userMetadata").orderBy("version"))
else:
    print(f"no changes in {TOPIC} yet: set send_examples to true, or produce Debezium-style changes, and run "
          "the query cells again.")
