# Databricks notebook source
# MAGIC %md
# MAGIC # Duplicates and order from an at-least-once producer: reliable groups
# MAGIC
# MAGIC A producer that retries a send writes the same message twice, and an exactly-once pipeline commits
# MAGIC both copies faithfully. `lastagent.reliable_groups` removes them at the receiver with WS-Reliability's
# MAGIC group rules: each message carries a group id and a sequence number in Kafka headers; per group the
# MAGIC step keeps the numbers it has accepted as intervals, delivers each message once (ordered groups in
# MAGIC order) and ends groups and forgets them by the rules t1–t5. Refused messages go to the dead letters
# MAGIC with the rule. Details: `docs/reliable_groups.md`.
# MAGIC
# MAGIC Install the `lastagent` wheel on the cluster, or in the notebook with `%pip install lastagent`.

# COMMAND ----------

# MAGIC %pip install lastagent

# COMMAND ----------

import lastagent  # noqa: E402

lastagent.register(spark)  # noqa: F821 — the notebook's SparkSession

# COMMAND ----------

dbutils.widgets.text("bootstrap", "127.0.0.1:39092")  # noqa: F821 — notebook globals
dbutils.widgets.text("base", "/tmp/lastagent-notebook")  # noqa: F821
dbutils.widgets.text("topic", "orders")  # noqa: F821
dbutils.widgets.text("send_examples", "true")  # noqa: F821
BOOTSTRAP = dbutils.widgets.get("bootstrap")  # noqa: F821
BASE = dbutils.widgets.get("base")  # noqa: F821
TOPIC = dbutils.widgets.get("topic")  # noqa: F821
SEND = dbutils.widgets.get("send_examples").lower() == "true"  # noqa: F821
LINK = f"{TOPIC}-groups-to-delta"
TABLE, REFUSED = f"{BASE}/tables/{TOPIC}-once", f"{BASE}/tables/{TOPIC}-refused"

# COMMAND ----------

from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
if TOPIC not in admin.list_topics(timeout=30).topics:
    for topic, created in admin.create_topics([NewTopic(TOPIC, 2, 1)]).items():
        created.result(30)
        print(f"created topic {topic}")

# COMMAND ----------

# MAGIC %md
# MAGIC ## What the producer sends
# MAGIC
# MAGIC Headers named as the specification's fields, values as UTF-8 text: `GroupId`; `SequenceNumber` (0, 1,
# MAGIC ...; none for a singleton); `Status` (`end` on the last); `ExpiryTime` (ms since the epoch, or ISO-8601
# MAGIC with a zone); `GroupMaxIdleDuration` (`PT1H`) or `GroupExpiryTime`; `Ordered` (`true`). A retry
# MAGIC re-sends the same headers.
# MAGIC
# MAGIC The next cell plays an at-least-once producer: group `order-A` in any order, `order-B` in order but
# MAGIC sent shuffled, a singleton, each with one message sent twice; and a message with both termination
# MAGIC parameters, which the rules refuse (`INVALID_GROUP_PARAMETER`). Run the notebook again: every
# MAGIC message is then a retry, and nothing new reaches the table.

# COMMAND ----------

import time  # noqa: E402

from confluent_kafka import Producer  # noqa: E402


def send(producer, group, seq, status=None, **more):
    headers = [("GroupId", group), ("ExpiryTime", str(int(time.time() * 1000) + 24 * 3600 * 1000))]
    headers += [("SequenceNumber", str(seq))] if seq is not None else []
    headers += [("Status", status)] if status else []
    headers += [(k, str(v)) for k, v in more.items()]
    producer.produce(TOPIC, key=group.encode(), value=f"{group}/{'-' if seq is None else seq}".encode(),
                     headers=headers)


if SEND:
    producer = Producer({"bootstrap.servers": BOOTSTRAP})
    for seq in (0, 2, 1, 2, 3):  # 2 is a retry
        send(producer, "order-A", seq, "end" if seq == 3 else None, GroupMaxIdleDuration="PT1H")
    for seq in (2, 0, 3, 1, 0):  # held until the gap fills; 0 is a retry
        send(producer, "order-B", seq, "end" if seq == 3 else None, Ordered="true")
    send(producer, "receipt-7", None)
    send(producer, "receipt-7", None)  # a retry of the singleton
    send(producer, "order-C", 0, GroupMaxIdleDuration="PT1H", GroupExpiryTime="2099-01-01T00:00:00Z")
    assert producer.flush(30) == 0
    print(f"sent 13 messages to {TOPIC}")

# COMMAND ----------

# MAGIC %md
# MAGIC ## The query
# MAGIC
# MAGIC The step keeps its state in Spark's state store, which must be RocksDB. `availableNow` reads what
# MAGIC the topic holds and stops. The time rules (idle, expiry) run on the micro-batches' time, which moves
# MAGIC as messages arrive.

# COMMAND ----------

spark.conf.set("spark.sql.streaming.stateStore.providerClass",  # noqa: F821
               "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
orders = (
    spark.readStream.format("lastagent-kafka")  # noqa: F821
    .option("kafka.bootstrap.servers", BOOTSTRAP)
    .option("subscribe", TOPIC)
    .option("startingOffsets", "earliest")
    .option("includeHeaders", "true")                      # the group fields are headers
    .load()
    .selectExpr("CAST(key AS STRING) AS key", "CAST(value AS STRING) AS value", "headers", "partition",
                "offset", "timestamp")
)
query = (
    lastagent.reliable_groups(orders, default_max_idle="1 day")
    .writeStream.format("lastagent-delta")
    .option("link", LINK)
    .option("checkpointLocation", f"{BASE}/checkpoints/{LINK}")  # the groups' state lives here too
    .option("deadLetterTable", REFUSED)                    # refusals, with the rule as the reason
    .trigger(availableNow=True)
    .start(TABLE)
)
query.awaitTermination()
counts = {k: 0 for k in ("delivered", "duplicate", "refused", "terminated", "removed")}
for progress in query.recentProgress:                    # the step's counts, per micro-batch
    batch = progress.observedMetrics.get("lastagent_reliable_groups")
    for k, v in (batch.asDict() if batch is not None else {}).items():
        counts[k] += v
print(f"this run: {counts['delivered']} delivered, {counts['duplicate']} duplicates dropped, "
      f"{counts['refused']} refused, {counts['terminated']} groups terminated")

# COMMAND ----------

from delta.tables import DeltaTable  # noqa: E402

if DeltaTable.isDeltaTable(spark, TABLE):  # noqa: F821
    display(spark.read.format("delta").load(TABLE).select("key", "value", "partition", "offset")  # noqa: F821
            .orderBy("key", "value"))
else:
    print(f"no table at {TABLE} yet: {TOPIC} had no messages. Set send_examples to true, or produce some "
          "with the headers above, and run the query cell again.")
if DeltaTable.isDeltaTable(spark, REFUSED):  # noqa: F821
    display(spark.read.format("delta").load(REFUSED)  # noqa: F821
            .selectExpr("CAST(value AS STRING) AS value", "reason", "exception"))
else:
    print("no refused messages yet")
