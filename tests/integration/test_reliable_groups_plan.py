"""lastagent.reliable_groups at query start, on real Spark: what it refuses before any query runs, each error naming
the setting, argument or column; and a batch run with every field taken from columns (headers_column=None)."""

from __future__ import annotations

import pytest

from lastagent import reliable_groups
from lastagent.errors import LastAgentError, OptionError
from lastagent.groups.step import REFUSED_RULE, ROCKSDB

pytestmark = pytest.mark.integration

PROVIDER = "spark.sql.streaming.stateStore.providerClass"
HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"


@pytest.fixture
def provider(spark):
    """Sets the session's state store provider for one test, then puts the old value back."""
    old = spark.conf.get(PROVIDER, None)

    def set_(value: str) -> None:
        spark.conf.set(PROVIDER, value)

    yield set_
    if old is None:
        spark.conf.unset(PROVIDER)
    else:
        spark.conf.set(PROVIDER, old)


def orders(spark):
    return spark.createDataFrame(
        [("g1", 0, 4102444800000, b"a"), ("g1", 1, 4102444800000, b"b"), ("g1", 1, 4102444800000, b"b"),
         ("g2", None, 4102444800000, b"c")],
        "order_id string, step long, expires long, value binary")


def test_the_hdfs_state_store_is_refused_naming_the_setting(spark, provider):
    provider(HDFS)
    with pytest.raises(LastAgentError, match=f"{PROVIDER}={HDFS}.*Set it to {ROCKSDB}"):
        reliable_groups(orders(spark), columns={"GroupId": "order_id"}, headers_column=None)


def test_missing_columns_and_an_inputs_own_watermark_are_refused(spark, provider):
    provider(ROCKSDB)
    df = orders(spark)
    with pytest.raises(OptionError, match="headers_column.*no column 'headers'.*includeHeaders=true"):
        reliable_groups(df)
    with pytest.raises(OptionError, match="column 'nope', which the input does not have"):
        reliable_groups(df, columns={"GroupId": "nope"}, headers_column=None)
    watermarked = (spark.readStream.format("rate").load().selectExpr("CAST(value AS STRING) AS g", "timestamp")
                   .withWatermark("timestamp", "1 minute"))  # a plan only: no query starts
    with pytest.raises(OptionError, match=r"watermark on \['timestamp'\]"):
        reliable_groups(watermarked, columns={"GroupId": "g"}, headers_column=None)


def test_every_field_from_columns(spark, provider):
    provider(ROCKSDB)
    assert spark.streams is not None  # Spark's state stores need the session's coordinator, made with its stream manager
    out = reliable_groups(orders(spark), headers_column=None,
                          columns={"GroupId": "order_id", "SequenceNumber": "step", "ExpiryTime": "expires"})
    rows = sorted((r.order_id, r.step, r[REFUSED_RULE]) for r in out.collect())
    assert rows == [("g1", 0, None), ("g1", 1, None), ("g2", None, None)]  # g1/1 once; g2 a singleton


def _judged_as_the_rules(out, rows) -> dict:
    """Each group's outcome in ``out`` (one message per group) against what the pure rules give for its texts;
    ``rows``: (group, {field: text}). Returns the outcomes by group."""
    from lastagent.groups import rules as group_rules
    from lastagent.groups.step import REFUSED_REASON, message

    got = {r.g: (r[REFUSED_RULE], r[REFUSED_REASON]) for r in out.collect()}
    now = 1_800_000_000_000  # before every ExpiryTime in these tests but the negative ones
    for g, fields in rows:
        try:
            m = message({"GroupId": g, **fields}, now, None, None, None, None)
        except ValueError as exc:
            want = ("invalid-message", str(exc))
        else:
            _, actions = group_rules.receive(group_rules.GroupState(g), m, now)
            kinds = [a for a in actions if isinstance(a, (group_rules.Deliver, group_rules.Refuse, group_rules.Hold))]
            assert len(kinds) == 1
            a = kinds[0]
            want = (a.rule, a.reason) if isinstance(a, group_rules.Refuse) else "held" if isinstance(
                a, group_rules.Hold) else (None, None)
        if want == "held":
            assert g not in got, (g, fields)
        else:
            assert got.get(g) == want, (g, fields, got.get(g), want)
    return got


def test_field_texts_in_every_form_are_judged_as_the_rules_parse_them(spark, provider):
    """The plan marks plain messages in the JVM (ASCII digits) and sends the rest to the rules' own parsing:
    numbers with spaces, a line break, other scripts' digits, more digits than fit, a negative ExpiryTime,
    a missing one, statuses and order. Each group's outcome must be what the pure rules give for its texts."""
    provider(ROCKSDB)
    assert spark.streams is not None
    far = "4102444800000"
    texts = [("5", far, None, None), (" 5", far, None, None), ("5\n", far, None, None), ("05", far, None, None),
             ("\u0665", far, None, None), ("1" * 20, far, None, None), ("5", "-0", None, None),
             ("5", " " + far, None, None), ("5", far + "\n", None, None), ("5", "2100-01-01T00:00:00Z", None, None),
             ("5", None, None, None), ("x", far, None, None), ("0", far, "start", None), ("0", far, "End", None),
             ("3", far, None, "FALSE"), ("3", far, None, "true"), ("3", far, None, "maybe"), (None, far, None, None)]
    rows = [(f"g{i}", s, e, st, o, b"v") for i, (s, e, st, o) in enumerate(texts)]
    df = spark.createDataFrame(rows, "g string, s string, e string, st string, o string, value binary")
    out = reliable_groups(df, headers_column=None, columns={"GroupId": "g", "SequenceNumber": "s", "ExpiryTime": "e",
                                                          "Status": "st", "Ordered": "o"})
    got = _judged_as_the_rules(out, [(g, {"SequenceNumber": s, "ExpiryTime": e, "Status": st, "Ordered": o})
                                     for g, s, e, st, o, _ in rows])
    assert got["g0"] == (None, None) and got["g6"][0] == "expired" and got["g10"][0] == "invalid-message"


def test_number_columns_are_judged_as_their_texts(spark, provider):
    """Integer and timestamp columns for SequenceNumber and ExpiryTime: the plan tests their values without
    making texts; at the edges (negative, 15 digits, 16, a long's largest) the outcome must be what the rules
    give for the column's text."""
    import datetime as dt

    provider(ROCKSDB)
    assert spark.streams is not None
    top, far = 10 ** 15 - 1, 4102444800000
    pairs = [(0, far), (-1, far), (top, far), (top + 1, far), (2 ** 63 - 1, far), (None, far), (5, -5), (5, top),
             (5, top + 1), (5, -top - 1), (5, None)]
    rows = [(f"g{i}", s, e, b"v") for i, (s, e) in enumerate(pairs)]
    out = reliable_groups(spark.createDataFrame(rows, "g string, s long, e long, value binary"), headers_column=None,
                          columns={"GroupId": "g", "SequenceNumber": "s", "ExpiryTime": "e"})
    got = _judged_as_the_rules(out, [(g, {"SequenceNumber": None if s is None else str(s),
                                          "ExpiryTime": None if e is None else str(e)}) for g, s, e, _ in rows])
    assert got["g0"] == (None, None) and got["g2"] == (None, None) and got["g1"][0] == "invalid-message"
    # The string group id column is read where it is: a null one is missing, not a group named "None".
    out = reliable_groups(spark.createDataFrame([(None, 1, far, b"v"), ("None", 1, far, b"w")],
                                                "g string, s long, e long, value binary"),
                          headers_column=None, columns={"GroupId": "g", "SequenceNumber": "s", "ExpiryTime": "e"})
    assert sorted((r.value, r[REFUSED_RULE]) for r in out.collect()) == [(b"v", "invalid-message"), (b"w", None)]
    utc = dt.timezone.utc
    times = [dt.datetime(2100, 1, 1, tzinfo=utc), dt.datetime(1999, 1, 1, tzinfo=utc), None]
    rows = [(f"t{i}", 7, t, b"v") for i, t in enumerate(times)]
    out = reliable_groups(spark.createDataFrame(rows, "g string, s int, e timestamp, value binary"),
                          headers_column=None, columns={"GroupId": "g", "SequenceNumber": "s", "ExpiryTime": "e"})
    got = _judged_as_the_rules(out, [(g, {"SequenceNumber": "7", "ExpiryTime": None if t is None else
                                          str(int(t.timestamp() * 1000))}) for g, _, t, _ in rows])
    assert got["t0"] == (None, None) and got["t1"][0] == "expired"
