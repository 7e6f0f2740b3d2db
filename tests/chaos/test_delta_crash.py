"""Crash matrix for the lastagent-delta sink: SIGKILL the driver at each named protocol point.

The driver (``python -m lastagent.examples delta-driver``, with the crash hook) reads a topic with ``lastagent-kafka``,
runs the demo transformer (poison records fail it) and writes ``lastagent-delta`` with a side
topic and dead letters (a dead-letter table, or a topic), several epochs of two tasks each. The
driver is killed at each point in turn, each time restarted from the checkpoint; at the end
every good record is in the Delta table exactly once (read by Spark's Delta reader), every
poison record once among the dead letters and every good record once in the side topic
(independent read_committed consumer), no transaction of the link is open, and no data file of
the link is left that its table does not reference.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections import Counter
from pathlib import Path

import pytest
import support
from support import read_committed

from lastagent.delta.files import parse_file_name
from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.chaos

ROWS = 400
POISON = {37, 251}
PER_TRIGGER = "100"


@pytest.fixture(scope="module")
def orders(kafka_admin, kafka_bootstrap) -> str:
    """A topic of ROWS records over 2 partitions, POISON of them not orders."""
    return support.orders_topic(kafka_admin, kafka_bootstrap, ROWS, POISON)


def run_driver(args: list[str], crash_at: str | None, state: Path, **kw) -> int:
    return support.run_driver("delta-driver", args, crash_at, state, **kw)


#: One query's history, killed at every named point in turn (the fault counter restarts with each
#: run), then run to the end. Epoch 0 is killed before its files, after them, after its Delta commit
#: (decided, branches open, not in Spark's commit log), inside the recovery of that, between the
#: recovery's branch commits, after the re-run epoch's phase 2 and before its dead-letter table
#: commit. Each run restarts from the previous run's checkpoint, as a user's restart would.
SCHEDULE = ["before_files:1", "after_files:2", "after_arbitration:1", "in_recovery:1", "between_branch_commits:1",
            "after_phase2:1", "before_dead_letter_table:1"]
#: Within make test's budget: the points where a decided epoch is left for recovery, and recovery
#: itself; ``make test-chaos-full`` runs the whole schedule (an undecided epoch's files, after_files, are
#: also removed in tests/integration/test_delta_sink.py's orphan-files test; between_branch_commits is killed in
#: make test by the kernel-table history below).
SHORT_SCHEDULE = ["after_arbitration:1", "in_recovery:1", "before_dead_letter_table:1"]


@pytest.mark.parametrize("session", support.sessions(default="daemon-off"))
def test_killed_at_every_point_in_turn_and_restarted_is_exactly_once(session, spark, kafka_bootstrap, new_topic,
                                                                      orders, tmp_path):
    """The history with Spark's Python daemon off (Windows, some managed runtimes; the integration tier runs
    this sink with it on); ``make test-chaos-full`` runs it in both sessions.

    The table is one users make with Spark SQL: column mapping (every column stored under a physical
    name), a NOT NULL column, a CHECK constraint and a generated column (docs/delta.md)."""
    table = str(tmp_path / "orders")
    spark.sql(f"CREATE TABLE delta.`{table}` (key STRING NOT NULL, value BINARY, topic STRING, partition INT, "
              "offset BIGINT, amount BIGINT, doubled BIGINT GENERATED ALWAYS AS (amount * 2)) USING delta "
              "TBLPROPERTIES ('delta.columnMapping.mode'='name')")
    spark.sql(f"ALTER TABLE delta.`{table}` ADD CONSTRAINT orders_only CHECK (amount >= 1000)")
    _kill_at_every_point_in_turn(spark, kafka_bootstrap, new_topic, orders, tmp_path, table, support.SESSIONS[session])
    assert all(r.doubled == 2 * r.amount for r in spark.read.format("delta").load(table).collect())


def test_killed_at_every_point_on_a_table_with_row_tracking_clustering_and_in_commit_timestamps(
        spark, kafka_bootstrap, new_topic, orders, tmp_path):
    """The same history on a table with what Delta gives a new table (deletion vectors, row tracking, in-commit
    timestamps, liquid clustering), whose commits go through Delta Kernel: besides every record once, every row
    has its own row id and the in-commit timestamps rise with each version."""
    table = str(tmp_path / "orders")
    spark.sql(f"CREATE TABLE delta.`{table}` (key STRING NOT NULL, value BINARY, topic STRING, partition INT, "
              "offset BIGINT, amount BIGINT) USING delta CLUSTER BY (amount) TBLPROPERTIES "
              "('delta.enableDeletionVectors'='true', 'delta.enableRowTracking'='true', "
              "'delta.enableInCommitTimestamps'='true')")
    # The points where a decided epoch waits for recovery, and recovery itself (the whole schedule in make
    # test-chaos-full): the kernel commit's own race is the same as delta-rs's, so fewer kills suffice here.
    _kill_at_every_point_in_turn(spark, kafka_bootstrap, new_topic, orders, tmp_path, table,
                                 support.SESSIONS["daemon-off"],
                                 SCHEDULE if support.FULL else ["after_arbitration:1", "between_branch_commits:1"])
    ids = spark.read.format("delta").load(table).select("_metadata.row_id").collect()
    assert len({r.row_id for r in ids}) == len(ids) == ROWS - len(POISON)
    stamps = [json.loads(f.read_text().splitlines()[0])["commitInfo"]["inCommitTimestamp"]
              for f in sorted(Path(table, "_delta_log").glob("*.json"))]
    assert stamps == sorted(set(stamps))


def _kill_at_every_point_in_turn(spark, kafka_bootstrap, new_topic, orders, tmp_path, table: str, conf,
                                 points: list[str] | None = None) -> None:
    side = new_topic(partitions=2)
    link = f"chaos-d-{uuid.uuid4().hex[:8]}"
    dead = str(tmp_path / "dead-letters")
    args = [kafka_bootstrap, orders, table, str(tmp_path / "ckpt"), link, "", side, PER_TRIGGER, dead]
    state = tmp_path / "crash"
    for point in points or (SCHEDULE if support.FULL else SHORT_SCHEDULE):
        state.write_text("0")
        code = run_driver(args, point, state, conf=conf)
        assert code == -signal.SIGKILL, f"the driver was not killed at {point} (exit {code}); see {state}.log"
        assert Path(str(state) + ".fired").read_text() == point.split(":")[0]
    assert run_driver(args, None, state, conf=conf) == 0, f"the last restart failed; see {state}.log"
    dead_rows = spark.read.format("delta").load(dead).select("key", "reason").collect()
    assert Counter(r.key for r in dead_rows) == Counter(str(i).encode() for i in POISON), "dead letters not once"
    assert {r.reason for r in dead_rows} == {"transformer-failed"}
    assert_exactly_once(spark, kafka_bootstrap, orders, table, side, link, extra_tables=[dead])


def test_task_killed_mid_write_is_retried_exactly_once(spark, kafka_bootstrap, new_topic, orders, tmp_path):
    """A task's Python worker dies mid-write; Spark retries it as a new attempt with new files
    and a new branch; the dead attempt's files and open branch never become visible."""
    dlq, side = new_topic(), new_topic(partitions=2)
    link = f"chaos-d-{uuid.uuid4().hex[:8]}"
    table = str(tmp_path / "orders")
    args = [kafka_bootstrap, orders, table, str(tmp_path / "ckpt"), link, dlq, side, PER_TRIGGER]
    state = tmp_path / "crash"
    assert run_driver(args, "task_mid_write:2", state, master="local[2,4]") == 0, f"see {state}.log"
    assert Path(str(state) + ".fired").read_text() == "task_mid_write"
    assert_exactly_once(spark, kafka_bootstrap, orders, table, side, link)
    dead = read_committed(kafka_bootstrap, dlq, len(POISON))
    assert Counter(k for k, _ in dead) == Counter(str(i).encode() for i in POISON), "dead letters not exactly once"


def assert_exactly_once(spark, bootstrap: str, topic: str, table: str, side: str, link: str,
                        extra_tables: list[str] = ()) -> None:
    good = [i for i in range(ROWS) if i not in POISON]
    rows = spark.read.format("delta").load(table).select("key", "topic", "amount").collect()
    counts = Counter(int(r.key) for r in rows)
    assert sorted(counts) == good, f"lost rows: {sorted(set(good) - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"duplicates in the table: {[k for k, c in counts.items() if c > 1][:10]}"
    assert {r.topic for r in rows} == {topic}
    follow = read_committed(bootstrap, side, len(good))
    side_counts = Counter(json.loads(v)["key"] for _, v in follow)
    assert sorted(int(k) for k in side_counts) == good and max(side_counts.values()) == 1, "side topic not exactly once"
    with KafkaXAResource({"bootstrap.servers": bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []
    from deltalake import DeltaTable

    for path in [table, *extra_tables]:
        referenced = {Path(p).name for p in DeltaTable(path).file_uris()}
        on_disk = {p.name for p in Path(path).rglob("*.parquet") if parse_file_name(p.name)}
        assert on_disk == referenced, f"files no decision references in {path}: {sorted(on_disk - referenced)[:5]}"
