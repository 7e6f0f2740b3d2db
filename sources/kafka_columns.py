"""The Arrow schema of the source's record batches: the row schema of Spark's kafka source.

The batches themselves are built by the compiled ``lastagent._native`` module (executor side),
straight from librdkafka's messages; ``read_range`` checks each against this schema.
"""

from __future__ import annotations

import pyarrow as pa

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
