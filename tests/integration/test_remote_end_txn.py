"""docs/design.md's central bet, proven against the pinned broker: a Kafka transaction whose
producer was SIGKILLed after flushing is finished from another process by its handle
(transactional.id, producer id, producer epoch) with EndTxn through kafka-python's protocol layer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from support import read_committed

from lastagent.kafka.wire import EndTxnResult, TransactionCoordinatorClient

pytestmark = pytest.mark.integration

# The producer process: writes n records inside a transaction, flushes, reports, then waits
# to be killed. It never commits, aborts or closes.
_PRODUCER = r"""
import sys, time
from confluent_kafka import Producer
bs, topic, tid, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
p = Producer({"bootstrap.servers": bs, "transactional.id": tid, "transaction.timeout.ms": 600000})
p.init_transactions(60)
p.begin_transaction()
for i in range(n):
    p.produce(topic, key=str(i).encode(), value=f"{tid}:{i}".encode(), partition=i % 2)
assert p.flush(60) == 0
print("PREPARED", flush=True)
time.sleep(600)
"""


def _prepare_and_kill(bootstrap: str, topic: str, tid: str, n: int) -> None:
    child = subprocess.Popen([sys.executable, "-c", _PRODUCER, bootstrap, topic, tid, str(n)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "PREPARED"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


def _end(client: TransactionCoordinatorClient, tid: str, pid: int, epoch: int, commit: bool) -> EndTxnResult:
    # While the coordinator writes markers it answers CONCURRENT_TRANSACTIONS: retry, bounded.
    for _ in range(100):
        result = client.end_txn(tid, pid, epoch, commit)
        if result.error != "CONCURRENT_TRANSACTIONS":
            return result
        time.sleep(0.1)
    raise AssertionError(f"{tid}: still CONCURRENT_TRANSACTIONS after 10s")


def _handle(kafka_admin, tid: str) -> tuple[int, int]:
    desc = kafka_admin.describe_transactions([tid])[tid]
    assert desc.state.value == "Ongoing", desc
    return desc.producer_id, desc.producer_epoch


def test_commit_from_another_process_after_sigkill(kafka_bootstrap, kafka_admin, new_topic):
    topic = new_topic(partitions=2)
    tid = f"bet-commit-{uuid.uuid4().hex[:8]}"
    _prepare_and_kill(kafka_bootstrap, topic, tid, 10)
    pid, epoch = _handle(kafka_admin, tid)
    with TransactionCoordinatorClient({"bootstrap.servers": kafka_bootstrap}) as client:
        first = _end(client, tid, pid, epoch, commit=True)
        assert first.ok, first
        # Sent twice: transaction protocol v2 bumped the epoch; the retry is recognised as done.
        second = _end(client, tid, pid, epoch, commit=True)
        assert second.ok, second
        # The opposite verb for a finished branch is refused, not silently applied.
        assert _end(client, tid, pid, epoch, commit=False).error == "INVALID_TXN_STATE"
    values = [v for _, v in read_committed(kafka_bootstrap, topic, expect=10)]
    assert sorted(values) == sorted(f"{tid}:{i}".encode() for i in range(10))
    assert kafka_admin.describe_transactions([tid])[tid].state.value == "CompleteCommit"


def test_abort_from_another_process_after_sigkill(kafka_bootstrap, kafka_admin, new_topic):
    topic = new_topic(partitions=2)
    tid = f"bet-abort-{uuid.uuid4().hex[:8]}"
    _prepare_and_kill(kafka_bootstrap, topic, tid, 10)
    pid, epoch = _handle(kafka_admin, tid)
    with TransactionCoordinatorClient({"bootstrap.servers": kafka_bootstrap}) as client:
        assert _end(client, tid, pid, epoch, commit=False).ok
        assert _end(client, tid, pid, epoch, commit=False).ok
        assert _end(client, tid, pid, epoch, commit=True).error == "INVALID_TXN_STATE"
    # A committed marker record from a second producer bounds the read: nothing of tid appears.
    other = f"bet-other-{uuid.uuid4().hex[:8]}"
    _prepare_and_kill(kafka_bootstrap, topic, other, 2)
    opid, oepoch = _handle(kafka_admin, other)
    with TransactionCoordinatorClient({"bootstrap.servers": kafka_bootstrap}) as client:
        assert _end(client, other, opid, oepoch, commit=True).ok
    values = [v for _, v in read_committed(kafka_bootstrap, topic, expect=2)]
    assert sorted(values) == [f"{other}:0".encode(), f"{other}:1".encode()]
