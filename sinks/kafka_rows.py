"""The Kafka sink's input schema and the Arrow-batch-to-record conversion. Pure, no I/O.

The input schema follows Spark's built-in ``kafka`` sink: ``value`` (string or binary,
required), ``key`` (string or binary, optional), ``topic`` (string; required unless the
``topic`` option is set, which then wins), ``partition`` (int, optional), ``headers``
(array<struct<key: string, value: binary>>, optional). Other columns are refused, as Spark's
sink refuses them, so a typo never silently drops data.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyspark.sql.types import ArrayType, BinaryType, IntegerType, StringType, StructType

from lastagent.errors import SchemaError
from lastagent.groups.refusals import REFUSED_REASON, REFUSED_RULE

#: (key, value, topic, partition, headers) for one Kafka record.
Record = tuple[bytes | None, bytes | None, str, int | None, list[tuple[str, bytes | None]] | None]

_ALLOWED = {
    "key": (StringType, BinaryType),
    "value": (StringType, BinaryType),
    "topic": (StringType,),
    "partition": (IntegerType,),
}


@dataclass(frozen=True)
class SinkColumns:
    """Which of the sink's columns the query supplies. Checked on the driver at query start."""

    has_key: bool
    has_topic: bool
    has_partition: bool
    has_headers: bool


def check_schema(schema: StructType, topic_option: str | None) -> SinkColumns:
    """Validates the input schema against Spark's kafka-sink contract.

    Raises:
        SchemaError: naming the column, its type, and the types that would be right.
    """
    names = {f.name.lower(): f for f in schema.fields}
    if REFUSED_RULE in names:
        raise SchemaError(
            f"column '{REFUSED_RULE}' marks messages that lastagent.reliable_groups refused, and lastagent-kafka "
            "has no dead-letter path for them; write the step's output with lastagent-delta (deadLetterTopic / "
            f"deadLetterTable), or split it: .where('{REFUSED_RULE} IS NULL').drop('{REFUSED_RULE}', "
            f"'{REFUSED_REASON}') to this sink, and the refused rows to a sink of your choice"
        )
    unknown = sorted(set(names) - set(_ALLOWED) - {"headers"})
    if unknown:
        raise SchemaError(
            f"column(s) {unknown} are not part of the Kafka sink's input; the sink takes key, value, "
            "topic, partition and headers (select or rename your columns, e.g. "
            "df.selectExpr('CAST(id AS STRING) AS key', 'to_json(struct(*)) AS value'))"
        )
    if "value" not in names:
        raise SchemaError("required column 'value' (string or binary) is missing")
    for name, types in _ALLOWED.items():
        if name in names and not isinstance(names[name].dataType, types):
            wanted = " or ".join(t.typeName() for t in types)
            raise SchemaError(f"column '{name}' is {names[name].dataType.simpleString()}; it must be {wanted}")
    if "headers" in names:
        dt = names["headers"].dataType
        ok = (isinstance(dt, ArrayType) and isinstance(dt.elementType, StructType)
              and [f.name for f in dt.elementType.fields] == ["key", "value"]
              and isinstance(dt.elementType.fields[0].dataType, StringType)
              and isinstance(dt.elementType.fields[1].dataType, BinaryType))
        if not ok:
            raise SchemaError(
                f"column 'headers' is {dt.simpleString()}; it must be array<struct<key:string,value:binary>>")
    if "topic" not in names and not topic_option:
        raise SchemaError("no topic: set option 'topic' or supply a string column 'topic'")
    return SinkColumns("key" in names, "topic" in names, "partition" in names, "headers" in names)


def _bytes_of(column: Any) -> list[bytes | None]:
    """A string or binary Arrow column as Python bytes; strings are reinterpreted, not encoded
    one by one (Arrow's strings are UTF-8 already)."""
    import pyarrow as pa

    assert isinstance(column, (pa.Array, pa.ChunkedArray))
    if pa.types.is_string(column.type):
        column = column.cast(pa.binary())
    elif pa.types.is_large_string(column.type):
        column = column.cast(pa.large_binary())
    return column.to_pylist()


def simple_columns(batch: object) -> tuple[Any, Any]:
    """(keys or None, values) of a batch with only key and value columns, as Arrow arrays: the
    sink's fast path hands them to the compiled producer without a Python object per record."""
    import pyarrow as pa

    assert isinstance(batch, pa.RecordBatch)
    cols = {name.lower(): batch.column(i) for i, name in enumerate(batch.schema.names)}
    return cols.get("key"), cols["value"]


def records(batch: object, topic_option: str | None) -> Iterator[Record]:
    """Yields the Kafka records of one Arrow RecordBatch. Executor side.

    Raises:
        SchemaError: a row has no topic (null ``topic`` column and no ``topic`` option).
    """
    import pyarrow as pa

    assert isinstance(batch, pa.RecordBatch)
    cols = {name.lower(): batch.column(i) for i, name in enumerate(batch.schema.names)}
    n = batch.num_rows
    values = _bytes_of(cols["value"])
    keys = _bytes_of(cols["key"]) if "key" in cols else [None] * n
    partitions = cols["partition"].to_pylist() if "partition" in cols else [None] * n
    if topic_option:
        topics: list[str | None] = [topic_option] * n
    else:
        topics = cols["topic"].to_pylist()
    headers = cols["headers"].to_pylist() if "headers" in cols else [None] * n
    if None in topics:
        row = topics.index(None)
        raise SchemaError(f"row {row} of a batch has a null 'topic' and no option 'topic' is set")
    for key, value, topic, partition, hdrs in zip(keys, values, topics, partitions, headers):
        yield key, value, topic, partition, ([(h["key"], h["value"]) for h in hdrs] if hdrs else None)  # type: ignore[misc]
