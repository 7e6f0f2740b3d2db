"""The three links on a standalone cluster: a driver SIGKILLed and restarted, a worker machine lost mid-epoch.

Each link's driver (``python -m lastagent.examples``) runs against the master of ``spark_cluster``:
executors in the workers' JVMs, Python workers under them, the driver in a process tree of its own.
First run: the driver's process group is SIGKILLed right after epoch 1's decision (branches open, the
epoch missing from Spark's commit log). Restart: recovery finishes epoch 1; in the next epoch a task
takes its whole worker down (the worker JVM, its executor JVM and Python workers, SIGKILL) mid-write;
Spark reruns the task on the other worker; the query runs to its end. Then every row is there once,
read back by an independent read_committed consumer and by Spark's Delta reader, and no transaction
of the link is open.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections import Counter
from pathlib import Path

import pytest
import support
from confluent_kafka import Producer
from support import read_committed

from lastagent.kafka_xa import KafkaXAResource

pytestmark = pytest.mark.cluster

ROWS = 300
PER_TRIGGER = "100"  # three epochs of two tasks (one per partition)
POISON = {41, 202}


def lose_a_worker_mid_write(state: Path) -> dict[str, str]:
    """Spark settings that make the first task to reach ``task_mid_write`` take its worker machine down."""
    return {"spark.executorEnv.LASTAGENT_CRASH_AT": "task_mid_write:1",
            "spark.executorEnv.LASTAGENT_CRASH_STATE": str(state),
            "spark.executorEnv.LASTAGENT_CRASH_SCOPE": "machine"}


def kill_driver_then_lose_a_worker(cluster, pipeline: str, args: list[str], tmp_path: Path) -> None:
    """Runs the link's history described in the module docstring; asserts each step happened."""
    state = tmp_path / "driver-crash"
    code = support.run_driver(pipeline, args, "after_arbitration:2", state, master=cluster.url)
    assert code == -signal.SIGKILL, f"the driver was not killed after the decision (exit {code}); see {state}.log"
    assert cluster.lost_workers() == [], "a worker died with the driver"
    worker_state = tmp_path / "worker-crash"
    code = support.run_driver(pipeline, args, None, tmp_path / "restart", master=cluster.url,
                              conf=lose_a_worker_mid_write(worker_state))
    assert code == 0, f"the restart failed (exit {code}); see {tmp_path / 'restart.log'}"
    assert Path(str(worker_state) + ".fired").read_text() == "task_mid_write"
    assert len(cluster.lost_workers()) == 1, "no worker machine was lost mid-write"


def produce(bootstrap: str, topic: str, value) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for i in range(ROWS):
        p.produce(topic, key=str(i).encode(), value=value(i).encode(), partition=i % 2)
    assert p.flush(30) == 0


def assert_once_in_topic(bootstrap: str, topic: str, link: str) -> None:
    rows = read_committed(bootstrap, topic, ROWS)
    counts = Counter(int(v) for _, v in rows)
    assert sorted(counts) == list(range(ROWS)), f"lost rows: {sorted(set(range(ROWS)) - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"duplicates: {[k for k, c in counts.items() if c > 1][:10]}"
    assert_nothing_open(bootstrap, link)


def assert_nothing_open(bootstrap: str, link: str) -> None:
    with KafkaXAResource({"bootstrap.servers": bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []


def test_delta_to_kafka(cluster, spark, kafka_bootstrap, new_topic, tmp_path):
    """Delta table → ``lastagent-kafka``: three files, one epoch each."""
    source = str(tmp_path / "source")
    for f in range(3):
        (spark.range(f * 100, (f + 1) * 100, numPartitions=1)
         .selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
         .write.format("delta").mode("append").save(source))
    topic, link = new_topic(partitions=2), f"cluster-{uuid.uuid4().hex[:8]}"
    args = [kafka_bootstrap, source, str(tmp_path / "ckpt"), str(tmp_path / "arb"), link, topic]
    kill_driver_then_lose_a_worker(cluster, "sink-driver", args, tmp_path)
    assert_once_in_topic(kafka_bootstrap, topic, link)


def test_kafka_to_kafka(cluster, kafka_bootstrap, new_topic, tmp_path):
    """``lastagent-kafka`` source → ``lastagent-kafka`` sink."""
    source, topic = new_topic(partitions=2), new_topic(partitions=2)
    produce(kafka_bootstrap, source, str)
    link = f"cluster-{uuid.uuid4().hex[:8]}"
    args = [kafka_bootstrap, source, str(tmp_path / "ckpt"), str(tmp_path / "arb"), link, topic, PER_TRIGGER]
    kill_driver_then_lose_a_worker(cluster, "kafka-driver", args, tmp_path)
    assert_once_in_topic(kafka_bootstrap, topic, link)


def test_kafka_to_delta(cluster, spark, kafka_bootstrap, new_topic, tmp_path):
    """Kafka → transformer → ``lastagent-delta``, with dead letters and a side topic in the same epochs."""
    source, dead, side = new_topic(partitions=2), new_topic(), new_topic(partitions=2)
    produce(kafka_bootstrap, source, lambda i: f"poison-{i}" if i in POISON else f"order-1-{i}")
    link, table = f"cluster-d-{uuid.uuid4().hex[:8]}", str(tmp_path / "orders")
    args = [kafka_bootstrap, source, table, str(tmp_path / "ckpt"), link, dead, side, PER_TRIGGER]
    kill_driver_then_lose_a_worker(cluster, "delta-driver", args, tmp_path)
    good = [i for i in range(ROWS) if i not in POISON]
    counts = Counter(int(r.key) for r in spark.read.format("delta").load(table).select("key").collect())
    assert sorted(counts) == good, f"lost rows: {sorted(set(good) - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"duplicates in the table: {[k for k, c in counts.items() if c > 1][:10]}"
    follow = Counter(json.loads(v)["key"] for _, v in read_committed(kafka_bootstrap, side, len(good)))
    assert sorted(int(k) for k in follow) == good and max(follow.values()) == 1, "side topic not exactly once"
    dead_keys = Counter(int(k) for k, _ in read_committed(kafka_bootstrap, dead, len(POISON)))
    assert dead_keys == Counter(POISON), "dead letters not exactly once"
    assert_nothing_open(kafka_bootstrap, link)
