"""The driver's protocol steps against the real broker and a Delta arbitration table."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from support import read_committed

from lastagent.core.arbitration import ArbitrationRecord
from lastagent.errors import DecidedBranchLostError
from lastagent.kafka.branch import BranchWriter
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions
from lastagent.sinks.link_ports import link_committer

pytestmark = pytest.mark.integration


@pytest.fixture
def options(kafka_bootstrap, tmp_path):
    return KafkaSinkOptions.parse({
        "kafka.bootstrap.servers": kafka_bootstrap, "link": f"c-{uuid.uuid4().hex[:8]}",
        "arbitrationTable": str(tmp_path / "arb"), "checkpointLocation": str(tmp_path / "ckpt")})


def _branches(options, topic, n, timeout_ms=600_000, attempt=0):
    handles = []
    for p in range(n):
        w = BranchWriter(options.client_config, options.transactional_id(1, p, attempt), timeout_ms)
        w.send(topic, f"{p}-{attempt}".encode())
        handles.append(w.prepare())
    return handles


def _query_metadata(checkpoint, query_id):
    """The file Spark writes when a query is created: the owner a driver-side abort claims the link for."""
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "metadata").write_text(f'{{"id":"{query_id}"}}\n')


def _decide_only(committer, epoch, handles):
    owner = committer.store.ownership(committer.link) or committer.store.claim(committer.link, "q")
    committer.store.decide(ArbitrationRecord(committer.link, epoch, f"{committer.link}:{epoch}",
                                             tuple(h.to_json() for h in handles)), owner.generation)


def test_commit_decides_commits_and_rolls_back_superseded(options, kafka_bootstrap, new_topic):
    topic = new_topic()
    stale = _branches(options, topic, 1, attempt=1)  # a failed attempt's branch, never reported
    live = _branches(options, topic, 2)
    with link_committer(options) as c:
        c.store.claim(c.link, "q")
        record = c.commit(0, 1, live)
        assert len(record.branches) == 2
        assert c.in_doubt() == []
    assert sorted(v for _, v in read_committed(kafka_bootstrap, topic, 2)) == [b"0-0", b"1-0"]
    assert stale  # its records never became visible (checked by the exact list above)


def test_start_completes_a_decided_epoch_missing_from_spark_commit_log(options, kafka_bootstrap, new_topic):
    topic = new_topic()
    with link_committer(options) as c:
        _decide_only(c, 0, _branches(options, topic, 3))  # crash after the arbitration commit
        assert c.start(owner="q")[1] == 0
        assert c.in_doubt() == []
    assert len(read_committed(kafka_bootstrap, topic, 3)) == 3


def test_undecided_branches_are_rolled_back_after_the_runs_claim_and_other_links_left_alone(
        options, kafka_bootstrap, new_topic, tmp_path):
    """A sink's start may run while an earlier run still runs, so it leaves an undecided branch open;
    after the new run's claim its first commit rolls it back (presumed abort)."""
    from dataclasses import replace

    topic = new_topic()
    commits = tmp_path / "ckpt" / "commits"
    commits.mkdir(parents=True)
    (commits / "0").write_text("v1\n{}")
    # A link whose name extends this one's: its ids share our prefix, yet they are not ours.
    neighbour = replace(options, link=options.link + "-1")
    theirs = _branches(neighbour, topic, 1)
    with link_committer(options) as c:
        _decide_only(c, 0, [])
        undecided = _branches(options, topic, 2)
        assert {t.transactional_id for t, d, _ in c.in_doubt() if d == "rollback"} == {
            h.transactional_id for h in undecided}
        ownership, decided = c.start(owner="q")
        assert decided == 0 and ownership is not None
        assert {t.transactional_id for t, _, _ in c.in_doubt()} == {h.transactional_id for h in undecided}
        claimed = c.store.claim(c.link, "q", run="run-2")  # the new run's first task
        assert claimed.generation == ownership.generation + 1 and claimed.run == "run-2"
        assert c.store.claim(c.link, "q", run="run-2") == claimed  # its other tasks change nothing
        c.commit(1, claimed.generation, [])
        assert c.in_doubt() == []
    with link_committer(neighbour) as n:
        assert [t.transactional_id for t, _, _ in n.in_doubt()] == [theirs[0].transactional_id]
        n.xa.end_all(theirs, commit=False)
    assert read_committed(kafka_bootstrap, topic, 0, timeout_s=3) == []


def test_abort_after_decision_completes_it_and_abort_before_rolls_back(options, kafka_bootstrap, new_topic, tmp_path):
    _query_metadata(tmp_path / "ckpt", "q")
    topic = new_topic()
    with link_committer(options) as c:
        decided = _branches(options, topic, 2)
        _decide_only(c, 0, decided)
        c.abort(0, 1, decided)  # the record stands
        assert c.store.ownership(c.link).generation == 1
        undecided = _branches(options, topic, 2, attempt=1)
        c.abort(1, 1, undecided[:1])  # presumed abort: the reported and the unreported branch
        assert c.in_doubt() == []
        assert c.store.ownership(c.link).generation == 2, "the undecided epoch's abort closed its run"
    assert sorted(v for _, v in read_committed(kafka_bootstrap, topic, 2)) == [b"0-0", b"1-0"]


@pytest.mark.parametrize("reported", [False, True])
def test_abort_rolls_back_what_late_tasks_open_while_it_settles(options, kafka_bootstrap, new_topic, tmp_path,
                                                                 reported):
    """query.stop() kills an epoch's tasks in the JVM, but a Python worker that has its input goes on and opens
    its branch after the abort listed the link's transactions (issue 44): the abort keeps rolling back for
    ``settle_s``, with or without task messages, so nothing of the link stays open after it returns."""
    _query_metadata(tmp_path / "ckpt", "q")
    topic = new_topic()
    with link_committer(options) as c:
        c.store.claim(c.link, "q")
        first = _branches(options, topic, 1) if reported else []
        late = threading.Timer(0.5, _branches, (options, topic, 1), {"attempt": 1})
        late.start()
        c.abort(0, 1 if reported else None, first, settle_s=2.5)
        late.join()
        assert c.in_doubt() == []
    assert read_committed(kafka_bootstrap, topic, 0, timeout_s=3) == []


def test_expired_decided_branch_fails_loudly_naming_link_epoch_branch(options, new_topic):
    topic = new_topic()
    with link_committer(options) as c:
        handles = _branches(options, topic, 1, timeout_ms=1000)
        _decide_only(c, 4, handles)
        deadline = time.monotonic() + 60
        while c.xa.recover(options.id_prefix) and time.monotonic() < deadline:
            time.sleep(0.5)  # the broker expires it
        with pytest.raises(DecidedBranchLostError) as err:
            c.start(owner="q")
    message = str(err.value)
    assert f"link {options.link!r} epoch 4" in message and handles[0].transactional_id in message
