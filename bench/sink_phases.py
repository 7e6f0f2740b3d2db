"""Where the `lastagent-kafka` sink's time goes per record, outside Spark.

Same broker, same run, ROWS records of 100 random bytes with 8-byte keys into a new 2-partition
topic, medians of 3:
* ``BranchWriter.send_columns`` (the sink's path: the compiled producer takes the Arrow columns)
  inside one open transaction, then ``prepare()`` (flush, read the handle) and a commit by handle;
  the same with librdkafka's default of 100,000 records in flight instead of the branch producer's
  20,000, and for both the producing process's CPU time per record (librdkafka's threads included);
* the path it replaced: confluent-kafka's transactional ``Producer.produce`` per record, from
  the columns turned into Python ``bytes`` (``to_pylist``), then flush and commit;
* a raw non-transactional confluent-kafka producer from Python ``bytes`` (the sink benchmark's limit).

Run with `make bench` (or `cd bench && python sink_phases.py`). BENCH_PHASE_ROWS (default
1,000,000). Prints a JSON summary.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import uuid

import pyarrow as pa
from common import BOOTSTRAP, new_topic
from confluent_kafka import Producer
from kafka.admin import KafkaAdminClient

from lastagent.kafka.branch import BranchWriter
from lastagent.kafka.xa import KafkaXAResource

ROWS = int(os.environ.get("BENCH_PHASE_ROWS", "1000000"))
BATCH = 10_000  # rows per Arrow batch, as Spark hands them to the sink by default


def columns() -> list[tuple[pa.Array, pa.Array]]:
    rng = random.Random(7)
    out = []
    for start in range(0, ROWS, BATCH):
        n = min(BATCH, ROWS - start)
        out.append((pa.array([b"%08d" % (start + i) for i in range(n)], pa.binary()),
                    pa.array([rng.randbytes(100) for _ in range(n)], pa.binary())))
    return out


def native_branch(topic: str, batches: list[tuple[pa.Array, pa.Array]], cpu: list[float] | None = None,
                  **settings: str) -> float:
    """Records/s of the sink's path; ``cpu`` gets this process's CPU µs per record (librdkafka's threads
    included). ``settings`` are added librdkafka settings (with dots as underscores)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    config = {"bootstrap.servers": BOOTSTRAP, **{k.replace("_", "."): v for k, v in settings.items()}}
    writer = BranchWriter(config, f"bench-{uuid.uuid4().hex[:8]}", 600_000)
    for keys, values in batches:
        writer.send_columns(topic, keys, values)
    handle = writer.prepare()
    writer.release()
    with KafkaXAResource({"bootstrap.servers": BOOTSTRAP}) as xa:
        xa.commit(handle)
    if cpu is not None:
        cpu.append((time.process_time() - cpu_start) / ROWS * 1e6)
    return ROWS / (time.perf_counter() - start)


def produce_all(producer: Producer, topic: str, pairs: list[tuple[bytes, bytes]]) -> None:
    """confluent-kafka's produce() per record; waits while the local queue is full."""
    for key, value in pairs:
        while True:
            try:
                producer.produce(topic, value, key)
                break
            except BufferError:
                producer.poll(0.1)
    producer.poll(0)


def confluent_branch(topic: str, batches: list[tuple[pa.Array, pa.Array]]) -> float:
    start = time.perf_counter()
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "transactional.id": f"bench-{uuid.uuid4().hex[:8]}",
                         "queue.buffering.max.kbytes": 32_768})
    producer.init_transactions(60)
    producer.begin_transaction()
    for keys, values in batches:
        produce_all(producer, topic, list(zip(keys.to_pylist(), values.to_pylist())))
    producer.flush(300)
    producer.commit_transaction(60)
    return ROWS / (time.perf_counter() - start)


def raw(topic: str, batches: list[tuple[pa.Array, pa.Array]]) -> float:
    pairs = [(k, v) for keys, values in batches for k, v in zip(keys.to_pylist(), values.to_pylist())]
    start = time.perf_counter()
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 5})
    produce_all(producer, topic, pairs)
    producer.flush(300)
    return ROWS / (time.perf_counter() - start)


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    batches = columns()
    runs: dict[str, list[float]] = {"native_branch": [], "native_branch_100000_in_flight": [],
                                    "confluent_branch": [], "raw_confluent": []}
    cpu: dict[str, list[float]] = {"native_branch": [], "native_branch_100000_in_flight": []}
    native_branch(new_topic(admin, 2), batches)  # warm-up
    for _ in range(3):
        runs["native_branch"].append(native_branch(new_topic(admin, 2), batches, cpu["native_branch"]))
        # librdkafka's own queue length (the branch producer's default is 20,000 records in flight).
        runs["native_branch_100000_in_flight"].append(native_branch(
            new_topic(admin, 2), batches, cpu["native_branch_100000_in_flight"], queue_buffering_max_messages="100000"))
        runs["confluent_branch"].append(confluent_branch(new_topic(admin, 2), batches))
        runs["raw_confluent"].append(raw(new_topic(admin, 2), batches))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(json.dumps({
        "rows": ROWS, "value_bytes": 100, "key_bytes": 8,
        "records_per_s_median": {k: round(v) for k, v in med.items()},
        "us_per_record": {k: round(1e6 / v, 3) for k, v in med.items()},
        "producer_process_cpu_us_per_record": {k: round(statistics.median(v), 3) for k, v in cpu.items()},
        "native_vs_confluent_branch": round(med["native_branch"] / med["confluent_branch"], 2),
        "native_vs_raw": round(med["native_branch"] / med["raw_confluent"], 2),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
