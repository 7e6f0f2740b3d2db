"""The Kafka XA resource on the real broker: prepare in one process, finish in another."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from support import read_committed

from lastagent import redact
from lastagent.core.branch_handle import BranchHandle
from lastagent.core.kafka_port import EndOutcome
from lastagent.errors import BranchError, TransactionFailed
from lastagent.kafka.branch import BranchWriter
from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.integration

# A task: prepares a branch, prints its handle (the commit message), then waits to be killed.
_TASK = r"""
import sys, time
from lastagent.kafka.branch import BranchWriter
bs, topic, tid, n, timeout_ms = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
w = BranchWriter({"bootstrap.servers": bs}, tid, timeout_ms)
for i in range(n):
    w.send(topic, f"{tid}:{i}".encode(), key=str(i).encode())
print(w.prepare().to_json(), flush=True)
time.sleep(600)
"""


def prepare_in_killed_process(bootstrap: str, topic: str, tid: str, n: int, timeout_ms: int = 600_000) -> BranchHandle:
    child = subprocess.Popen([sys.executable, "-c", _TASK, bootstrap, topic, tid, str(n), str(timeout_ms)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    return BranchHandle.from_json(line)


@pytest.fixture
def xa(kafka_bootstrap):
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as resource:
        yield resource


def _values(bootstrap: str, topic: str, expect: int) -> list[bytes]:
    return sorted(v for _, v in read_committed(bootstrap, topic, expect))


def test_prepared_branch_survives_sigkill_and_commits_once(kafka_bootstrap, new_topic, xa):
    topic = new_topic(partitions=3)
    tid = f"xa-{uuid.uuid4().hex[:8]}-0"
    handle = prepare_in_killed_process(kafka_bootstrap, topic, tid, 50)
    assert handle.records == 50 and handle.producer_id >= 0
    assert {t for t, _ in handle.partitions} == {topic}
    assert xa.commit(handle).outcome is EndOutcome.COMMITTED
    assert xa.commit(handle).outcome is EndOutcome.COMMITTED  # a retried commit is done, not an error
    assert _values(kafka_bootstrap, topic, 50) == sorted(f"{tid}:{i}".encode() for i in range(50))


def test_rollback_hides_records_and_is_idempotent(kafka_bootstrap, new_topic, xa):
    topic = new_topic()
    dead = prepare_in_killed_process(kafka_bootstrap, topic, f"xa-{uuid.uuid4().hex[:8]}-0", 20)
    assert xa.rollback(dead).outcome is EndOutcome.ROLLED_BACK
    assert xa.rollback(dead).outcome is EndOutcome.ROLLED_BACK
    live = prepare_in_killed_process(kafka_bootstrap, topic, f"xa-{uuid.uuid4().hex[:8]}-1", 3)
    assert xa.commit(live).outcome is EndOutcome.COMMITTED
    assert _values(kafka_bootstrap, topic, 3) == sorted(f"{live.transactional_id}:{i}".encode() for i in range(3))


def test_commit_after_rollback_is_not_committed(kafka_bootstrap, new_topic, xa):
    topic = new_topic()
    handle = prepare_in_killed_process(kafka_bootstrap, topic, f"xa-{uuid.uuid4().hex[:8]}-0", 2)
    assert xa.rollback(handle).outcome is EndOutcome.ROLLED_BACK
    result = xa.commit(handle)
    assert result.outcome is EndOutcome.NOT_COMMITTED
    assert "CompleteAbort" in result.detail


def test_rollback_after_commit_is_heuristic(kafka_bootstrap, new_topic, xa):
    topic = new_topic()
    handle = prepare_in_killed_process(kafka_bootstrap, topic, f"xa-{uuid.uuid4().hex[:8]}-0", 2)
    assert xa.commit(handle).outcome is EndOutcome.COMMITTED
    assert xa.rollback(handle).outcome is EndOutcome.HEURISTIC_COMMIT


def test_recover_lists_open_branches_of_a_prefix_only(kafka_bootstrap, new_topic, xa):
    topic = new_topic()
    link = f"xa-{uuid.uuid4().hex[:8]}"
    mine = [prepare_in_killed_process(kafka_bootstrap, topic, f"{link}-{i}", 1) for i in range(3)]
    other = prepare_in_killed_process(kafka_bootstrap, topic, f"other-{uuid.uuid4().hex[:8]}-0", 1)
    try:
        found = xa.recover(link + "-")
        assert sorted(t.transactional_id for t in found) == sorted(h.transactional_id for h in mine)
        by_id = {t.transactional_id: t for t in found}
        for h in mine:
            assert (by_id[h.transactional_id].producer_id, by_id[h.transactional_id].producer_epoch) == (
                h.producer_id, h.producer_epoch)
        results = xa.end_all([t.handle() for t in found], commit=False)
        assert {r.outcome for r in results} == {EndOutcome.ROLLED_BACK}
        assert xa.recover(link + "-") == []
    finally:
        xa.rollback(other)


def test_expired_branch_is_reported_not_committed(kafka_bootstrap, new_topic, xa):
    topic = new_topic()
    handle = prepare_in_killed_process(kafka_bootstrap, topic, f"xa-{uuid.uuid4().hex[:8]}-0", 5, timeout_ms=1000)
    deadline = time.monotonic() + 60
    while xa.recover(handle.transactional_id) and time.monotonic() < deadline:
        time.sleep(0.5)  # the broker aborts it after transaction.timeout.ms
    result = xa.commit(handle)
    assert result.outcome is EndOutcome.NOT_COMMITTED, result
    assert _values(kafka_bootstrap, topic, 0) == []


def test_new_producer_of_same_id_fences_the_old_branch(kafka_bootstrap, new_topic, xa):
    topic = new_topic()
    tid = f"xa-{uuid.uuid4().hex[:8]}-0"
    old = prepare_in_killed_process(kafka_bootstrap, topic, tid, 4)
    new = BranchWriter({"bootstrap.servers": kafka_bootstrap}, tid, 600_000)  # fences `old`
    new.send(topic, b"new")
    new_handle = new.prepare()
    assert xa.commit(old).outcome is EndOutcome.NOT_COMMITTED
    assert xa.commit(new_handle).outcome is EndOutcome.COMMITTED
    assert _values(kafka_bootstrap, topic, 1) == [b"new"]


def test_read_only_branch_has_nothing_to_end(kafka_bootstrap, xa):
    w = BranchWriter({"bootstrap.servers": kafka_bootstrap}, f"xa-{uuid.uuid4().hex[:8]}-0", 600_000)
    handle = w.prepare()
    assert handle.read_only
    assert xa.commit(handle).outcome is EndOutcome.NOTHING_TO_END


def test_broker_transaction_limits(xa):
    assert xa.broker_max_timeout_ms() >= 3_600_000


def test_a_record_the_broker_refuses_fails_prepare(kafka_bootstrap, new_topic):
    """Delivery reports come for failures only; a failed record must still stop the branch."""
    topic = new_topic(partitions=1)
    w = BranchWriter({"bootstrap.servers": kafka_bootstrap, "message.timeout.ms": "5000"},
                     f"xa-{uuid.uuid4().hex[:8]}-0", 60_000)
    w.send(topic, b"fine")
    # The topic has one partition. Once the producer has the topic's metadata, produce() refuses
    # at once; before that the record fails in delivery and prepare must say so. Either stops it.
    with pytest.raises(BranchError, match=rf"record #1 of the branch \(topic {topic} partition 7, null key\): "
                                          r".*Unknown partition"):
        w.send(topic, b"nowhere", partition=7)
        w.prepare(flush_timeout_s=30)
    w.abort_local()


def test_a_record_larger_than_the_broker_takes_fails_fast_naming_topic_partition_key_digest_and_limit(
        kafka_bootstrap, new_topic):
    """The client's message.max.bytes raised above the broker's: the broker refuses the record, the
    transaction must abort, and the next send (or the prepare) says why."""
    topic = new_topic(partitions=1)
    w = BranchWriter({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": "10000000"},
                     f"xa-{uuid.uuid4().hex[:8]}-0", 60_000)
    with pytest.raises(TransactionFailed, match=rf"record #\d+ of the branch \(topic {topic} partition 0, key "
                                                rf"{redact.digest(b'big')}\): .*too large.* \(MSG_SIZE_TOO_LARGE; the "
                                                r"record has 2000003 bytes, .* the broker's message.max.bytes"):
        w.send(topic, b"x" * 2_000_000, key=b"big")
        for _ in range(50):
            w.send(topic, b"x" * 2_000_000, key=b"big")
        w.prepare(flush_timeout_s=30)
    w.abort_local()


def _ongoing(admin, transactional_id: str) -> bool:
    """Whether the broker holds transactional_id's transaction open, by a list and a describe."""
    listed = admin.list_transactions(state_filters=["Ongoing"])
    if any(t.transactional_id == transactional_id for rows in listed.values() for t in rows):
        return True
    return admin.describe_transactions([transactional_id])[transactional_id].state.value == "Ongoing"


@pytest.mark.parametrize("records_before", [0, 3])
def test_a_record_the_broker_refuses_ends_the_branch_at_once_naming_its_position_not_its_contents(
        kafka_bootstrap, kafka_admin, new_topic, records_before):
    """A topic whose max.message.bytes is below the record while the producer's own limit (1 MB by
    default) lets it through: the broker refuses it in delivery. prepare() must fail within seconds,
    name the record's position (index in the branch, topic, partition, key digest) and the broker's
    reason, never its key or value, and leave no open transaction on the broker (an open one holds
    the partition's last stable offset for every read_committed reader)."""
    topic = new_topic(partitions=1, max_message_bytes=1024)
    tid = f"xa-refused-{uuid.uuid4().hex[:8]}"
    secret_key, secret_value = f"key-{uuid.uuid4().hex}".encode(), b"payload-" + b"S" * 5000
    w = BranchWriter({"bootstrap.servers": kafka_bootstrap}, tid, 600_000)
    for i in range(records_before):
        w.send(topic, b"fine", key=str(i).encode())
    if records_before:
        w._flush(30)  # delivered before the refused one: its batch is not the first
    w.send(topic, secret_value, key=secret_key)
    started = time.monotonic()
    with pytest.raises(TransactionFailed) as failed:
        w.prepare(flush_timeout_s=120)
    assert time.monotonic() - started < 60, "an upper bound against a hang, not a performance figure"
    text = str(failed.value)
    assert (f"record #{records_before} of the branch (topic {topic} partition 0, key {redact.digest(secret_key)}): "
            "Broker: Message size too large (MSG_SIZE_TOO_LARGE") in text
    assert secret_key.decode() not in text and "payload-" not in text and "SSSS" not in text
    assert failed.value.aborted and "the branch was aborted" in text
    assert failed.value.refused[0].index == records_before
    assert not _ongoing(kafka_admin, tid)
    with pytest.raises(BranchError, match="ended after a failure"):
        w.send(topic, b"more")  # the writer ended the branch: nothing more goes into it
    w.abort_local()  # and ending it again is a no-op


def test_the_pinned_broker_runs_transaction_protocol_2(kafka_bootstrap):
    """Kafka 4 finalizes transaction.version 2 (KIP-890): ends are classified by epoch + 1."""
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.transaction_protocol() == 2


def test_released_producer_leaves_its_prepared_branch_open_and_abort_local_ends_it(kafka_bootstrap, new_topic):
    """Tasks free their producer right after prepare. That must leave the transaction open for the
    driver (librdkafka's destroy sends no EndTxn), while a task that fails before prepare aborts
    its own branch. A client upgrade that changes either behaviour fails here, not in a
    production epoch."""
    from lastagent.kafka.branch import describe_open

    topic = new_topic()
    config = {"bootstrap.servers": kafka_bootstrap}
    kept = BranchWriter(config, f"release-{uuid.uuid4().hex[:8]}", 60_000)
    kept.send(topic, b"kept")
    handle = kept.prepare()
    kept.release()
    assert kept._producer is None  # freed now, not at some later collection
    assert describe_open(config, handle.transactional_id)[:2] == (handle.producer_id, handle.producer_epoch)
    aborted = BranchWriter(config, f"abort-{uuid.uuid4().hex[:8]}", 60_000)
    aborted.send(topic, b"aborted")
    aborted_handle = aborted.prepare()
    aborted.abort_local()
    # Aborted: PrepareAbort while the coordinator still writes the markers, CompleteAbort after.
    with pytest.raises(BranchError, match="broker says (Prepare|Complete)Abort"):
        describe_open(config, aborted_handle.transactional_id)
    with KafkaXAResource(config) as xa:
        assert xa.commit(handle).outcome is EndOutcome.COMMITTED
    assert [v for _, v in read_committed(kafka_bootstrap, topic, 1)] == [b"kept"]
