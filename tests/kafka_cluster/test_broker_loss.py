"""The three links keep running while the replicated cluster loses brokers, as production clusters do.

One application (``python -m lastagent.examples links-driver``, every second until a stop file) runs
Delta → ``lastagent-kafka``, Kafka → ``lastagent-kafka`` and Kafka → transformer → ``lastagent-delta``
(dead letters and a side topic in the same epochs) against the 3-node cluster, while a feeder keeps
adding orders to the source topic and rows to the source table. Meanwhile the harness

1. restarts every node in turn, cleanly (controlled shutdown), each back and every partition in sync
   before the next: a rolling restart;
2. SIGKILLs the node that coordinates the most open transactions of the links, mid-epoch, and starts
   it again 15 s later.

In a second run of the three links, each query is held right after its decision (the arbitration record
written, every branch prepared, phase 2 not begun); the node coordinating most of those branches is
SIGKILLed, the queries go on, and the node comes back 15 s later.

A third run of the three links takes one replica of every two-replica output topic away for 30 s,
so that ``min.insync.replicas=2`` refuses every write to them (``NOT_ENOUGH_REPLICAS``): the links wait
it out.
A fourth SIGKILLs two of the three nodes for 15 s: the controller quorum, the transaction log's and every
topic's in-sync replicas are all short; the Kafka → Kafka link waits it out too.

No query may fail (the driver exits 0 after draining). Then every record is there once, read back by
an independent read_committed consumer and by Spark's Delta reader, no transaction of any link is
open and ``lastagent status`` is clean for each link.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import support
from support import cluster_admin, in_sync, read_committed

from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.kafka_cluster

LINKS = ("sink", "copy", "delta")
PER_TRIGGER = "50"
POISON_EVERY = 97  # every 97th order is poison: a dead letter


class Feeder:
    """Adds orders to the source topic and rows to the source table until stopped; remembers what it added.

    The producer is idempotent with acks=all and a long delivery timeout, as a production producer rides
    through a broker loss; a record whose delivery failed would be reported in ``failed``.
    """

    def __init__(self, bootstrap: str, topic: str, table: str) -> None:
        from confluent_kafka import Producer

        self.topic, self.table = topic, table
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                                  "message.timeout.ms": 300_000})
        self.orders: list[int] = []
        self.failed: list[str] = []
        self.rows = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _report(self, err: Any, msg: Any) -> None:
        if err is not None:
            self.failed.append(f"{msg.key()}: {err}")

    def add_orders(self, count: int) -> None:
        for _ in range(count):
            i = len(self.orders)
            value = f"poison-{i}" if i % POISON_EVERY == POISON_EVERY - 1 else f"order-1-{i}"
            self.producer.produce(self.topic, key=str(i).encode(), value=value.encode(), partition=i % 2,
                                  on_delivery=self._report)
            self.orders.append(i)
        self.producer.poll(0)

    def add_rows(self, count: int) -> None:
        from deltalake import write_deltalake

        ids = range(self.rows, self.rows + count)
        write_deltalake(self.table, pa.table({"key": [str(i) for i in ids], "value": [str(i) for i in ids]}),
                        mode="append")
        self.rows += count

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(0.25):
            self.add_orders(5)
            tick += 1
            if tick % 8 == 0:
                self.add_rows(10)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()
        if self.producer.flush(300):
            self.failed.append("the producer did not deliver everything within 300 s")

    @property
    def good(self) -> list[int]:
        return [i for i in self.orders if i % POISON_EVERY != POISON_EVERY - 1]

    @property
    def poison(self) -> list[int]:
        return [i for i in self.orders if i % POISON_EVERY == POISON_EVERY - 1]


def _wait_for_first_epochs(proc: subprocess.Popen, base: Path, log: Path, timeout_s: float = 300) -> None:
    """Until each of the three queries committed an epoch (a file in its checkpoint's commits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the driver ended early (exit {proc.returncode}); see {log}"
        if all(any((base / f"ckpt-{name}" / "commits").glob("[0-9]*")) for name in LINKS):
            return
        time.sleep(1)
    raise AssertionError(f"not every link committed an epoch within {timeout_s:.0f}s; see {log}")


def _busiest_coordinator(bootstrap: str, link: str, timeout_s: float = 120, with_count: bool = False) -> Any:
    """The node that coordinates the most open (Ongoing) transactions of the link's three queries
    (with ``with_count``: and how many of them)."""
    from kafka.admin import KafkaAdminClient

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
        try:
            listed = admin.list_transactions(state_filters=["Ongoing"])
            ids = [t.transactional_id for rows in listed.values() for t in rows
                   if t.transactional_id.startswith(f"lastagent-{link}-")]
            if ids:
                counts = Counter(d.coordinator_id for d in admin.describe_transactions(ids).values())
                node, held = counts.most_common(1)[0]
                return (node, held) if with_count else node
        finally:
            admin.close()
        time.sleep(0.2)
    raise AssertionError(f"no open transaction of link {link} seen within {timeout_s:.0f}s")


def once(counts: Counter, expected: list[int], what: str) -> None:
    assert sorted(counts) == sorted(expected), (
        f"{what}: lost {sorted(set(expected) - set(counts))[:10]}, unexpected {sorted(set(counts) - set(expected))[:10]}")
    assert max(counts.values(), default=1) == 1, f"{what}: duplicates {[k for k, c in counts.items() if c > 1][:10]}"


@pytest.mark.timeout(1800)
def test_three_links_ride_through_a_rolling_restart_and_a_coordinator_kill(kafka_cluster, cluster_topic, spark,
                                                                           tmp_path, monkeypatch):
    def rolling_restart_then_coordinator_kill(link: str, proc: subprocess.Popen, log: Path) -> None:
        for node in kafka_cluster.nodes:
            kafka_cluster.stop(node)
            assert proc.poll() is None, f"the driver failed while node {node} was down; see {log}"
            kafka_cluster.start(node)
            in_sync(kafka_cluster)
        coordinator = _busiest_coordinator(kafka_cluster.bootstrap, link)
        kafka_cluster.kill(coordinator)  # mid-epoch: the link has open transactions there
        time.sleep(15)
        assert proc.poll() is None, f"the driver failed while coordinator {coordinator} was down; see {log}"
        kafka_cluster.start(coordinator)
        in_sync(kafka_cluster)

    _three_links_through(rolling_restart_then_coordinator_kill, kafka_cluster, cluster_topic, spark, tmp_path,
                         monkeypatch)


@pytest.mark.timeout(1800)
def test_three_links_ride_through_the_coordinator_killed_between_decision_and_phase_2(kafka_cluster, cluster_topic,
                                                                                     spark, tmp_path, monkeypatch):
    """Each of the three queries stops right after its last agent's decision (tests/crashhook's pause at
    ``after_arbitration``) with its branches prepared; the node coordinating most of them is SIGKILLed,
    then the queries go on to phase 2, which must wait for the coordinators to move."""
    pause = tmp_path / "pause"
    pause.mkdir()
    monkeypatch.setenv("LASTAGENT_PAUSE_AT", "after_arbitration")
    monkeypatch.setenv("LASTAGENT_PAUSE_DIR", str(pause))

    def kill_between_decision_and_phase_2(link: str, proc: subprocess.Popen, log: Path) -> None:
        (pause / "armed").touch()
        deadline = time.monotonic() + 300
        while len(list(pause.glob("paused-*"))) < len(LINKS):
            assert proc.poll() is None, f"the driver ended while pausing (exit {proc.returncode}); see {log}"
            assert time.monotonic() < deadline, f"not every query reached after_arbitration; see {log}"
            time.sleep(0.2)
        coordinator, held = _busiest_coordinator(kafka_cluster.bootstrap, link, with_count=True)
        kafka_cluster.kill(coordinator)  # decided, prepared, and phase 2 not yet begun
        (pause / "resume").touch()
        time.sleep(15)
        assert proc.poll() is None, f"the driver failed while coordinator {coordinator} was down; see {log}"
        kafka_cluster.start(coordinator)
        in_sync(kafka_cluster)
        assert held > 0  # the kill hit decided branches (else the test would prove nothing)

    _three_links_through(kill_between_decision_and_phase_2, kafka_cluster, cluster_topic, spark, tmp_path, monkeypatch)


def _three_links_through(fault, kafka_cluster, cluster_topic, spark, tmp_path: Path, monkeypatch,
                         output_topic=None) -> None:
    """The three links run while ``fault(link, driver, log)`` breaks the cluster; no query may fail, then every
    record is there once, no transaction is open and ``lastagent status`` is clean for each link.
    ``output_topic(partitions, prefix)`` makes the topics the links write (default: ``cluster_topic``)."""
    bootstrap = kafka_cluster.bootstrap
    output_topic = output_topic or cluster_topic
    orders, sink_topic, copy_topic = cluster_topic(2, "orders"), output_topic(2, "sink"), output_topic(2, "copy")
    dead, side = output_topic(1, "dead"), output_topic(2, "side")
    feeder = Feeder(bootstrap, orders, str(tmp_path / "source"))
    feeder.add_rows(20)
    feeder.add_orders(100)
    link, base, until = f"ride-{uuid.uuid4().hex[:8]}", tmp_path / "links", tmp_path / "stop"
    monkeypatch.setenv("LASTAGENT_RUN_UNTIL", str(until))
    state = tmp_path / "driver"
    log = state.with_suffix(".log")
    # local[2,4]: a task may be retried, as on every cluster (spark.task.maxFailures is 4 there).
    proc = support.start_driver("links-driver", [bootstrap, str(base), link, feeder.table, orders, sink_topic,
                                                 copy_topic, dead, side, PER_TRIGGER], None, state, master="local[2,4]")
    try:
        _wait_for_first_epochs(proc, base, log)
        feeder.start()
        fault(link, proc, log)
    finally:
        code = _drain(proc, feeder, until)
    assert code == 0, f"a query failed during the broker loss (exit {code}); see {log}:\n{_tail(log)}"
    assert feeder.failed == [], f"the feeder's producer lost records: {feeder.failed[:5]}"

    once(Counter(int(v) for _, v in read_committed(bootstrap, sink_topic, feeder.rows, 120)), list(range(feeder.rows)),
         "Delta → Kafka")
    once(Counter(int(k) for k, _ in read_committed(bootstrap, copy_topic, len(feeder.orders), 120)), feeder.orders,
         "Kafka → Kafka")
    once(Counter(int(r.key) for r in spark.read.format("delta").load(str(base / "orders")).select("key").collect()),
         feeder.good, "Kafka → Delta")
    once(Counter(int(json.loads(v)["key"]) for _, v in read_committed(bootstrap, side, len(feeder.good), 120)),
         feeder.good, "the side topic")
    once(Counter(int(k) for k, _ in read_committed(bootstrap, dead, len(feeder.poison), 60)), feeder.poison,
         "the dead letters")
    with KafkaXAResource({"bootstrap.servers": bootstrap}) as xa:
        for name in LINKS:
            assert xa.recover(f"lastagent-{link}-{name}-") == [], f"open transactions of link {link}-{name}"
    for name, where in (("sink", ["--arbitration-table", str(base / "arb-sink")]),
                        ("copy", ["--arbitration-table", str(base / "arb-copy")]),
                        ("delta", ["--table", str(base / "orders")])):
        status = subprocess.run([sys.executable, "-m", "lastagent.cli", "status", "--link", f"{link}-{name}", *where,
                                 "--bootstrap-servers", bootstrap], capture_output=True, text=True, timeout=180, check=False)
        assert status.returncode == 0, f"lastagent status of {link}-{name}: {status.stdout}{status.stderr}"


def _drain(proc: subprocess.Popen, feeder: Feeder, until: Path) -> int | None:
    """Stops feeding, asks the driver to drain and stop; its exit code (None: it had to be killed).

    Asserts nothing: it runs in ``finally`` and must not hide the failure that got there."""
    feeder.stop()
    if proc.poll() is None:
        until.touch()
        try:
            proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return None
    return proc.returncode


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def _copy_link_through(fault, kafka_cluster, source: str, copy: str, tmp_path: Path, monkeypatch) -> None:
    """A Kafka → Kafka link runs while ``fault()`` happens and the cluster gets back in sync; the query
    must not fail, and every record is copied once."""
    bootstrap = kafka_cluster.bootstrap
    feeder = Feeder(bootstrap, source, str(tmp_path / "unused"))
    feeder.add_orders(200)
    until, state = tmp_path / "stop", tmp_path / "driver"
    log = state.with_suffix(".log")
    monkeypatch.setenv("LASTAGENT_RUN_UNTIL", str(until))
    link = f"copy-{uuid.uuid4().hex[:8]}"
    proc = support.start_driver("kafka-driver", [bootstrap, source, str(tmp_path / "ckpt"), str(tmp_path / "arb"), link,
                                                 copy, PER_TRIGGER], None, state, master="local[2,4]")
    try:
        deadline = time.monotonic() + 300
        while not any((tmp_path / "ckpt" / "commits").glob("[0-9]*")):
            assert proc.poll() is None and time.monotonic() < deadline, f"no first epoch; see {log}"
            time.sleep(1)
        feeder.start()
        fault()
        assert proc.poll() is None, f"the query failed during the fault; see {log}:\n{_tail(log)}"
        in_sync(kafka_cluster)
    finally:
        code = _drain(proc, feeder, until)
    assert code == 0, f"the query failed (exit {code}); see {log}:\n{_tail(log)}"
    assert feeder.failed == [], f"the feeder's producer lost records: {feeder.failed[:5]}"
    once(Counter(int(k) for k, _ in read_committed(bootstrap, copy, len(feeder.orders), 120)), feeder.orders,
         "Kafka → Kafka")
    with KafkaXAResource({"bootstrap.servers": bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []


@pytest.mark.timeout(1800)
def test_three_links_wait_out_writes_refused_for_too_few_in_sync_replicas(kafka_cluster, cluster_topic, spark,
                                                                          tmp_path, monkeypatch):
    """Every topic the links write has two replicas, on nodes 1 and 2: with node 2 away each partition has
    one in-sync replica, and min.insync.replicas=2 refuses every write (NOT_ENOUGH_REPLICAS) for 30 s,
    the sinks' outputs, the side topic and the dead letters alike."""
    from kafka.admin import NewTopic

    def on_nodes_1_and_2(partitions: int, prefix: str) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        admin = cluster_admin(kafka_cluster.bootstrap)
        try:
            admin.create_topics([NewTopic(name, replica_assignments={p: [1, 2] if p % 2 == 0 else [2, 1]
                                                                     for p in range(partitions)})])
        finally:
            admin.close()
        return name

    def refuse_writes_for_30_s(link: str, proc: subprocess.Popen, log: Path) -> None:
        kafka_cluster.stop(2)
        time.sleep(30)  # every epoch's writes are refused meanwhile
        assert proc.poll() is None, f"the driver failed while writes were refused; see {log}:\n{_tail(log)}"
        kafka_cluster.start(2)
        in_sync(kafka_cluster)

    _three_links_through(refuse_writes_for_30_s, kafka_cluster, cluster_topic, spark, tmp_path, monkeypatch,
                         output_topic=on_nodes_1_and_2)


@pytest.mark.timeout(1200)
def test_two_of_three_nodes_killed_for_15_s_are_waited_out(kafka_cluster, cluster_topic, tmp_path, monkeypatch):
    def two_nodes_away() -> None:
        kafka_cluster.kill(2)
        kafka_cluster.kill(3)
        time.sleep(15)
        kafka_cluster.up()  # both launched before either is waited for: a quorum needs them both

    _copy_link_through(two_nodes_away, kafka_cluster, cluster_topic(2, "orders"), cluster_topic(2, "copy"), tmp_path,
                       monkeypatch)
