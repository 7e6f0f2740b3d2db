"""Where the `lastagent-kafka` source's time goes, per record and per query.

Three figures, same broker, same run:
* the compiled read path alone, outside Spark: ``lastagent._native.RangeConsumer`` reading one
  partition of ROWS 100-byte records into Arrow batches of 10,000 rows (without and with the
  headers column), and confluent-kafka's ``consume()`` on the same partition, the path it replaced;
* a query's fixed cost: `trigger(availableNow=True)` over a 1,000-record topic into `noop`, for
  Spark's `kafka` source and for `lastagent-kafka`: seconds from `start()` to the first
  micro-batch (for a Python data source, Spark starts the driver's Python source process then),
  and the micro-batch itself.

Run with `make bench` (or `cd bench && python source_phases.py`). BENCH_PHASE_ROWS (default
1,000,000) sets the partition's size. Prints a JSON summary.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
import uuid

import pyarrow as pa
from common import BOOTSTRAP, fill_topic
from confluent_kafka import Consumer, TopicPartition
from kafka.admin import KafkaAdminClient

from lastagent._native import RangeConsumer
from lastagent.sources.kafka_source import consumer_settings
from lastagent.spark_session import local_session

ROWS = int(os.environ.get("BENCH_PHASE_ROWS", "1000000"))
#: The settings of the source's task consumers (consumer_settings), read_committed.
SETTINGS = list(consumer_settings({"bootstrap.servers": BOOTSTRAP, "isolation.level": "read_committed"},
                                  "bench-phases").items())


def native_read(topic: str, headers: bool) -> float:
    """Records/s of RangeConsumer over [0, ROWS) of partition 0, batches imported by pyarrow."""
    consumer = RangeConsumer(SETTINGS)
    consumer.assign(topic, 0, 0)
    start, seen, position = time.perf_counter(), 0, 0
    for _ in range(ROWS):  # bound: every call either adds records or ends the range
        batch, after, status, error = consumer.next_batch(ROWS, 10_000, 1000, headers)
        if batch is not None:
            seen += pa.record_batch(batch).num_rows
        position = max(position, after)
        if status in ("done", "error", "reset") or position >= ROWS:
            break
    elapsed = time.perf_counter() - start
    consumer.close()
    if seen != ROWS:
        raise SystemExit(f"native read {seen} records, expected {ROWS} ({status} {error})")
    return ROWS / elapsed


def confluent_read(topic: str) -> float:
    """Records/s of confluent-kafka's consume() over the same partition (Message objects only)."""
    consumer = Consumer(dict(SETTINGS))
    consumer.assign([TopicPartition(topic, 0, 0)])
    start, seen = time.perf_counter(), 0
    for _ in range(ROWS):
        for msg in consumer.consume(10_000, 1.0):
            if msg.error() is None:
                seen += 1
        if seen >= ROWS:
            break
    elapsed = time.perf_counter() - start
    consumer.close()
    return seen / elapsed


def query_phases(spark, fmt: str, topic: str) -> tuple[float, float]:
    """(seconds from start() to the first micro-batch, seconds of that micro-batch)."""
    before = time.time()
    query = (spark.readStream.format(fmt).option("kafka.bootstrap.servers", BOOTSTRAP).option("subscribe", topic)
             .option("startingOffsets", "earliest").load().writeStream.format("noop")
             .option("checkpointLocation", f"/tmp/lastagent-bench/ckpt-{uuid.uuid4().hex}")
             .trigger(availableNow=True).start())
    query.awaitTermination()
    first = query.recentProgress[0]
    began = datetime.datetime.fromisoformat(first["timestamp"].replace("Z", "+00:00")).timestamp()
    return began - before, first["durationMs"]["triggerExecution"] / 1000


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    big = fill_topic(admin, 1, ROWS, 100)
    native_read(big, False)  # warm-up: connections, page cache
    rates = {"native": [native_read(big, False) for _ in range(3)],
             "native_headers": [native_read(big, True) for _ in range(3)],
             "confluent_consume": [confluent_read(big) for _ in range(3)]}
    med = {k: statistics.median(v) for k, v in rates.items()}

    spark = local_session("lastagent-bench-phases")
    spark.sparkContext.setLogLevel("ERROR")
    small = fill_topic(admin, 2, 1000, 100)
    phases: dict[str, list[tuple[float, float]]] = {"kafka": [], "lastagent-kafka": []}
    for fmt in phases:
        query_phases(spark, fmt, small)  # warm-up: JIT, Python workers
    for _ in range(3):
        for fmt, runs in phases.items():
            runs.append(query_phases(spark, fmt, small))
    spark.stop()
    summary = {
        "partition_rows": ROWS, "value_bytes": 100,
        "outside_spark_records_per_s_median": {k: round(v) for k, v in med.items()},
        "outside_spark_us_per_record": {k: round(1e6 / v, 3) for k, v in med.items()},
        "native_vs_confluent_consume": round(med["native"] / med["confluent_consume"], 1),
        "query_start_to_first_batch_s_median": {k: round(statistics.median(p[0] for p in v), 2) for k, v in phases.items()},
        "first_batch_s_median_1000_records": {k: round(statistics.median(p[1] for p in v), 2) for k, v in phases.items()},
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
