# Databricks notebook source
# MAGIC %md
# MAGIC # Kafka → Delta, exactly once, with dead letters and follow-up messages
# MAGIC
# MAGIC `lastagent-kafka` reads the topic (`read_committed`); `lastagent-delta` writes the table. Each
# MAGIC micro-batch is one atomic epoch: the table's Delta commit (the *last agent*) decides it, and the
# MAGIC dead-letter and side-topic records, written into open Kafka transactions by the tasks, are
# MAGIC committed after it — or not at all. Recover by restarting the query; inspect a link with
# MAGIC `lastagent status --link payments-to-delta --table <table path> --bootstrap-servers <servers>`.
# MAGIC
# MAGIC Install the `lastagent` wheel on the cluster, or in the notebook with `%pip install lastagent`: it
# MAGIC does not bring its own pyspark, so the runtime's Spark stays. Spark 4 finds the formats by itself;
# MAGIC the next cell registers them where a runtime does not (harmless where it does).

# COMMAND ----------

import lastagent  # noqa: E402

lastagent.register(spark)  # noqa: F821 — the notebook's SparkSession

# COMMAND ----------

dbutils.widgets.text("bootstrap", "127.0.0.1:39092")  # noqa: F821 — notebook globals
dbutils.widgets.text("base", "/tmp/lastagent-notebook")  # noqa: F821
BOOTSTRAP = dbutils.widgets.get("bootstrap")  # noqa: F821
BASE = dbutils.widgets.get("base")  # noqa: F821

# COMMAND ----------

# MAGIC %md
# MAGIC A transformer is any importable `module:function` taking and returning a `pyarrow.RecordBatch`.
# MAGIC It runs on executors; a record it rejects goes to the dead letters with the exception text.
# MAGIC The example `lastagent.examples:enrich` adds an `amount` column to `order-<t>-<i>` values.

# COMMAND ----------

query = (
    spark.readStream.format("lastagent-kafka")  # noqa: F821 — the notebook's SparkSession
    .option("kafka.bootstrap.servers", BOOTSTRAP)
    .option("subscribe", "payments")
    .option("startingOffsets", "earliest")
    .option("maxOffsetsPerTrigger", "10000")
    .load()
    .selectExpr("CAST(key AS STRING) AS key", "value", "topic", "partition", "offset")
    .writeStream.format("lastagent-delta")
    .option("link", "payments-to-delta")                     # stable: recovery finds the link by it
    .option("checkpointLocation", f"{BASE}/checkpoints/payments-to-delta")
    .option("transformer", "lastagent.examples:enrich")
    .option("deadLetterTopic", "payments-dead-letters")      # then deadLetterTable, if set
    .option("sideTopics", "receipts")                        # every delivered row, as JSON
    .option("kafka.bootstrap.servers", BOOTSTRAP)
    .trigger(availableNow=True)
    .start(f"{BASE}/tables/payments")
)
query.awaitTermination()

# COMMAND ----------

# MAGIC %md
# MAGIC Spark's own Delta reader reads the table; each epoch's commit carries its arbitration record.

# COMMAND ----------

display(spark.read.format("delta").load(f"{BASE}/tables/payments").groupBy("partition").count())  # noqa: F821
display(  # noqa: F821
    spark.sql(f"DESCRIBE HISTORY delta.`{BASE}/tables/payments`")  # noqa: F821
    .selectExpr("version", "operation", "operationParameters", "userMetadata")
)

# COMMAND ----------

# MAGIC %md
# MAGIC The link's state — decided epochs, branches in doubt, hazards — from a cell, as `lastagent status`
# MAGIC prints it in a terminal (exit status 0: nothing in doubt).

# COMMAND ----------

from lastagent.cli import main as lastagent_command  # noqa: E402

lastagent_command(["status", "--link", "payments-to-delta", "--table", f"{BASE}/tables/payments",
                   "--bootstrap-servers", BOOTSTRAP])
