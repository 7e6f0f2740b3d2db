"""The lastagent-delta sink on real Spark, a real broker and tables read back by Spark's Delta reader."""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer
from support import read_committed

from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.integration


@pytest.fixture
def source(spark, tmp_path):
    """A Delta table of 3 commits x 40 rows: each becomes one micro-batch."""
    path = str(tmp_path / "source")
    for f in range(3):
        (spark.range(f * 40, (f + 1) * 40, numPartitions=2)
         .selectExpr("id", "CAST(id % 3 AS STRING) AS region", "CAST(id AS STRING) AS name",
                     "TIMESTAMP '2026-01-01 00:00:00' + make_interval(0, 0, 0, 0, 0, 0, id) AS ts")
         .write.format("delta").mode("append").save(path))
    return path


def _write(spark, source, tmp_path, table, select=None, link=None, **options):
    df = spark.readStream.format("delta").option("maxFilesPerTrigger", "2").load(source)
    if select:
        df = df.selectExpr(*select)
    writer = (df.writeStream.format("lastagent-delta").option("link", link or f"d-{uuid.uuid4().hex[:8]}")
              .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True))
    for k, v in options.items():
        writer = writer.option(k, v)
    return writer.start(table)


def test_epochs_commit_once_and_spark_reads_the_table(spark, source, tmp_path):
    from deltalake import DeltaTable

    table = str(tmp_path / "out")
    link = f"d-{uuid.uuid4().hex[:8]}"
    q = _write(spark, source, tmp_path, table, link=link, partitionBy="region")
    q.awaitTermination()
    epochs = [p["batchId"] for p in q.recentProgress if p["numInputRows"] > 0]
    out = spark.read.format("delta").load(table)
    assert sorted(r.id for r in out.select("id").collect()) == list(range(120))
    assert out.schema.simpleString() == "struct<id:bigint,region:string,name:string,ts:timestamp>"
    assert out.filter("id = 61").collect()[0].ts.isoformat() == "2026-01-01T00:01:01"
    dt = DeltaTable(table)
    assert dt.metadata().partition_columns == ["region"]
    assert dt.transaction_version(link) == max(epochs)
    # One commit per epoch, each with its arbitration record; files carry statistics.
    commits = [c for c in dt.history() if c.get("lastagent.link") == link]
    assert sorted(int(c["lastagent.epoch"]) for c in commits) == sorted(epochs)
    assert all(c["lastagent.branches"] == "[]" for c in commits)
    import pyarrow as pa

    adds = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    assert sum(a["num_records"] for a in adds) == 120
    assert all(a["min.id"] is not None and a["max.id"] >= a["min.id"] for a in adds)
    # Data skipping on those statistics gives the right answer.
    assert spark.read.format("delta").load(table).filter("id >= 100").count() == 20
    # Spark's DESCRIBE HISTORY shows each epoch's arbitration summary.
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").select("userMetadata").collect()
    shown = [json.loads(r.userMetadata)["lastagent"] for r in history if r.userMetadata]
    assert sorted(h["epoch"] for h in shown) == sorted(epochs) and all(h["link"] == link for h in shown)
    # Spark's own appends to the table still work after ours.
    spark.range(500, 501).selectExpr("id", "'0' AS region", "'x' AS name", "current_timestamp() AS ts") \
        .write.format("delta").mode("append").save(table)
    assert spark.read.format("delta").load(table).count() == 121
    # A later query without partitionBy keeps writing the table's partitions.
    (spark.range(120, 130).selectExpr("id", "'9' AS region", "CAST(id AS STRING) AS name",
                                      "TIMESTAMP '2026-01-01 00:00:00' AS ts")
     .write.format("delta").mode("append").save(source))
    _write(spark, source, tmp_path / "again", table).awaitTermination()
    assert pa.table(DeltaTable(table).get_add_actions(flatten=True)).num_rows > len(adds)
    assert spark.read.format("delta").load(table).filter("region = '9'").count() == 10


def test_schema_mismatch_fails_at_start_naming_the_column(spark, source, tmp_path):
    table = str(tmp_path / "out")
    spark.range(1).selectExpr("CAST(id AS STRING) AS id").write.format("delta").save(table)
    q = _write(spark, source, tmp_path, table, select=["id"])
    with pytest.raises(Exception) as err:
        q.awaitTermination()
    assert "column 'id': the table has \"string\", the query gives \"long\"" in str(err.value)
    assert "mergeSchema" in str(err.value)
    from deltalake import DeltaTable

    assert DeltaTable(table).version() == 0  # nothing committed


def test_complete_mode_is_refused_naming_output_mode(spark, source, tmp_path):
    table = str(tmp_path / "out")
    q = (spark.readStream.format("delta").load(source).groupBy("id").count()
         .writeStream.format("lastagent-delta").outputMode("complete").option("link", "d-complete")
         .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start(table))
    with pytest.raises(Exception, match=r"option 'outputMode': lastagent-delta appends each epoch"):
        q.awaitTermination()
    assert not Path(table, "_delta_log").exists()  # nothing committed


def test_merge_schema_adds_new_columns(spark, source, tmp_path):
    table = str(tmp_path / "out")
    spark.range(1000, 1001).selectExpr("id").write.format("delta").save(table)
    q = _write(spark, source, tmp_path, table, select=["id", "name"], mergeSchema="true")
    q.awaitTermination()
    out = spark.read.format("delta").load(table)
    assert out.count() == 121 and out.filter("name IS NULL").count() == 1
    assert out.filter("id = 7").collect()[0].name == "7"


def test_orphan_files_of_undecided_epochs_are_removed_by_the_next_runs_first_epoch(spark, source, tmp_path):
    table = str(tmp_path / "out")
    link = f"d-{uuid.uuid4().hex[:8]}"
    _write(spark, source, tmp_path, table, link=link).awaitTermination()
    from lastagent.delta.files import file_name

    orphan = Path(table) / file_name(link, 1, 99, 0, 0)
    foreign = Path(table) / file_name("someone-else", 1, 99, 0, 0)
    newer_run = Path(table) / file_name(link, 99, 99, 0, 0)  # a run that superseded the restart: its own
    for f in (orphan, foreign, newer_run):
        f.write_bytes(b"x")
    # The restarted query plans its writer (and cleans up) when it has a batch to run.
    (spark.range(120, 160).selectExpr("id", "'0' AS region", "CAST(id AS STRING) AS name",
                                      "TIMESTAMP '2026-01-01 00:00:00' AS ts")
     .write.format("delta").mode("append").save(source))
    _write(spark, source, tmp_path, table, link=link).awaitTermination()
    assert not orphan.exists() and foreign.exists() and newer_run.exists()
    newer_run.unlink()
    assert spark.read.format("delta").load(table).count() == 160


def _produce(bootstrap: str, topic: str, values: list[bytes], headers: list | None = None) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for i, v in enumerate(values):
        p.produce(topic, value=v, key=str(i).encode(), partition=i % 2, headers=headers)
    p.flush(30)


def _kafka_to_delta(spark, bootstrap, topic, table, ckpt, link, **options):
    df = (spark.readStream.format("lastagent-kafka").option("kafka.bootstrap.servers", bootstrap)
          .option("subscribe", topic).option("startingOffsets", "earliest").option("includeHeaders", "true")
          .option("maxOffsetsPerTrigger", "20").load()
          .selectExpr("CAST(key AS STRING) AS key", "value", "topic", "partition", "offset", "headers"))
    writer = (df.writeStream.format("lastagent-delta").option("link", link).option("checkpointLocation", ckpt)
              .option("kafka.bootstrap.servers", bootstrap).trigger(availableNow=True))
    for k, v in options.items():
        writer = writer.option(k, v)
    return writer.start(table)


def _headers_of(bootstrap: str, topic: str) -> list[dict[str, bytes]]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex, "isolation.level": "read_committed",
                  "auto.offset.reset": "earliest"})
    c.subscribe([topic])
    out = []
    for _ in range(40):
        for m in c.consume(100, 0.5):
            if m.error() is None:
                out.append(dict(m.headers() or []))
        if out:
            break
    c.close()
    return out


def test_poison_records_go_to_dead_letters_in_the_same_epoch(spark, tmp_path, kafka_bootstrap, new_topic, capsys):
    topic, dlq, side = new_topic(partitions=2), new_topic(), new_topic(partitions=2)
    values = [f"order-1-{i}".encode() for i in range(60)]
    values[17] = b"poison"
    _produce(kafka_bootstrap, topic, values, headers=[("trace", b"t"), ("secret", b"s")])
    table, link = str(tmp_path / "out"), f"d-{uuid.uuid4().hex[:8]}"
    q = _kafka_to_delta(spark, kafka_bootstrap, topic, table, str(tmp_path / "ckpt"), link,
                        transformer="lastagent.examples:enrich", deadLetterTopic=dlq, sideTopics=side,
                        dropHeaders="secret")
    q.awaitTermination()
    out = spark.read.format("delta").load(table)
    assert out.count() == 59 and out.select("partition", "offset").distinct().count() == 59
    assert sorted(r.amount for r in out.select("amount").collect()) == sorted(1000 + i for i in range(60) if i != 17)
    assert {h.key for r in out.select("headers").collect() for h in r.headers} == {"trace"}
    dead = read_committed(kafka_bootstrap, dlq, 1)
    assert dead == [(b"17", b"poison")]
    headers = _headers_of(kafka_bootstrap, dlq)[0]
    assert headers["lastagent.dlq.reason"] == b"transformer-failed"
    assert b"ValueError" in headers["lastagent.dlq.exception"]
    assert headers["lastagent.dlq.link"] == link.encode() and headers["lastagent.dlq.source.topic"] == topic.encode()
    follow = read_committed(kafka_bootstrap, side, 59)
    assert Counter(json.loads(v)["amount"] for _, v in follow) == Counter(1000 + i for i in range(60) if i != 17)
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []
    # The lastagent command reads a Delta link's decisions from the table's own commits.
    from lastagent import cli

    assert cli.main(["status", "--link", link, "--table", table, "--bootstrap-servers", kafka_bootstrap,
                     "--json", "--epochs", "3"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["decided_epochs"] == 3 and status["in_doubt"] == [] and status["hazards"] == []
    assert status["in_doubt_count"] == 0 and status["latest_decided_epoch"] == 2 and status["generation"] >= 0
    # Each epoch's figures: 20 offsets (10 per partition) per epoch; the poison record (partition 1,
    # offset 8) is epoch 0's one dead letter; every row also went to the side topic, so each epoch's
    # Kafka branches (one per task) hold 20 records: 19 + 1 dead letter in epoch 0.
    epochs = {e["epoch"]: e for e in status["epochs"]}
    assert {e: (f["records"], f["dead_letters"], f["branches"]) for e, f in epochs.items()} == {
        0: ({"kafka": 20, "table": 19}, 1, 2), 1: ({"kafka": 20, "table": 20}, 0, 2),
        2: ({"kafka": 20, "table": 20}, 0, 2)}
    # Timings reach the next epoch's record: epoch 2's are known once a next epoch is decided.
    assert [epochs[e]["decide_ms"] is not None and epochs[e]["phase2_ms"] is not None for e in (0, 1, 2)] == [
        True, True, False]
    assert all(0 <= f["oldest_branch_age_ms"] < f["transaction_timeout_ms"] for f in epochs.values())
    # The source's lag, as Spark's kafka source names it: each epoch ends 20, 10, then 0 offsets
    # behind the newest (30 per partition) on both partitions.
    from lastagent.core.figures import offsets_behind_latest

    lags = {p.batchId: offsets_behind_latest(p.sources[0]) for p in q.recentProgress if p.numInputRows > 0}
    assert {b: lag.metrics() for b, lag in lags.items() if lag is not None} == {
        b: {"minOffsetsBehindLatest": str(n), "maxOffsetsBehindLatest": str(n), "avgOffsetsBehindLatest": f"{n}.0"}
        for b, n in ((0, 20), (1, 10), (2, 0))}


def test_a_first_run_on_an_empty_topic_then_records(spark, tmp_path, kafka_bootstrap, new_topic):
    """With a transformer the table is created by the first epoch with rows; an empty first epoch that
    Spark commits before that is recorded in the checkpoint, so the restart goes on instead of taking the
    checkpoint for another link's — and a restart under another link name is still refused."""
    topic = new_topic(partitions=2)
    table, ckpt, link = str(tmp_path / "out"), str(tmp_path / "ckpt"), f"d-{uuid.uuid4().hex[:8]}"
    run = functools.partial(_kafka_to_delta, spark, kafka_bootstrap, topic, table, ckpt,
                            transformer="lastagent.examples:enrich")
    run(link).awaitTermination()
    assert not Path(table).exists() and Path(ckpt, "commits", "0").exists()
    _produce(kafka_bootstrap, topic, [f"order-1-{i}".encode() for i in range(10)])
    with pytest.raises(Exception, match="has never seen link 'renamed'"):
        run("renamed").awaitTermination()
    run(link).awaitTermination()
    assert sorted(r.amount for r in spark.read.format("delta").load(table).collect()) == [1000 + i for i in range(10)]


def test_without_dead_letter_topic_a_poison_record_fails_the_batch(spark, tmp_path, kafka_bootstrap, new_topic):
    topic = new_topic(partitions=2)
    _produce(kafka_bootstrap, topic, [b"order-1-0", b"poison", b"order-1-2"])
    table = str(tmp_path / "out")
    q = _kafka_to_delta(spark, kafka_bootstrap, topic, table, str(tmp_path / "ckpt"), f"d-{uuid.uuid4().hex[:8]}",
                        transformer="lastagent.examples:enrich")
    with pytest.raises(Exception) as err:
        q.awaitTermination()
    assert f"record {topic}-1@0 failed (transformer-failed" in str(err.value)
    assert "set option deadLetterTopic" in str(err.value)
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    with contextlib.suppress(TableNotFoundError):  # nothing was ever committed
        assert DeltaTable(table).to_pyarrow_table().num_rows == 0


def test_dead_letter_chain_ends_in_a_delta_table(spark, tmp_path, kafka_bootstrap, new_topic):
    """No dead-letter topic: poison records go to the dead-letter table, committed once per epoch."""
    topic = new_topic(partitions=2)
    values = [f"order-1-{i}".encode() for i in range(30)]
    values[4] = values[25] = b"poison"
    _produce(kafka_bootstrap, topic, values)
    table, dead = str(tmp_path / "out"), str(tmp_path / "dead")
    link = f"d-{uuid.uuid4().hex[:8]}"
    q = _kafka_to_delta(spark, kafka_bootstrap, topic, table, str(tmp_path / "ckpt"), link,
                        transformer="lastagent.examples:enrich", deadLetterTable=dead)
    q.awaitTermination()
    assert spark.read.format("delta").load(table).count() == 28
    rows = spark.read.format("delta").load(dead).collect()
    assert sorted((r.key, r.reason, r.source_topic, r.link) for r in rows) == [
        (b"25", "transformer-failed", topic, link), (b"4", "transformer-failed", topic, link)]
    assert all(r.value == b"poison" and "ValueError" in r.exception for r in rows)
    # Completing an epoch's dead letters again (as a restart does) adds nothing.
    from deltalake import DeltaTable

    from lastagent.delta.target_table import TargetTableStore

    store = TargetTableStore(table, dead_letter_table=dead)
    version = DeltaTable(dead).version()
    for epoch in range(DeltaTable(table).transaction_version(link) + 1):
        assert store.complete_dead_letters(link, epoch) == 0
    assert DeltaTable(dead).version() == version


def test_record_too_large_for_the_side_topic_is_a_dead_letter(spark, tmp_path, kafka_bootstrap, new_topic):
    topic, dlq, side = new_topic(partitions=2), new_topic(), new_topic()
    big = b"x" * 800_000  # fits Kafka as it is, not as base64 JSON on the side topic
    _produce(kafka_bootstrap, topic, [b"small", big, b"small too"])
    table = str(tmp_path / "out")
    q = _kafka_to_delta(spark, kafka_bootstrap, topic, table, str(tmp_path / "ckpt"), f"d-{uuid.uuid4().hex[:8]}",
                        deadLetterTopic=dlq, sideTopics=side)
    q.awaitTermination()
    assert spark.read.format("delta").load(table).count() == 3
    assert len(read_committed(kafka_bootstrap, side, 2)) == 2
    assert read_committed(kafka_bootstrap, dlq, 1) == [(b"1", big)]
    assert _headers_of(kafka_bootstrap, dlq)[0]["lastagent.dlq.reason"] == b"record-too-large"


def test_partition_column_not_in_the_query_is_refused_at_start(spark, source, tmp_path):
    table = str(tmp_path / "out")
    with pytest.raises(Exception, match=r"option 'partitionBy': column\(s\) \['regoin'\] are not among the query's"):
        _write(spark, source, tmp_path, table, partitionBy="regoin").awaitTermination()
    assert not (tmp_path / "out").exists()  # refused before anything was created


def test_files_of_every_killed_run_of_a_decided_epoch_are_swept(tmp_path):
    """Two runs were killed writing epoch 14, each with files of the same task attempts (partition 0 and 1,
    attempt 0) as the third run, which then decided the epoch: its sweep removes the killed runs' files however many there
    were, and keeps its own (the decision names the generation whose files it committed). Found on an S3 server
    after five kills: the killed runs' files had stayed, looking like the decided attempts'."""
    import pyarrow as pa
    from deltalake import DeltaTable

    from lastagent.core.arbitration import ArbitrationRecord
    from lastagent.delta.files import FileWriter
    from lastagent.delta.target_table import StagedEpoch, TargetTableStore

    schema = '{"type":"struct","fields":[{"name":"id","type":"long","nullable":true,"metadata":{}}]}'
    table = str(tmp_path / "t")
    store = TargetTableStore(table, fallback_schema_json=schema)
    generations = [store.claim("l", "q", run=run).generation for run in ("r1", "r2", "r3")]

    def files(generation: int) -> list[dict]:
        adds = []
        for partition in (0, 1):
            writer = FileWriter(table, "l", generation, 14, partition, 0)
            writer.write(pa.record_batch([pa.array([partition], pa.int64())], names=["id"]))
            adds.extend(writer.close())
        return adds

    killed = files(generations[0]) + files(generations[1])
    decided = files(generations[2])
    staged = StagedEpoch(tuple(decided), schema, ((0, 0), (1, 0)))
    assert store.decide(ArbitrationRecord("l", 14, "g", ()), generations[2], staged).won
    assert store.sweep("l", 14, generations[2]) == len(killed) == 4
    on_disk = sorted(p.name for p in Path(table).glob("*.parquet"))
    assert on_disk == sorted(Path(a["path"]).name for a in decided)
    assert sorted(Path(p).name for p in DeltaTable(table).file_uris()) == on_disk


def test_racing_deciders_on_the_target_table_one_wins_and_the_loser_drops_its_files(tmp_path):
    """Two deciders of one epoch with files of their own: one commit stands; the other's files are deleted."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from support import race

    from lastagent.core.arbitration import ArbitrationRecord
    from lastagent.delta.target_table import StagedEpoch, TargetTableStore

    schema = '{"type":"struct","fields":[{"name":"id","type":"long","nullable":true,"metadata":{}}]}'
    store = TargetTableStore(str(tmp_path / "t"), fallback_schema_json=schema)
    generation = store.claim("race", "q").generation
    staged: dict[str, StagedEpoch] = {}
    for name in ("x", "y"):
        path = tmp_path / "t" / f"part-{name}.parquet"
        pq.write_table(pa.table({"id": pa.array([1, 2], pa.int64())}), path)
        add = {"path": path.name, "size": path.stat().st_size, "partitionValues": {}, "modificationTime": 0,
               "dataChange": True, "stats": None}
        staged[name] = StagedEpoch((add,), schema, ((0, 0),))
    results = race(lambda name: store.decide(ArbitrationRecord("race", 0, "g", (name,)), generation, staged[name]),
                   ["x", "y"])
    assert sorted(d.won for d in results.values()) == [False, True]
    winner = next(n for n, d in results.items() if d.won)
    loser = "y" if winner == "x" else "x"
    assert results[loser].record.branches == (winner,)
    from deltalake import DeltaTable

    assert [p.rsplit("/", 1)[-1] for p in DeltaTable(store.path).file_uris()] == [f"part-{winner}.parquet"]
    assert not (tmp_path / "t" / f"part-{loser}.parquet").exists()


def test_data_files_drop_the_dictionary_of_distinct_columns_and_read_back_whole(tmp_path):
    """A task's parquet file: plain encoding for the distinct key, a dictionary for the repeated topic;
    the rows read back as written (the encodings Spark's reader meets in the table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lastagent.delta.files import FileWriter

    n = 20_000
    batch = pa.record_batch({"key": pa.array([f"k{i}" for i in range(n)]), "topic": pa.array(["t"] * n),
                             "offset": pa.array(range(n), pa.int64())})
    files = FileWriter(str(tmp_path), "l", 1, 0, 0, 0)
    for start in range(0, n, 5000):
        files.write(batch.slice(start, 5000))
    [add] = files.close()
    written = pq.ParquetFile(tmp_path / add["path"])
    encodings = {written.metadata.row_group(0).column(i).path_in_schema: written.metadata.row_group(0).column(i).encodings
                 for i in range(3)}
    assert "RLE_DICTIONARY" not in encodings["key"] and "RLE_DICTIONARY" not in encodings["offset"], encodings
    assert "RLE_DICTIONARY" in encodings["topic"], encodings
    assert written.read().equals(pa.Table.from_batches([batch]))
    assert json.loads(add["stats"])["numRecords"] == n


def test_a_side_topic_record_the_broker_refuses_fails_the_task_fast_naming_the_option(spark, tmp_path, kafka_bootstrap,
                                                                                       new_topic):
    """A side-topic record under the producer's limit but over the topic's max.message.bytes: the broker
    refuses it in a delivery report, after it joined the task's Kafka transaction, which the refusal fails
    as a whole; so it cannot go to the dead letters. The task must fail within seconds naming the option
    and the record's position, without its contents, and leave no transaction of the link open."""
    import time

    marker = uuid.uuid4().hex
    topic, dlq, side = new_topic(), new_topic(), new_topic(max_message_bytes=1024)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i, v in enumerate([b"small", f"payload-{marker}".encode() + b"S" * 5000, b"small too"]):
        p.produce(topic, value=v, key=f"key-{marker}".encode() if i == 1 else str(i).encode(), partition=0)
    p.flush(30)
    table, link = str(tmp_path / "out"), f"d-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    q = _kafka_to_delta(spark, kafka_bootstrap, topic, table, str(tmp_path / "ckpt"), link,
                        deadLetterTopic=dlq, sideTopics=side)
    with pytest.raises(Exception) as failed:  # Spark's StreamingQueryException wraps ours
        q.awaitTermination(120)
    assert time.monotonic() - started < 60, "an upper bound against a hang, not a performance figure"
    text = str(failed.value)
    assert f"the side-topic record of row #1 of task 0.0's rows (option sideTopics: {side}) ({side} partition 0" in text
    assert "MSG_SIZE_TOO_LARGE" in text and "cannot go to the dead letters" in text
    assert marker not in text
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []
    assert not Path(table, "_delta_log").exists() or spark.read.format("delta").load(table).count() == 0
