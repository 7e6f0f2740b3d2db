"""The three links on a standalone cluster: the driver SIGKILLed and restarted, a worker machine lost mid-epoch.

One application (``python -m lastagent.examples links-driver``) runs the three links as three queries
against the master of ``spark_cluster``: Delta → ``lastagent-kafka``, Kafka → ``lastagent-kafka``
and Kafka → transformer → ``lastagent-delta`` (dead letters and a side topic in the same epochs).
Executors live in the workers' JVMs, their Python workers under them, the driver in a process tree
of its own. First run: the driver's process group is SIGKILLed right after the second decision (a
decided epoch with open branches, missing from Spark's commit log). Restart: recovery finishes what
was decided; then the first task to write takes its whole worker down (worker JVM, executor JVM,
Python workers: SIGKILL) mid-write, killing every task of the three queries running there; Spark
reruns them on the other worker and the queries run to their end. Then every row is there once,
read back by an independent read_committed consumer and by Spark's Delta reader, and no transaction
of any link is open.
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

from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.cluster

ROWS = 300  # per source; with PER_TRIGGER, three epochs of two tasks (one per partition)
PER_TRIGGER = "100"
POISON = {41, 202}


def lose_a_worker_mid_write(state: Path) -> dict[str, str]:
    """Spark settings that make the first task to reach ``task_mid_write`` take its worker machine down."""
    return {"spark.executorEnv.LASTAGENT_CRASH_AT": "task_mid_write:1",
            "spark.executorEnv.LASTAGENT_CRASH_STATE": str(state),
            "spark.executorEnv.LASTAGENT_CRASH_SCOPE": "machine"}


def test_three_links_survive_a_driver_kill_and_a_lost_worker(cluster, spark, kafka_bootstrap, new_topic, tmp_path):
    source = str(tmp_path / "source")
    for f in range(3):
        (spark.range(f * 100, (f + 1) * 100, numPartitions=1)
         .selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
         .write.format("delta").mode("append").save(source))
    orders = new_topic(partitions=2)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(ROWS):
        p.produce(orders, key=str(i).encode(), value=(f"poison-{i}" if i in POISON else f"order-1-{i}").encode(),
                  partition=i % 2)
    assert p.flush(30) == 0
    sink_topic, copy_topic, dead, side = new_topic(partitions=2), new_topic(partitions=2), new_topic(), new_topic(partitions=2)
    link, base = f"cluster-{uuid.uuid4().hex[:8]}", tmp_path / "links"
    args = [kafka_bootstrap, str(base), link, source, orders, sink_topic, copy_topic, dead, side, PER_TRIGGER]

    state = tmp_path / "driver-crash"
    code = support.run_driver("links-driver", args, "after_arbitration:2", state, master=cluster.url)
    assert code == -signal.SIGKILL, f"the driver was not killed after a decision (exit {code}); see {state}.log"
    assert cluster.lost_workers() == [], "a worker died with the driver"
    worker_state = tmp_path / "worker-crash"
    code = support.run_driver("links-driver", args, None, tmp_path / "restart", master=cluster.url,
                              conf=lose_a_worker_mid_write(worker_state))
    assert code == 0, f"the restart failed (exit {code}); see {tmp_path / 'restart.log'}"
    assert Path(str(worker_state) + ".fired").read_text() == "task_mid_write"
    assert len(cluster.lost_workers()) == 1, "no worker machine was lost mid-write"

    once(Counter(int(v) for _, v in read_committed(kafka_bootstrap, sink_topic, 300)), range(300), "Delta → Kafka")
    copied = read_committed(kafka_bootstrap, copy_topic, ROWS)
    once(Counter(int(k) for k, _ in copied), range(ROWS), "Kafka → Kafka")
    good = [i for i in range(ROWS) if i not in POISON]
    once(Counter(int(r.key) for r in spark.read.format("delta").load(str(base / "orders")).select("key").collect()),
         good, "Kafka → Delta")
    once(Counter(int(json.loads(v)["key"]) for _, v in read_committed(kafka_bootstrap, side, len(good))), good,
         "the side topic")
    once(Counter(int(k) for k, _ in read_committed(kafka_bootstrap, dead, len(POISON))), sorted(POISON),
         "the dead letters")
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        for name in ("sink", "copy", "delta"):
            assert xa.recover(f"lastagent-{link}-{name}-") == [], f"open transactions of link {link}-{name}"


def once(counts: Counter, expected, what: str) -> None:
    """Every expected key exactly once."""
    expected = list(expected)
    assert sorted(counts) == expected, f"{what}: lost {sorted(set(expected) - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"{what}: duplicates {[k for k, c in counts.items() if c > 1][:10]}"
