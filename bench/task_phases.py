"""Where one `lastagent-kafka` task's time goes, outside Spark: the per-task cost behind the epoch times of issue 44.

A task of the sink does, in this order (``BranchWriter`` and ``prepare``): create the compiled producer, run
``init_transactions`` (connects, fences an older producer of the id, waits for the coordinator),
``begin_transaction``, send its records, flush them, then ``describe_open`` (the Python worker's kafka-python
coordinator client, kept from task to task, asks the coordinator for the open transaction's producer id, epoch and
partitions: the branch handle). The driver then commits the
branch by handle (``EndTxn``). Each step is timed here on its own, for BENCH_TASKS tasks in a row with the same
transactional id per task slot, as a link reuses its ids from epoch to epoch, BENCH_TASK_ROWS records each.

Beside it in the same run, what Spark's built-in `kafka` sink does per task: a non-transactional idempotent
producer, created per task (the first task of an executor) and cached (every later task: Spark keeps one per
executor), send and flush.

Run with `make bench` (or `cd bench && python task_phases.py` with a broker up: `make kafka-up`). Prints JSON:
median, p90 and max milliseconds per step, and how many
tasks took over 250 ms in it (the bimodal epochs).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid

from common import BOOTSTRAP, new_topic
from confluent_kafka import Producer
from kafka.admin import KafkaAdminClient

from lastagent._native import BranchProducer
from lastagent.core.branch_handle import BranchHandle
from lastagent.kafka.branch import describe_open, producer_config
from lastagent.kafka.config import KafkaConfig, as_librdkafka_strings
from lastagent.kafka.xa import KafkaXAResource

TASKS = int(os.environ.get("BENCH_TASKS", "40"))
ROWS = int(os.environ.get("BENCH_TASK_ROWS", "200"))


def _ms(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"p50": round(statistics.median(ordered) * 1000, 1),
            "p90": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 1),
            "max": round(ordered[-1] * 1000, 1),
            "over_250_ms": sum(t > 0.25 for t in ordered)}


class _Laps:
    """Records the time since the previous lap under each step's name."""

    def __init__(self, steps: dict[str, list[float]]) -> None:
        self.steps = steps
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.steps.setdefault(name, []).append(now - self.last)
        self.last = now


def lastagent_tasks(topic: str, xa: KafkaXAResource) -> dict[str, list[float]]:
    """TASKS branch tasks on one transactional id, each committed by the driver before the next (one per epoch)."""
    client = KafkaConfig.of({"bootstrap.servers": BOOTSTRAP})
    transactional_id = f"bench-task-{uuid.uuid4().hex[:8]}"
    config = producer_config(client, transactional_id, 60_000)
    config["delivery.report.only.error"] = True
    settings = as_librdkafka_strings(config)
    values = [os.urandom(100) for _ in range(ROWS)]
    steps: dict[str, list[float]] = {}
    for _ in range(TASKS):
        task_start = time.perf_counter()
        lap = _Laps(steps)
        producer = BranchProducer(settings)
        lap("create producer")
        assert producer.init_transactions(60_000) is None
        lap("init_transactions")
        assert producer.begin_transaction() is None
        lap("begin_transaction")
        for i, value in enumerate(values):
            assert producer.produce(topic, value, str(i).encode(), -1, None, i) is None
        lap("send")
        assert producer.flush(60_000) == 0
        lap("flush")
        pid, epoch, partitions = describe_open(client, transactional_id)
        lap("describe (the worker's coordinator client)")
        producer.release()
        steps.setdefault("task in all", []).append(time.perf_counter() - task_start)
        lap = _Laps(steps)
        xa.commit(BranchHandle(transactional_id, pid, epoch, ROWS, partitions))
        lap("driver: commit by handle")
    return steps


def builtin_like_tasks(topic: str) -> dict[str, list[float]]:
    """What Spark's kafka sink's task does: an idempotent producer (new, or the executor's cached one), send, flush."""
    values = [os.urandom(100) for _ in range(ROWS)]
    steps: dict[str, list[float]] = {}
    cached = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True})
    for _ in range(TASKS):
        for name, make in (("new producer", lambda: Producer({"bootstrap.servers": BOOTSTRAP,
                                                               "enable.idempotence": True})),
                           ("cached producer", lambda: cached)):
            start = time.perf_counter()
            producer = make()
            for i, value in enumerate(values):
                producer.produce(topic, value=value, key=str(i).encode())
            assert producer.flush(60) == 0
            steps.setdefault(f"{name}: task in all", []).append(time.perf_counter() - start)
    return steps


def main() -> None:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    topic = new_topic(admin, 1)
    admin.close()
    with KafkaXAResource({"bootstrap.servers": BOOTSTRAP}) as xa:
        ours = lastagent_tasks(topic, xa)
    peer = builtin_like_tasks(topic)
    out = {"tasks": TASKS, "records_per_task": ROWS,
           "lastagent_kafka_task_ms": {k: _ms(v) for k, v in ours.items()},
           "builtin_like_task_ms": {k: _ms(v) for k, v in peer.items()}}
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
