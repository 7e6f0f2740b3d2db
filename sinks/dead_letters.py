"""Dead letters: records that cannot be delivered, sent to the dead-letter topic with their reason.

Executor side. After the JMS bridge's dead-message queue: a record that fails the transformer,
fails conversion to the table's schema, or is too large for a side topic is written to the
dead-letter topic inside the task's Kafka branch, so it commits in the same epoch as the table's
data (after the Delta commit) or not at all. The record keeps its key, value and headers; headers
``lastagent.dlq.*`` say why, when, from where (source topic, partition, offset when the row has
them), and which link and epoch. If the dead-letter topic does not take it after the configured
attempts, or no dead-letter topic is configured, the batch fails: nothing is ever dropped.

"Too large" means larger than ``kafka.message.max.bytes``: the client refuses such a record at
once, and the branch stays usable. A record the *broker* refuses (the topic's ``max.message.bytes``
is smaller) is refused in a delivery report, after it joined the task's Kafka transaction, and the
refusal fails that whole transaction (librdkafka drops every record of it and takes no more until
it is aborted): it cannot be routed here after the fact, so the task fails naming the record.

Logs and errors name a record by its position or a digest (:func:`describe`, :func:`shown_error`),
never by its contents; the contents stay in the dead letter itself.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import time
from typing import Any

import pyarrow as pa

from lastagent import redact
from lastagent.delta.dead_letter_table import HEADER_PREFIX


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    return str(value)


def row_json(row: dict[str, Any]) -> bytes:
    """A row as JSON (binary as base64, times in ISO form): the value of side-topic records."""
    return json.dumps(row, default=_json_default, separators=(",", ":")).encode()


def _bytes(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return str(value).encode()


def describe(row: dict[str, Any]) -> str:
    """Which record this is, for logs and errors, never with its contents.

    Its source topic/partition/offset when the row has them; else a digest of its key
    (``key sha256:<12 hex>``), or of the whole row as JSON when it has no key.
    """
    if {"topic", "partition", "offset"} <= row.keys():
        return f"record {row['topic']}-{row['partition']}@{row['offset']}"
    if row.get("key") is not None:
        return f"record with {redact.key_label(_bytes(row['key']))}"
    return f"record with row digest {redact.digest(row_json(row))} (of the row as JSON)"


def shown_error(error: BaseException | str) -> str:
    """An error as logs and exception messages may show it: without text that may quote the record.

    A string is lastagent's own wording and is shown as it is. An exception's message may quote
    the record (Arrow's cast errors do; so does ``int('poison')``): only its type is shown, and its
    ``summary`` when it has one (:class:`lastagent.sinks.transformer.ConversionFailed`). The full
    message goes with the dead letter only (header ``lastagent.dlq.exception``), beside the record.
    """
    if isinstance(error, str):
        return error
    summary = getattr(error, "summary", None)
    if isinstance(summary, str):
        return f"{type(error).__name__}: {summary}"
    return f"{type(error).__name__} (its message is kept with the dead letter only, as it may quote the record)"


def dead_letter(row: pa.RecordBatch | dict[str, Any], reason: str, error: BaseException | str, link: str,
                epoch: int) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]]:
    """(key, value, headers) of the dead letter for one record.

    The value is the record's own ``value`` column when it has one (a Kafka record passes
    through unchanged), else the row as JSON.
    """
    if isinstance(row, pa.RecordBatch):
        row = row.to_pylist()[0]
    value = _bytes(row["value"]) if "value" in row else row_json(row)
    key = _bytes(row.get("key"))
    headers: list[tuple[str, bytes | None]] = [(h["key"], h["value"]) for h in (row.get("headers") or [])]
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    headers += [
        (HEADER_PREFIX + "reason", reason.encode()),
        (HEADER_PREFIX + "exception", text[:4000].encode()),
        (HEADER_PREFIX + "time", str(int(time.time() * 1000)).encode()),
        (HEADER_PREFIX + "link", link.encode()),
        (HEADER_PREFIX + "epoch", str(epoch).encode()),
    ]
    for name in ("topic", "partition", "offset"):
        if name in row and row[name] is not None:
            headers.append((HEADER_PREFIX + "source." + name, str(row[name]).encode()))
    return key, value, headers


def filter_headers(batch: pa.RecordBatch, keep: tuple[str, ...], drop: tuple[str, ...]) -> pa.RecordBatch:
    """The batch with its ``headers`` column reduced to the kept (or without the dropped) keys."""
    if not (keep or drop) or "headers" not in batch.schema.names:
        return batch
    idx = batch.schema.get_field_index("headers")
    col = batch.column(idx)

    def wanted(key: str) -> bool:
        return key in keep if keep else key not in drop

    rows = [None if hs is None else [h for h in hs if wanted(h["key"])] for hs in col.to_pylist()]
    return batch.set_column(idx, batch.schema.field(idx), pa.array(rows, col.type))
