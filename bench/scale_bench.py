"""Per-epoch time against the number of tasks: each lastagent sink beside Spark's own, in one run (issue 44).

For each P in BENCH_SCALE_P (default ``1 4 16 48``): a topic of P partitions holding BENCH_SCALE_ROWS (200) records
of 100 bytes per partition per epoch, read by Spark's `kafka` source with ``maxOffsetsPerTrigger`` = P x 200 under
``Trigger.AvailableNow``, so each epoch is P tasks of about 200 records; the same input written by Spark's `kafka`
sink and by `lastagent-kafka` (P branches per epoch), by Spark's `delta` sink and by `lastagent-delta`, and by
``ceiling-sink`` (bench/ceiling_bench.py: a Python data source sink that only counts its rows, what any Python sink
costs a task on this Spark). BENCH_SCALE_SOURCE=lastagent-kafka reads with lastagent's source instead. Each
epoch's time is the query progress's ``triggerExecution``; the first BENCH_SCALE_WARMUP (2) epochs of a query are
left out. Prints JSON: per sink and P, the median and p90 epoch milliseconds and p90/p50; per pair and P, the
ratio of medians; and per sink the slope (ms per extra task, least squares over P).

BENCH_SCALE_SINKS chooses the sinks (default the five above).

Run with `make bench` (or `cd bench && python scale_bench.py` with a broker up: `make kafka-up`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import uuid

from ceiling_bench import CeilingSink
from common import BOOTSTRAP, new_topic
from confluent_kafka import Producer
from kafka.admin import KafkaAdminClient

from lastagent.spark_session import local_session

TASKS = [int(p) for p in os.environ.get("BENCH_SCALE_P", "1 4 16 48").split()]
ROWS = int(os.environ.get("BENCH_SCALE_ROWS", "200"))
EPOCHS = int(os.environ.get("BENCH_SCALE_EPOCHS", "12"))
WARMUP = int(os.environ.get("BENCH_SCALE_WARMUP", "2"))
SOURCE = os.environ.get("BENCH_SCALE_SOURCE", "kafka")
SINKS = tuple(os.environ.get("BENCH_SCALE_SINKS", "kafka lastagent-kafka delta lastagent-delta ceiling-sink").split())
PAIRS = tuple((a, b) for a, b in (("lastagent-kafka", "kafka"), ("lastagent-delta", "delta"),
                                  ("ceiling-sink", "kafka")) if a in SINKS and b in SINKS)


def _source(admin: KafkaAdminClient, partitions: int) -> str:
    """A topic of ``partitions`` partitions with (WARMUP + EPOCHS) x ROWS records in each."""
    topic = new_topic(admin, partitions)
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 20})
    value = os.urandom(100)
    for partition in range(partitions):
        for i in range((WARMUP + EPOCHS) * ROWS):
            producer.produce(topic, value=value, key=str(i).encode(), partition=partition)
            if i % 10_000 == 0:
                producer.poll(0)
        producer.flush(120)  # many partitions' records together outgrow the client's local queue
    assert producer.flush(120) == 0
    return topic


def _epochs_ms(spark, topic: str, partitions: int, sink: str, work: str, admin: KafkaAdminClient) -> list[float]:
    """The epochs' trigger times (ms) of one AvailableNow query from ``topic`` into ``sink``, warm-up left out."""
    name = f"scale-{partitions}-{sink}-{uuid.uuid4().hex[:6]}"
    df = (spark.readStream.format(SOURCE).option("kafka.bootstrap.servers", BOOTSTRAP).option("subscribe", topic)
          .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", str(partitions * ROWS)).load())
    if sink == "ceiling-sink":
        writer = df.selectExpr("key", "value").writeStream.format(sink)
    elif sink.endswith("kafka"):
        writer = (df.selectExpr("key", "value").writeStream.format(sink)
                  .option("kafka.bootstrap.servers", BOOTSTRAP).option("topic", new_topic(admin, partitions)))
        if sink == "lastagent-kafka":
            writer = writer.option("link", name).option("arbitrationTable", f"{work}/arb-{name}")
    else:
        writer = df.selectExpr("CAST(key AS STRING) AS k", "value", "partition", "offset").writeStream.format(sink)
        if sink == "lastagent-delta":
            writer = writer.option("link", name)
    writer = writer.option("checkpointLocation", f"{work}/ckpt-{name}").trigger(availableNow=True)
    query = writer.start(f"{work}/table-{name}") if sink.endswith("delta") else writer.start()
    query.awaitTermination()
    assert query.exception() is None, query.exception()
    times = [float(p["durationMs"]["triggerExecution"]) for p in query.recentProgress if p["numInputRows"]]
    return times[WARMUP:]


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    p50 = statistics.median(ordered)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"epochs": len(ordered), "p50_ms": round(p50, 1), "p90_ms": round(p90, 1),
            "p90_over_p50": round(p90 / p50, 2)}


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares milliseconds per extra task."""
    xs, ys = [p for p, _ in points], [t for _, t in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("bench-scale", extra_conf={"spark.sql.shuffle.partitions": "2"})
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(CeilingSink)
    results: dict[str, dict[str, dict[str, float]]] = {sink: {} for sink in SINKS}
    with tempfile.TemporaryDirectory() as work:
        for partitions in TASKS:
            topic = _source(admin, partitions)
            for sink in SINKS:
                results[sink][str(partitions)] = _summary(_epochs_ms(spark, topic, partitions, sink, work, admin))
    out: dict[str, object] = {"source": SOURCE, "records_per_task": ROWS, "epochs": EPOCHS, "sinks": results}
    out["ratio_p50"] = {f"{a} / {b}": {p: round(results[a][p]["p50_ms"] / results[b][p]["p50_ms"], 2)
                                       for p in results[a]} for a, b in PAIRS}
    if len(TASKS) > 1:
        out["slope_ms_per_task"] = {sink: round(_slope([(int(p), r["p50_ms"]) for p, r in results[sink].items()]), 1)
                                    for sink in SINKS}
    json.dump(out, sys.stdout, indent=2)
    print()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
