"""lastagent.epoch inside foreachBatch: a CDC stream MERGEd into Delta with one event per change to Kafka.

The table has an identity column, liquid clustering, row tracking and deletion vectors: features
lastagent-delta refuses (delta-rs cannot commit them), which Spark's own writer honours here.

Spark's own Delta writer makes the epoch's one commit (the MERGE), carrying txn(app id, epoch) and the record that
names the epoch's prepared Kafka branches; the block commits them after it. Checked: the table holds the last
change per key (Spark's reader), every event is read once by an independent read_committed consumer, and an
epoch Spark replays (its commit-log entry removed, as a driver killed after the MERGE leaves it) is skipped by
Delta and sends nothing again.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from support import read_committed

pytestmark = pytest.mark.integration

KEYS, CHANGES = 20, 120  # change i sets key i % KEYS to amount i; the last per key is in the last 20


def _produce(bootstrap: str, topic: str) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(CHANGES):
        producer.produce(topic, key=str(i % KEYS).encode(), value=json.dumps({"id": i % KEYS, "amount": i}).encode(),
                         partition=i % 2)
    assert producer.flush(30) == 0


def _query(spark, bootstrap, source, events, table, checkpoint, link):
    from lastagent.examples import merge_changes  # the crash tests' driver runs the same pipeline

    return merge_changes(spark, bootstrap, source, events, table, str(checkpoint), link, "40")


def test_merge_and_events_once_and_a_replayed_epoch_sends_nothing_again(spark, kafka_bootstrap, new_topic, tmp_path):
    source, events = new_topic(partitions=2), new_topic(partitions=2, prefix="events")
    _produce(kafka_bootstrap, source)
    table, checkpoint, link = str(tmp_path / "orders"), tmp_path / "ckpt", f"cdc-{uuid.uuid4().hex[:8]}"
    # A table with the features lastagent-delta refuses (its commits are delta-rs'): Spark's writer honours them.
    spark.sql(f"CREATE TABLE delta.`{table}` (sk BIGINT GENERATED ALWAYS AS IDENTITY, id BIGINT, amount BIGINT) "
              "USING delta CLUSTER BY (id) TBLPROPERTIES ('delta.enableDeletionVectors' = 'true', "
              "'delta.enableRowTracking' = 'true')")
    _query(spark, kafka_bootstrap, source, events, table, checkpoint, link).awaitTermination()
    expected = {i: max(j for j in range(CHANGES) if j % KEYS == i) for i in range(KEYS)}
    rows = spark.read.format("delta").load(table).collect()
    assert {r.id: r.amount for r in rows} == expected and len({r.sk for r in rows}) == KEYS  # identity values
    sent = read_committed(kafka_bootstrap, events, CHANGES)
    assert sorted(json.loads(v)["amount"] for _, v in sent) == list(range(CHANGES))
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").select("operation", "userMetadata").collect()
    merges = [json.loads(r.userMetadata)["lastagent"] for r in history if r.operation == "MERGE"]
    assert sorted(m["epoch"] for m in merges) == [0, 1, 2] and all(m["branches"] for m in merges)

    # Spark replays the last epoch when its commit-log entry is missing (a driver killed after the MERGE): the
    # restarted run's claim fences the first run, the block finds the epoch's record, Delta skips the MERGE.
    last = max(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    for name in (str(last), f".{last}.crc"):
        Path(checkpoint / "commits" / name).unlink(missing_ok=True)
    versions_before = len(history)
    _query(spark, kafka_bootstrap, source, events, table, checkpoint, link).awaitTermination()
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").select("operation", "userMetadata").collect()
    assert [r.operation for r in history[: len(history) - versions_before]] == ["WRITE"]  # the restart's claim only
    assert {r.id: r.amount for r in spark.read.format("delta").load(table).collect()} == expected
    again = read_committed(kafka_bootstrap, events, CHANGES)
    assert sorted(json.loads(v)["amount"] for _, v in again) == list(range(CHANGES))
