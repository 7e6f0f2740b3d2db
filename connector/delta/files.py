"""Data files of the ``lastagent-delta`` sink: parquet written by tasks, no snapshot references them.

Executor side (:class:`FileWriter`) and shared naming (:func:`file_name`, :func:`parse_file_name`).
A task writes its rows as parquet files under the table's root (Hive-style partition
directories) and returns their Delta add actions with statistics; nothing is visible until the
driver's one Delta commit for the epoch references them. Files are named after link, epoch,
Spark partition and attempt, so files of undecided epochs and of failed attempts can be found and
deleted later without touching anyone else's.

Memory stays bounded: batches are appended to open parquet writers (one per partition value) and a
file is closed once it reaches the target size.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import pyarrow as pa
import pyarrow.compute as pc

from lastagent.storage import StorageConfig, open_path

_NAME = re.compile(r"^lastagent-(?P<link>.+)-g(?P<generation>\d+)-e(?P<epoch>\d+)-p(?P<partition>\d+)"
                   r"-a(?P<attempt>\d+)-[0-9a-f]{12}\.snappy\.parquet$")
#: Delta truncates string statistics; a longer max would need a tie-breaker, so it is left out.
_STRING_PREFIX = 32


def file_name(link: str, generation: int, epoch: int, partition: int, attempt: int) -> str:
    """A data file's base name: which link, run (generation), epoch and task attempt wrote it."""
    return (f"lastagent-{link}-g{generation}-e{epoch}-p{partition}-a{attempt}-{uuid.uuid4().hex[:12]}"
            ".snappy.parquet")


def parse_file_name(name: str) -> tuple[str, int, int, int, int] | None:
    """(link, generation, epoch, partition, attempt) of a file this sink wrote, or None for any other file."""
    m = _NAME.match(name)
    if m is None:
        return None
    return m["link"], int(m["generation"]), int(m["epoch"]), int(m["partition"]), int(m["attempt"])


#: Delta's primitive types as Arrow types, as Delta readers (delta-rs, Delta Kernel) map them.
_PRIMITIVES: dict[str, pa.DataType] = {
    "string": pa.string(), "long": pa.int64(), "integer": pa.int32(), "short": pa.int16(), "byte": pa.int8(),
    "float": pa.float32(), "double": pa.float64(), "boolean": pa.bool_(), "binary": pa.binary(), "date": pa.date32(),
    "timestamp": pa.timestamp("us", tz="UTC"), "timestamp_ntz": pa.timestamp("us"),
}
_DECIMAL = re.compile(r"decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)")


def arrow_schema(schema_json: str) -> pa.Schema:
    """A Delta table's schema (its ``metaData.schemaString``) as an Arrow schema. Executor and driver, no Delta library.

    Delta's types map as delta-rs and Delta Kernel map them: timestamps to microseconds (``timestamp`` UTC-adjusted),
    ``date`` to ``date32``, ``decimal(p,s)`` to ``decimal128``, arrays to lists of ``element``, maps to Arrow maps
    (their keys not null), ``variant`` to its struct of ``metadata`` and ``value``; a field keeps its nullability and
    its metadata (values that are not strings as their JSON text).

    Raises:
        ValueError: a type this mapping does not know, naming it.
    """
    def metadata(d: dict[str, Any]) -> dict[str, str] | None:
        meta = d.get("metadata") or {}
        return {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()} or None

    def field(d: dict[str, Any]) -> pa.Field:
        return pa.field(d["name"], kind(d["type"]), bool(d.get("nullable", True)), metadata=metadata(d))

    def kind(t: Any) -> pa.DataType:
        if isinstance(t, str):
            if t in _PRIMITIVES:
                return _PRIMITIVES[t]
            if (m := _DECIMAL.fullmatch(t)) is not None:
                return pa.decimal128(int(m.group(1)), int(m.group(2)))
            if t == "variant":
                return pa.struct([pa.field("metadata", pa.binary(), False), pa.field("value", pa.binary(), False)])
            raise ValueError(f"Delta type {t!r} has no Arrow mapping here")
        if t["type"] == "struct":
            return pa.struct([field(f) for f in t["fields"]])
        if t["type"] == "array":
            return pa.list_(pa.field("element", kind(t["elementType"]), bool(t.get("containsNull", True))))
        if t["type"] == "map":
            return pa.map_(pa.field("key", kind(t["keyType"]), False),
                           pa.field("value", kind(t["valueType"]), bool(t.get("valueContainsNull", True))))
        raise ValueError(f"Delta type {t['type']!r} has no Arrow mapping here")

    return pa.schema([field(f) for f in json.loads(schema_json)["fields"]])


def delta_schema_json(schema: pa.Schema) -> str:
    """An Arrow schema as a Delta schema (``schemaString`` JSON), as delta-rs maps it. Executor, no Delta library.

    Integers of either sign to the Delta integer of their width, every string and binary form to ``string`` and
    ``binary``, dictionaries to their values' type, dates to ``date``, timestamps in UTC to ``timestamp`` and
    without a zone to ``timestamp_ntz``, ``decimal128`` to ``decimal(p,s)``, every list form to ``array``, Arrow's
    null type to ``void``; field metadata as strings.

    Raises:
        ValueError: a type Delta cannot hold (half floats, times, durations, ``decimal256``, timestamps in another
            zone, in nanoseconds, or without a zone in other units than microseconds), naming the column.
    """
    def field(f: pa.Field, where: str) -> dict[str, Any]:
        meta = {k.decode(): v.decode() for k, v in (f.metadata or {}).items()}
        return {"name": f.name, "type": kind(f.type, f"{where}{f.name}"), "nullable": f.nullable, "metadata": meta}

    def kind(t: pa.DataType, where: str) -> Any:
        if pa.types.is_dictionary(t):
            return kind(t.value_type, where)
        for test, name in _ARROW_KINDS:
            if test(t):
                return name
        if pa.types.is_timestamp(t) and (t.tz == "UTC" and t.unit != "ns" or t.tz is None and t.unit == "us"):
            return "timestamp" if t.tz else "timestamp_ntz"
        if pa.types.is_decimal128(t):
            return f"decimal({t.precision},{t.scale})"
        if isinstance(t, (pa.ListType, pa.LargeListType, pa.FixedSizeListType, pa.ListViewType, pa.LargeListViewType)):
            return {"type": "array", "elementType": kind(t.value_type, f"{where}."),
                    "containsNull": t.value_field.nullable}
        if pa.types.is_map(t):
            return {"type": "map", "keyType": kind(t.key_type, f"{where}."), "valueType": kind(t.item_type, f"{where}."),
                    "valueContainsNull": t.item_field.nullable}
        if pa.types.is_struct(t):
            return {"type": "struct", "fields": [field(t.field(i), f"{where}.") for i in range(t.num_fields)]}
        raise ValueError(f"column '{where}': Arrow type {t} has no Delta type (Delta holds no half floats, times, "
                         "durations or decimals over 38 digits, and timestamps in UTC or, without a zone, in "
                         "microseconds)")

    fields = [field(f, "") for f in schema]
    return json.dumps({"type": "struct", "fields": fields}, separators=(",", ":"))


#: Arrow type tests and the Delta primitive each maps to (delta-rs's mapping; the sign of an integer is dropped).
_ARROW_KINDS: tuple[tuple[Any, str], ...] = (
    (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t), "string"),
    (lambda t: (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)
                or pa.types.is_fixed_size_binary(t)), "binary"),
    (lambda t: pa.types.is_int8(t) or pa.types.is_uint8(t), "byte"),
    (lambda t: pa.types.is_int16(t) or pa.types.is_uint16(t), "short"),
    (lambda t: pa.types.is_int32(t) or pa.types.is_uint32(t), "integer"),
    (lambda t: pa.types.is_int64(t) or pa.types.is_uint64(t), "long"),
    (pa.types.is_float32, "float"),
    (pa.types.is_float64, "double"),
    (pa.types.is_boolean, "boolean"),
    (pa.types.is_date, "date"),
    (pa.types.is_null, "void"),
)


def delta_arrow_schema(schema: pa.Schema) -> pa.Schema:
    """The schema a batch is stored with: Delta's timestamps are microseconds, UTC-adjusted."""
    fields = []
    for f in schema:
        t = f.type
        if pa.types.is_timestamp(t):
            t = pa.timestamp("us", tz="UTC") if t.tz else pa.timestamp("us")
        fields.append(pa.field(f.name, t, f.nullable))
    return pa.schema(fields)


def physical_fields(logical: pa.Schema, schema_json: str) -> dict[str, pa.Field]:
    """The fields a column-mapped table's files are written with, by logical column name. Executor side.

    Each field (nested struct fields too) takes its physical name
    (``delta.columnMapping.physicalName``) and its field id (``delta.columnMapping.id``, as
    parquet's ``field_id``), as Spark's writer does in modes ``name`` and ``id``; readers find
    columns by them, so a renamed column reads its own values.

    Args:
        logical: the table's Arrow schema (logical names), as the tasks cast rows to it.
        schema_json: the table's Delta schema, which holds the mapping.
    """
    def field(f: pa.Field, delta: dict[str, Any]) -> pa.Field:
        meta = delta.get("metadata", {})
        name = meta.get("delta.columnMapping.physicalName", f.name)
        ids = {b"PARQUET:field_id": str(meta["delta.columnMapping.id"]).encode()} if "delta.columnMapping.id" in meta else None
        return pa.field(name, kind(f.type, delta["type"]), f.nullable, metadata=ids)

    def kind(t: pa.DataType, delta: Any) -> pa.DataType:
        if pa.types.is_struct(t):
            by_name = {d["name"]: d for d in delta["fields"]}
            return pa.struct([field(t.field(i), by_name[t.field(i).name]) for i in range(t.num_fields)])
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            value = pa.field(t.value_field.name, kind(t.value_type, delta["elementType"]), t.value_field.nullable)
            return pa.large_list(value) if pa.types.is_large_list(t) else pa.list_(value)
        if pa.types.is_map(t):
            return pa.map_(kind(t.key_type, delta["keyType"]),
                           pa.field(t.item_field.name, kind(t.item_type, delta["valueType"]), t.item_field.nullable))
        return t

    by_name = {d["name"]: d for d in json.loads(schema_json)["fields"]}
    return {f.name: field(f, by_name[f.name]) for f in logical}


def partition_value(value: Any) -> str | None:
    """Delta's string form of a partition value (None stays null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _stat_value(value: Any, is_max: bool) -> Any:
    """A JSON statistics value, or None when it cannot be stated safely."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
        # Delta states timestamps in milliseconds: round min down and max up, so skipping stays safe.
        micros = value.microsecond % 1000
        if micros and is_max:
            value += dt.timedelta(microseconds=1000 - micros)
        elif micros:
            value -= dt.timedelta(microseconds=micros)
        return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, str):
        if len(value) > _STRING_PREFIX:
            return None if is_max else value[:_STRING_PREFIX]
        return value
    if isinstance(value, (int, bool)):
        return value
    return None


@dataclass
class _Stats:
    """Running statistics of one file (top-level columns with an order Delta can use)."""

    rows: int = 0
    mins: dict[str, Any] = field(default_factory=dict)
    maxs: dict[str, Any] = field(default_factory=dict)
    nulls: dict[str, int] = field(default_factory=dict)

    def add(self, batch: pa.RecordBatch) -> None:
        self.rows += batch.num_rows
        for name, col in zip(batch.schema.names, batch.columns):
            self.nulls[name] = self.nulls.get(name, 0) + col.null_count
            t = col.type
            if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_string(t)
                    or pa.types.is_large_string(t) or pa.types.is_date(t) or pa.types.is_timestamp(t)):
                continue
            if col.null_count == len(col):
                continue
            mm = pc.min_max(col).as_py()
            lo, hi = mm["min"], mm["max"]
            if name not in self.mins or (lo is not None and self.mins[name] is not None and lo < self.mins[name]):
                self.mins[name] = lo
            if name not in self.maxs or (hi is not None and self.maxs[name] is not None and hi > self.maxs[name]):
                self.maxs[name] = hi

    def to_json(self) -> str:
        mins = {k: v for k, v in ((k, _stat_value(v, False)) for k, v in self.mins.items()) if v is not None}
        maxs = {k: v for k, v in ((k, _stat_value(v, True)) for k, v in self.maxs.items()) if v is not None}
        return json.dumps({"numRecords": self.rows, "minValues": mins, "maxValues": maxs, "nullCount": self.nulls},
                          separators=(",", ":"))


#: A column keeps parquet's dictionary encoding when at most this share of its values is distinct.
DICTIONARY_MAX_DISTINCT = 0.5


def dictionary_columns(batch: pa.RecordBatch) -> list[str]:
    """The parquet columns of a new file worth a dictionary, judged on its first batch. Executor.

    pyarrow dictionary-encodes every column until a row group's dictionary passes 1 MB; for
    columns whose values rarely repeat (Kafka keys, offsets, random payloads) that is work that
    only makes the file larger. Spark's parquet writer drops the dictionary as soon as it stops
    paying; here a top-level column keeps it when at most half of the first batch's values are
    distinct. Nested columns (headers) keep theirs, as before.
    """
    import io

    import pyarrow.parquet as pq

    nested = {n for n, t in zip(batch.schema.names, batch.schema.types) if pa.types.is_nested(t)}
    keep = []
    for name, col in zip(batch.schema.names, batch.columns):
        if name in nested:
            continue
        present = len(col) - col.null_count
        try:
            repeats = present == 0 or pc.count_distinct(col).as_py() <= DICTIONARY_MAX_DISTINCT * present
        except pa.ArrowNotImplementedError:
            repeats = True  # a type Arrow cannot count: keep pyarrow's default (a dictionary)
        if repeats:
            keep.append(name)
    if nested:
        # pyarrow names a nested column's parts by their leaf paths (headers.list.element.key, ...):
        # read them off an empty file of the same schema.
        empty = io.BytesIO()
        pq.write_table(batch.schema.empty_table(), empty)
        leaves = pq.ParquetFile(io.BytesIO(empty.getvalue())).schema
        keep += [c.path for c in (leaves.column(i) for i in range(len(leaves))) if c.path.split(".")[0] in nested]
    return keep


@dataclass
class _OpenFile:
    relative: str
    stream: Any
    writer: Any
    partition_values: dict[str, str | None]
    stats: _Stats = field(default_factory=_Stats)


class FileWriter:
    """Writes one task attempt's rows as parquet data files under the table root. Executor side.

    Args:
        root: the table's location.
        link, generation, epoch, partition, attempt: name the files (see :func:`file_name`).
        partition_by: the table's partition columns (not stored in the files, as Delta does).
        target_bytes: a file is closed and a new one started after about this many bytes.
        storage: the query's ``storage.*`` settings (object stores).
        option: the option that named ``root``, for errors.
        physical: a column-mapped table's :func:`physical_fields`: files, statistics and partition
            values then use physical names and field ids. None for a table without column mapping.
    """

    def __init__(self, root: str, link: str, generation: int, epoch: int, partition: int, attempt: int,
                 partition_by: tuple[str, ...] = (), target_bytes: int = 128 << 20,
                 storage: StorageConfig | None = None, option: str = "path",
                 physical: dict[str, pa.Field] | None = None) -> None:
        self.fs, self.root = open_path(root, option, storage)
        self.naming = (link, generation, epoch, partition, attempt)
        self.partition_by = partition_by
        self.target_bytes = target_bytes
        self.schema: pa.Schema | None = None
        self._open: dict[tuple[str | None, ...], _OpenFile] = {}
        self._written: list[str] = []
        self.adds: list[dict[str, Any]] = []
        self.rows = 0
        self.physical = physical

    def _stored(self, name: str) -> str:
        """The name a top-level column has in files, statistics and partition values."""
        return name if self.physical is None else self.physical[name].name

    def _renamed(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if self.physical is None:
            return batch
        # A zero-copy view: same buffers, physical names and field ids (nested ones too).
        fields = [self.physical[name] for name in batch.schema.names]
        return pa.RecordBatch.from_struct_array(batch.to_struct_array().view(pa.struct(fields)))

    def write(self, batch: pa.RecordBatch) -> None:
        """Appends a batch (already in the table's schema) to the files of its partition values."""
        if batch.num_rows == 0:
            return
        if self.schema is None:
            self.schema = batch.schema
        self.rows += batch.num_rows
        if not self.partition_by:
            self._append((), {}, self._renamed(batch))
            return
        table = pa.Table.from_batches([batch])
        keys = table.select(list(self.partition_by)).group_by(list(self.partition_by)).aggregate([]).to_pylist()
        data_cols = [n for n in batch.schema.names if n not in self.partition_by]
        for key in keys:
            mask = None
            for col in self.partition_by:
                value = key[col]
                cond = pc.is_null(table[col]) if value is None else pc.equal(table[col], pa.scalar(value, table[col].type))
                cond = pc.fill_null(cond, False)
                mask = cond if mask is None else pc.and_(mask, cond)
            part = table.filter(mask).select(data_cols)
            values = {self._stored(c): partition_value(key[c]) for c in self.partition_by}
            for b in part.to_batches():
                self._append(tuple(values.values()), values, self._renamed(b))

    def _append(self, key: tuple[str | None, ...], values: dict[str, str | None], batch: pa.RecordBatch) -> None:
        import pyarrow.parquet as pq

        f = self._open.get(key)
        if f is None:
            dirs = "".join(f"{c}={quote(v if v is not None else '__HIVE_DEFAULT_PARTITION__', safe='')}/"
                           for c, v in values.items())
            relative = dirs + file_name(*self.naming)
            full = f"{self.root}/{relative}"
            self.fs.create_dir(f"{self.root}/{dirs}".rstrip("/"), recursive=True)
            stream = self.fs.open_output_stream(full)
            self._written.append(full)
            writer = pq.ParquetWriter(stream, batch.schema, compression="snappy",
                                      use_dictionary=dictionary_columns(batch))
            f = _OpenFile(relative, stream, writer, values)
            self._open[key] = f
        f.writer.write_batch(batch)
        f.stats.add(batch)
        if f.stream.tell() >= self.target_bytes:
            self._close(key)

    def _close(self, key: tuple[str | None, ...]) -> None:
        f = self._open.pop(key)
        f.writer.close()
        size = f.stream.tell()
        f.stream.close()
        self.adds.append({
            # The path as on disk: the driver URI-encodes it for the log (kernel_add).
            "path": f.relative, "size": size, "partitionValues": f.partition_values,
            "modificationTime": int(time.time() * 1000), "dataChange": True, "stats": f.stats.to_json(),
        })

    def close(self) -> list[dict[str, Any]]:
        """Closes every open file; returns the add actions (JSON-able dicts) of all files written."""
        for key in list(self._open):
            self._close(key)
        return self.adds

    def discard(self) -> None:
        """Deletes every file this attempt wrote (the task failed before reporting them)."""
        for f in self._open.values():
            f.stream.close()
        self._open.clear()
        for path in self._written:
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(path)


def kernel_add(add: dict[str, Any]) -> dict[str, Any]:
    """The add action as the Delta log holds it: the path URI-encoded (a partition directory's ``%`` escapes become
    ``%25``). Driver side."""
    return {**add, "path": quote(add["path"], safe="/=:@!$&'()*+,;")}


def write_table_file(filesystem: Any, root: str, table: pa.Table) -> dict[str, Any]:
    """Writes ``table`` as one parquet file with a name of its own under ``root`` and returns its add action (with
    statistics). Driver side: the rows of lastagent's own arbitration table."""
    import pyarrow.parquet as pq

    relative = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    stats = _Stats()
    for batch in table.to_batches():
        stats.add(batch)
    with filesystem.open_output_stream(f"{root}/{relative}") as stream:
        pq.write_table(table, stream, compression="snappy")
        size = stream.tell()
    return {"path": relative, "size": size, "partitionValues": {}, "modificationTime": int(time.time() * 1000),
            "dataChange": True, "stats": stats.to_json()}
