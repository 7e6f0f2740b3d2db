"""Three queries in one driver, SIGKILLed at named points: two lastagent.epoch MERGE pipelines and a plain
foreachBatch that appends through the driver's global session.

The driver (``python -m lastagent.examples shared-driver``, with the crash hook) runs the three queries at once;
it is killed where one of the blocks stands at a named point (the other queries wherever they are), and restarted
from the checkpoints as a user would. At the end both MERGE tables hold the last change per key, every event of
each was sent once (an independent read_committed consumer), no transaction of either link is open, and the plain
query's table holds every row (at least once, as Spark's foreachBatch gives) with no commit carrying a block's
``txn`` or record: the blocks' Delta settings never reached it.
"""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import pytest
import support
from support import produce_changes, read_committed

from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.chaos

KEYS, CHANGES, PER_TRIGGER = 20, 120, "40"

#: A block's MERGE committed with its branches open (decided, not in Spark's commit log); then a block's branches
#: prepared before its MERGE (undecided). The last run goes to the end.
SCHEDULE = ["after_arbitration:2", "after_prepare:3"]


def _produce(bootstrap: str, topic: str) -> None:
    produce_changes(bootstrap, topic, CHANGES, KEYS)


def _log_actions(table: Path) -> list[dict]:
    return [json.loads(line) for entry in sorted((table / "_delta_log").glob("*.json"))
            for line in entry.read_text().splitlines()]


def test_two_block_queries_and_a_plain_one_killed_and_restarted(spark, kafka_bootstrap, new_topic, tmp_path):
    sources = [new_topic(partitions=2) for _ in range(3)]
    events = [new_topic(partitions=2, prefix="events") for _ in range(2)]
    for source in sources:
        _produce(kafka_bootstrap, source)
    base = tmp_path / "tables"
    for name in ("a", "b", "c"):
        spark.sql(f"CREATE TABLE delta.`{base / name}` (id BIGINT, amount BIGINT) USING delta")
    links = [f"shared-{n}-{uuid.uuid4().hex[:6]}" for n in ("a", "b")]
    args = [kafka_bootstrap, str(base), sources[0], events[0], links[0], sources[1], events[1], links[1], sources[2],
            PER_TRIGGER]
    for n, point in enumerate(SCHEDULE):
        state = tmp_path / f"run-{n}"
        code = support.run_driver("shared-driver", args, point, state)
        assert code == -signal.SIGKILL and Path(f"{state}.fired").read_text() == point.split(":")[0], (
            f"run {n} was to be killed at {point}, exit {code}; see {state}.log")
    state = tmp_path / "run-last"
    assert support.run_driver("shared-driver", args, None, state) == 0, f"see {state}.log"

    expected = {i: max(j for j in range(CHANGES) if j % KEYS == i) for i in range(KEYS)}
    for name, topic, link in zip(("a", "b"), events, links):
        rows = spark.read.format("delta").load(str(base / name)).collect()
        assert {r.id: r.amount for r in rows} == expected and len(rows) == KEYS, name
        sent = sorted(json.loads(v)["amount"] for _, v in read_committed(kafka_bootstrap, topic, CHANGES))
        assert sent == list(range(CHANGES)), (name, f"missing {sorted(set(range(CHANGES)) - set(sent))}, twice "
                                                    f"{sorted({a for a in sent if sent.count(a) > 1})}")
        with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
            assert xa.recover(f"lastagent-{link}-") == [], name

    plain = spark.read.format("delta").load(str(base / "c")).collect()
    assert sorted({r.amount for r in plain}) == list(range(CHANGES))  # every row (a replayed batch may add twice)
    actions = _log_actions(base / "c")
    assert [a for a in actions if "txn" in a] == []
    assert [a["commitInfo"].get("userMetadata") for a in actions
            if "commitInfo" in a and a["commitInfo"].get("userMetadata")] == []
