"""Kafka messages → pyarrow record batches in the row schema of Spark's kafka source. Executor side."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

_HEADER = pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())])


def arrow_schema(include_headers: bool) -> pa.Schema:
    """The Arrow form of :func:`lastagent.sources.kafka_source.kafka_schema` (what Spark checks batches against)."""
    fields = [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("topic", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("timestampType", pa.int32()),
    ]
    if include_headers:
        fields.append(pa.field("headers", pa.list_(_HEADER)))
    return pa.schema(fields)


class BatchBuilder:
    """Collects one partition's messages and cuts them into record batches of bounded rows.

    Args:
        topic: the partition's topic (a constant column).
        partition: the partition number (a constant column).
        include_headers: add the ``headers`` column.
    """

    def __init__(self, topic: str, partition: int, include_headers: bool) -> None:
        self.topic = topic
        self.partition = partition
        self.include_headers = include_headers
        self.schema = arrow_schema(include_headers)
        self._msgs: list[Any] = []
        self._offsets: list[int] = []

    def add(self, msgs: Sequence[Any], offsets: Sequence[int], batch_rows: int) -> Iterator[pa.RecordBatch]:
        """Adds messages (in offset order); yields every full batch."""
        self._msgs.extend(msgs)
        self._offsets.extend(offsets)
        while len(self._msgs) >= batch_rows:
            yield self._build(self._msgs[:batch_rows], self._offsets[:batch_rows])
            del self._msgs[:batch_rows], self._offsets[:batch_rows]

    def flush(self) -> pa.RecordBatch | None:
        """The last, partial batch, or None."""
        if not self._msgs:
            return None
        batch = self._build(self._msgs, self._offsets)
        self._msgs, self._offsets = [], []
        return batch

    def _build(self, msgs: Sequence[Any], offsets: Sequence[int]) -> pa.RecordBatch:
        n = len(msgs)
        stamps = [m.timestamp() for m in msgs]
        millis = pa.array([s[1] for s in stamps], pa.int64())
        columns = [
            pa.array([m.key() for m in msgs], pa.binary()),
            pa.array([m.value() for m in msgs], pa.binary()),
            pa.repeat(pa.scalar(self.topic, pa.string()), n),
            pa.repeat(pa.scalar(self.partition, pa.int32()), n),
            pa.array(offsets, pa.int64()),
            pc.multiply(millis, 1000).cast(pa.timestamp("us", tz="UTC")),
            # Kafka's TimestampType ids, as Spark shows them: -1 none, 0 CreateTime, 1 LogAppendTime.
            pa.array([s[0] - 1 for s in stamps], pa.int32()),
        ]
        if self.include_headers:
            columns.append(pa.array([_headers(m.headers()) for m in msgs], pa.list_(_HEADER)))
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)


def _headers(pairs: list[tuple[str, bytes | None]] | None) -> list[dict[str, Any]] | None:
    # Spark's kafka source gives null, not an empty array, for a record without headers.
    if not pairs:
        return None
    return [{"key": k, "value": v} for k, v in pairs]
