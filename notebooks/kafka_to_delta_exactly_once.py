# Databricks notebook source
# MAGIC %md
# MAGIC # Kafka → Delta, exactly once, with dead letters and follow-up messages
# MAGIC
# MAGIC `lastagent-kafka` reads the topic (`read_committed`); `lastagent-delta` writes the table. Each
# MAGIC micro-batch is one atomic epoch: the table's Delta commit (the *last agent*) decides it, and the
# MAGIC dead-letter and side-topic records, written into open Kafka transactions by the tasks, are
# MAGIC committed after it — or not at all. Recover by restarting the query; inspect a link with
# MAGIC `lastagent status --link <topic>-to-delta --table <table path> --bootstrap-servers <servers>`.
# MAGIC
# MAGIC Install the `lastagent` wheel on the cluster, or in the notebook with `%pip install lastagent` (next
# MAGIC cell): it does not bring its own pyspark, so the runtime's Spark stays. Spark 4 finds the formats by
# MAGIC itself; the cell after it registers them where a runtime does not (harmless where it does).

# COMMAND ----------

# MAGIC %pip install lastagent

# COMMAND ----------

import lastagent  # noqa: E402

lastagent.register(spark)  # noqa: F821 — the notebook's SparkSession

# COMMAND ----------

dbutils.widgets.text("bootstrap", "127.0.0.1:39092")  # noqa: F821 — notebook globals
dbutils.widgets.text("base", "/tmp/lastagent-notebook")  # noqa: F821
dbutils.widgets.text("topic", "payments")  # noqa: F821
BOOTSTRAP = dbutils.widgets.get("bootstrap")  # noqa: F821
BASE = dbutils.widgets.get("base")  # noqa: F821
TOPIC = dbutils.widgets.get("topic")  # noqa: F821
DEAD_LETTERS, RECEIPTS, LINK = f"{TOPIC}-dead-letters", f"{TOPIC}-receipts", f"{TOPIC}-to-delta"
TABLE = f"{BASE}/tables/{TOPIC}"

# COMMAND ----------

# MAGIC %md
# MAGIC The sink checks at query start that its dead-letter and side topics exist (a transactional producer
# MAGIC would otherwise wait for them). On a shared cluster your administrators create topics; on a
# MAGIC development broker this cell creates the three topics if they are missing.

# COMMAND ----------

from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
missing = [t for t in (TOPIC, DEAD_LETTERS, RECEIPTS) if t not in admin.list_topics(timeout=30).topics]
if missing:
    for topic, created in admin.create_topics([NewTopic(t, 2, 1) for t in missing]).items():
        created.result(30)
        print(f"created topic {topic}")

# COMMAND ----------

# MAGIC %md
# MAGIC A transformer is any importable `module:function` taking and returning a `pyarrow.RecordBatch`.
# MAGIC It runs on executors; a record it rejects goes to the dead letters with the exception text.
# MAGIC The example `lastagent.examples:enrich` adds an `amount` column to `order-<t>-<i>` values.
# MAGIC `availableNow` reads what the topic holds now and stops; run the cell again after producing more.

# COMMAND ----------

query = (
    spark.readStream.format("lastagent-kafka")  # noqa: F821 — the notebook's SparkSession
    .option("kafka.bootstrap.servers", BOOTSTRAP)
    .option("subscribe", TOPIC)
    .option("startingOffsets", "earliest")
    .option("maxOffsetsPerTrigger", "10000")
    .load()
    .selectExpr("CAST(key AS STRING) AS key", "value", "topic", "partition", "offset")
    .writeStream.format("lastagent-delta")
    .option("link", LINK)                                   # stable: recovery finds the link by it
    .option("checkpointLocation", f"{BASE}/checkpoints/{LINK}")
    .option("transformer", "lastagent.examples:enrich")
    .option("deadLetterTopic", DEAD_LETTERS)                # then deadLetterTable, if set
    .option("sideTopics", RECEIPTS)                         # every delivered row, as JSON
    .option("kafka.bootstrap.servers", BOOTSTRAP)
    .trigger(availableNow=True)
    .start(TABLE)
)
query.awaitTermination()
read = sum(p["numInputRows"] for p in query.recentProgress)
print(f"this run read {read} records from {TOPIC} in {len(query.recentProgress)} epochs")

# COMMAND ----------

# MAGIC %md
# MAGIC Spark's own Delta reader reads the table; each epoch's commit carries its arbitration record.
# MAGIC Until a first epoch commits (an empty topic) there is no table yet.

# COMMAND ----------

from delta.tables import DeltaTable  # noqa: E402

if DeltaTable.isDeltaTable(spark, TABLE):  # noqa: F821
    display(spark.read.format("delta").load(TABLE).groupBy("partition").count())  # noqa: F821
    display(  # noqa: F821
        spark.sql(f"DESCRIBE HISTORY delta.`{TABLE}`")  # noqa: F821
        .selectExpr("version", "operation", "operationParameters", "userMetadata")
    )
else:
    print(f"no table at {TABLE} yet: {TOPIC} had no records. Produce some (values like order-1-1) and run "
          "the query cell again.")

# COMMAND ----------

# MAGIC %md
# MAGIC The link's state — decided epochs, branches in doubt, hazards — from a cell, as `lastagent status`
# MAGIC prints it in a terminal (exit status 0: nothing in doubt).

# COMMAND ----------

from lastagent.cli import main as lastagent_command  # noqa: E402

if DeltaTable.isDeltaTable(spark, TABLE):  # noqa: F821
    status = lastagent_command(["status", "--link", LINK, "--table", TABLE, "--bootstrap-servers", BOOTSTRAP])
    print(f"lastagent status: exit {status}")
else:
    print(f"link {LINK}: nothing decided yet (no table at {TABLE})")

# COMMAND ----------

# MAGIC %md
# MAGIC How the run went, epoch by epoch: the lag the source saw (`maxOffsetsBehindLatest`, offsets between
# MAGIC the epoch's end and the topic's newest) and how long each epoch's commit took (the Delta decision
# MAGIC plus phase 2, from the figures each decision records; the newest epoch's arrive with the next
# MAGIC epoch). On Databricks pick a line chart in the table below; elsewhere matplotlib draws it when it is
# MAGIC installed. `docs/operations.md` lists every figure and how to alert on them.

# COMMAND ----------

from lastagent.cli import link_status  # noqa: E402
from lastagent.core.figures import run_figures  # noqa: E402

if DeltaTable.isDeltaTable(spark, TABLE):  # noqa: F821
    doc = link_status(LINK, BOOTSTRAP, table=TABLE, epochs=len(query.recentProgress) + 1)
    rows = run_figures(query.recentProgress, doc["epochs"])
    columns = "epoch LONG, input_rows LONG, max_offsets_behind LONG, commit_ms LONG, add_batch_ms LONG"
    display(spark.createDataFrame(rows, columns))  # noqa: F821
    print(f"run figures: {len(rows)} epochs with records")
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
        print("matplotlib is not installed here: chart the table above instead")
    if plt is not None and rows:
        def column(i):  # an unknown figure is a gap in the line
            return [float("nan") if r[i] is None else r[i] for r in rows]

        fig, (lag_ax, ms_ax) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
        lag_ax.plot(column(0), column(2), marker="o")
        lag_ax.set_ylabel("max offsets behind latest")
        ms_ax.plot(column(0), column(3), marker="o", label="decide + phase 2")
        ms_ax.plot(column(0), column(4), marker=".", label="Spark addBatch")
        ms_ax.set_ylabel("ms")
        ms_ax.set_xlabel("epoch")
        ms_ax.legend()
        plt.show()
else:
    print(f"link {LINK}: no epochs to chart yet")
