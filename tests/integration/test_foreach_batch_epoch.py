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
from support import produce_changes, read_committed

pytestmark = pytest.mark.integration

KEYS, CHANGES = 20, 120  # change i sets key i % KEYS to amount i; the last per key is in the last 20


def _produce(bootstrap: str, topic: str) -> None:
    produce_changes(bootstrap, topic, CHANGES, KEYS)


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

    # lastagent status reads the link from the table's own commits: three decided epochs, two runs, nothing open.
    from lastagent.cli import link_status

    status = link_status(link, kafka_bootstrap, table=table)
    assert (status["decided_epochs"], status["latest_decided_epoch"], status["generation"]) == (3, 2, 2), status
    assert status["in_doubt"] == [] and status["hazards"] == [] and status["run"], status
    assert [e["epoch"] for e in status["epochs"]] == [2, 1, 0], status["epochs"]


@pytest.mark.objectstore
def test_a_table_on_object_storage(spark, s3, kafka_bootstrap, new_topic, tmp_path, monkeypatch):
    """The same pipeline on an s3a:// table: Spark writes it with its own settings, the block reads it with the
    storage.* settings the sinks take (the example driver's LASTAGENT_STORAGE_CONFIG file)."""
    source, events = new_topic(partitions=2), new_topic(partitions=2, prefix="events")
    _produce(kafka_bootstrap, source)
    table, link = f"s3a://{s3.bucket()}/orders", f"cdc-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("LASTAGENT_STORAGE_CONFIG", str(s3.properties(tmp_path / "storage.properties")))
    spark.sql(f"CREATE TABLE delta.`{table}` (id BIGINT, amount BIGINT) USING delta")
    _query(spark, kafka_bootstrap, source, events, table, tmp_path / "ckpt", link).awaitTermination()
    expected = {i: max(j for j in range(CHANGES) if j % KEYS == i) for i in range(KEYS)}
    assert {r.id: r.amount for r in spark.read.format("delta").load(table).collect()} == expected
    sent = read_committed(kafka_bootstrap, events, CHANGES)
    assert sorted(json.loads(v)["amount"] for _, v in sent) == list(range(CHANGES))
    merges = [r for r in spark.sql(f"DESCRIBE HISTORY delta.`{table}`").collect() if r.operation == "MERGE"]
    assert len(merges) == 3 and all(json.loads(r.userMetadata)["lastagent"]["branches"] for r in merges)


FORMS_BATCH = 10  # records per epoch; epoch k carries ids 0..9 with amounts 10k..10k+9


def _forms_expected() -> list[tuple[int, int]]:
    """The table after the five epochs of :func:`test_every_form_of_spark_delta_write_decides_its_epoch`."""
    rows = [(i, i) for i in range(FORMS_BATCH)]  # 0: overwrite
    rows = [(i, 10 + i) for i, _ in rows]  # 1: MERGE, every id matched
    rows += [(i, 20 + i) for i in range(FORMS_BATCH)]  # 2: append
    rows = [(i, a + 1000 if i % 2 == 0 else a) for i, a in rows]  # 3: UPDATE the ids of even amounts
    return sorted((i, a) for i, a in rows if i % 2 == 0)  # 4: DELETE the ids of odd amounts


def test_every_form_of_spark_delta_write_decides_its_epoch(spark, kafka_bootstrap, new_topic, tmp_path):
    """Each epoch's one Delta write in another form, on a table given by catalog name: overwrite by path, SQL
    MERGE, append by name, SQL UPDATE, DeltaTable DELETE. Each commit carries its epoch's record; a replayed
    DELETE is skipped by Delta; every event once."""
    from confluent_kafka import Producer
    from delta.tables import DeltaTable

    import lastagent
    from lastagent.foreach_batch import table_location

    source, events = new_topic(partitions=1), new_topic(partitions=2, prefix="events")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(5 * FORMS_BATCH):
        producer.produce(source, value=json.dumps({"id": i % FORMS_BATCH, "amount": i}).encode())
    assert producer.flush(30) == 0
    name, link = f"forms_{uuid.uuid4().hex[:8]}", f"forms-{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE TABLE {name} (id BIGINT, amount BIGINT) USING delta "
              "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    path = table_location(spark, name)
    assert path.startswith("/") and (Path(path) / "_delta_log").is_dir()
    checkpoint = tmp_path / "ckpt"

    def apply(batch, epoch_id):
        session = batch.sparkSession
        with lastagent.epoch(batch, epoch_id, link=link, table=name, **{"kafka.bootstrap.servers": kafka_bootstrap}) as e:
            e.to_kafka(batch.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value"),
                       topic=events)
            even = ", ".join(str(r.id) for r in batch.where("amount % 2 = 0").collect()) or "NULL"
            odd = ", ".join(str(r.id) for r in batch.where("amount % 2 = 1").collect()) or "NULL"
            if epoch_id == 0:
                batch.write.format("delta").mode("overwrite").save(path)
            elif epoch_id == 1:
                batch.createOrReplaceTempView("changes")
                session.sql(f"MERGE INTO {name} t USING changes s ON t.id = s.id "
                            "WHEN MATCHED THEN UPDATE SET amount = s.amount WHEN NOT MATCHED THEN INSERT *")
            elif epoch_id == 2:
                batch.write.format("delta").mode("append").saveAsTable(name)
            elif epoch_id == 3:
                session.sql(f"UPDATE {name} SET amount = amount + 1000 WHERE id IN ({even})")
            else:
                DeltaTable.forName(session, name).delete(f"id IN ({odd})")

    def run():
        (spark.readStream.format("lastagent-kafka").option("kafka.bootstrap.servers", kafka_bootstrap)
         .option("subscribe", source).option("startingOffsets", "earliest")
         .option("maxOffsetsPerTrigger", str(FORMS_BATCH)).load()
         .selectExpr("CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
                     "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount")
         .writeStream.foreachBatch(apply).option("checkpointLocation", str(checkpoint))
         .trigger(availableNow=True).start().awaitTermination())

    try:
        run()
        table = sorted((r.id, r.amount) for r in spark.table(name).collect())
        assert table == _forms_expected()
        history = spark.sql(f"DESCRIBE HISTORY {name}").select("version", "operation", "userMetadata").collect()
        decided = sorted((json.loads(r.userMetadata)["lastagent"]["epoch"], r.operation) for r in history
                         if r.userMetadata and json.loads(r.userMetadata)["lastagent"].get("branches"))
        assert decided == [(0, "WRITE"), (1, "MERGE"), (2, "WRITE"), (3, "UPDATE"), (4, "DELETE")]
        sent = read_committed(kafka_bootstrap, events, 5 * FORMS_BATCH)
        assert sorted(json.loads(v)["amount"] for _, v in sent) == list(range(5 * FORMS_BATCH))

        # The DELETE epoch replayed (a driver killed after its commit): Delta skips it, nothing is sent again.
        for entry in ("4", ".4.crc"):
            Path(checkpoint / "commits" / entry).unlink(missing_ok=True)
        run()
        after = spark.sql(f"DESCRIBE HISTORY {name}").select("operation").collect()
        assert [r.operation for r in after[: len(after) - len(history)]] == ["WRITE"]  # the restart's claim only
        assert sorted((r.id, r.amount) for r in spark.table(name).collect()) == _forms_expected()
        again = read_committed(kafka_bootstrap, events, 5 * FORMS_BATCH)
        assert sorted(json.loads(v)["amount"] for _, v in again) == list(range(5 * FORMS_BATCH))
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {name}")


def test_a_table_name_spark_does_not_know_is_refused_by_name(spark):
    from lastagent.errors import OptionError
    from lastagent.foreach_batch import table_location

    assert table_location(spark, "delta.`/data/orders`") == "/data/orders"
    assert table_location(spark, "s3a://bucket/orders") == "s3a://bucket/orders"
    with pytest.raises(OptionError, match=r"option 'table': 'no_such_table_here' is not a path and Spark does not know it"):
        table_location(spark, "no_such_table_here")
    spark.range(1).write.format("parquet").mode("overwrite").saveAsTable("forms_parquet_table")
    try:
        with pytest.raises(OptionError, match=r"option 'table': 'forms_parquet_table' (is a 'parquet' table|is not a "
                                              r"path and Spark does not know it as a table: .*Delta)"):
            table_location(spark, "forms_parquet_table")
    finally:
        spark.sql("DROP TABLE IF EXISTS forms_parquet_table")


def _slow_cdc_query(spark, bootstrap, source, events, table, checkpoint, link, timeout_ms, sleep_s):
    """The CDC pipeline whose to_kafka task of partition 1 ends ``sleep_s`` after partition 0's task has handed its
    records to its branch (a slow task): partition 0's branch waits open on the broker for the whole job.

    Partition 1 counts from a marker partition 0 leaves, not from its own start: on a loaded machine the two tasks'
    Python workers start seconds apart, and a sleep counted from partition 1's start once left partition 0's branch
    younger than the margin (a CI run did not refuse)."""
    import os
    import time

    import lastagent

    marker = Path(str(checkpoint) + ".partition0-written")

    def slow(batches):
        from pyspark import TaskContext

        yield from batches
        if not sleep_s:
            return
        if TaskContext.get().partitionId() == 0:
            written = marker.with_suffix(".tmp")
            written.write_text(str(time.time()))
            os.replace(written, marker)  # whole, so partition 1 never reads it half-written
            return
        deadline = time.time() + 120  # bounded: under local[2] both tasks run at once
        while not marker.exists():
            if time.time() > deadline:
                raise TimeoutError(f"partition 0 left no {marker} within 120 s")
            time.sleep(0.1)
        time.sleep(max(0.0, float(marker.read_text()) + sleep_s - time.time()))

    def apply(batch, epoch_id):
        options = {"kafka.bootstrap.servers": bootstrap, "kafka.transaction.timeout.ms": str(timeout_ms)}
        with lastagent.epoch(batch, epoch_id, link=link, table=table, **options) as e:
            out = batch.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value")
            e.to_kafka(out.mapInArrow(slow, out.schema), topic=events)
            batch.groupBy("id").max("amount").withColumnRenamed("max(amount)", "amount") \
                .write.format("delta").mode("append").save(table)

    return (spark.readStream.format("lastagent-kafka").option("kafka.bootstrap.servers", bootstrap)
            .option("subscribe", source).option("startingOffsets", "earliest").load()
            .selectExpr("CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
                        "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount")
            .writeStream.foreachBatch(apply).option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True).start())


def test_branches_near_their_timeout_are_refused_before_the_delta_write(spark, kafka_bootstrap, new_topic, tmp_path):
    """A slow to_kafka task keeps the job waiting until the other task's branch has less than the decision margin
    (a quarter of a 20 s timeout) left: the block refuses before the Delta write, as the sinks refuse to decide;
    nothing is written or left open. The restarted query, fast again, writes every event once."""
    from pyspark.errors import StreamingQueryException

    from lastagent.kafka.xa import KafkaXAResource

    source, events = new_topic(partitions=2), new_topic(partitions=2, prefix="events")
    _produce(kafka_bootstrap, source)
    table, checkpoint, link = str(tmp_path / "orders"), tmp_path / "ckpt", f"slow-{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE TABLE delta.`{table}` (id BIGINT, amount BIGINT) USING delta")
    query = _slow_cdc_query(spark, kafka_bootstrap, source, events, table, checkpoint, link, 20_000, 17)
    with pytest.raises(StreamingQueryException) as failed:
        query.awaitTermination()
    text = str(failed.value)
    # Refused for the time left or, should the check come after the broker's own abort, for the branch being gone.
    assert "was not decided" in text and ("s left of its 20 s transaction timeout" in text
                                          or "is no longer open on the broker" in text), text[:3000]
    assert spark.read.format("delta").load(table).count() == 0
    assert read_committed(kafka_bootstrap, events, 1, timeout_s=5) == []
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []

    _slow_cdc_query(spark, kafka_bootstrap, source, events, table, checkpoint, link, 20_000, 0).awaitTermination()
    sent = read_committed(kafka_bootstrap, events, CHANGES)
    assert sorted(json.loads(v)["amount"] for _, v in sent) == list(range(CHANGES))
    assert spark.read.format("delta").load(table).count() == KEYS


def test_a_transaction_timeout_above_the_brokers_limit_is_refused_by_name(spark, kafka_bootstrap, new_topic,
                                                                          tmp_path):
    from pyspark.errors import StreamingQueryException

    source, events = new_topic(partitions=1), new_topic(partitions=1, prefix="events")
    _produce(kafka_bootstrap, source)
    table = str(tmp_path / "orders")
    spark.sql(f"CREATE TABLE delta.`{table}` (id BIGINT, amount BIGINT) USING delta")
    query = _slow_cdc_query(spark, kafka_bootstrap, source, events, table, tmp_path / "ckpt",
                            f"limit-{uuid.uuid4().hex[:8]}", 7_200_000, 0)
    with pytest.raises(StreamingQueryException) as failed:
        query.awaitTermination()
    assert ("option 'kafka.transaction.timeout.ms': 7200000 exceeds the broker's transaction.max.timeout.ms"
            in str(failed.value)), str(failed.value)[:3000]
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").collect()
    assert [r.operation for r in history] == ["CREATE TABLE"]  # no claim was made
