"""The dead-letter table's rows (option ``deadLetterTable``): a dead letter and why it failed, as columns.

Executor side (the tasks write its files) and driver side (its schema when the table is created with the epoch's
commit, :class:`lastagent.delta.target_table.TargetTableStore`). The dead letter itself, its key, value and
``lastagent.dlq.*`` headers, is made by :mod:`lastagent.sinks.dead_letters`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pyarrow as pa

#: The prefix of the headers that say why, when and where a record became a dead letter.
HEADER_PREFIX = "lastagent.dlq."


#: Rows of the dead-letter table (option ``deadLetterTable``): the record and why it failed.
TABLE_SCHEMA = pa.schema([
    pa.field("key", pa.binary()), pa.field("value", pa.binary()),
    pa.field("headers", pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))),
    pa.field("reason", pa.string()), pa.field("exception", pa.string()),
    pa.field("failed_at", pa.timestamp("us", tz="UTC")),
    pa.field("source_topic", pa.string()), pa.field("source_partition", pa.int32()),
    pa.field("source_offset", pa.int64()), pa.field("link", pa.string()), pa.field("epoch", pa.int64()),
])


def table_row(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes | None]]) -> dict[str, Any]:
    """A dead-letter table row from the (key, value, headers) of :func:`lastagent.sinks.dead_letters.dead_letter`."""
    meta = {k[len(HEADER_PREFIX):]: v.decode() for k, v in headers if k.startswith(HEADER_PREFIX) and v is not None}

    def num(name: str) -> int | None:
        return int(meta[name]) if name in meta else None

    return {
        "key": key, "value": value,
        "headers": [{"key": k, "value": v} for k, v in headers if not k.startswith(HEADER_PREFIX)] or None,
        "reason": meta.get("reason"), "exception": meta.get("exception"),
        "failed_at": dt.datetime.fromtimestamp(int(meta["time"]) / 1000, dt.timezone.utc),
        "source_topic": meta.get("source.topic"), "source_partition": num("source.partition"),
        "source_offset": num("source.offset"), "link": meta.get("link"), "epoch": num("epoch"),
    }
