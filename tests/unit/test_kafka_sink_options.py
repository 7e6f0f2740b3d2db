"""Sink options and input schema: parsed once, errors name the option or column."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.types import ArrayType, BinaryType, IntegerType, LongType, StringType, StructField, StructType

from lastagent.errors import OptionError, SchemaError
from lastagent.sinks.kafka_rows import check_schema, records
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions

pytestmark = pytest.mark.unit

BASE = {"kafka.bootstrap.servers": "h:9092", "link": "orders", "arbitrationTable": "/arb",
        "checkpointLocation": "/ckpt"}


def test_parse_defaults_and_passthrough():
    o = KafkaSinkOptions.parse({**BASE, "kafka.linger.ms": "20", "topic": "out"})
    assert o.client_config == {"bootstrap.servers": "h:9092", "linger.ms": "20"}
    assert o.topic == "out" and o.transaction_timeout_ms == 900_000
    assert o.transactional_id(1, 3, 1).startswith(o.id_prefix)
    assert o.transactional_id(1, 3, 1) != o.transactional_id(1, 3, 0) != o.transactional_id(1, 2, 0) != o.transactional_id(2, 3, 1)


def test_branch_producer_defaults_give_way_to_the_users_settings():
    """Keys partitioned as the Java producer does; a bounded queue, in bytes and in records."""
    from lastagent.kafka.branch import producer_config

    ours = producer_config(KafkaSinkOptions.parse(BASE).client_config, "t-1", 60_000)
    assert (ours["partitioner"], ours["queue.buffering.max.kbytes"], ours["queue.buffering.max.messages"]) == (
        "murmur2_random", 32_768, 20_000)
    chosen = KafkaSinkOptions.parse({**BASE, "kafka.partitioner": "consistent_random",
                                     "kafka.queue.buffering.max.messages": "100000"})
    theirs = producer_config(chosen.client_config, "t-1", 60_000)
    assert (theirs["partitioner"], theirs["queue.buffering.max.messages"]) == ("consistent_random", "100000")


def test_option_names_are_case_insensitive_like_spark():
    lowered = {k.lower(): v for k, v in BASE.items()}
    assert KafkaSinkOptions.parse(lowered).arbitration_table == "/arb"


@pytest.mark.parametrize("missing", ["kafka.bootstrap.servers", "link", "arbitrationTable", "checkpointLocation"])
def test_required_options_are_named(missing):
    opts = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(OptionError, match=f"option '{missing}': is required"):
        KafkaSinkOptions.parse(opts)


@pytest.mark.parametrize("bad, match", [
    ({"subscribe": "x"}, "option 'subscribe': unknown option.*valid options: arbitrationCleanupEvery"),
    ({"kafka.transactional.id": "x"}, "option 'kafka.transactional.id': is set by the sink"),
    ({"kafka.value.serializer": "x"}, "cast the 'value' column"),
    ({"link": "has space"}, "option 'link': 'has space' has characters not allowed"),
    ({"kafka.transaction.timeout.ms": "soon"}, "option 'kafka.transaction.timeout.ms': 'soon' is not an integer"),
    ({"phase2Parallelism": "0"}, "option 'phase2Parallelism': 0 is too small"),
])
def test_bad_options_say_what_would_be_right(bad, match):
    with pytest.raises(OptionError, match=match):
        KafkaSinkOptions.parse({**BASE, **bad})


HEADERS = ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())]))


def test_schema_like_spark_kafka_sink():
    schema = StructType([StructField("key", StringType()), StructField("value", BinaryType()),
                         StructField("topic", StringType()), StructField("partition", IntegerType()),
                         StructField("headers", HEADERS)])
    cols = check_schema(schema, None)
    assert cols.has_key and cols.has_topic and cols.has_partition and cols.has_headers


@pytest.mark.parametrize("fields, topic, match", [
    ([StructField("key", StringType())], "t", "required column 'value'"),
    ([StructField("value", LongType())], "t", "column 'value' is bigint; it must be string or binary"),
    ([StructField("value", StringType()), StructField("extra", StringType())], "t", r"column\(s\) \['extra'\]"),
    ([StructField("value", StringType())], None, "set option 'topic' or supply a string column 'topic'"),
    ([StructField("value", StringType()), StructField("headers", StringType())], "t",
     "array<struct<key:string,value:binary>>"),
    ([StructField("value", StringType()), StructField("_lastagent_refused_rule", StringType()),
      StructField("_lastagent_refused_reason", StringType())], "t",
     "lastagent.reliable_groups refused, and lastagent-kafka has no dead-letter path"),
])
def test_schema_errors_name_the_column(fields, topic, match):
    with pytest.raises(SchemaError, match=match):
        check_schema(StructType(fields), topic)


def test_records_from_arrow_option_topic_wins():
    batch = pa.record_batch({"key": ["k1", None], "value": [b"v1", b"v2"], "topic": ["a", "b"],
                             "headers": [[{"key": "h", "value": b"x"}], None]})
    out = list(records(batch, "forced"))
    assert out == [(b"k1", b"v1", "forced", None, [("h", b"x")]), (None, b"v2", "forced", None, None)]


def test_null_topic_row_is_refused_by_row_number():
    batch = pa.record_batch({"value": ["v"], "topic": pa.array([None], pa.string())})
    with pytest.raises(SchemaError, match="row 0 .* null 'topic'"):
        list(records(batch, None))


def test_unknown_option_suggests_the_near_one():
    with pytest.raises(OptionError, match="option 'arbitrationtabel': unknown option .* did you mean 'arbitrationTable'"):
        KafkaSinkOptions.parse({**BASE, "arbitrationTabel": "/x"})


class _Ctx:
    def __init__(self, batch_id):
        self.batch_id = batch_id

    def getLocalProperty(self, key):  # pyspark's name
        assert key == "streaming.sql.batchId"
        return self.batch_id


def test_a_task_without_a_batch_id_writes_nothing_rather_than_guess():
    from lastagent.errors import LastAgentError
    from lastagent.sinks.query_run import task_epoch

    assert task_epoch(_Ctx("7")) == 7
    for missing in (None, "", "-1", "x"):
        with pytest.raises(LastAgentError, match="no micro-batch id"):
            task_epoch(_Ctx(missing))


def test_commit_messages_name_one_run():
    from lastagent.errors import LastAgentError
    from lastagent.sinks.kafka_sink import BranchMessage
    from lastagent.sinks.query_run import generation_of

    assert generation_of([], 3) is None
    assert generation_of([BranchMessage(3, 2, 0, 0, None), BranchMessage(3, 2, 1, 0, None)], 3) == 2
    with pytest.raises(LastAgentError, match="epoch 3: commit messages of generations \\[1, 2\\]"):
        generation_of([BranchMessage(3, 1, 0, 0, None), BranchMessage(3, 2, 1, 0, None)], 3)


def test_a_writer_that_skipped_query_start_refuses_to_write():
    from lastagent.errors import NotStartedError
    from lastagent.sinks.query_run import require_started

    with pytest.raises(NotStartedError, match="without the query-start claim and recovery"):
        require_started(None)


def test_checkpoint_reads_fail_closed(tmp_path):
    from lastagent import spark_checkpoint as checkpoint

    assert checkpoint.committed_through(str(tmp_path / "new")) == -1
    (tmp_path / "c" / "commits").mkdir(parents=True)
    for e in ("0", "1", "12", ".12.crc"):
        (tmp_path / "c" / "commits" / e).write_text("v1")
    assert checkpoint.committed_through(str(tmp_path / "c")) == 12
    assert checkpoint.committed_through(f"file://{tmp_path / 'c'}") == 12
    with pytest.raises(OptionError, match="option 'checkpointLocation': 'wasbs://c@a/p': lastagent cannot reach paths "
                                          "of scheme 'wasbs'"):
        checkpoint.committed_through("wasbs://c@a/p")
    with pytest.raises(OptionError, match="has no Spark query metadata file"):
        checkpoint.query_id(str(tmp_path / "c"))
    (tmp_path / "c" / "metadata").write_text('{"id":"5b1e"}')
    assert checkpoint.query_id(str(tmp_path / "c")) == "5b1e"
    (tmp_path / "c" / "metadata").write_text("garbage")
    with pytest.raises(OptionError, match="is not Spark's query metadata"):
        checkpoint.query_id(str(tmp_path / "c"))
