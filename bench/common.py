"""Shared pieces of the benchmarks: broker address, topic creation, worker memory sampling."""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer
from kafka.admin import KafkaAdminClient, NewTopic

BOOTSTRAP = os.environ.get("LASTAGENT_KAFKA_BOOTSTRAP", f"127.0.0.1:{os.environ.get('LASTAGENT_KAFKA_PORT', '39092')}")


def new_topic(admin: KafkaAdminClient, partitions: int) -> str:
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, partitions, 1)])
    return topic


def fill_topic(admin: KafkaAdminClient, partitions: int, rows: int, value_size: int) -> str:
    """A new topic with ``rows`` records of ``value_size`` random bytes, round-robin over partitions.

    Random, uncompressed values: a 1 GB partition is 1 GB on the broker and on the wire. (Constant
    values under lz4 once made "1 GB" a 10 MB log whose 1 MB fetches inflated to 100 MB.)
    """
    topic = new_topic(admin, partitions)
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 50, "batch.size": 1_000_000,
                         "compression.type": "none", "queue.buffering.max.kbytes": 1_048_576})
    rng = random.Random(42)
    for i in range(rows):
        value = rng.randbytes(value_size)
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

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
