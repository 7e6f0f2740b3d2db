"""Benchmark: the exactly-once `lastagent-kafka` sink vs Spark's built-in (at-least-once)
`kafka` sink vs a raw confluent-kafka producer, on the same rows in the same run; the
per-epoch commit overhead (decide + phase 2) at 1, 4 and 16 branches; and the peak RSS of
the Python worker while one task writes BENCH_MEM_MB.

Run with `make bench` (or `python bench/sink_bench.py`). Sizes via env: BENCH_ROWS (default
1,000,000 rows, 100-byte values, 2 partitions), BENCH_MEM_MB (default 1024), BENCH_REPEAT (3),
BENCH_EPOCHS (30 epochs per branch count for the overhead).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid

from common import BOOTSTRAP, PeakRss, new_topic
from confluent_kafka import Producer
from kafka.admin import KafkaAdminClient

from lastagent.kafka.branch import BranchWriter
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions
from lastagent.sinks.link_ports import link_committer
from lastagent.spark_session import local_session

ROWS = int(os.environ.get("BENCH_ROWS", "1000000"))
MEM_MB = int(os.environ.get("BENCH_MEM_MB", "1024"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))
EPOCHS = int(os.environ.get("BENCH_EPOCHS", "30"))
WORK = tempfile.mkdtemp(prefix="lastagent-bench-")


def source_table(spark, rows: int, value_size: int, partitions: int) -> str:
    path = os.path.join(WORK, f"src-{uuid.uuid4().hex[:6]}")
    (spark.range(rows, numPartitions=partitions)
     .selectExpr("CAST(id AS STRING) AS key", f"repeat('x', {value_size}) AS value")
     .write.format("delta").save(path))
    return path


def spark_write(spark, fmt: str, source: str, topic: str, rows: int, write_rates: list[float] | None = None) -> float:
    """Rows/s from query start to its end (wall clock). ``write_rates`` gets the rate of the sink's
    write: rows over Spark's addBatch time (the epoch's tasks, which also scan the Delta table, and
    the sink's commit), which leaves out query start and the Delta source's planning (latestOffset)."""
    ckpt = os.path.join(WORK, f"ckpt-{uuid.uuid4().hex}")
    writer = (spark.readStream.format("delta").load(source).writeStream.format(fmt)
              .option("kafka.bootstrap.servers", BOOTSTRAP).option("topic", topic)
              .option("checkpointLocation", ckpt).trigger(availableNow=True))
    if fmt == "lastagent-kafka":
        writer = (writer.option("link", f"bench-{uuid.uuid4().hex[:6]}")
                  .option("arbitrationTable", os.path.join(WORK, f"arb-{uuid.uuid4().hex[:6]}")))
    start = time.perf_counter()
    query = writer.start()
    query.awaitTermination()
    elapsed = time.perf_counter() - start
    written = sum(int(p["numInputRows"]) for p in query.recentProgress)
    if written != rows:
        raise SystemExit(f"{fmt} wrote {written} rows, expected {rows}")
    if write_rates is not None:
        write_rates.append(rows / (sum(int(p["durationMs"].get("addBatch", 0)) for p in query.recentProgress) / 1000))
    return rows / elapsed


def raw_producer(topic: str, rows: int, value_size: int) -> float:
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 5, "enable.idempotence": True})
    value = b"x" * value_size
    start = time.perf_counter()
    for i in range(rows):
        while True:
            try:
                producer.produce(topic, value=value, key=str(i).encode())
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(120) == 0
    return rows / (time.perf_counter() - start)


def commit_overhead(branches: int, admin: KafkaAdminClient, arbitration: str = WORK,
                    storage: dict[str, str] | None = None) -> dict[str, float]:
    """p50/p95 ms of Committer.commit (decide + phase 2 + roll back others) per epoch.

    The arbitration table goes below ``arbitration`` (a local directory, or an object store's URI with
    its ``storage.*`` options).
    """
    topic = new_topic(admin, 4)
    link = f"bench-ovh-{uuid.uuid4().hex[:6]}"
    options = KafkaSinkOptions.parse({
        "kafka.bootstrap.servers": BOOTSTRAP, "link": link, "checkpointLocation": WORK,
        "arbitrationTable": f"{arbitration}/arb-{link}", "arbitrationCleanupEvery": "1000000", **(storage or {}),
    })
    times = []
    with link_committer(options) as committer:
        generation = committer.claim_and_recover(owner="bench")[0].generation
        for epoch in range(EPOCHS):
            handles = []
            for b in range(branches):
                w = BranchWriter(options.client_config, options.transactional_id(generation, b, 0), options.transaction_timeout_ms)
                w.send(topic, b"v", key=str(b).encode())
                handles.append(w.prepare())
            start = time.perf_counter()
            committer.commit(epoch, generation, handles)
            times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"p50_ms": round(statistics.median(times), 1), "p95_ms": round(times[int(len(times) * 0.95) - 1], 1)}


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("lastagent-bench")
    spark.sparkContext.setLogLevel("ERROR")
    src = source_table(spark, ROWS, 100, 2)
    spark_write(spark, "kafka", src, new_topic(admin, 2), ROWS)  # warm-up
    spark_write(spark, "lastagent-kafka", src, new_topic(admin, 2), ROWS)
    results: dict[str, list[float]] = {"raw": [], "kafka": [], "lastagent-kafka": []}
    writing: dict[str, list[float]] = {"kafka": [], "lastagent-kafka": []}
    for _ in range(REPEAT):
        results["raw"].append(raw_producer(new_topic(admin, 2), ROWS, 100))
        for fmt in ("kafka", "lastagent-kafka"):
            results[fmt].append(spark_write(spark, fmt, src, new_topic(admin, 2), ROWS, writing[fmt]))
    med = {k: statistics.median(v) for k, v in results.items()}
    med_writing = {k: statistics.median(v) for k, v in writing.items()}
    overhead = {n: commit_overhead(n, admin) for n in (1, 4, 16)}
    # Baseline: the same task writing 1,000 rows (pyspark's worker, pandas, Arrow, clients).
    small = source_table(spark, 1000, 1024, 1)
    with PeakRss() as base:
        spark_write(spark, "lastagent-kafka", small, new_topic(admin, 1), 1000)
    mem_rows = MEM_MB * 1024
    big = source_table(spark, mem_rows, 1024, 1)
    with PeakRss() as rss:
        spark_write(spark, "lastagent-kafka", big, new_topic(admin, 1), mem_rows)
    summary = {
        "rows": ROWS, "value_bytes": 100, "repeat": REPEAT,
        "rows_per_s_median": {k: round(v) for k, v in med.items()},
        "ratio_vs_builtin": round(med["lastagent-kafka"] / med["kafka"], 2),
        "ratio_vs_raw": round(med["lastagent-kafka"] / med["raw"], 2),
        "add_batch_rows_per_s_median": {k: round(v) for k, v in med_writing.items()},
        "add_batch_ratio_vs_builtin": round(med_writing["lastagent-kafka"] / med_writing["kafka"], 2),
        "add_batch_ratio_vs_raw": round(med_writing["lastagent-kafka"] / med["raw"], 2),
        "commit_overhead_ms": overhead,
        "memory_mb_written": MEM_MB,
        "python_worker_peak_rss_mb": round(rss.peak_kb / 1024, 1),
        "python_worker_baseline_rss_mb_1000_rows": round(base.peak_kb / 1024, 1),
    }
    print(json.dumps(summary, indent=2))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
