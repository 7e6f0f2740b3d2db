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
    out = run(notebook, spark, {"bootstrap": kafka_bootstrap, "base": str(tmp_path), "topic": topic})
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
    keys = Counter(r.key for r in spark.read.format("delta").load(f"{tmp_path}/tables/{topic}").collect())
    assert keys == Counter(str(i) for i in range(20) if i != 7)
    assert [k for k, _ in read_committed(kafka_bootstrap, f"{topic}-dead-letters", 1)] == [b"7"]
