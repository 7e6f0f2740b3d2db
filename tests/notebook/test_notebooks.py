"""The notebooks, run top to bottom headless (``headless.run``) against the local broker and local paths."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Producer
from headless import run
from support import read_committed

pytestmark = pytest.mark.notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.py"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_cold_first_run_on_an_empty_topic_explains_itself(notebook, spark, kafka_bootstrap, tmp_path):
    """First run on a new broker topic: no error; the notebook says there is nothing yet and why."""
    topic = f"nb-{uuid.uuid4().hex[:8]}"
    out = run(notebook, spark, {"bootstrap": kafka_bootstrap, "base": str(tmp_path), "topic": topic,
                                "send_examples": "false"})
    assert "Traceback" not in out and "Error" not in out, out


def test_kafka_to_delta_notebook_after_records(spark, kafka_bootstrap, tmp_path):
    """Cold run, then records (one poison) and a second run: the table, dead letters and status show them."""
    notebook = next(p for p in NOTEBOOKS if p.stem == "kafka_to_delta_exactly_once")
    topic = f"nb-{uuid.uuid4().hex[:8]}"
    widgets = {"bootstrap": kafka_bootstrap, "base": str(tmp_path), "topic": topic}
    cold = run(notebook, spark, widgets)
    assert f"created topic {topic}" in cold
    assert f"this run read 0 records from {topic}" in cold
    assert f"no table at {tmp_path}/tables/{topic} yet: {topic} had no records" in cold
    assert f"link {topic}-to-delta: nothing decided yet" in cold

    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(20):
        p.produce(topic, key=str(i).encode(), value=(b"poison" if i == 7 else f"order-1-{i}".encode()))
    assert p.flush(30) == 0
    warm = run(notebook, spark, widgets)
    assert "created topic" not in warm
    assert f"this run read 20 records from {topic}" in warm
    assert "lastagent status: exit 0" in warm, warm
    assert "userMetadata" in warm and '"kafka_branches"' in warm  # DESCRIBE HISTORY was displayed
    assert "run figures: 1 epochs with records" in warm and "max_offsets_behind" in warm  # the chart's table
    keys = Counter(r.key for r in spark.read.format("delta").load(f"{tmp_path}/tables/{topic}").collect())
    assert keys == Counter(str(i) for i in range(20) if i != 7)
    assert [k for k, _ in read_committed(kafka_bootstrap, f"{topic}-dead-letters", 1)] == [b"7"]


def test_reliable_groups_notebook_drops_a_producers_retries(spark, kafka_bootstrap, tmp_path):
    """First run: each message once, ordered group in order, a refusal in the dead letters. Second run (the
    producer sends everything again): only duplicates, nothing new in the table."""
    notebook = next(p for p in NOTEBOOKS if p.stem == "reliable_groups")
    topic = f"nb-{uuid.uuid4().hex[:8]}"
    widgets = {"bootstrap": kafka_bootstrap, "base": str(tmp_path), "topic": topic}
    first = run(notebook, spark, widgets)
    assert f"sent 13 messages to {topic}" in first
    assert "this run: 9 delivered, 3 duplicates dropped, 1 refused, 2 groups terminated" in first, first
    table = f"{tmp_path}/tables/{topic}-once"
    rows = spark.read.format("delta").load(table)
    assert not [c for c in rows.columns if c.startswith("_lastagent")], rows.columns  # refusals: dead letters only
    values = Counter(r.value for r in rows.collect())
    assert values == Counter([f"order-A/{i}" for i in range(4)] + [f"order-B/{i}" for i in range(4)] + ["receipt-7/-"])
    refused = spark.read.format("delta").load(f"{tmp_path}/tables/{topic}-refused").collect()
    assert [(bytes(r.value), r.reason) for r in refused] == [(b"order-C/0", "INVALID_GROUP_PARAMETER")]
    again = run(notebook, spark, widgets)
    assert "this run: 0 delivered, 12 duplicates dropped, 1 refused, 0 groups terminated" in again, again
    assert spark.read.format("delta").load(table).count() == 9


def test_merge_cdc_notebook_survives_a_driver_lost_after_a_merge(spark, kafka_bootstrap, tmp_path):
    """Debezium-style changes MERGEd with events out; run 1 dies right after epoch 1's MERGE (events prepared,
    invisible), run 2 finishes it from the record: the table is the last change per order, each event once."""
    notebook = next(p for p in NOTEBOOKS if p.stem == "merge_cdc_with_events")
    topic = f"nb-{uuid.uuid4().hex[:8]}"
    out = run(notebook, spark, {"bootstrap": kafka_bootstrap, "base": str(tmp_path), "topic": topic,
                                "die_after_merge_of_epoch": "1"})
    assert f"sent 43 changes and 1 poison record to {topic}" in out
    assert "run 1 stopped: the driver was lost" in out, out
    between = next(line for line in out.splitlines() if line.startswith("after run 1:"))
    seen = int(between.split("sees ")[1].split()[0])
    assert 0 < seen < 39, between  # epoch 0's events only: epoch 1's are prepared, not committed
    assert "branch(es) in doubt, of epoch(s) [1]; recovery will commit" in out, out
    assert "the table matches the last change per order: True (9 orders)" in out, out
    assert "events: 39 read, 39 distinct changes of 39, sent twice: 0, missing: 0" in out, out
    assert "dead letters: 1: 'order 5 shipped?' (not a change record)" in out, out
    rows = spark.read.format("delta").load(f"{tmp_path}/tables/{topic}").collect()
    assert sorted(r.id for r in rows) == [i for i in range(12) if i % 4] and len({r.sk for r in rows}) == 9
    assert {r.status for r in rows} == {"shipped"}
    events = read_committed(kafka_bootstrap, f"{topic}-events", 39)
    assert len(events) == 39 and len(set(events)) == 39
