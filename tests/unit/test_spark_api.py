"""lastagent.spark_api: what stands in where a Spark 4 minor offers less. pyspark 4.0's rows go back to Arrow
(rows_to_arrow) as pyspark 4.0's worker made them from Spark's Arrow batches; checked here with the pyspark
installed (4.0's conversion is what pyspark.sql.conversion does on every minor)."""

from __future__ import annotations

import datetime as dt
import os
import time

import pyarrow as pa
import pytest
from pyspark.sql.conversion import ArrowTableToRowsConversion
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from lastagent import spark_api
from lastagent.errors import UnsupportedSparkError
from lastagent.spark_api import arrow_input, rows_to_arrow

pytestmark = pytest.mark.unit

HEADERS = ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())]))
SCHEMA = StructType([
    StructField("key", BinaryType()), StructField("value", BinaryType()), StructField("topic", StringType()),
    StructField("partition", IntegerType()), StructField("ts", TimestampType()), StructField("ntz", TimestampNTZType()),
    StructField("headers", HEADERS), StructField("attrs", MapType(StringType(), IntegerType())),
    StructField("nested", StructType([StructField("at", TimestampType()), StructField("n", IntegerType())])),
])


def _spark_batch() -> pa.RecordBatch:
    """A batch as Spark's Arrow writer sends it (timestamps in the session's zone, here New York)."""
    ny = dt.timezone(dt.timedelta(hours=-5))
    at = dt.datetime(2026, 1, 15, 8, 30, 0, 123456, tzinfo=ny)
    rows = [
        {"key": b"k1", "value": b"v1", "topic": "t", "partition": 0, "ts": at, "ntz": dt.datetime(2026, 1, 15, 8, 30),
         "headers": [{"key": "h", "value": b"\x00\x01"}], "attrs": [("a", 1)], "nested": {"at": at, "n": 7}},
        {"key": None, "value": b"", "topic": None, "partition": None, "ts": None, "ntz": None, "headers": None,
         "attrs": None, "nested": None},
    ]
    at_ny = pa.timestamp("us", tz="America/New_York")
    schema = pa.schema([("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()), ("partition", pa.int32()),
                        ("ts", at_ny), ("ntz", pa.timestamp("us")),
                        ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
                        ("attrs", pa.map_(pa.string(), pa.int32())),
                        ("nested", pa.struct([("at", at_ny), ("n", pa.int32())]))])
    return pa.RecordBatch.from_pylist(rows, schema=schema)


def _as_pyspark_40_rows(batch: pa.RecordBatch) -> list:
    """What pyspark 4.0's write_into_data_source hands a stream writer: its batch_to_rows."""
    import inspect

    from pyspark.sql.types import _create_row

    # pyspark 4.0's converters give bytearray for binary; later ones say so with binary_as_bytes=False.
    as_40 = {"binary_as_bytes": False} if "binary_as_bytes" in inspect.signature(
        ArrowTableToRowsConversion._create_converter).parameters else {}
    converters = [ArrowTableToRowsConversion._create_converter(f.dataType, **as_40) for f in SCHEMA.fields]
    columns = [c.to_pylist() for c in batch.columns]
    return [_create_row(SCHEMA.fieldNames(), [converters[i](columns[i][r]) for i in range(len(columns))])
            for r in range(batch.num_rows)]


@pytest.mark.parametrize("zone", ["UTC", "America/Los_Angeles", "Asia/Kolkata"])
def test_pyspark_40_rows_give_back_the_batch_spark_sent(monkeypatch, zone):
    # pyspark 4.0 makes timestamps naive in the Python worker's zone: any zone must give the same instants.
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        sent = _spark_batch()
        rows = _as_pyspark_40_rows(sent)
        assert isinstance(rows[0].value, bytearray) and rows[0].ts.tzinfo is None  # as 4.0 gives them
        (got,) = list(rows_to_arrow(rows, SCHEMA))
        utc = sent.cast(got.schema)  # the same instants, in UTC
        assert got.schema == utc.schema and got.to_pylist() == utc.to_pylist()
    finally:
        os.environ.pop("TZ", None)
        time.tzset()


def test_rows_are_batched_and_nothing_is_lost():
    rows = _as_pyspark_40_rows(_spark_batch()) * 2_501  # 5002 rows
    batches = list(rows_to_arrow(rows, SCHEMA, rows_per_batch=1_000))
    assert [b.num_rows for b in batches] == [1_000] * 5 + [2]
    assert list(rows_to_arrow([], SCHEMA)) == []


def test_arrow_batches_pass_through_on_a_spark_that_sends_them():
    batch = _spark_batch()
    if spark_api.ARROW_WRITER:
        assert list(arrow_input(iter([batch]), SCHEMA)) == [batch]


def test_a_type_rows_cannot_carry_back_is_refused_by_column():
    from pyspark.sql.types import VariantType

    schema = StructType([StructField("value", BinaryType()), StructField("payload", ArrayType(VariantType()))])
    with pytest.raises(UnsupportedSparkError, match="column 'payload' has type variant, .*Spark 4.1 or newer"):
        list(rows_to_arrow([], schema))
    if not spark_api.ARROW_WRITER:  # pyspark 4.0: refused at query start, on the driver
        with pytest.raises(UnsupportedSparkError, match="column 'payload'"):
            spark_api.require_arrow_input(schema)
    else:
        spark_api.require_arrow_input(schema)  # later minors hand the writer Arrow: nothing to refuse
