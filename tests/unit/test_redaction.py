"""No record contents in logs or errors: how records are named (positions, digests), pure parts."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pytest

from lastagent import redact
from lastagent.kafka.branch import RefusedRecord
from lastagent.sinks import dead_letters, transformer
from lastagent.sinks.task_outputs import side_record

pytestmark = pytest.mark.unit


def test_a_digest_is_the_labelled_start_of_the_sha256_of_the_bytes():
    assert redact.digest(b"secret") == "sha256:" + hashlib.sha256(b"secret").hexdigest()[:12]
    assert redact.digest("secret") == redact.digest(b"secret")
    assert redact.key_label(b"secret") == f"key {redact.digest(b'secret')}"
    assert redact.key_label(None) == "null key"


def test_a_row_without_a_source_position_is_named_by_a_digest_not_its_values():
    with_key = {"key": "customer-4711", "name": "Alice Secret", "amount": 12345}
    assert dead_letters.describe(with_key) == f"record with key {redact.digest(b'customer-4711')}"
    no_key = {"name": "Alice Secret", "amount": 12345}
    shown = dead_letters.describe(no_key)
    assert shown == f"record with row digest {redact.digest(dead_letters.row_json(no_key))} (of the row as JSON)"
    for text in (dead_letters.describe(with_key), shown):
        assert "Alice" not in text and "12345" not in text and "4711" not in text
    # Where the row says where it came from, that is the name, as before.
    assert dead_letters.describe({"topic": "in", "partition": 2, "offset": 9, "value": b"x"}) == "record in-2@9"


def test_errors_that_may_quote_the_record_show_their_type_only():
    try:
        pa.array(["Alice Secret"]).cast(pa.int64())
    except pa.ArrowInvalid as exc:
        arrow = exc
    assert "Alice Secret" in str(arrow)  # Arrow quotes the value: it must not reach a log
    shown = dead_letters.shown_error(arrow)
    assert shown.startswith("ArrowInvalid") and "Alice" not in shown
    assert "Alice" not in dead_letters.shown_error(ValueError("invalid literal for int(): 'Alice Secret'"))
    assert dead_letters.shown_error("side topic t: record #3 too large") == "side topic t: record #3 too large"


def test_a_conversion_failure_names_the_column_and_types_and_keeps_arrows_reason_for_the_dead_letter():
    target = pa.schema([("n", pa.int64())])
    _, failed = transformer.conform(pa.RecordBatch.from_pydict({"n": ["1", "Alice Secret"]}), target, merge=False)
    [failure] = failed
    assert isinstance(failure.error, transformer.ConversionFailed)
    assert failure.error.summary == "column 'n' (string) does not convert to the table's int64"
    assert dead_letters.shown_error(failure.error) == f"ConversionFailed: {failure.error.summary}"
    assert "Alice Secret" in str(failure.error)  # the dead letter's exception header keeps the whole reason
    _, _, headers = dead_letters.dead_letter(failure.row, failure.reason, failure.error, "orders", 1)
    assert b"does not convert" in dict(headers)["lastagent.dlq.exception"]


def test_a_refused_record_is_described_by_position_and_key_digest():
    report = ("MSG_SIZE_TOO_LARGE", "Broker: Message size too large", "orders", 0, b"customer-4711", 5009, 7)
    refused = RefusedRecord.of(report)
    assert refused == RefusedRecord("orders", 0, 7, f"key {redact.digest(b'customer-4711')}", 5009,
                                    "MSG_SIZE_TOO_LARGE", "Broker: Message size too large")
    text = refused.describe()
    assert text.startswith(f"record #7 of the branch (topic orders partition 0, key {redact.digest(b'customer-4711')}): "
                           "Broker: Message size too large (MSG_SIZE_TOO_LARGE; the record has 5009 bytes")
    assert "4711" not in text
    unknown = RefusedRecord.of(("UNKNOWN_TOPIC_OR_PART", "Broker: Unknown topic or partition", "gone", -1, None, 3, -1))
    assert (unknown.partition, unknown.index, unknown.key) == (None, None, "null key")
    assert unknown.position() == "record of the branch (topic gone, null key)"


def test_a_side_record_is_found_by_its_index_in_the_branch():
    topics = ("a", "b")
    # Batch 1 from index 0: rows 0 and 1 to a and b; row 1's record for b went to the dead letters
    # (index 3), so a mark resumes at index 4 with row 2, topic a. Batch 2 starts at index 10, row 5.
    marks = [(0, 0, 0), (4, 1, 2), (10, 5, 0)]
    assert [side_record(marks, topics, i) for i in (0, 1, 2)] == [(0, "a"), (0, "b"), (1, "a")]
    assert [side_record(marks, topics, i) for i in (4, 5, 6)] == [(2, "a"), (2, "b"), (3, "a")]
    assert side_record(marks, topics, 11) == (5, "b")
    assert side_record([], topics, 0) is None and side_record(marks, (), 0) is None
