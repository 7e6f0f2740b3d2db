"""Crash schedule for lastagent.epoch: SIGKILL the driver of a foreachBatch MERGE pipeline at each named point.

The driver (``python -m lastagent.examples merge-driver``, with the crash hook) reads change records with
``lastagent-kafka`` and, in ``foreachBatch``, sends one event per change to a topic (``e.to_kafka``, two branches per
epoch) and MERGEs the newest amount per key into a Delta table with an identity column and liquid clustering. It
is killed at each point in turn, each time restarted from the checkpoint as a user would; at the end the table
holds the last change per key (Spark's reader), every event was sent once (an independent read_committed
consumer), each epoch has one MERGE commit, and no transaction of the link is open.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import uuid
from pathlib import Path

import pytest
import support
from support import read_committed

from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.chaos

KEYS, CHANGES, PER_TRIGGER = 20, 120, "40"

#: One query's history, killed at every point in turn: epoch 1's branches prepared before its MERGE (undecided:
#: the restart's claim rolls them back and the epoch is written again); right after the MERGE committed (decided,
#: branches open, not in Spark's commit log); right after the next run's claim commit, before its recovery; between
#: the recovery's branch commits. The last run goes to the end: it finishes the decided branches, Spark replays
#: the decided epoch, and Delta skips its MERGE.
SCHEDULE = ["after_prepare:2", "after_arbitration:1", "in_recovery:1", "between_branch_commits:1"]
#: Within make test's budget; ``make test-chaos-full`` runs the whole schedule. A block killed with its branches
#: prepared before its MERGE (after_prepare) is in make test too: tests/chaos/test_shared_driver_crash.py.
SHORT_SCHEDULE = ["after_arbitration:1", "between_branch_commits:1"]


def _status(bootstrap: str, table: str, link: str) -> tuple[int, dict]:
    """``lastagent status --json`` of the link, as an operator runs it: (exit code, document)."""
    from lastagent.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["status", "--link", link, "--table", table, "--bootstrap-servers", bootstrap, "--json"])
    assert code in (0, 1), out.getvalue()
    return code, json.loads(out.getvalue())


def test_killed_at_every_point_in_turn_and_restarted_is_exactly_once(spark, kafka_bootstrap, new_topic, tmp_path):
    from confluent_kafka import Producer

    source, events = new_topic(partitions=2), new_topic(partitions=2, prefix="events")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(CHANGES):
        producer.produce(source, key=str(i % KEYS).encode(), value=json.dumps({"id": i % KEYS, "amount": i}).encode(),
                         partition=i % 2)
    assert producer.flush(30) == 0
    table, link = str(tmp_path / "orders"), f"merge-{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE TABLE delta.`{table}` (sk BIGINT GENERATED ALWAYS AS IDENTITY, id BIGINT, amount BIGINT) "
              "USING delta CLUSTER BY (id)")
    args = [kafka_bootstrap, source, events, table, str(tmp_path / "ckpt"), link, PER_TRIGGER]
    for n, point in enumerate(SCHEDULE if support.FULL else SHORT_SCHEDULE):
        state = tmp_path / f"run-{n}"
        code = support.run_driver("merge-driver", args, point, state)
        fired = Path(f"{state}.fired")
        assert code == -signal.SIGKILL and fired.read_text() == point.split(":")[0], (
            f"run {n} was to be killed at {point}, exit {code}; see {state}.log")
        # What `lastagent status` tells the operator of the killed run: the open branches and what recovery does.
        code, status = _status(kafka_bootstrap, table, link)
        decisions = {b["decision"] for b in status["in_doubt"]}
        if point.startswith("after_prepare"):  # prepared, never decided: rolled back by the next run
            assert code == 1 and decisions == {"rollback"}, status
        elif point.startswith("after_arbitration"):  # the MERGE decided them: committed by the next run
            assert code == 1 and decisions == {"commit"}, status
            assert {b["epoch"] for b in status["in_doubt"]} == {status["latest_decided_epoch"]}, status
        elif point.startswith("between_branch_commits"):
            assert code == 1 and "commit" in decisions, status
    state = tmp_path / "run-last"
    assert support.run_driver("merge-driver", args, None, state) == 0, f"see {state}.log"
    code, status = _status(kafka_bootstrap, table, link)
    assert code == 0 and not status["in_doubt"] and not status["hazards"], status
    assert status["decided_epochs"] == CHANGES // int(PER_TRIGGER), status

    expected = {i: max(j for j in range(CHANGES) if j % KEYS == i) for i in range(KEYS)}
    rows = spark.read.format("delta").load(table).collect()
    assert {r.id: r.amount for r in rows} == expected and len(rows) == KEYS
    sent = sorted(json.loads(v)["amount"] for _, v in read_committed(kafka_bootstrap, events, CHANGES))
    assert sent == list(range(CHANGES)), f"events missing {sorted(set(range(CHANGES)) - set(sent))}, " \
                                         f"twice {sorted({a for a in sent if sent.count(a) > 1})}"
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").select("operation", "userMetadata").collect()
    merged = sorted(json.loads(r.userMetadata)["lastagent"]["epoch"] for r in history if r.operation == "MERGE")
    assert merged == list(range(CHANGES // int(PER_TRIGGER)))  # one MERGE per epoch
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []
