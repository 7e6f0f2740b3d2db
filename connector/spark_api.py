"""What the pyspark in this Python offers the formats, and what stands in where it offers less.
Driver and executor.

The Python Data Source API the formats use grew over the Spark 4 minors:

======== ================================================ =============================================
pyspark  stream reader                                    stream writer's ``write``
======== ================================================ =============================================
4.0      ``latestOffset()``: no start, no read limit      rows (``pyspark.sql.Row``)
4.1      as 4.0                                           Arrow record batches (``DataSourceStreamArrowWriter``)
4.2, 4.3 admission control: ``latestOffset(start, limit)``, Arrow record batches
         ``getDefaultReadLimit``, ``SupportsTriggerAvailableNow``
======== ================================================ =============================================

The source implements both reader forms in one method (pyspark 4.2+ chooses by its signature), the sinks
turn 4.0's rows back into Arrow batches (:func:`arrow_input`), so every minor gives the same records;
docs/install.md says what differs. A pyspark older than 4.0 or newer than the newest minor tested here is
refused by name (:func:`lastagent.spark_versions.require_supported`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lastagent.errors import UnsupportedSparkError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql.types import DataType, StructType

# -- the API as this pyspark has it ---------------------------------------------------------------

try:
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as StreamWriter  # pyspark 4.1+

    #: True when Spark hands a stream writer's ``write`` Arrow record batches (4.1+), False for rows (4.0).
    ARROW_WRITER = True
except ImportError:
    from pyspark.sql.datasource import DataSourceStreamWriter as StreamWriter  # type: ignore[assignment]

    ARROW_WRITER = False

try:
    import pyspark.sql.streaming.datasource  # noqa: F401  (pyspark 4.2+: admission control)

    #: True when Spark passes a Python stream reader its start and read limit (4.2+).
    ADMISSION_CONTROL = True
except ImportError:
    ADMISSION_CONTROL = False

if TYPE_CHECKING or ADMISSION_CONTROL:
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadLimit,
        ReadMaxRows,
        ReadMinRows,
        SupportsTriggerAvailableNow,
    )
else:
    # Stand-ins with the same names and fields: before 4.2 Spark never sees them; the source's own
    # latestOffset() uses them to take the same path on every minor.
    class ReadLimit:
        """A read limit (pyspark 4.2's class, absent before)."""

    @dataclass
    class ReadAllAvailable(ReadLimit):
        """Read everything available."""

    @dataclass
    class ReadMinRows(ReadLimit):
        """Wait for at least ``min_rows`` rows."""

        min_rows: int

    @dataclass
    class ReadMaxRows(ReadLimit):
        """Read at most ``max_rows`` rows."""

        max_rows: int

    class SupportsTriggerAvailableNow:
        """pyspark 4.2's mixin; before 4.2 Spark wraps the source itself and never calls it."""

        def prepareForTriggerAvailableNow(self) -> None:
            raise NotImplementedError


__all__ = ["ADMISSION_CONTROL", "ARROW_WRITER", "ReadAllAvailable", "ReadLimit", "ReadMaxRows", "ReadMinRows",
           "StreamWriter", "SupportsTriggerAvailableNow", "arrow_input", "require_arrow_input"]


# -- pyspark 4.0's rows back into Arrow (executor) ------------------------------------------------

#: Rows per Arrow batch built from 4.0's rows (Spark's own default for Arrow batches).
ROWS_PER_BATCH = 10_000


def arrow_input(iterator: Iterable[Any], schema: StructType) -> Iterator[pa.RecordBatch]:
    """The records Spark gave a stream writer's ``write``, as Arrow record batches. Executor.

    pyspark 4.1+ gives Arrow batches (passed through as they are); 4.0 gives rows, which are turned back
    into Arrow with the types Spark's Arrow writer gives ``schema``, so the sinks see one kind of input on
    every minor.

    Raises:
        UnsupportedSparkError: a column of a type 4.0's rows cannot carry back (variant, intervals, user-defined).
    """
    if ARROW_WRITER:
        return iter(iterator)
    return rows_to_arrow(iterator, schema)


def require_arrow_input(schema: StructType) -> None:
    """At query start (driver): refuses, naming the column, a schema whose rows pyspark 4.0 could not give back
    as Arrow; nothing on a Spark whose writers get Arrow.

    Raises:
        UnsupportedSparkError: naming the column and its type.
    """
    if not ARROW_WRITER:
        for f in schema.fields:
            _arrow_type(f.dataType, f.name)


def rows_to_arrow(rows: Iterable[Any], schema: StructType, rows_per_batch: int = ROWS_PER_BATCH
                  ) -> Iterator[pa.RecordBatch]:
    """Arrow record batches of ``rows`` (``pyspark.sql.Row``, as pyspark 4.0's writer gives them). Executor.

    Values are put back as Spark had them before pyspark made rows of them: a ``TimestampType`` value,
    which pyspark turned into a naive datetime in the Python worker's local time zone, becomes that
    instant in UTC; binary values are bytes again, maps key-value pairs.

    Raises:
        UnsupportedSparkError: naming the first column of a type rows cannot carry back.
    """
    import pyarrow as pa

    arrow_schema = pa.schema([pa.field(f.name, _arrow_type(f.dataType, f.name), f.nullable) for f in schema.fields])
    convert = [_converter(f.dataType) for f in schema.fields]

    def batch(chunk: list[Any]) -> pa.RecordBatch:
        columns = []
        for i, field in enumerate(arrow_schema):
            fn = convert[i]
            values = [row[i] for row in chunk] if fn is None else [fn(row[i]) for row in chunk]
            columns.append(pa.array(values, type=field.type))
        return pa.RecordBatch.from_arrays(columns, schema=arrow_schema)

    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= rows_per_batch:
            yield batch(chunk)
            chunk = []
    if chunk:
        yield batch(chunk)


def _arrow_type(t: DataType, column: str) -> pa.DataType:
    """The Arrow type Spark's Arrow writer gives a Spark type (timestamps in UTC), or a refusal naming ``column``."""
    import pyarrow as pa
    from pyspark.sql import types as T

    simple = {T.BooleanType: pa.bool_(), T.ByteType: pa.int8(), T.ShortType: pa.int16(), T.IntegerType: pa.int32(),
              T.LongType: pa.int64(), T.FloatType: pa.float32(), T.DoubleType: pa.float64(), T.StringType: pa.string(),
              T.BinaryType: pa.binary(), T.DateType: pa.date32(), T.TimestampType: pa.timestamp("us", tz="UTC"),
              T.TimestampNTZType: pa.timestamp("us"), T.NullType: pa.null()}
    for spark_type, arrow in simple.items():
        if isinstance(t, spark_type):
            return arrow
    if isinstance(t, T.DecimalType):
        return pa.decimal128(t.precision, t.scale)
    if isinstance(t, T.ArrayType):
        return pa.list_(_arrow_type(t.elementType, column))
    if isinstance(t, T.MapType):
        return pa.map_(_arrow_type(t.keyType, column), _arrow_type(t.valueType, column))
    if isinstance(t, T.StructType):
        return pa.struct([pa.field(f.name, _arrow_type(f.dataType, column), f.nullable) for f in t.fields])
    raise UnsupportedSparkError(f"column '{column}' has type {t.simpleString()}, which pyspark 4.0 hands a Python "
                                "stream writer only as Python objects; cast it (to a string or binary) in the query, "
                                "or run Spark 4.1 or newer")


def _converter(t: DataType) -> Callable[[Any], Any] | None:
    """A function from a row value of type ``t`` to what ``pa.array`` takes, or None when none is needed."""
    from pyspark.sql.types import ArrayType, BinaryType, MapType, StructType, TimestampType

    if isinstance(t, TimestampType):
        # pyspark 4.0 made it value.astimezone().replace(tzinfo=None): naive, in this process's zone.
        return lambda v: None if v is None else (v.astimezone(dt.timezone.utc) if v.tzinfo is None else v)
    if isinstance(t, BinaryType):
        return lambda v: None if v is None else bytes(v)
    if isinstance(t, StructType):
        names = t.names
        inner = [_converter(f.dataType) for f in t.fields]
        if all(c is None for c in inner):
            return lambda v: None if v is None else dict(zip(names, tuple(v)))
        return lambda v: None if v is None else {
            n: (x if c is None else c(x)) for n, x, c in zip(names, tuple(v), inner)}
    if isinstance(t, ArrayType):
        element = _converter(t.elementType)
        if element is None:
            return None
        return lambda v: None if v is None else [element(x) for x in v]
    if isinstance(t, MapType):
        key, value = _converter(t.keyType), _converter(t.valueType)
        return lambda v: None if v is None else [
            (k if key is None else key(k), x if value is None else value(x)) for k, x in v.items()]
    return None
