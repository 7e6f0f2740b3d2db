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
import threading
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from lastagent.spark_session import local_session

BOOTSTRAP = os.environ.get("LASTAGENT_KAFKA_BOOTSTRAP", f"127.0.0.1:{os.environ.get('LASTAGENT_KAFKA_PORT', '39092')}")
ROWS = int(os.environ.get("BENCH_ROWS", "2000000"))
MEM_MB = int(os.environ.get("BENCH_MEM_MB", "1024"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))


def make_topic(admin: KafkaAdminClient, partitions: int, rows: int, value_size: int) -> str:
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, partitions, 1)])
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 50, "batch.size": 1_000_000,
                         "compression.type": "lz4", "queue.buffering.max.kbytes": 1_048_576})
    value = b"x" * value_size
    for i in range(rows):
        while True:
            try:
                producer.produce(topic, value=value, key=str(i).encode(), partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 10000 == 0:
            producer.poll(0)
    assert producer.flush(120) == 0
    return topic


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


def spark_read(spark, fmt: str, topic: str, rows: int, extra: dict[str, str] | None = None) -> float:
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
    return rows / elapsed


class PeakRss:
    """Samples the peak RSS of Spark's Python worker processes (pyspark.daemon / worker)."""

    def __init__(self) -> None:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _workers(self) -> list[int]:
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"pyspark.daemon" in cmd or b"pyspark.worker" in cmd:
                pids.append(int(d.name))
        return pids

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in self._workers():
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            self.peak_kb = max(self.peak_kb, int(line.split()[1]))
                except OSError:
                    pass
            time.sleep(0.05)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("lastagent-bench")
    spark.sparkContext.setLogLevel("ERROR")
    topic = make_topic(admin, 2, ROWS, 100)
    results: dict[str, list[float]] = {"raw": [], "kafka": [], "lastagent-kafka": []}
    # Warm-up: JIT, Python workers, consumers.
    spark_read(spark, "kafka", topic, ROWS)
    spark_read(spark, "lastagent-kafka", topic, ROWS)
    for _ in range(REPEAT):
        results["raw"].append(raw_consumer(topic, 2, ROWS))
        results["kafka"].append(spark_read(spark, "kafka", topic, ROWS))
        results["lastagent-kafka"].append(spark_read(spark, "lastagent-kafka", topic, ROWS))
    med = {k: statistics.median(v) for k, v in results.items()}

    # Memory: one task reads one partition of MEM_MB (1 KiB values).
    mem_rows = MEM_MB * 1024
    big = make_topic(admin, 1, mem_rows, 1024)
    with PeakRss() as rss:
        spark_read(spark, "lastagent-kafka", big, mem_rows)
    summary = {
        "rows": ROWS, "value_bytes": 100, "partitions": 2, "repeat": REPEAT,
        "rows_per_s_median": {k: round(v) for k, v in med.items()},
        "ratio_vs_builtin": round(med["lastagent-kafka"] / med["kafka"], 2),
        "ratio_vs_raw": round(med["lastagent-kafka"] / med["raw"], 2),
        "builtin_vs_raw": round(med["kafka"] / med["raw"], 2),
        "memory_partition_mb": MEM_MB,
        "python_worker_peak_rss_mb": round(rss.peak_kb / 1024, 1),
    }
    print(json.dumps(summary, indent=2))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
