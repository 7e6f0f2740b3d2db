"""A driver process for crash tests: Delta table (deterministic rows) → lastagent-kafka.

Run as ``python sink_driver.py BOOTSTRAP SOURCE_TABLE CHECKPOINT ARBITRATION LINK TOPIC``; the
crash point comes from ``LASTAGENT_CRASH_AT`` in the environment. Exits 0 once every source
file is processed (trigger availableNow); a crash kills its whole process group.
"""

from __future__ import annotations

import sys

from lastagent.spark_session import local_session


def main(bootstrap: str, source: str, checkpoint: str, arbitration: str, link: str, topic: str) -> int:
    spark = local_session("lastagent-chaos")
    spark.sparkContext.setLogLevel("ERROR")
    query = (
        spark.readStream.format("delta").option("maxFilesPerTrigger", "1").load(source)
        .selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
        .writeStream.format("lastagent-kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("topic", topic)
        .option("link", link)
        .option("arbitrationTable", arbitration)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:7]))
