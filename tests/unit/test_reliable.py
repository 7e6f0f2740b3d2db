"""The reliable-groups step's pure parts: field values, the step's arguments, the encoded group state, and
the sinks' split of refused rows. No Spark session, no I/O."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest

from lastagent.errors import OptionError
from lastagent.groups import rules as group_rules
from lastagent.groups.refusals import split_refused, strip_refusal_columns
from lastagent.groups.step import (
    FIELDS,
    REFUSED_REASON,
    REFUSED_RULE,
    Settings,
    message,
    parse_duration,
    parse_time,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text, ms", [(30000, 30000), ("30000", 30000), ("30 seconds", 30000), ("10 minutes", 600000),
                                      ("2h", 7200000), ("1 day", 86400000), ("PT30S", 30000), ("PT0.5S", 500),
                                      ("P1DT2H", 93600000), ("PT1M30S", 90000)])
def test_durations_in_each_accepted_form(text, ms):
    assert parse_duration(text, "x") == ms


@pytest.mark.parametrize("text", ["", "P", "PT", "P1Y", "P1M", "10 fortnights", "-5", "0", "PT0S", True, "1.5 s"])
def test_a_bad_duration_names_what_it_was_for(text):
    with pytest.raises(ValueError, match="GroupMaxIdleDuration"):
        parse_duration(text, "GroupMaxIdleDuration")


def test_times_as_milliseconds_or_iso_with_a_zone():
    assert parse_time("1700000000000", "ExpiryTime") == 1700000000000
    assert parse_time("2023-11-14T22:13:20Z", "ExpiryTime") == 1700000000000
    assert parse_time("2023-11-14T23:13:20+01:00", "ExpiryTime") == 1700000000000
    with pytest.raises(ValueError, match="no zone"):
        parse_time("2023-11-14T22:13:20", "ExpiryTime")
    with pytest.raises(ValueError, match="ExpiryTime: 'tomorrow' is not a time"):
        parse_time("tomorrow", "ExpiryTime")


def fields(**kw):
    base = {"GroupId": "g", "SequenceNumber": "3", "ExpiryTime": "5000"}
    base.update(kw)
    return {k: v for k, v in base.items() if v is not None}


def test_a_message_from_its_fields():
    m = message(fields(Status="END", GroupMaxIdleDuration="PT1S", Ordered="true"), 100, None, None, None, 7)
    assert m == group_rules.Message("g", 3, 5000, "end", None, 1000, True, 7)
    single = message(fields(SequenceNumber=None, GroupExpiryTime="9000"), 100, None, None, False, 0)
    assert (single.seq, single.group_expiry, single.ordered) == (None, 9000, False)


def test_a_missing_expiry_takes_the_default_after_the_record_time_or_now():
    assert message(fields(ExpiryTime=None), 100, 50, 70, None, 0).expiry == 120
    assert message(fields(ExpiryTime=None), 100, 50, None, None, 0).expiry == 150


@pytest.mark.parametrize("kw, says", [
    ({"GroupId": None}, "GroupId is missing"),
    ({"GroupId": ""}, "GroupId is missing"),
    ({"SequenceNumber": "-1"}, "SequenceNumber '-1'"),
    ({"SequenceNumber": "x"}, "SequenceNumber 'x'"),
    ({"Status": "middle"}, "Status 'middle'"),
    ({"Status": "end", "SequenceNumber": None}, "needs a SequenceNumber"),
    ({"ExpiryTime": None}, "ExpiryTime is missing"),
    ({"GroupExpiryTime": "soon"}, "GroupExpiryTime: 'soon'"),
    ({"GroupMaxIdleDuration": "P1Y"}, "GroupMaxIdleDuration: 'P1Y'"),
    ({"Ordered": "yes"}, "Ordered 'yes'"),
])
def test_a_malformed_message_is_refused_naming_the_field(kw, says):
    with pytest.raises(ValueError, match=says):
        message(fields(**kw), 100, None, None, None, 0)


def settings(**kw):
    args = dict(headers=None, columns=None, headers_column="headers", ordered=None, default_expiry=None,
                default_max_idle=None, name="m")
    args.update(kw)
    return Settings.parse(**args)


def test_without_headers_the_fields_not_given_as_columns_are_absent():
    s = settings(headers_column=None, columns={"GroupId": "g", "SequenceNumber": "n"})
    assert s.sources[:3] == (("GroupId", "column", "g"), ("SequenceNumber", "column", "n"), ("Status", "absent", ""))


def test_settings_default_to_headers_named_as_the_fields():
    s = settings(headers={"GroupId": "x-group"}, columns={"SequenceNumber": "seq"}, default_max_idle="10 minutes")
    assert s.sources[0] == ("GroupId", "header", "x-group")
    assert s.sources[1] == ("SequenceNumber", "column", "seq")
    assert [src[2] for src in s.sources[2:]] == list(FIELDS[2:])
    assert s.default_max_idle == 600000 and s.default_expiry is None


@pytest.mark.parametrize("kw, option", [
    ({"headers": {"Group": "g"}}, "headers"),
    ({"columns": {"GroupId": ""}}, "columns"),
    ({"headers": {"GroupId": "a"}, "columns": {"GroupId": "b"}}, "columns"),
    ({"ordered": "yes"}, "ordered"),
    ({"name": "a metric"}, "name"),
    ({"default_expiry": "soon"}, "default_expiry"),
    ({"default_max_idle": 0}, "default_max_idle"),
    ({"headers_column": None, "columns": {"SequenceNumber": "s"}}, "columns"),
    ({"headers_column": None, "headers": {"Status": "s"}, "columns": {"GroupId": "g"}}, "headers"),
])
def test_bad_arguments_name_the_argument(kw, option):
    with pytest.raises(OptionError) as err:
        settings(**kw)
    assert err.value.option == option


def test_every_state_of_random_histories_survives_encoding():
    rng = random.Random(12)
    seen = 0
    for _ in range(400):
        state, now = group_rules.GroupState("g"), 0
        for _ in range(rng.randint(1, 12)):
            now += rng.choice([0, 1, 5, 40])
            seq = rng.choice([None, *range(6)])
            kind = rng.choice(["none", "expiry", "idle"])
            m = group_rules.Message("g", seq, now + rng.randint(1, 60), rng.choice([None, None, "start", "end"]),
                                    now + 100 if kind == "expiry" else None, 20 if kind == "idle" else None,
                                    rng.random() < 0.5, None)
            state, _ = group_rules.receive(state, m, now, group_rules.Limits(rng.choice([None, 30])))
            assert group_rules.decode("g", group_rules.encode(state)) == state
            seen += state.active is not None and bool(state.active.held)
    assert seen, "no history held a message: the encoding of held messages went untested"


def test_a_state_of_another_version_is_refused():
    with pytest.raises(ValueError, match="not version 1"):
        group_rules.decode("g", b"[2,null,[],null,0]")


def test_refused_rows_are_split_off_without_their_columns():
    batch = pa.RecordBatch.from_pydict({"value": [b"a", b"b", b"c"], REFUSED_RULE: [None, "t5", None],
                                        REFUSED_REASON: [None, "held, and the group terminated", None]})
    kept, refused = split_refused(batch)
    assert kept.schema.names == ["value"] and kept.column(0).to_pylist() == [b"a", b"c"]
    assert refused == [({"value": b"b"}, "t5", "held, and the group terminated")]
    plain = pa.RecordBatch.from_pydict({"value": [b"a"]})
    assert split_refused(plain) == (plain, [])
    none_refused = pa.RecordBatch.from_pydict({"value": [b"a"], REFUSED_RULE: pa.array([None], pa.string()),
                                               REFUSED_REASON: pa.array([None], pa.string())})
    assert split_refused(none_refused)[0].schema.names == ["value"]


def test_the_tables_schema_never_has_the_refusal_columns():
    schema = ('{"type":"struct","fields":[{"name":"value","type":"binary","nullable":true,"metadata":{}},'
              f'{{"name":"{REFUSED_RULE}","type":"string","nullable":true,"metadata":{{}}}}]}}')
    assert [f["name"] for f in json.loads(strip_refusal_columns(schema))["fields"]] == ["value"]


@pytest.mark.parametrize("batch_time", [-1, 0, None])
def test_without_the_micro_batch_time_the_processor_stops_and_changes_nothing(batch_time):
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import TimerValues

    from lastagent.errors import LastAgentError
    from lastagent.groups.step import _EXPIRY, _KEY, _SEQ, _TEXTS, _BucketProcessor, _Layout

    class Handle:  # a state store that records every call
        calls: list[str] = []

        def getValueState(self, *a):
            return self

        def getMapState(self, *a):
            return self

        def __getattr__(self, name):
            self.calls.append(name)
            return lambda *a: None

    settings = Settings.parse(headers=None, columns={"GroupId": "g"}, headers_column=None, ordered=False,
                              default_expiry=None, default_max_idle=None, name="m")
    processor = _BucketProcessor(settings, ("g",), ("g", _KEY, _SEQ, _EXPIRY, _TEXTS),
                                 _Layout(_KEY, _SEQ, _EXPIRY, (), False), ())
    handle = Handle()
    processor.init(handle)
    frame = pd.DataFrame({"g": ["a"], _KEY: ["a"], _SEQ: [1.0], _EXPIRY: [9e12], _TEXTS: [None]})
    with pytest.raises(LastAgentError, match="no micro-batch time"):
        list(processor.handleInputRows(("a",), iter([frame]), TimerValues(batch_time, 0)))
    assert handle.calls == []


def test_a_held_row_is_stored_as_versioned_arrow_and_reads_back_as_it_was():
    """Held rows outlive pandas and Python upgrades (Arrow IPC, not pickle); rows an earlier version pickled
    still read; bytes of an unknown format are refused without being quoted."""
    import datetime as dt
    import pickle

    import pandas as pd

    from lastagent.errors import LastAgentError
    from lastagent.groups.step import HELD_ROW_FORMAT, held_bytes, held_row

    row = pd.DataFrame({
        "key": [b"k-1"], "value": [b"\x00payload"], "topic": ["orders"], "partition": [3], "offset": [41],
        "timestamp": [pd.Timestamp(dt.datetime(2026, 11, 25, 10, 0, 0))], "missing": [None],
        "headers": [[{"key": "GroupId", "value": b"g1"}, {"key": "MessageNumber", "value": b"7"}]],
    })
    stored = held_bytes(row)
    assert stored.startswith(HELD_ROW_FORMAT) and b"\x80\x05" not in stored[:len(HELD_ROW_FORMAT) + 2]
    back = held_row(stored)
    assert list(back.columns) == list(row.columns)
    assert back.iloc[0]["key"] == b"k-1" and back.iloc[0]["value"] == b"\x00payload"
    assert back.iloc[0]["partition"] == 3 and back.iloc[0]["offset"] == 41 and back.iloc[0]["missing"] is None
    assert back.iloc[0]["timestamp"] == row.iloc[0]["timestamp"]
    assert [dict(h) for h in back.iloc[0]["headers"]] == row.iloc[0]["headers"]
    legacy = pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL)  # what earlier versions stored
    pd.testing.assert_frame_equal(held_row(legacy), row)
    with pytest.raises(LastAgentError, match="unknown format") as refused:
        held_row(b"secret-record-bytes")
    assert "secret" not in str(refused.value)
