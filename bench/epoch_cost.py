"""What an epoch costs: many small micro-batches through `lastagent-kafka` and Spark's built-in `kafka`
sink, in one run, plus what the link leaves behind (transactional ids on the broker, claims in the
arbitration table).

Kafka (2 partitions, BENCH_EPOCHS x 2 records) -> Spark's `kafka` source with maxOffsetsPerTrigger=2,
`trigger(availableNow=True)`: BENCH_EPOCHS epochs of two tasks, one record each, so the time is the
per-epoch machinery (start, tasks, decision, phase 2), not the data. Prints JSON: seconds per epoch
for each sink (median of BENCH_REPEAT runs after one warm-up), the ratio, the link's transactional
ids held by the broker and the `SET TBLPROPERTIES` commits in its arbitration table.

Run with `make bench` (or `cd bench && python epoch_cost.py` with a broker up: `make kafka-up`).
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

from lastagent.kafka.xa import KafkaXAResource
from lastagent.spark_session import local_session

EPOCHS = int(os.environ.get("BENCH_EPOCHS", "100"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))


def _source(admin: KafkaAdminClient) -> str:
    topic = new_topic(admin, 2)
    p = Producer({"bootstrap.servers": BOOTSTRAP})
    for i in range(2 * EPOCHS):
        p.produce(topic, value=str(i).encode(), key=str(i).encode(), partition=i % 2)
    assert p.flush(60) == 0
    return topic


def _run(spark, source: str, sink: str, work: str, admin: KafkaAdminClient) -> dict[str, float]:
    target = new_topic(admin, 2)
    link = f"bench-ep-{uuid.uuid4().hex[:6]}"
    df = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", BOOTSTRAP).option("subscribe", source)
          .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", "2").load()
          .selectExpr("key", "value"))
    w = (df.writeStream.format(sink).option("kafka.bootstrap.servers", BOOTSTRAP).option("topic", target)
         .option("checkpointLocation", f"{work}/ckpt-{link}").trigger(availableNow=True))
    if sink == "lastagent-kafka":
        w = w.option("link", link).option("arbitrationTable", f"{work}/arb-{link}")
    start = time.perf_counter()
    q = w.start()
    q.awaitTermination()
    seconds = time.perf_counter() - start
    out: dict[str, float] = {"s_per_epoch": seconds / EPOCHS}
    if sink == "lastagent-kafka":
        with KafkaXAResource({"bootstrap.servers": BOOTSTRAP}) as xa:
            out["transactional_ids"] = len(xa.transactional_ids(f"lastagent-{link}-"))
        history = spark.sql(f"DESCRIBE HISTORY delta.`{work}/arb-{link}`").select("operation").collect()
        out["claims"] = sum(r.operation == "SET TBLPROPERTIES" for r in history)
    return out


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("bench-epoch-cost")
    source = _source(admin)
    runs: dict[str, list[dict[str, float]]] = {"kafka": [], "lastagent-kafka": []}
    with tempfile.TemporaryDirectory() as work:
        for i in range(REPEAT + 1):
            for sink, results in runs.items():
                result = _run(spark, source, sink, work, admin)
                if i:  # the first round warms up
                    results.append(result)
    summary: dict[str, object] = {"epochs": EPOCHS}
    for sink, rs in runs.items():
        summary[sink] = {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
    summary["ratio_s_per_epoch"] = round(summary["lastagent-kafka"]["s_per_epoch"]  # type: ignore[index]
                                         / summary["kafka"]["s_per_epoch"], 2)  # type: ignore[index]
    json.dump(summary, sys.stdout, indent=2)
    print()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
