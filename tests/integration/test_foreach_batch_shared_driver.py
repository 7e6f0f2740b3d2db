"""lastagent.epoch beside other queries in one driver: blocks of two queries at once, a plain foreachBatch beside them.

Delta's idempotent-write settings are session confs. The block puts them on the batch's own session only (the
query's clone), so a third query that writes Delta through the driver's global ``spark`` never sees them, and two
block queries never refuse each other. Leaving, the block reads what the table committed while it was open: a
write through a session the settings did not reach, or a second write, is refused by name.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import pytest
from support import produce_changes, read_committed

pytestmark = pytest.mark.integration

KEYS, CHANGES, PER_TRIGGER = 20, 160, 20  # change i sets key i % KEYS to amount i; 8 epochs a query


def _produce(bootstrap: str, topic: str, n: int = CHANGES) -> None:
    produce_changes(bootstrap, topic, n, KEYS)


def _changes(spark, bootstrap: str, source: str):
    return (spark.readStream.format("lastagent-kafka").option("kafka.bootstrap.servers", bootstrap)
            .option("subscribe", source).option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", str(PER_TRIGGER)).load()
            .selectExpr("CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
                        "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount"))


def _txn_apps(table: str) -> set[str]:
    """Every ``txn`` app id in the table's log (Spark's DESCRIBE HISTORY does not show them)."""
    apps = set()
    for entry in sorted((Path(table) / "_delta_log").glob("*.json")):
        for line in entry.read_text().splitlines():
            action = json.loads(line)
            if "txn" in action:
                apps.add(action["txn"]["appId"])
    return apps


def test_two_block_queries_and_a_plain_query_in_one_driver_at_once(spark, kafka_bootstrap, new_topic, tmp_path):
    """Q1 and Q2 MERGE through lastagent.epoch (each its own link, table and events topic, the block held open a
    while); Q3 appends every batch to its own table through the global session, as many notebooks do. Before: Q2
    failed at its first block beside one of Q1's and Q3 lost rows to Q1's txn. Now every query has every row,
    every event is sent once, and Q3's commits carry no block's txn or record."""
    import lastagent

    lock = threading.Lock()
    spans: dict[str, list[tuple[float, float]]] = {"q1": [], "q2": [], "q3": []}

    def block_query(name: str, source: str, events: str, table: str, link: str):
        def apply(batch, epoch_id):
            with lastagent.epoch(batch, epoch_id, link=link, table=table,
                                 **{"kafka.bootstrap.servers": kafka_bootstrap}) as e:
                began = time.monotonic()
                e.to_kafka(batch.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value"),
                           topic=events)
                time.sleep(0.5)  # work inside the block: Q3's writes and the other block fall in here
                batch.groupBy("id").max("amount").withColumnRenamed("max(amount)", "amount").createOrReplaceTempView(
                    f"{name}_changes")
                batch.sparkSession.sql(f"MERGE INTO delta.`{table}` t USING {name}_changes s ON t.id = s.id "
                                       "WHEN MATCHED AND s.amount > t.amount THEN UPDATE SET amount = s.amount "
                                       "WHEN NOT MATCHED THEN INSERT *")
                with lock:
                    spans[name].append((began, time.monotonic()))

        return (_changes(spark, kafka_bootstrap, source).writeStream.foreachBatch(apply)
                .option("checkpointLocation", str(tmp_path / f"{name}-ckpt")).trigger(availableNow=True).start())

    def plain_query(source: str, table: str):
        def append(batch, epoch_id):
            view = f"q3_batch_{epoch_id}"
            batch.createOrReplaceGlobalTempView(view)
            try:
                for half in (0, 1):  # two appends a batch, through the driver's global session
                    began = time.monotonic()
                    spark.sql(f"INSERT INTO delta.`{table}` SELECT id, amount FROM global_temp.{view} "
                              f"WHERE amount % 2 = {half}")
                    with lock:
                        spans["q3"].append((began, time.monotonic()))
            finally:
                spark.catalog.dropGlobalTempView(view)

        return (_changes(spark, kafka_bootstrap, source).writeStream.foreachBatch(append)
                .option("checkpointLocation", str(tmp_path / "q3-ckpt"))
                .trigger(processingTime="200 milliseconds").start())

    sources = [new_topic(partitions=2) for _ in range(3)]
    events = [new_topic(partitions=2, prefix="events") for _ in range(2)]
    tables = [str(tmp_path / n) for n in ("q1", "q2", "q3")]
    for source in sources:
        _produce(kafka_bootstrap, source)
    for table in tables:
        spark.sql(f"CREATE TABLE delta.`{table}` (id BIGINT, amount BIGINT) USING delta")
    links = [f"shared-{n}-{uuid.uuid4().hex[:6]}" for n in ("q1", "q2")]

    q3 = plain_query(sources[2], tables[2])
    q1 = block_query("q1", sources[0], events[0], tables[0], links[0])
    q2 = block_query("q2", sources[1], events[1], tables[1], links[1])
    try:
        q1.awaitTermination()
        q2.awaitTermination()
        deadline = time.time() + 120  # bounded: Q3 reads its source to the end at a 200 ms trigger
        while spark.read.format("delta").load(tables[2]).count() < CHANGES and time.time() < deadline:
            q3.awaitTermination(1)  # raises Q3's error if it failed
    finally:
        q3.stop()

    def overlaps(a: str, b: str) -> int:
        return sum(1 for s, e in spans[a] for s2, e2 in spans[b] if s < e2 and s2 < e)

    # The case this test is about happened: blocks of Q1 and Q2 open at once, and Q3 writing inside Q1's blocks.
    assert overlaps("q1", "q2") > 0 and overlaps("q1", "q3") + overlaps("q2", "q3") > 0, spans

    expected = {i: max(j for j in range(CHANGES) if j % KEYS == i) for i in range(KEYS)}
    for name, table, topic, link in zip(("q1", "q2"), tables, events, links):
        rows = spark.read.format("delta").load(table).collect()
        assert {r.id: r.amount for r in rows} == expected and len(rows) == KEYS, name
        sent = sorted(json.loads(v)["amount"] for _, v in read_committed(kafka_bootstrap, topic, CHANGES))
        assert sent == list(range(CHANGES)), name
        assert _txn_apps(table) >= {f"lastagent/{link}/g0", f"lastagent/{link}/g1"}, name

    plain = sorted(r.amount for r in spark.read.format("delta").load(tables[2]).collect())
    assert plain == list(range(CHANGES))  # every row of Q3, once (nothing failed, nothing replayed)
    assert _txn_apps(tables[2]) == set()
    history = spark.sql(f"DESCRIBE HISTORY delta.`{tables[2]}`").select("operation", "userMetadata").collect()
    assert [r.userMetadata for r in history if r.userMetadata] == [], history


def _one_block_query(spark, bootstrap, source, events, table, checkpoint, link, write):
    import lastagent

    def apply(batch, epoch_id):
        with lastagent.epoch(batch, epoch_id, link=link, table=table, **{"kafka.bootstrap.servers": bootstrap}) as e:
            e.to_kafka(batch.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value"),
                       topic=events)
            write(batch)

    return (_changes(spark, bootstrap, source).writeStream.foreachBatch(apply)
            .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())


def test_a_write_through_the_global_session_is_refused_by_name(spark, kafka_bootstrap, new_topic, tmp_path):
    """The block's settings are not on the driver's global session: a MERGE through a DeltaTable made from it
    commits without the block's txn and record. The block sees that commit, decides nothing (no event reaches a
    read_committed consumer) and fails naming the version and the session to use."""
    from delta.tables import DeltaTable
    from pyspark.errors import StreamingQueryException

    from lastagent.kafka.xa import KafkaXAResource

    source, events = new_topic(partitions=2), new_topic(partitions=2, prefix="events")
    _produce(kafka_bootstrap, source, PER_TRIGGER)
    table, link = str(tmp_path / "orders"), f"global-{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE TABLE delta.`{table}` (id BIGINT, amount BIGINT) USING delta")

    def merge_through_global(batch):
        (DeltaTable.forPath(spark, table).alias("t").merge(batch.alias("s"), "t.id = s.id")
         .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute())

    query = _one_block_query(spark, kafka_bootstrap, source, events, table, tmp_path / "ckpt", link,
                             merge_through_global)
    with pytest.raises(StreamingQueryException) as failed:
        query.awaitTermination()
    text = str(failed.value)
    merge = [r.version for r in spark.sql(f"DESCRIBE HISTORY delta.`{table}`").collect() if r.operation == "MERGE"]
    assert len(merge) == 1 and "BlockWriteError" in text and f"version {merge[0]} (MERGE)" in text, text[:3000]
    assert "batch.sparkSession" in text and "rolled back" in text, text[:3000]
    assert read_committed(kafka_bootstrap, events, 1, timeout_s=5) == []
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []


def test_a_second_delta_write_in_one_block_is_refused_by_name(spark, kafka_bootstrap, new_topic, tmp_path):
    """Two appends through the batch's session: the first takes the block's txn and decides the epoch (its events
    are committed), the second fails in Delta before it writes (auto-reset), and the block names it."""
    from pyspark.errors import StreamingQueryException

    source, events = new_topic(partitions=2), new_topic(partitions=2, prefix="events")
    _produce(kafka_bootstrap, source, PER_TRIGGER)
    table, link = str(tmp_path / "orders"), f"twice-{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE TABLE delta.`{table}` (id BIGINT, amount BIGINT) USING delta")

    def append_twice(batch):
        batch.write.format("delta").mode("append").save(table)
        batch.write.format("delta").mode("append").save(table)

    query = _one_block_query(spark, kafka_bootstrap, source, events, table, tmp_path / "ckpt", link, append_twice)
    with pytest.raises(StreamingQueryException) as failed:
        query.awaitTermination()
    text = str(failed.value)
    assert "BlockWriteError" in text and "a second Delta write in one lastagent.epoch block" in text, text[:3000]
    assert spark.read.format("delta").load(table).count() == PER_TRIGGER  # the first write only
    sent = read_committed(kafka_bootstrap, events, PER_TRIGGER)
    assert len(sent) == PER_TRIGGER  # decided by the first write: its events are committed
