"""The lastagent-kafka source on a real broker and real Spark: options, transactions, restarts, loss."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions

pytestmark = pytest.mark.integration

Record = tuple[Any, Any, int]  # key, value, partition (+ optional headers via dict form)


def produce(bootstrap: str, topic: str, records: Sequence[Record], txn: str | None = None,
            headers: list | None = None) -> None:
    """Writes records; ``txn`` = "commit" or "abort" writes them inside one transaction.

    Aborted records are flushed before the abort, so they occupy offsets in the log.
    """
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap}
    if txn:
        conf["transactional.id"] = f"test-{uuid.uuid4().hex[:8]}"
    p = Producer(conf)
    if txn:
        p.init_transactions()
        p.begin_transaction()
    for key, value, part in records:
        p.produce(topic, key=key, value=value, partition=part, headers=headers)
    p.flush()
    if txn == "commit":
        p.commit_transaction()
    elif txn == "abort":
        p.abort_transaction()


def rows_of(n: int, partitions: int = 1, tag: str = "v", start: int = 0) -> list[Record]:
    return [(f"k{i}".encode(), f"{tag}{i}".encode(), i % partitions) for i in range(start, start + n)]


class Query:
    """Runs a source into a memory sink with Trigger.AvailableNow and returns what it read."""

    def __init__(self, spark, tmp_path, fmt: str = "lastagent-kafka") -> None:
        self.spark, self.fmt = spark, fmt
        self.checkpoint = str(tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}")
        self.progress: list[dict] = []

    def run(self, timeout: float = 180, **options: str) -> list[dict]:
        rows: list[dict] = []
        df = self.spark.readStream.format(self.fmt).options(**options).load()
        # foreachBatch, not the memory sink: it restarts from a checkpoint, as users' sinks do.
        q = (df.writeStream.foreachBatch(lambda b, _: rows.extend(r.asDict(recursive=True) for r in b.collect()))
             .trigger(availableNow=True).option("checkpointLocation", self.checkpoint).start())
        try:
            assert q.awaitTermination(timeout), "query did not finish"
        finally:
            q.stop()
        self.progress.extend(p for p in q.recentProgress if p["numInputRows"] > 0)
        return rows


def old_then_new(bootstrap: str, topic: str, old: int, new: int, partitions: int) -> int:
    """Writes ``old`` records tagged "old", then ``new`` tagged "new"; returns a timestamp (ms) between them."""
    produce(bootstrap, topic, rows_of(old, partitions, "old"))
    time.sleep(0.05)
    cut = int(time.time() * 1000)
    time.sleep(0.05)
    produce(bootstrap, topic, rows_of(new, partitions, "new"))
    return cut


def values(rows: list[dict]) -> list[bytes]:
    return sorted(r["value"] for r in rows)


@pytest.fixture
def base(kafka_bootstrap) -> dict[str, str]:
    return {"kafka.bootstrap.servers": kafka_bootstrap, "startingOffsets": "earliest"}


def test_read_committed_skips_aborted_and_marker_gaps(spark, tmp_path, kafka_bootstrap, new_topic, base):
    topic = new_topic(partitions=2)
    produce(kafka_bootstrap, topic, rows_of(6, 2, "c"), txn="commit")
    produce(kafka_bootstrap, topic, rows_of(4, 2, "a"), txn="abort")
    produce(kafka_bootstrap, topic, rows_of(3, 2, "n", start=6))            # not transactional
    produce(kafka_bootstrap, topic, rows_of(4, 2, "a", start=10), txn="abort")  # ends each partition
    rows = Query(spark, tmp_path).run(subscribe=topic, **base)
    assert values(rows) == sorted([f"c{i}".encode() for i in range(6)] + [f"n{i}".encode() for i in range(6, 9)])
    assert {r["topic"] for r in rows} == {topic} and {r["partition"] for r in rows} == {0, 1}
    assert all(r["timestampType"] == 0 for r in rows)

    everything = Query(spark, tmp_path).run(subscribe=topic, **base, **{"kafka.isolation.level": "read_uncommitted"})
    assert len(everything) == 6 + 4 + 3 + 4


def test_open_transaction_never_stalls_or_leaks(spark, tmp_path, kafka_bootstrap, new_topic, base):
    """A batch ends at the last stable offset: an open transaction's records wait for its end."""
    topic = new_topic()
    produce(kafka_bootstrap, topic, rows_of(3, tag="before"))
    p = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"open-{uuid.uuid4().hex[:6]}"})
    p.init_transactions()
    p.begin_transaction()
    for i in range(5):
        p.produce(topic, value=f"open{i}".encode())
    p.flush()
    q = Query(spark, tmp_path)
    assert values(q.run(subscribe=topic, **base)) == [b"before0", b"before1", b"before2"]
    p.commit_transaction()
    assert values(q.run(subscribe=topic, **base)) == [f"open{i}".encode() for i in range(5)]


def test_stop_and_restart_from_checkpoint_has_no_gap_and_no_duplicate(spark, tmp_path, kafka_bootstrap,
                                                                      new_topic, base):
    topic = new_topic(partitions=3)
    produce(kafka_bootstrap, topic, rows_of(90, 3), txn="commit")
    q = Query(spark, tmp_path)
    first = q.run(subscribe=topic, maxOffsetsPerTrigger="25", **base)
    produce(kafka_bootstrap, topic, rows_of(60, 3, start=90), txn="commit")
    second = q.run(subscribe=topic, maxOffsetsPerTrigger="25", **base)
    assert values(first + second) == sorted(f"v{i}".encode() for i in range(150))
    assert len({(r["partition"], r["offset"]) for r in first + second}) == 150
    # maxOffsetsPerTrigger goes through admission control: no batch above it (offsets include
    # the commit markers, so a batch of 25 offsets holds at most 25 rows).
    assert len(q.progress) >= 150 // 25 and all(p["numInputRows"] <= 25 for p in q.progress)


def test_starting_offsets_latest_json_and_timestamps(spark, tmp_path, kafka_bootstrap, new_topic, base):
    topic = new_topic(partitions=2)
    cut = old_then_new(kafka_bootstrap, topic, 10, 4, 2)
    common = {"kafka.bootstrap.servers": kafka_bootstrap, "subscribe": topic}

    assert Query(spark, tmp_path).run(**common, startingOffsets="latest") == []
    by_json = Query(spark, tmp_path).run(**common, startingOffsets=f'{{"{topic}":{{"0":3,"1":-1}}}}')
    assert sorted((r["partition"], r["offset"]) for r in by_json) == [(0, 3), (0, 4), (0, 5), (0, 6)]
    assert values(Query(spark, tmp_path).run(**common, startingTimestamp=str(cut))) == values(
        [{"value": f"new{i}".encode()} for i in range(4)])
    per_part = Query(spark, tmp_path).run(**common, startingOffsetsByTimestamp=f'{{"{topic}":{{"0":{cut},"1":0}}}}')
    assert len(per_part) == 2 + 7
    with pytest.raises(Exception, match="startingOffsetsByTimestampStrategy=latest"):
        Query(spark, tmp_path).run(**common, startingTimestamp=str(cut + 3_600_000))
    assert Query(spark, tmp_path).run(**common, startingTimestamp=str(cut + 3_600_000),
                                      startingOffsetsByTimestampStrategy="latest") == []


def test_assign_pattern_new_partitions_and_new_topics(spark, tmp_path, kafka_bootstrap, new_topic, base):
    prefix = f"pat{uuid.uuid4().hex[:6]}"
    first = new_topic(partitions=1, prefix=prefix)
    produce(kafka_bootstrap, first, rows_of(3, tag="a"))
    q = Query(spark, tmp_path)
    assert len(q.run(subscribePattern=f"{prefix}-.*", **base)) == 3

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_partitions([NewPartitions(first, 2)])[first].result()
    second = new_topic(partitions=1, prefix=prefix)
    time.sleep(1)
    produce(kafka_bootstrap, first, [(b"x", b"new-partition", 1)])
    produce(kafka_bootstrap, second, rows_of(2, tag="b"))
    again = q.run(subscribePattern=f"{prefix}-.*", **base)
    assert values(again) == [b"b0", b"b1", b"new-partition"]

    assigned = Query(spark, tmp_path).run(assign=f'{{"{first}":[1]}}', **base)
    assert values(assigned) == [b"new-partition"]


def test_headers_and_min_partitions(spark, tmp_path, kafka_bootstrap, new_topic, base):
    topic = new_topic()
    produce(kafka_bootstrap, topic, rows_of(40), headers=[("trace", b"abc"), ("empty", None)])
    produce(kafka_bootstrap, topic, [(None, b"plain", 0)])
    rows = Query(spark, tmp_path).run(subscribe=topic, includeHeaders="true", minPartitions="4", **base)
    assert len(rows) == 41 and len({r["offset"] for r in rows}) == 41
    with_headers = [r for r in rows if r["value"] != b"plain"]
    assert all(r["headers"] == [{"key": "trace", "value": b"abc"}, {"key": "empty", "value": None}]
               for r in with_headers)
    assert [r["headers"] for r in rows if r["value"] == b"plain"] == [None]
    assert [r["key"] for r in rows if r["value"] == b"plain"] == [None]

    parts: list[int] = []
    name = f"mp_{uuid.uuid4().hex[:6]}"
    df = spark.readStream.format("lastagent-kafka").options(subscribe=topic, minPartitions="4", **base).load()
    q = (df.writeStream.foreachBatch(lambda b, _: parts.append(b.rdd.getNumPartitions())).queryName(name)
         .trigger(availableNow=True).option("checkpointLocation", str(tmp_path / name)).start())
    assert q.awaitTermination(180)
    assert parts and parts[0] >= 4


def test_group_offsets_are_committed_and_can_start_a_query(spark, tmp_path, kafka_bootstrap, new_topic, base):
    topic = new_topic(partitions=2)
    group = f"g-{uuid.uuid4().hex[:6]}"
    produce(kafka_bootstrap, topic, rows_of(10, 2), txn="commit")
    Query(spark, tmp_path).run(subscribe=topic, **base, **{"kafka.group.id": group})
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
    committed = {tp.partition: tp.offset for tp in c.committed([TopicPartition(topic, 0), TopicPartition(topic, 1)],
                                                               timeout=10)}
    c.close()
    assert committed == {0: 6, 1: 6}  # 5 records + the commit marker each

    produce(kafka_bootstrap, topic, rows_of(4, 2, "later"))
    rows = Query(spark, tmp_path).run(subscribe=topic, startingOffsets="group",
                                      **{"kafka.bootstrap.servers": kafka_bootstrap, "kafka.group.id": group})
    assert values(rows) == [b"later0", b"later1", b"later2", b"later3"]


@pytest.mark.parametrize("fail", [True, False])
def test_records_lost_to_retention(fail, spark, tmp_path, kafka_bootstrap, new_topic, base):
    topic = new_topic()
    produce(kafka_bootstrap, topic, rows_of(5))
    q = Query(spark, tmp_path)
    assert len(q.run(subscribe=topic, **base)) == 5
    produce(kafka_bootstrap, topic, rows_of(10, start=5))
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.delete_records([TopicPartition(topic, 0, 12)])[TopicPartition(topic, 0, 12)].result()
    if fail:
        with pytest.raises(Exception) as e:
            q.run(subscribe=topic, **base)
        assert f"{topic}-0 at offsets [5, 12) are gone" in str(e.value) and "failOnDataLoss=false" in str(e.value)
    else:
        rows = q.run(subscribe=topic, failOnDataLoss="false", **base)
        assert values(rows) == [b"v12", b"v13", b"v14"]


@pytest.mark.parametrize("options, words", [
    ({"subscribe": "t", "assign": '{"t":[0]}'}, "option 'subscribe': give exactly one of"),
    ({"subscribe": "t", "startingOffsets": "{bad"}, "option 'startingOffsets': is not valid JSON"),
    ({"subscribe": "t", "kafka.no.such.setting": "1"}, "option 'kafka.no.such.setting'"),
    ({"subscribe": "t", "startOffsets": "earliest"}, "unknown option for the lastagent-kafka source; did you mean 'startingOffsets'?"),
    ({"subscribe": "missing-topic-xyz"}, "option 'subscribe': topic(s) missing-topic-xyz do not exist"),
])
def test_bad_options_fail_at_start_naming_the_option(options, words, spark, tmp_path, kafka_bootstrap):
    with pytest.raises(Exception) as e:
        Query(spark, tmp_path).run(**{"kafka.bootstrap.servers": kafka_bootstrap, **options})
    assert words in str(e.value)


def test_unreachable_broker_fails_in_bounded_time(spark, tmp_path):
    began = time.monotonic()
    with pytest.raises(Exception) as e:
        Query(spark, tmp_path).run(**{"kafka.bootstrap.servers": "127.0.0.1:1", "subscribe": "t",
                                      "kafka.default.api.timeout.ms": "3000"})
    assert "option 'kafka.bootstrap.servers': no Kafka broker answered at 127.0.0.1:1" in str(e.value)
    assert time.monotonic() - began < 120


def test_differential_against_sparks_kafka_source(spark, tmp_path, kafka_bootstrap, new_topic, kafka_admin):
    """Same topics, both sources, every row and column equal — committed, aborted, compacted, empty."""
    mixed = new_topic(partitions=3)  # partition 2 stays empty
    produce(kafka_bootstrap, mixed, [(f"k{i}".encode(), f"c{i}".encode(), i % 2) for i in range(50)], txn="commit")
    produce(kafka_bootstrap, mixed, [(b"x", b"aborted", 0), (b"y", b"aborted", 1)], txn="abort")
    produce(kafka_bootstrap, mixed, [(None, b"plain", 1)], headers=[("h", b"1"), ("h", b"2")])
    compacted = new_topic(partitions=1, cleanup_policy="compact", segment_ms="100",
                          min_cleanable_dirty_ratio="0.001", delete_retention_ms="100")
    for round_ in range(5):
        produce(kafka_bootstrap, compacted, [(f"key{i % 5}".encode(), f"r{round_}-{i}".encode(), 0) for i in range(20)])
        time.sleep(0.3)
    _wait_for_compaction(kafka_bootstrap, compacted, total=100)

    for isolation in ("read_committed", "read_uncommitted"):
        options = {"kafka.bootstrap.servers": kafka_bootstrap, "subscribe": f"{mixed},{compacted}",
                   "startingOffsets": "earliest", "includeHeaders": "true", "kafka.isolation.level": isolation}
        ours = Query(spark, tmp_path).run(**options)
        theirs = Query(spark, tmp_path, fmt="kafka").run(**options)
        key = lambda r: (r["topic"], r["partition"], r["offset"])  # noqa: E731
        assert sorted(ours, key=key) == sorted(theirs, key=key)
        assert len(ours) == 50 + 1 + (2 if isolation == "read_uncommitted" else 0) + _count(ours, compacted)
        assert _count(ours, compacted) < 100  # compaction left gaps, and both sources read across them


def _count(rows: list[dict], topic: str) -> int:
    return sum(1 for r in rows if r["topic"] == topic)


def _wait_for_compaction(bootstrap: str, topic: str, total: int, timeout_s: float = 60) -> None:
    """Waits until the log cleaner removed some records (their offsets become gaps)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"peek-{uuid.uuid4().hex}",
                      "auto.offset.reset": "earliest", "enable.partition.eof": True})
        c.assign([TopicPartition(topic, 0, 0)])
        seen = 0
        while True:
            msgs = c.consume(1000, 5)
            if not msgs or any(m.error() is not None for m in msgs):
                seen += sum(1 for m in msgs if m.error() is None)
                break
            seen += len(msgs)
        c.close()
        if seen < total:
            return
        # A fresh record rolls the active segment so the cleaner can take the older ones.
        produce(bootstrap, topic, [(b"key0", b"roll", 0)])
        total += 1
        time.sleep(2)
    pytest.fail(f"the log cleaner did not compact {topic} within {timeout_s}s")


def batch_read(spark, fmt: str = "lastagent-kafka", **options: str) -> list[dict]:
    """``spark.read`` of the source: every row, as dicts."""
    return [r.asDict(recursive=True) for r in spark.read.format(fmt).options(**options).load().collect()]


def test_batch_read_matches_sparks_kafka_source(spark, kafka_bootstrap, new_topic):
    """spark.read: committed, aborted, open and plain records; both ends; every row equal to Spark's."""
    topic = new_topic(partitions=3)  # partition 2 stays empty
    produce(kafka_bootstrap, topic, rows_of(20, 2, "c"), txn="commit")
    produce(kafka_bootstrap, topic, rows_of(4, 2, "a"), txn="abort")
    produce(kafka_bootstrap, topic, rows_of(5, 2, "n", start=20), headers=[("h", b"1")])
    # Spark's source reads uncommitted unless told; ours reads committed unless told.
    common = {"kafka.bootstrap.servers": kafka_bootstrap, "subscribe": topic, "includeHeaders": "true",
              "kafka.isolation.level": "read_committed"}
    key = lambda r: (r["partition"], r["offset"])  # noqa: E731
    for extra in ({}, {"startingOffsets": f'{{"{topic}":{{"0":3,"1":-2,"2":-2}}}}',
                       "endingOffsets": f'{{"{topic}":{{"0":12,"1":-1,"2":-1}}}}'}):
        ours = sorted(batch_read(spark, **common, **extra), key=key)
        assert ours == sorted(batch_read(spark, "kafka", **common, **extra), key=key)
        assert not any(r["value"].startswith(b"a") for r in ours)
    assert len(batch_read(spark, **common)) == 25
    # Batch reads end at the last stable offset: an open transaction is not waited for.
    open_txn = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"open-{uuid.uuid4().hex[:8]}"})
    open_txn.init_transactions()
    open_txn.begin_transaction()
    open_txn.produce(topic, value=b"open", partition=2)
    open_txn.flush()
    try:
        assert len(batch_read(spark, **common)) == 25
    finally:
        open_txn.abort_transaction()


def test_batch_read_by_timestamps_and_bad_ends(spark, kafka_bootstrap, new_topic):
    topic = new_topic(partitions=1)
    cut = old_then_new(kafka_bootstrap, topic, 5, 3, 1)
    common = {"kafka.bootstrap.servers": kafka_bootstrap, "subscribe": topic}
    assert values(batch_read(spark, **common, endingTimestamp=str(cut))) == values(
        [{"value": f"old{i}".encode()} for i in range(5)])
    assert len(batch_read(spark, **common, startingTimestamp=str(cut),
                          endingOffsetsByTimestamp=f'{{"{topic}":{{"0":{cut + 3_600_000}}}}}')) == 3
    assert batch_read(spark, **common, startingOffsets=f'{{"{topic}":{{"0":8}}}}') == []
    with pytest.raises(Exception, match=r"option 'endingOffsets': is beyond the latest offset in .*-0 \(99 > 8\)"):
        batch_read(spark, **common, endingOffsets=f'{{"{topic}":{{"0":99}}}}')
    with pytest.raises(Exception, match="option 'startingOffsets': latest"):
        batch_read(spark, **common, startingOffsets="latest")
    with pytest.raises(Exception, match=r"option 'endingOffsets': ends before the start in .*-0 \(5 > 3\)"):
        batch_read(spark, **common, startingOffsets=f'{{"{topic}":{{"0":5}}}}',
                   endingOffsets=f'{{"{topic}":{{"0":3}}}}')


def test_a_read_that_ends_late_never_touches_a_later_reads_consumer(kafka_bootstrap, new_topic):
    """Spark may drop a task's generator unfinished; when the garbage collector finalises it during a
    later task of the same worker, its clean-up must not unassign the consumer that task is using."""
    from confluent_kafka import Producer

    from lastagent.sources import kafka_source
    from lastagent.sources.kafka_offsets import OffsetRange
    from lastagent.sources.kafka_source import read_range
    from lastagent.sources.kafka_source_options import KafkaSourceOptions

    topic = new_topic(partitions=2)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(200):
        p.produce(topic, value=str(i).encode(), partition=i % 2)
    assert p.flush(30) == 0
    options = KafkaSourceOptions.parse({"kafka.bootstrap.servers": kafka_bootstrap, "subscribe": topic,
                                        "maxRecordsPerArrowBatch": "10", "kafkaConsumer.pollTimeoutMs": "5000"})
    early = read_range(OffsetRange(topic, 0, 0, 100), options)
    assert next(early).num_rows == 10  # an earlier task, dropped unfinished
    later = read_range(OffsetRange(topic, 1, 0, 100), options)
    rows = next(later).num_rows
    early.close()  # its finally runs now, in the middle of the later read
    rows += sum(b.num_rows for b in later)
    assert rows == 100
    # This process is not a Spark worker: close the consumer it kept for a next task, or it would ask this session's
    # broker after the broker stopped (its log filled a two-worker run's output for minutes).
    for key in list(kafka_source._IDLE):
        for consumer in kafka_source._IDLE.pop(key):
            consumer.close()


def test_registered_by_hand_reads_like_discovered(spark, kafka_bootstrap, new_topic):
    """lastagent.register (for runtimes that do not scan pyspark_* modules) on a session that found the
    formats already: registering again changes nothing, and the format reads."""
    from confluent_kafka import Producer

    import lastagent

    topic = new_topic()
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(3):
        producer.produce(topic, value=str(i).encode())
    assert producer.flush(30) == 0
    lastagent.register(spark)
    rows = spark.read.format("lastagent-kafka").option("kafka.bootstrap.servers", kafka_bootstrap) \
        .option("subscribe", topic).load().select("value").collect()
    assert sorted(r.value for r in rows) == [b"0", b"1", b"2"]
