"""The exactly-once lastagent-kafka sink on a real broker and real Spark."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest
import support
from support import read_committed

from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.integration


@pytest.fixture
def source(spark, tmp_path):
    """A Delta table of 3 commits x 40 rows: each becomes one micro-batch."""
    path = str(tmp_path / "source")
    for f in range(3):
        spark.range(f * 40, (f + 1) * 40, numPartitions=2).write.format("delta").mode("append").save(path)
    return path


def _query(spark, source, tmp_path, bootstrap, topic, link=None, select=None, **options):
    df = spark.readStream.format("delta").option("maxFilesPerTrigger", "2").load(source)
    df = df.selectExpr(*(select or ["CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value"]))
    writer = (df.writeStream.format("lastagent-kafka").option("kafka.bootstrap.servers", bootstrap)
              .option("link", link or f"it-{uuid.uuid4().hex[:8]}")
              .option("arbitrationTable", str(tmp_path / "arb"))
              .option("checkpointLocation", str(tmp_path / "ckpt"))
              .trigger(availableNow=True))
    if topic:
        writer = writer.option("topic", topic)
    for k, v in options.items():
        writer = writer.option(k, v)
    return writer.start()


def test_every_row_once_and_one_decision_per_epoch(spark, source, tmp_path, kafka_bootstrap, new_topic, capsys):
    topic = new_topic(partitions=2)
    link = f"it-{uuid.uuid4().hex[:8]}"
    q = _query(spark, source, tmp_path, kafka_bootstrap, topic, link=link)
    q.awaitTermination()
    epochs = [p["batchId"] for p in q.recentProgress if p["numInputRows"] > 0]
    rows = read_committed(kafka_bootstrap, topic, 120)
    assert Counter(v for _, v in rows) == Counter(str(i).encode() for i in range(120))
    assert all(k == v for k, v in rows)
    arb = spark.read.format("delta").load(str(tmp_path / "arb"))
    assert sorted(r.epoch for r in arb.select("epoch").collect()) == sorted(epochs)
    assert {r.link for r in arb.select("link").collect()} == {link}
    # Nothing of the link stays open, and the arbitration carries no payload.
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []
    import json

    for r in arb.collect():
        for branch in json.loads(r.branches):
            assert set(json.loads(branch)) == {"tid", "pid", "epoch", "records", "partitions"}
    # Each epoch's figures, as `lastagent status --json` reads them from the arbitration commits.
    from lastagent import cli

    assert cli.main(["status", "--link", link, "--arbitration-table", str(tmp_path / "arb"), "--bootstrap-servers",
                     kafka_bootstrap, "--json", "--epochs", "5"]) == 0
    status = json.loads(capsys.readouterr().out)
    rows_of = {p["batchId"]: p["numInputRows"] for p in q.recentProgress if p["numInputRows"] > 0}
    branches_of = {r.epoch: len(json.loads(r.branches)) for r in arb.collect()}
    assert {e["epoch"]: e["records"] for e in status["epochs"]} == {e: {"kafka": n} for e, n in rows_of.items()}
    assert {e["epoch"]: e["branches"] for e in status["epochs"]} == branches_of
    from lastagent.sinks.kafka_sink_options import DEFAULT_TRANSACTION_TIMEOUT_MS

    assert all(e["dead_letters"] == 0 and e["transaction_timeout_ms"] == DEFAULT_TRANSACTION_TIMEOUT_MS
               and 0 <= e["oldest_branch_age_ms"] < DEFAULT_TRANSACTION_TIMEOUT_MS for e in status["epochs"])
    newest = max(rows_of)
    assert all((e["decide_ms"] is None) == (e["epoch"] == newest) for e in status["epochs"])


def test_topic_column_partition_and_headers(spark, source, tmp_path, kafka_bootstrap, new_topic):
    topic = new_topic(partitions=3)
    q = _query(spark, source, tmp_path, kafka_bootstrap, None, select=[
        "CAST(id AS STRING) AS value", f"'{topic}' AS topic", "CAST(id % 3 AS INT) AS partition",
        "array(named_struct('key', 'src', 'value', CAST('delta' AS BINARY))) AS headers"])
    q.awaitTermination()
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": uuid.uuid4().hex,
                  "isolation.level": "read_committed", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, p, 0) for p in range(3)])
    seen = []
    while len(seen) < 120:
        for m in c.consume(500, 5):
            assert m.error() is None
            seen.append((int(m.value()), m.partition(), m.headers()))
    c.close()
    assert all(v % 3 == p and h == [("src", b"delta")] for v, p, h in seen)


def test_a_keyed_record_lands_where_sparks_kafka_sink_puts_it(spark, source, tmp_path, kafka_bootstrap, new_topic):
    """Same key, same partition as Spark's kafka sink (the Java producer's murmur2 of the key), so a query
    can move between the two formats, or share a topic with Java producers, without splitting a key."""
    ours, theirs = new_topic(partitions=7), new_topic(partitions=7)
    (spark.read.format("delta").load(source).selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
     .write.format("kafka").option("kafka.bootstrap.servers", kafka_bootstrap).option("topic", theirs).save())
    _query(spark, source, tmp_path, kafka_bootstrap, ours).awaitTermination()

    def placed(topic: str) -> dict[str, int]:
        rows = (spark.read.format("kafka").option("kafka.bootstrap.servers", kafka_bootstrap)
                .option("kafka.isolation.level", "read_committed").option("subscribe", topic).load()
                .selectExpr("CAST(key AS STRING) AS k", "partition").collect())
        return {r.k: r.partition for r in rows}

    expected = placed(theirs)
    assert len(expected) == 120 and len(set(expected.values())) == 7  # spread wide enough to tell partitioners apart
    assert placed(ours) == expected


def test_timeout_above_broker_max_is_refused_at_start(spark, source, tmp_path, kafka_bootstrap, new_topic):
    with pytest.raises(Exception, match="kafka.transaction.timeout.ms.*transaction.max.timeout.ms"):
        q = _query(spark, source, tmp_path, kafka_bootstrap, new_topic(),
                   **{"kafka.transaction.timeout.ms": str(7_200_000)})
        q.awaitTermination()


def test_renamed_link_is_refused(spark, source, tmp_path, kafka_bootstrap, new_topic):
    topic = new_topic()
    _query(spark, source, tmp_path, kafka_bootstrap, topic, link="first-name").awaitTermination()
    with pytest.raises(Exception, match="option 'link'.*first-name"):
        _query(spark, source, tmp_path / "other", kafka_bootstrap, topic, link="second-name",
               arbitrationTable=str(tmp_path / "arb")).awaitTermination()


def test_bad_input_column_is_refused_before_writing(spark, source, tmp_path, kafka_bootstrap, new_topic):
    with pytest.raises(Exception, match="column 'value' is bigint; it must be string or binary"):
        _query(spark, source, tmp_path, kafka_bootstrap, new_topic(), select=["id AS value"]).awaitTermination()


@pytest.mark.parametrize("conf", [support.DAEMON_OFF], ids=["daemon-off"])
def test_every_row_once_with_spark_settings_users_have(conf, spark, tmp_path, kafka_bootstrap, new_topic):
    """The quickstart's three epochs in a driver with a setting our test session does not have: with the
    Python daemon off, pyspark runs its commit runner as ``__main__``; the sink must not care which."""
    source = str(tmp_path / "kv")
    for f in range(3):  # one file per commit: one epoch each in the driver (maxFilesPerTrigger 1)
        (spark.range(f * 40, (f + 1) * 40, numPartitions=1)
         .selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
         .write.format("delta").mode("append").save(source))
    topic = new_topic(partitions=2)
    link = f"it-{uuid.uuid4().hex[:8]}"
    args = [kafka_bootstrap, source, str(tmp_path / "ckpt"), str(tmp_path / "arb"), link, topic]
    state = tmp_path / "run"
    assert support.run_driver("sink-driver", args, None, state, conf=conf) == 0, (tmp_path / "run.log").read_text()[-3000:]
    rows = read_committed(kafka_bootstrap, topic, 120)
    assert Counter(v for _, v in rows) == Counter(str(i).encode() for i in range(120))
    from deltalake import DeltaTable

    assert DeltaTable(str(tmp_path / "arb")).transaction_version(link) == 2  # three epochs, each decided once
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []


def test_missing_topic_is_refused_at_start_naming_the_option(spark, source, tmp_path, kafka_bootstrap):
    """The test broker does not create topics on first write: a missing topic is a start-time error."""
    missing = f"absent-{uuid.uuid4().hex[:8]}"
    with pytest.raises(Exception, match=f"option 'topic': topic\\(s\\) {missing} do not exist") as refused:
        _query(spark, source, tmp_path, kafka_bootstrap, missing).awaitTermination()
    # Spark's error ends with lastagent's, not with pyspark's "Could not serialize object" (issue 52)
    assert "QueryStartError: the query could not start: OptionError: option 'topic'" in str(refused.value)
    assert "Could not serialize" not in str(refused.value)
    assert not (tmp_path / "arb").exists()  # refused before the link was claimed: nothing written


@pytest.mark.parametrize("simple", [True, False], ids=["key-value", "with-partition-column"])
def test_a_record_the_broker_refuses_fails_the_query_fast_naming_its_position_not_its_contents(
        spark, tmp_path, kafka_bootstrap, new_topic, simple):
    """One record larger than the topic's max.message.bytes, smaller than the producer's own limit (1 MB),
    so the client takes it and the broker refuses it. The query must fail within seconds, the error must
    name the record's position and the broker's reason without its key or value, and no transaction of the
    link may stay open (it would hold the partition's last stable offset for read_committed readers)."""
    import time

    from lastagent import redact

    marker = uuid.uuid4().hex
    secret_key, secret_value = f"key-{marker}", f"payload-{marker}"
    source = str(tmp_path / "kv")
    # One task (one partition) of 10 records; record #7 is 5,000 bytes, on a topic that takes 1,024.
    (spark.range(10, numPartitions=1)
     .selectExpr(f"CASE WHEN id = 7 THEN '{secret_key}' ELSE CAST(id AS STRING) END AS key",
                 f"CASE WHEN id = 7 THEN concat('{secret_value}', repeat('S', 5000)) ELSE CAST(id AS STRING) END "
                 "AS value")
     .write.format("delta").save(source))
    topic = new_topic(partitions=1, max_message_bytes=1024)
    link = f"it-{uuid.uuid4().hex[:8]}"
    select = ["key", "value"] if simple else ["key", "value", "CAST(0 AS INT) AS partition"]
    started = time.monotonic()
    q = _query(spark, source, tmp_path, kafka_bootstrap, topic, link=link, select=select)
    with pytest.raises(Exception) as failed:  # Spark's StreamingQueryException wraps ours
        q.awaitTermination(120)
    assert time.monotonic() - started < 60, "an upper bound against a hang, not a performance figure"
    text = str(failed.value)
    assert (f"record #7 of the branch (topic {topic} partition 0, key {redact.digest(secret_key)}): "
            "Broker: Message size too large (MSG_SIZE_TOO_LARGE") in text
    assert "the branch was aborted" in text
    assert marker not in text and "key b'" not in text  # no key of the refused batch either
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []


def test_a_query_stopped_mid_epoch_leaves_no_transaction_open(spark, tmp_path, kafka_bootstrap, new_topic):
    """query.stop() at seeded random moments while epochs are in flight (issue 44): once stop() returns, within a
    few seconds no transaction of the link is open, so read_committed readers of the output never stall behind a
    stopped query; every restart carries on, and in the end every record is in the output once."""
    import random

    from confluent_kafka import Producer

    rows, partitions, stops = 24_000, 4, 6
    source, out = new_topic(partitions=partitions), new_topic(partitions=partitions)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 20})
    for i in range(rows):
        producer.produce(source, key=str(i).encode(), value=str(i).encode() + b"-" + b"x" * 500,
                         partition=i % partitions)
        if i % 5_000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0
    link = f"it-stop-{uuid.uuid4().hex[:8]}"

    def start(**trigger):
        return (spark.readStream.format("lastagent-kafka").option("kafka.bootstrap.servers", kafka_bootstrap)
                .option("subscribe", source).option("startingOffsets", "earliest")
                .option("maxOffsetsPerTrigger", "2000").load().selectExpr("key", "value")
                .writeStream.format("lastagent-kafka").option("kafka.bootstrap.servers", kafka_bootstrap)
                .option("topic", out).option("link", link).option("arbitrationTable", str(tmp_path / "arb"))
                .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(**trigger).start())

    seeded = random.Random(4401)
    left_open = []
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        for _ in range(stops):
            query = start(processingTime="0 seconds")
            deadline = time.monotonic() + 120
            while not [p for p in query.recentProgress if p["numInputRows"]] and time.monotonic() < deadline:
                time.sleep(0.05)  # its first epoch with records has run: the link holds a generation
            time.sleep(seeded.uniform(0.0, 1.5))
            query.stop()
            stopped = time.monotonic()
            while xa.recover(f"lastagent-{link}-") and time.monotonic() - stopped < 10:
                time.sleep(0.2)
            left_open.append(xa.recover(f"lastagent-{link}-"))
        assert left_open == [[]] * stops, left_open
        final = start(availableNow=True)
        final.awaitTermination(300)
        assert final.exception() is None, final.exception()
        assert xa.recover(f"lastagent-{link}-") == []
    got = read_committed(kafka_bootstrap, out, rows, timeout_s=60)
    assert Counter(k for k, _ in got) == Counter(str(i).encode() for i in range(rows))
