"""Benchmark: the `lastagent-kafka` source vs Spark's built-in `kafka` source vs a raw consumer.

All three read the same topic in the same run on the same broker:
* raw confluent-kafka consumer (read_committed) — the limit;
* Spark's built-in `kafka` source → noop sink, trigger availableNow;
* `lastagent-kafka` → noop sink, trigger availableNow.
Then the peak RSS of the Python worker while one task reads one large partition.

Run with `make bench` (or `python bench/source_bench.py`). Sizes via env:
BENCH_ROWS (default 2,000,000 rows of 100-byte values over 2 partitions), BENCH_MEM_MB
(default 1024: the single partition read for the memory figure), BENCH_REPEAT (default 3).
Prints a JSON summary and a markdown section for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid

from common import BOOTSTRAP, PeakRss, fill_topic
from confluent_kafka import Consumer, TopicPartition
from kafka.admin import KafkaAdminClient

from lastagent.spark_session import local_session

ROWS = int(os.environ.get("BENCH_ROWS", "2000000"))
MEM_MB = int(os.environ.get("BENCH_MEM_MB", "1024"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))
BACKOFF_1S = "lastagent-kafka, fetch.queue.backoff.ms=1000"


def raw_consumer(topic: str, partitions: int, rows: int) -> float:
    consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": uuid.uuid4().hex,
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "fetch.max.bytes": 52_428_800, "queued.max.messages.kbytes": 262_144})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    start = time.perf_counter()
    seen = 0
    while seen < rows:
        for msg in consumer.consume(10_000, 1.0):
            if msg.error() is None:
                seen += 1
    elapsed = time.perf_counter() - start
    consumer.close()
    return rows / elapsed


def spark_read(spark, fmt: str, topic: str, rows: int, extra: dict[str, str] | None = None,
               trigger_rates: list[float] | None = None) -> float:
    """Rows/s from query start to its end (wall clock). ``trigger_rates`` gets the rate inside the
    query's micro-batches (rows over Spark's triggerExecution time), which leaves out query start:
    for a Python data source that includes starting the driver's Python source process."""
    ckpt = f"/tmp/lastagent-bench/ckpt-{uuid.uuid4().hex}"
    reader = (spark.readStream.format(fmt).option("kafka.bootstrap.servers", BOOTSTRAP)
              .option("subscribe", topic).option("startingOffsets", "earliest"))
    for k, v in (extra or {}).items():
        reader = reader.option(k, v)
    start = time.perf_counter()
    query = (reader.load().writeStream.format("noop").option("checkpointLocation", ckpt)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    elapsed = time.perf_counter() - start
    progress = query.recentProgress
    read = sum(int(p["numInputRows"]) for p in progress)
    if read != rows:
        raise SystemExit(f"{fmt} read {read} rows, expected {rows}")
    if trigger_rates is not None:
        trigger_rates.append(rows / (sum(int(p["durationMs"]["triggerExecution"]) for p in progress) / 1000))
    return rows / elapsed


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("lastagent-bench")
    spark.sparkContext.setLogLevel("ERROR")
    topic = fill_topic(admin, 2, ROWS, 100)
    results: dict[str, list[float]] = {"raw": [], "kafka": [], "lastagent-kafka": [], BACKOFF_1S: []}
    in_trigger: dict[str, list[float]] = {"kafka": [], "lastagent-kafka": [], BACKOFF_1S: []}
    # Warm-up: JIT, Python workers, consumers.
    spark_read(spark, "kafka", topic, ROWS)
    spark_read(spark, "lastagent-kafka", topic, ROWS)
    for _ in range(REPEAT):
        results["raw"].append(raw_consumer(topic, 2, ROWS))
        results["kafka"].append(spark_read(spark, "kafka", topic, ROWS, trigger_rates=in_trigger["kafka"]))
        results["lastagent-kafka"].append(spark_read(spark, "lastagent-kafka", topic, ROWS,
                                                     trigger_rates=in_trigger["lastagent-kafka"]))
        # The same source with librdkafka's own fetch backoff (1 s once the client's queue is full):
        # what the task consumers' 10 ms default is worth.
        results[BACKOFF_1S].append(spark_read(spark, "lastagent-kafka", topic, ROWS,
                                              {"kafka.fetch.queue.backoff.ms": "1000"}, in_trigger[BACKOFF_1S]))
    med = {k: statistics.median(v) for k, v in results.items()}
    med_trigger = {k: statistics.median(v) for k, v in in_trigger.items()}

    # Memory: one task reads one partition of MEM_MB (1 KiB values).
    # Baseline: the same read of 1,000 rows (pyspark's worker, pandas, Arrow, clients).
    small = fill_topic(admin, 1, 1000, 1024)
    with PeakRss() as base:
        spark_read(spark, "lastagent-kafka", small, 1000)
    mem_rows = MEM_MB * 1024
    big = fill_topic(admin, 1, mem_rows, 1024)
    with PeakRss() as rss:
        spark_read(spark, "lastagent-kafka", big, mem_rows)
    summary = {
        "rows": ROWS, "value_bytes": 100, "partitions": 2, "repeat": REPEAT,
        "rows_per_s_median": {k: round(v) for k, v in med.items()},
        "ratio_vs_builtin": round(med["lastagent-kafka"] / med["kafka"], 2),
        "ratio_vs_raw": round(med["lastagent-kafka"] / med["raw"], 2),
        "builtin_vs_raw": round(med["kafka"] / med["raw"], 2),
        "in_trigger_rows_per_s_median": {k: round(v) for k, v in med_trigger.items()},
        "in_trigger_ratio_vs_builtin": round(med_trigger["lastagent-kafka"] / med_trigger["kafka"], 2),
        "backoff_1s_ratio_vs_builtin": round(med[BACKOFF_1S] / med["kafka"], 2),
        "backoff_1s_in_trigger_ratio_vs_builtin": round(med_trigger[BACKOFF_1S] / med_trigger["kafka"], 2),
        "memory_partition_mb": MEM_MB,
        "python_worker_peak_rss_mb": round(rss.peak_kb / 1024, 1),
        "python_worker_baseline_rss_mb_1000_rows": round(base.peak_kb / 1024, 1),
    }
    print(json.dumps(summary, indent=2))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
