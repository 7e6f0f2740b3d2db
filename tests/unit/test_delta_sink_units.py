"""The lastagent-delta sink's pure parts: options, file naming, statistics, schema checks,
transformer with per-record fallback, conversion, dead-letter records and header filters."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow as pa
import pytest

from lastagent.delta import dead_letter_table
from lastagent.delta.files import _Stats, file_name, parse_file_name, partition_value
from lastagent.delta.target_table import schema_diff
from lastagent.errors import OptionError
from lastagent.sinks import dead_letters, transformer
from lastagent.sinks.delta_sink_options import DeltaSinkOptions

pytestmark = pytest.mark.unit

BASE = {"path": "/t", "link": "orders", "checkpointLocation": "/ckpt"}


def test_defaults_need_no_kafka():
    o = DeltaSinkOptions.parse(BASE)
    assert not o.has_kafka and o.partition_by == () and not o.merge_schema and o.transformer is None


def test_side_outputs_need_bootstrap_servers():
    with pytest.raises(OptionError, match="option 'kafka.bootstrap.servers': is required when 'deadLetterTopic'"):
        DeltaSinkOptions.parse({**BASE, "deadLetterTopic": "dlq"})
    o = DeltaSinkOptions.parse({**BASE, "deadLetterTopic": "dlq", "kafka.bootstrap.servers": "h:1",
                                "sideTopics": "a, b"})
    assert o.has_kafka and o.side_topics == ("a", "b") and o.client_config == {"bootstrap.servers": "h:1"}
    assert o.transactional_id(1, 0, 0).startswith(o.id_prefix)


@pytest.mark.parametrize("missing", ["path", "link", "checkpointLocation"])
def test_required_options_are_named(missing):
    with pytest.raises(OptionError, match=f"option '{missing}': is required"):
        DeltaSinkOptions.parse({k: v for k, v in BASE.items() if k != missing})


@pytest.mark.parametrize("bad, match", [
    ({"mergeschema": "yes"}, "option 'mergeSchema': 'yes' is not a boolean"),
    ({"transformer": "nocolon"}, "option 'transformer': 'nocolon' is not 'module:function'"),
    ({"partitionBy": "a b"}, "option 'partitionBy': 'a b' is not a valid column name"),
    ({"targetFileSizeMB": "0"}, "option 'targetFileSizeMB': 0 is too small"),
    ({"keepHeaders": "a", "dropHeaders": "b"}, "option 'keepHeaders': give keepHeaders or dropHeaders"),
    ({"mergeSchem": "true"}, "option 'mergeschem': unknown option .* did you mean 'mergeSchema'"),
    ({"kafka.transactional.id": "x"}, "option 'kafka.transactional.id': is set by the sink"),
])
def test_bad_options_name_the_option(bad, match):
    with pytest.raises(OptionError, match=match):
        DeltaSinkOptions.parse({**BASE, **bad})


def test_partition_columns_option():
    assert DeltaSinkOptions.parse({**BASE, "partitionBy": "day, region"}).partition_by == ("day", "region")


def test_file_names_say_link_run_epoch_task_and_attempt():
    name = file_name("orders-eu", 4, 12, 3, 1)
    assert parse_file_name(name) == ("orders-eu", 4, 12, 3, 1)
    assert parse_file_name(file_name("a-g1", 2, 0, 0, 0)) == ("a-g1", 2, 0, 0, 0)
    assert parse_file_name("part-00000-abc.snappy.parquet") is None


def test_statistics_are_safe_for_data_skipping():
    s = _Stats()
    ts = pa.array([dt.datetime(2026, 1, 1, 0, 0, 0, 1500), dt.datetime(2026, 1, 1, 0, 0, 0, 2500)],
                  pa.timestamp("us", tz="UTC"))
    s.add(pa.RecordBatch.from_arrays([pa.array([3, None, 1]), pa.array(["b", "a", "x" * 40]),
                                      pa.array([b"1", b"2", b"3"])], names=["n", "s", "bin"]))
    s.add(pa.RecordBatch.from_arrays([pa.array([7]), pa.array([None], pa.string()), pa.array([None], pa.binary())],
                                     names=["n", "s", "bin"]))
    t = _Stats()
    t.add(pa.RecordBatch.from_arrays([ts], names=["ts"]))
    stats, tstats = json.loads(s.to_json()), json.loads(t.to_json())
    assert stats["numRecords"] == 4 and stats["nullCount"] == {"n": 1, "s": 1, "bin": 1}
    assert stats["minValues"] == {"n": 1, "s": "a"}
    assert stats["maxValues"] == {"n": 7}  # a string max longer than the prefix is left out
    # Milliseconds: min rounds down, max rounds up.
    assert tstats["minValues"]["ts"] == "2026-01-01T00:00:00.001Z"
    assert tstats["maxValues"]["ts"] == "2026-01-01T00:00:00.003Z"


def test_partition_values_in_delta_form():
    assert partition_value(None) is None and partition_value(True) == "true"
    assert partition_value(dt.date(2026, 1, 2)) == "2026-01-02" and partition_value(5) == "5"


def _schema(**cols: str) -> str:
    return json.dumps({"type": "struct", "fields": [{"name": n, "type": t, "nullable": True, "metadata": {}}
                                                    for n, t in cols.items()]})


def test_schema_diff_names_columns_and_types():
    problems, new = schema_diff(_schema(a="long", b="string"), _schema(a="string", c="long"), merge=False)
    assert problems == ['column \'a\': the table has "long", the query gives "string"',
                        'column \'c\' ("long") is not in the table'] and new == []
    problems, new = schema_diff(_schema(a="long"), _schema(a="long", c="long"), merge=True)
    assert problems == [] and [f["name"] for f in new] == ["c"]


def _batch(values: list) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"value": pa.array(values, pa.string()), "offset": list(range(len(values)))})


def _upper(batch: pa.RecordBatch) -> pa.RecordBatch:
    values = batch.column("value").to_pylist()
    if any(v == "poison" for v in values):
        raise ValueError("poison")
    return pa.RecordBatch.from_pydict({"value": [v.upper() for v in values]})


def test_transformer_failures_are_found_record_by_record():
    out, failed = transformer.apply(_upper, _batch(["a", "poison", "b"]))
    assert [v for b in out for v in b.column("value").to_pylist()] == ["A", "B"]
    assert [(f.row.to_pylist()[0]["offset"], f.reason, str(f.error)) for f in failed] == [
        (1, "transformer-failed", "poison")]


def test_transformer_spec_errors_name_the_option():
    with pytest.raises(OptionError, match="option 'transformer': cannot import module 'no_such_mod'"):
        transformer.load("no_such_mod:f")
    with pytest.raises(OptionError, match="has no callable 'nope'"):
        transformer.load("json:nope")
    assert transformer.load("json:dumps") is json.dumps


def test_conform_casts_fills_and_splits_failures():
    target = pa.schema([("n", pa.int64()), ("extra", pa.string())])
    ok, failed = transformer.conform(pa.RecordBatch.from_pydict({"n": ["1", "x", "3"]}), target, merge=False)
    assert [r for b in ok for r in b.to_pylist()] == [{"n": 1, "extra": None}, {"n": 3, "extra": None}]
    assert [(f.row.to_pylist(), f.reason) for f in failed] == [([{"n": "x"}], "conversion-failed")]


def test_dead_letter_keeps_the_record_and_says_why():
    row = {"key": b"k", "value": b"v", "topic": "in", "partition": 2, "offset": 9,
           "headers": [{"key": "trace", "value": b"t1"}]}
    key, value, headers = dead_letters.dead_letter(row, "transformer-failed", ValueError("bad"), "orders", 4)
    h = dict(headers)
    assert (key, value) == (b"k", b"v") and h["trace"] == b"t1"
    assert h["lastagent.dlq.reason"] == b"transformer-failed" and h["lastagent.dlq.exception"] == b"ValueError: bad"
    assert h["lastagent.dlq.link"] == b"orders" and h["lastagent.dlq.epoch"] == b"4"
    assert (h["lastagent.dlq.source.topic"], h["lastagent.dlq.source.partition"],
            h["lastagent.dlq.source.offset"]) == (b"in", b"2", b"9")
    assert int(h["lastagent.dlq.time"]) > 0
    assert dead_letters.describe(row) == "record in-2@9"
    _, value, _ = dead_letters.dead_letter({"n": 1, "b": b"\x00"}, "conversion-failed", "x", "l", 0)
    assert json.loads(value) == {"n": 1, "b": "AA=="}


def test_header_filters_keep_or_drop_named_keys():
    htype = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
    batch = pa.RecordBatch.from_arrays([pa.array([[{"key": "a", "value": b"1"}, {"key": "b", "value": b"2"}], None],
                                                 htype)], names=["headers"])
    keep = dead_letters.filter_headers(batch, ("a",), ())
    drop = dead_letters.filter_headers(batch, (), ("a",))
    assert keep.column(0).to_pylist() == [[{"key": "a", "value": b"1"}], None]
    assert drop.column(0).to_pylist() == [[{"key": "b", "value": b"2"}], None]
    assert keep.schema == batch.schema


def test_dead_letter_table_row_carries_the_reason_columns():
    row = {"key": b"k", "value": b"v", "topic": "in", "partition": 2, "offset": 9,
           "headers": [{"key": "trace", "value": b"t1"}]}
    out = dead_letter_table.table_row(*dead_letters.dead_letter(row, "conversion-failed", "bad cast", "orders", 4))
    batch = pa.RecordBatch.from_pylist([out], schema=dead_letter_table.TABLE_SCHEMA)
    got = batch.to_pylist()[0]
    assert (got["key"], got["value"], got["reason"], got["exception"]) == (b"k", b"v", "conversion-failed", "bad cast")
    assert (got["source_topic"], got["source_partition"], got["source_offset"], got["link"], got["epoch"]) == (
        "in", 2, 9, "orders", 4)
    assert got["headers"] == [{"key": "trace", "value": b"t1"}] and got["failed_at"].year >= 2026


def test_dead_letter_table_alone_needs_no_kafka():
    o = DeltaSinkOptions.parse({**BASE, "deadLetterTable": "/dead"})
    assert o.dead_letter_table == "/dead" and not o.has_kafka


def test_parquet_dictionary_only_where_values_repeat():
    """Keys, offsets and payloads that rarely repeat are written plain; topic, partition and
    header leaves keep their dictionary (pyarrow would dictionary-encode every column)."""
    from lastagent.delta.files import dictionary_columns

    n = 1000
    headers = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
    batch = pa.record_batch({
        "key": pa.array([str(i) for i in range(n)]),
        "value": pa.array([i.to_bytes(4, "big") for i in range(n)], pa.binary()),
        "topic": pa.array(["orders"] * n),
        "partition": pa.array([i % 3 for i in range(n)], pa.int32()),
        "offset": pa.array(range(n), pa.int64()),
        "half": pa.array([i // 2 for i in range(n)], pa.int64()),  # exactly half distinct: kept
        "nothing": pa.nulls(n, pa.string()),
        "headers": pa.array([[{"key": "h", "value": b"v"}]] * n, headers),
    })
    assert dictionary_columns(batch) == ["topic", "partition", "half", "nothing",
                                         "headers.list.element.key", "headers.list.element.value"]


def test_a_column_arrow_cannot_count_keeps_its_dictionary():
    """count_distinct has no kernel for some types (a dictionary column): pyarrow's default stands."""
    from lastagent.delta.files import dictionary_columns

    n = 1000
    batch = pa.record_batch({"offset": pa.array(range(n), pa.int64()),
                             "topic": pa.array([f"t{i}" for i in range(n)]).dictionary_encode()})
    assert dictionary_columns(batch) == ["topic"]


def test_a_commit_that_lost_a_race_is_read_and_tried_again_a_bounded_number_of_times():

    from lastagent.core.arbitration import LostRace
    from lastagent.delta.table_properties import COMMIT_TRIES, until_committed
    from lastagent.errors import ArbitrationError

    tries = []

    def loses_twice() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise LostRace("another writer committed version 3 first")
        if len(tries) == 2:
            raise LostRace("another writer created the table first")
        return "won"

    assert until_committed(loses_twice, "the commit", "/t") == "won" and len(tries) == 3

    def always_loses() -> str:
        tries.append(1)
        raise LostRace("version taken")

    tries.clear()
    with pytest.raises(ArbitrationError, match=f"the commit: too many concurrent commits to /t \\({COMMIT_TRIES} tries"):
        until_committed(always_loses, "the commit", "/t")
    assert len(tries) == COMMIT_TRIES

    def fails() -> str:
        tries.append(1)
        raise ArbitrationError("cannot write")

    tries.clear()
    with pytest.raises(ArbitrationError, match="cannot write"):
        until_committed(fails, "the commit", "/t")
    assert len(tries) == 1  # anything but a lost race is not tried again


def test_a_plain_append_is_the_txn_then_each_add_with_its_path_encoded_as_the_log_holds_it():
    from lastagent.delta.kernel import append_actions

    add = {"path": "day=2026-11-28 10%3A00/part-0.parquet", "size": 10, "partitionValues": {"day": "x"},
           "modificationTime": 5, "dataChange": True, "stats": '{"numRecords":3}'}
    txn, logged = append_actions([add], "orders", 7, 123)
    assert txn == {"txn": {"appId": "orders", "version": 7, "lastUpdated": 123}}
    assert logged == {"add": {**add, "path": "day=2026-11-28%2010%253A00/part-0.parquet"}}
    assert append_actions([], "orders", 8, 1) == [{"txn": {"appId": "orders", "version": 8, "lastUpdated": 1}}]


def test_a_streaming_epochs_commit_info_is_sparks_with_the_record_and_the_epochs_metrics():
    from lastagent.delta.kernel import streaming_commit_info

    adds = [{"size": 100, "stats": '{"numRecords":3}'}, {"size": 50, "stats": '{"numRecords":2}'}, {"size": 7}]
    info = streaming_commit_info(4, {"lastagent.epoch": "4", "userMetadata": "{}"}, adds)
    assert info["operation"] == "STREAMING UPDATE" and info["isBlindAppend"] is True
    assert info["operationParameters"] == {"outputMode": "Append", "epochId": "4"}
    assert info["operationMetrics"] == {"numAddedFiles": "3", "numRemovedFiles": "0", "numOutputRows": "5",
                                        "numOutputBytes": "157"}
    assert info["lastagent.epoch"] == "4" and info["userMetadata"] == "{}"


def test_a_new_table_gets_reader_1_writer_2_or_the_features_its_column_types_need():
    from lastagent.delta.kernel import new_table

    plain = json.dumps({"type": "struct", "fields": [{"name": "id", "type": "long", "nullable": True, "metadata": {}}]})
    protocol, metadata = new_table(plain, ("day",), 7, "t")
    assert protocol == {"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}}
    assert metadata["metaData"]["schemaString"] == plain and metadata["metaData"]["partitionColumns"] == ["day"]
    assert metadata["metaData"]["name"] == "t" and metadata["metaData"]["createdTime"] == 7
    nested = json.dumps({"type": "struct", "fields": [{"name": "s", "nullable": True, "metadata": {}, "type": {
        "type": "array", "containsNull": True, "elementType": {"type": "struct", "fields": [
            {"name": "at", "type": "timestamp_ntz", "nullable": True, "metadata": {}}]}}}]})
    (protocol, _) = new_table(nested, (), 7)
    assert protocol["protocol"] == {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["timestampNtz"],
                                    "writerFeatures": ["timestampNtz"]}
