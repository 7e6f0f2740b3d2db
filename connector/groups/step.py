"""Reliable-messaging groups as a Spark step: duplicate elimination and ordered delivery across
at-least-once producers, by the WS-Reliability group rules of :mod:`lastagent.groups.rules`.

:func:`reliable_groups` runs on the driver and returns a DataFrame; the rules run on the
executors in a ``transformWithStateInPandas`` operator whose keys are buckets of group ids (64), the
groups' state in Spark's state store (RocksDB), so it is part of the query's checkpoint and replays with the
epochs the lastagent sinks commit. The rules' clock is the time of the micro-batch (Spark keeps it
in its offset log: a replayed batch sees the same clock and makes the same decisions); timers fire
on an event-time watermark that follows it, so time moves with micro-batches that carry rows,
and a query with ``availableNow`` ends (a processing-time timer would run empty batches forever).

Each message carries the WS-Reliability fields, from Kafka headers named as in the
specification (``GroupId``, ``SequenceNumber``, ...) or from columns. The output has the input's
columns plus two: ``_lastagent_refused_rule`` and ``_lastagent_refused_reason``, null for a
delivered message. ``lastagent-delta`` sends the refused ones to its dead letters with the rule as
the reason; ``lastagent-kafka`` has no dead-letter path and refuses such a query at start.
Duplicates are dropped; every batch's counts (delivered, duplicate, refused, terminated,
removed) are the query's observed metrics, under the step's ``name``.
"""

from __future__ import annotations

import datetime as dt
import json
import pickle
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.streaming.stateful_processor import StatefulProcessor

from lastagent.errors import LastAgentError, OptionError
from lastagent.groups import rules as group_rules
from lastagent.groups.refusals import REFUSED_REASON, REFUSED_RULE
from lastagent.options import parse_duration

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

#: The WS-Reliability fields a message carries, in the names of the specification; the default
#: Kafka header of each has the same name.
FIELDS = ("GroupId", "SequenceNumber", "Status", "ExpiryTime", "GroupExpiryTime", "GroupMaxIdleDuration",
          "Ordered")

_OUTCOME = "_lastagent_outcome"
_KEY = "_lastagent_group"
_CLOCK = "_lastagent_clock"  # the same, a day later, as the watermark's event time
_PREFIX = "_lastagent_"
#: Outcomes, counted in the observed metrics; the step's output keeps the first two.
OUTCOMES = ("delivered", "refused", "duplicate", "terminated", "removed")
_CODE = {o: i for i, o in enumerate(OUTCOMES)}  # the operator's output says each by its index

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
_PROVIDER = "spark.sql.streaming.stateStore.providerClass"
_HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"

# -- values, pure ---------------------------------------------------------------------------------


def parse_time(text: str, what: str) -> int:
    """Milliseconds since the epoch of a point in time: an integer (ms) or an ISO-8601 / xsd:dateTime
    with its zone (``2026-11-24T10:00:00Z``).

    Raises:
        ValueError: naming ``what``; a time without a zone is refused (it would depend on the executor's).
    """
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a time; give milliseconds since the epoch or an ISO-8601 "
                         "date-time with its zone, e.g. 2026-11-24T10:00:00Z") from None
    if t.tzinfo is None:
        raise ValueError(f"{what}: {text!r} has no zone; add one (Z or +01:00)")
    return int(t.timestamp() * 1000)


def message(fields: Mapping[str, str | None], now: int, default_expiry: int | None,
            base_time: int | None, ordered: bool | None, ref: Any) -> group_rules.Message:
    """The rules' message from the text of its WS-Reliability fields. Executor side.

    ``default_expiry`` (ms after ``base_time``, the record's timestamp, or ``now``) stands in for a
    missing ``ExpiryTime``; ``ordered`` overrides the ``Ordered`` field when not None.

    Raises:
        ValueError: a field is missing or malformed, naming it and its value.
    """
    group = fields.get("GroupId")
    if not group:
        raise ValueError("GroupId is missing")
    seq_text = fields.get("SequenceNumber")
    seq = None
    if seq_text is not None:
        if not re.fullmatch(r"\d+", seq_text.strip()):
            raise ValueError(f"SequenceNumber {seq_text!r} is not a whole number >= 0")
        seq = int(seq_text)
    status = fields.get("Status")
    if status is not None:
        status = status.strip().lower()
        if status not in ("start", "end"):
            raise ValueError(f"Status {fields['Status']!r} is neither start nor end")
        if seq is None:
            raise ValueError(f"Status {status} needs a SequenceNumber")
    expiry_text = fields.get("ExpiryTime")
    if expiry_text is not None:
        expiry = parse_time(expiry_text, "ExpiryTime")
    elif default_expiry is not None:
        expiry = (now if base_time is None else base_time) + default_expiry
    else:
        raise ValueError("ExpiryTime is missing (or give the step a default_expiry)")
    group_expiry = fields.get("GroupExpiryTime")
    max_idle = fields.get("GroupMaxIdleDuration")
    order_text = fields.get("Ordered")
    if ordered is None:
        if order_text is not None and order_text.strip().lower() not in ("true", "false"):
            raise ValueError(f"Ordered {order_text!r} is neither true nor false")
        ordered = order_text is not None and order_text.strip().lower() == "true"
    return group_rules.Message(
        group, seq, expiry, status,
        None if group_expiry is None else parse_time(group_expiry, "GroupExpiryTime"),
        None if max_idle is None else parse_duration(max_idle.strip(), "GroupMaxIdleDuration"),
        ordered, ref)


# -- the step's settings, checked on the driver ---------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The step's arguments, checked once on the driver; pickled to the executors with the processor.

    Attributes:
        sources: per field, ``("header", name)`` or ``("column", name)``.
        headers_column: the column of Kafka headers (``array<struct<key:string,value:binary>>``); None: no
            headers, the fields not given as columns are absent.
        ordered: None: each group's ``Ordered`` field decides; True/False: every group.
        default_expiry: ms; an ``ExpiryTime`` for messages without one (None: they are refused).
        default_max_idle: ms; the ``t2-default`` limit for groups no rule would end (None: none).
        name: the observed metrics' name.
    """

    sources: tuple[tuple[str, str, str], ...]
    headers_column: str | None
    ordered: bool | None
    default_expiry: int | None
    default_max_idle: int | None
    name: str

    @classmethod
    def parse(cls, *, headers: Mapping[str, str] | None, columns: Mapping[str, str] | None,
              headers_column: str | None,
              ordered: bool | None, default_expiry: Any, default_max_idle: Any, name: str) -> Settings:
        """Checks the arguments of :func:`reliable_groups`.

        Raises:
            OptionError: naming the argument and what would be right.
        """
        headers, columns = dict(headers or {}), dict(columns or {})
        for arg, given in (("headers", headers), ("columns", columns)):
            bad = sorted(set(given) - set(FIELDS))
            if bad:
                raise OptionError(arg, f"{bad} are not WS-Reliability fields; the fields are {', '.join(FIELDS)}")
            empty = sorted(k for k, v in given.items() if not isinstance(v, str) or not v)
            if empty:
                raise OptionError(arg, f"the names for {empty} must be non-empty strings")
        both = sorted(set(headers) & set(columns))
        if both:
            raise OptionError("columns", f"{both} are given both as a header and as a column; give each once")
        if ordered is not None and not isinstance(ordered, bool):
            raise OptionError("ordered", f"{ordered!r} is not True, False or None")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name or ""):
            raise OptionError("name", f"{name!r} is not a name for observed metrics (letters, digits, _)")
        durations = {}
        for arg, value in (("default_expiry", default_expiry), ("default_max_idle", default_max_idle)):
            try:
                durations[arg] = None if value is None else parse_duration(value, arg)
            except ValueError as exc:
                raise OptionError(arg, str(exc)) from None
        if headers_column is None:
            if headers:
                raise OptionError("headers", "header names are given, and headers_column is None (no headers)")
            if "GroupId" not in columns:
                raise OptionError("columns", "with headers_column=None, GroupId must come from a column, e.g. "
                                             "columns={'GroupId': 'order_id', 'SequenceNumber': 'step'}")
        sources = tuple((f, "column", columns[f]) if f in columns else
                        (f, "absent", "") if headers_column is None else (f, "header", headers.get(f, f))
                        for f in FIELDS)
        return cls(sources, headers_column, ordered, durations["default_expiry"], durations["default_max_idle"], name)


# -- the Spark step (driver) ------------------------------------------------------------------------


def reliable_groups(df: DataFrame, *, headers: Mapping[str, str] | None = None,
                    columns: Mapping[str, str] | None = None, headers_column: str | None = "headers",
                    ordered: bool | None = None, default_expiry: Any = None, default_max_idle: Any = None,
                    name: str = "lastagent_reliable_groups") -> DataFrame:
    """Each new message of ``df`` once, ordered groups in order; refusals marked for the dead letters.

    Driver side: builds the plan. The rules run on the executors, with their state in the query's
    state store (the session must use RocksDB, ``spark.sql.streaming.stateStore.providerClass``).

    Args:
        df: a DataFrame (usually a stream from ``lastagent-kafka`` or ``kafka`` with
            ``includeHeaders=true``).
        headers: Kafka header names for fields whose header is not named as the field, e.g.
            ``{"GroupId": "x-group"}``.
        columns: fields taken from a column instead of a header, e.g. ``{"GroupId": "order_id"}``.
            Times may be timestamp or integer (ms) columns.
        headers_column: the column that holds the Kafka headers; None when every field is a column
            (fields given neither way are then absent: no ``SequenceNumber`` makes every message a singleton).
        ordered: True or False for every group; None (default): each group's ``Ordered`` field.
        default_expiry: ``ExpiryTime`` for a message without one, as a duration after its Kafka
            ``timestamp`` (or the batch's time): ms, ``"10 minutes"`` or ``"PT10M"``. None: such a
            message is refused (``invalid-message``).
        default_max_idle: a group with neither termination parameter nor ``end`` terminates after
            this idle time (rule ``t2-default``). None: it waits for its ``end``.
        name: the name of the observed metrics (``query.lastProgress.observedMetrics[name]``).

    Returns:
        ``df``'s columns (nullable) plus ``_lastagent_refused_rule`` and ``_lastagent_refused_reason``.

    Raises:
        OptionError: an argument is wrong, or a field's column or the headers column is missing.
        LastAgentError: the session's state store is not RocksDB, or pyspark is older than 4.1.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType, ByteType, IntegralType, StringType, StructField, StructType, TimestampType

    settings = Settings.parse(headers=headers, columns=columns, headers_column=headers_column, ordered=ordered,
                              default_expiry=default_expiry, default_max_idle=default_max_idle, name=name)
    if not hasattr(df.groupBy(), "transformWithStateInPandas"):
        raise LastAgentError("lastagent.reliable_groups needs pyspark 4.1 or newer (transformWithStateInPandas)")
    provider = df.sparkSession.conf.get(_PROVIDER, None)
    # Only Spark's HDFS-backed store (its default) is known to lack what transformWithState needs; any other
    # provider (a runtime's own RocksDB store) is Spark's to accept or refuse when the query starts.
    if not provider or provider == _HDFS:
        raise LastAgentError(
            f"lastagent.reliable_groups keeps its state with transformWithState, which needs the RocksDB state "
            f"store; this session has {_PROVIDER}={provider or '(unset: HDFS-backed)'}. Set it to {ROCKSDB} "
            "before the query starts (it cannot change for an existing checkpoint).")
    reserved = [c for c in df.columns if c.startswith(_PREFIX)]
    if reserved:
        raise OptionError("df", f"column(s) {reserved} start with {_PREFIX}, which lastagent.reliable_groups "
                                "reserves for its own; rename them")
    types = {f.name: f.dataType for f in df.schema.fields}
    extracted, present = [], []
    numbers = {}  # a number field from an integer or timestamp column: its value, without a text between
    for field, kind, source in settings.sources:
        if kind == "absent":
            continue  # null: not sent to the operator
        if kind == "header":
            assert settings.headers_column is not None
            if settings.headers_column not in types:
                raise OptionError("headers_column", f"field {field} comes from header {source!r}, and the input has "
                                                    f"no column {settings.headers_column!r}; read Kafka with option "
                                                    "includeHeaders=true, take the field from a column "
                                                    f"(columns={{'{field}': ...}}), or pass headers_column=None "
                                                    "when every field present is a column")
            col = _last_header(settings.headers_column, source)
        else:
            if source not in types:
                raise OptionError("columns", f"field {field} comes from column {source!r}, which the input does not "
                                             f"have (columns: {', '.join(df.columns)})")
            t = types[source]
            if isinstance(t, (IntegralType, TimestampType)) and field in ("SequenceNumber", "ExpiryTime"):
                numbers[field] = F.unix_millis(F.col(source)) if isinstance(t, TimestampType) else F.col(source)
            if isinstance(t, TimestampType):
                col = F.unix_millis(F.col(source)).cast("string")
            elif isinstance(t, (StringType, BinaryType, IntegralType)) or t.typeName() == "boolean":
                col = F.col(source).cast("string")
            else:
                raise OptionError("columns", f"column {source!r} for field {field} is {t.simpleString()}; give a "
                                             "string, binary, integer, boolean or timestamp column")
        extracted.append(col.alias(_PREFIX + field))
        present.append(field)
    marked = [f.name for f in df.schema.fields if "spark.watermarkDelayMs" in (f.metadata or {})]
    if marked:
        raise OptionError("df", f"the input has a watermark on {marked}; lastagent.reliable_groups keeps its own "
                                "clock (the micro-batch time) and Spark would take the earliest of the two "
                                "watermarks, holding back every group's time rules. Apply withWatermark after "
                                "the step")
    # The rules' clock: the micro-batch's time (Spark keeps it in the offset log, so a replay sees it again),
    # as an event-time column whose watermark fires the timers. Shifted by a day with a day's delay, the
    # watermark is the previous batch's time and no row is ever late, even if the wall clock steps back.
    has_timestamp = "timestamp" in types and isinstance(types["timestamp"], TimestampType)
    if has_timestamp:
        extracted.append(F.unix_millis(F.col("timestamp")).alias(_BASE))
    # Ties between copies of one number are broken by Kafka partition and offset, when the input has them.
    order = tuple(c for c in ("partition", "offset") if c in types and isinstance(types[c], IntegralType))
    # A field that is a column of the input goes to the operator with the row: it is not sent twice when the
    # rules can read it there (a string group id; an integer number that is its own value for a plain row).
    column = {f: s for f, k, s in settings.sources if k == "column"}
    reused = {f: column[f] for f, t in (("GroupId", StringType), ("SequenceNumber", IntegralType),
                                        ("ExpiryTime", IntegralType))
              if f in column and isinstance(types[column[f]], t)
              and not (f == "ExpiryTime" and settings.default_expiry is not None)}
    keyed, layout = _with_plain(df.select("*", *extracted), settings, tuple(f for f in present if f != "GroupId"),
                                numbers, reused, has_timestamp)
    keyed = (keyed.withColumn(_BUCKET, F.pmod(F.xxhash64(F.coalesce(F.col(layout.key), F.lit(""))),
                                              F.lit(BUCKETS)).cast("int"))
             .withColumn(_CLOCK, F.current_timestamp() + F.expr("INTERVAL 1 DAY"))
             .withWatermark(_CLOCK, "1 day")
             # The watermark follows the column without the operator reading it: a column less to send.
             .drop(_CLOCK))
    payload = [StructField(f.name, f.dataType, True) for f in df.schema.fields]
    extra = [StructField(c, StringType(), True) for c in (REFUSED_RULE, REFUSED_REASON)]
    out = keyed.groupBy(_BUCKET).transformWithStateInPandas(
        _BucketProcessor(settings, tuple(df.columns), tuple(keyed.columns), layout, order),
        StructType([*payload, *extra, StructField(_OUTCOME, ByteType(), False)]), "Append", "EventTime")
    # The outcome is its index in OUTCOMES: a byte per row, where its name would be a string.
    counts = [F.count_if(F.col(_OUTCOME) == F.lit(i)).alias(o) for i, o in enumerate(OUTCOMES)]
    return (out.observe(settings.name, *counts)
            .where(F.col(_OUTCOME) <= F.lit(OUTCOMES.index("refused"))).drop(_OUTCOME))


@dataclass(frozen=True)
class _Layout:
    """Where the processor finds a message's parts among the operator's input columns; the plan decides.

    Attributes:
        key: the group's name: ``_KEY``, or the GroupId column when it is a string column.
        seq: a plain row's sequence number: ``_SEQ``, or the SequenceNumber column when it is an integer column.
        expiry: a plain row's ``ExpiryTime``: ``_EXPIRY``, or the ExpiryTime column (an integer column, no
            default expiry).
        texts: the fields whose texts a row that is not plain has in ``_TEXTS`` (a JSON array), in order; its
            Kafka timestamp (ms) follows when ``has_timestamp``.
    """

    key: str
    seq: str
    expiry: str
    texts: tuple[str, ...]
    has_timestamp: bool

    @property
    def plain(self) -> str | None:
        """The column that marks plain rows, sent when ``seq`` is a column of the input; None: a plain row is
        one with a number in ``_SEQ``."""
        return None if self.seq == _SEQ else _PLAIN


def _with_plain(df: DataFrame, settings: Settings, texts: tuple[str, ...], numbers: Mapping[str, Any],
                reused: Mapping[str, str], has_timestamp: bool) -> tuple[DataFrame, _Layout]:
    """Marks the plain messages (a sequence number, an ``ExpiryTime`` and nothing else; unordered) and gives
    their two numbers as integers, in the JVM: such a row skips the rules' parsing, and its field texts are
    not sent to Python. Anything else (a status, parameters, order, a number in another form, a missing or
    malformed field) keeps its texts and takes the rules' own parsing, with its reasons.

    ``numbers``: the value of a number field that comes from an integer or timestamp column; ``reused``: the
    fields that the operator reads from ``df``'s own columns (named), as :class:`_Layout` says.

    The operator gets ``df``'s columns, the group's name, the two numbers (null: not plain) and, for a row
    that is not plain, one text column: a JSON array of the texts of the fields ``texts``, then of its Kafka
    timestamp in ms (``has_timestamp``); the last returned says where each is."""
    from pyspark.sql import functions as F

    present = {_PREFIX + f for f in FIELDS} & set(df.columns)

    def text(f: str) -> Any:
        return F.col(_PREFIX + f) if _PREFIX + f in present else F.lit(None).cast("string")

    # ASCII digits only, up to 15: exact in the float64 column pandas makes of a nullable long, and a cast
    # that cannot fail. \z, not $: Java's $ also matches before a final line break. Other forms the rules
    # accept (spaces around, other scripts' digits, longer numbers) take their parsing.
    seq = F.when(text("SequenceNumber").rlike(r"^[0-9]{1,15}\z"), text("SequenceNumber").cast("long"))
    expiry = F.when(text("ExpiryTime").rlike(r"^-?[0-9]{1,15}\z"), text("ExpiryTime").cast("long"))
    # The same tests on a number column's value (``numbers``), without making its text: its text is its digits.
    top = 10 ** 15 - 1
    if "SequenceNumber" in numbers:
        seq = F.when(numbers["SequenceNumber"].between(0, top), numbers["SequenceNumber"].cast("long"))
    if "ExpiryTime" in numbers:
        expiry = F.when(numbers["ExpiryTime"].between(-top, top), numbers["ExpiryTime"].cast("long"))
    now = F.unix_millis(F.current_timestamp())
    if settings.default_expiry is not None:
        base = F.coalesce(F.col(_BASE), now) if has_timestamp else now
        expiry = F.when(text("ExpiryTime").isNull(), base + F.lit(settings.default_expiry)).otherwise(expiry)
    unordered = {True: F.lit(False), False: F.lit(True),
                 None: text("Ordered").isNull() | (F.lower(text("Ordered")) == F.lit("false"))}[settings.ordered]
    plain = F.coalesce((F.coalesce(text("GroupId"), F.lit("")) != F.lit("")) & seq.isNotNull() & expiry.isNotNull()
                       & text("Status").isNull() & text("GroupExpiryTime").isNull()
                       & text("GroupMaxIdleDuration").isNull() & unordered, F.lit(False))
    given = [F.col(_PREFIX + f) for f in texts] + ([F.col(_BASE).cast("string")] if has_timestamp else [])
    df = (df.withColumn(_KEY, F.coalesce(text("GroupId"), F.lit("")))  # the group's name ("": refused as missing)
          .withColumn(_PLAIN, plain)
          .withColumn(_SEQ, F.when(F.col(_PLAIN), seq))
          .withColumn(_EXPIRY, F.when(F.col(_PLAIN), expiry))
          # JSON text, not an array column: pyspark converts an array column to pandas row by row, which
          # halved the step's throughput even with every row null.
          .withColumn(_TEXTS, F.when(~F.col(_PLAIN), F.to_json(F.array(*given)))))
    layout = _Layout(reused.get("GroupId", _KEY), reused.get("SequenceNumber", _SEQ), reused.get("ExpiryTime", _EXPIRY),
                     texts, has_timestamp)
    # Not sent: the field texts (in _TEXTS), what the input's columns give, and the plain mark while a plain
    # row is one with a number in _SEQ.
    internal = {_BASE, *present, *({_KEY, _SEQ, _EXPIRY, _PLAIN} - {layout.key, layout.seq, layout.expiry, layout.plain})}
    return df.select(*[c for c in df.columns if c not in internal]), layout


def _last_header(headers_column: str, name: str) -> Any:
    """The text of the last header called ``name`` (null when there is none): a Kafka record may repeat a header."""
    from pyspark.sql import functions as F

    named = F.filter(F.col(headers_column), lambda h: h["key"] == F.lit(name))
    return F.try_element_at(named, F.lit(-1))["value"].cast("string")


# -- the processor (executor) ------------------------------------------------------------------------

#: Group ids are spread over this many keys of the stateful operator (``xxhash64`` of the id). Spark's
#: Python operator pays a fixed cost per key and micro-batch (a call, state round trips to the JVM): one
#: key per group id caps the step near 15,000 rows/s whatever the rules do (docs/benchmarks.md). Fixed:
#: it decides where each group's state is, so a checkpoint holds it in every stored value, checked on load.
BUCKETS = 64
_BUCKET = "_lastagent_bucket"
_BASE = "_lastagent_base"  # the record's Kafka timestamp, ms (the base of default_expiry)
_PLAIN = "_lastagent_plain"  # a plain message (in the plan only): the next two are its numbers
_SEQ = "_lastagent_seq"
_EXPIRY = "_lastagent_expiry"
_TEXTS = "_lastagent_texts"  # a row that is not plain: its fields' texts (and Kafka timestamp), a JSON array
_STATE_VERSION = 2


class _Output:
    """One call's output rows in order: rows of the call's frame (by position) and held rows of earlier
    batches (a one-row frame each, at ``-1 - j`` for ``held[j]``); then rows that only count (duplicates,
    terminations, removals)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.held: list[Any] = []
        self.refused: dict[int, tuple[str, str]] = {}  # output row -> (rule, reason)
        self.counts: list[tuple[str, str | None]] = []  # (outcome, rule)

    def add(self, row: Any, refused: tuple[str, str] | None = None) -> None:
        if refused is not None:
            self.refused[len(self.rows)] = refused
        if isinstance(row, int):
            self.rows.append(row)
        else:
            self.rows.append(-1 - len(self.held))
            self.held.append(row)


def _decode_bucket(data: bytes) -> tuple[int | None, dict[str, list[Any]]]:
    """A bucket's stored value: its registered timer and its groups' ``[deadline, state fields]``.

    Raises:
        LastAgentError: the value was written by another version of the step, or with another number of
            buckets (its groups' state would not be found where this version looks).
    """
    f = json.loads(data)
    if not isinstance(f, list) or len(f) != 4 or f[0] != _STATE_VERSION:
        raise LastAgentError(f"the stored state of lastagent.reliable_groups is not version {_STATE_VERSION}; "
                             "this checkpoint was written by another version of the step")
    if f[1] != BUCKETS:
        raise LastAgentError(f"this checkpoint's reliable groups are spread over {f[1]} buckets and this "
                             f"version of the step uses {BUCKETS}; group state would not be found: resume it "
                             "with the version that wrote it")
    return f[2], f[3]


def kept_groups(spark: Any, checkpoint: str) -> dict[str, group_rules.GroupState]:
    """The group ids whose state a query's checkpoint keeps (terminated groups kept for duplicate checks
    included), with that state, from Spark's state reader. Driver side; run it while the query is stopped."""
    rows = (spark.read.format("statestore").option("stateVarName", "groups").load(checkpoint)
            .select("value.state").collect())
    kept = {}
    for row in rows:
        _, groups = _decode_bucket(bytes(row[0]))
        kept.update({g: group_rules.from_fields(g, f) for g, (_, f) in groups.items()})
    return kept


#: A held message's row in the state store: this prefix (the format's name and version), then one Arrow IPC
#: stream holding the row (its schema carries pandas' column metadata). Arrow's IPC format is stable across
#: pyarrow, pandas and Python versions, where a pickled frame may not load after an upgrade of any of them.
HELD_ROW_FORMAT = b"lastagent.held.arrow.v1\n"


def held_bytes(row: Any) -> bytes:
    """A held message's row (a one-row pandas frame of the payload columns), as stored. Executor side."""
    import pyarrow as pa

    table = pa.Table.from_pandas(row, preserve_index=False)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return HELD_ROW_FORMAT + sink.getvalue().to_pybytes()


def held_row(stored: bytes) -> Any:
    """The row :func:`held_bytes` stored, as a pandas frame. Executor side.

    A row stored by lastagent before this format (a pickled frame, in a checkpoint written by an earlier
    version) is still read, so a running link can be upgraded; anything else is refused.

    Raises:
        LastAgentError: the stored bytes are neither format.
    """
    import pyarrow as pa

    if stored.startswith(HELD_ROW_FORMAT):
        return pa.ipc.open_stream(stored[len(HELD_ROW_FORMAT):]).read_all().to_pandas()
    if stored[:1] == b"\x80":  # pickle's PROTO opcode: what versions before the Arrow format wrote
        return pickle.loads(stored)  # written by this step into the query's own checkpoint
    raise LastAgentError(f"a held row of lastagent.reliable_groups in the checkpoint has an unknown format "
                         f"({len(stored)} bytes, neither {HELD_ROW_FORMAT!r} nor a pickle); it was written by a newer "
                         "version of lastagent: resume the query with that version")


class _BucketProcessor(StatefulProcessor):
    """The rules for the group ids of one bucket per call, state in Spark's state store. Executor side.

    State per bucket: ``groups``, one value: ``[version, BUCKETS, registered timer, {group id: [deadline,
    state]}]`` (compact JSON; the state as :func:`lastagent.groups.rules.to_fields` gives it), and ``held``, an
    ordered group's held messages' rows by (group id, sequence number), each as :func:`held_bytes` stores it.
    One event-time timer per bucket (on the watermark that follows the micro-batches' time), at the earliest
    deadline of its groups.
    """

    def __init__(self, settings: Settings, payload: tuple[str, ...], columns: tuple[str, ...], layout: _Layout,
                 order: tuple[str, ...]) -> None:
        self.settings, self.payload, self.columns, self.layout, self.order = settings, payload, columns, layout, order
        self.limits = group_rules.Limits(settings.default_max_idle)

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.state = handle.getValueState("groups", "state binary")
        self.held = handle.getMapState("held", "group string, seq long", "row binary")

    # -- state

    def _load(self) -> tuple[int | None, dict[str, list[Any]]]:
        """The bucket's registered timer and its groups' ``[deadline, state fields]``."""
        # exists() first: Spark's state server logs a warning for every get() of a value that is not there
        # (each bucket's first batch), and a healthy run's log should have none. One round trip more per call.
        if not self.state.exists():
            return None, {}
        stored = self.state.get()
        return (None, {}) if stored is None else _decode_bucket(bytes(stored[0]))

    def _store(self, timer: int | None, groups: dict[str, list[Any]]) -> None:
        """Writes the groups and moves the bucket's one timer from ``timer`` (None: none registered) to the
        earliest deadline."""
        due = min((d for d, _ in groups.values() if d is not None), default=None)
        if due != timer:
            if timer is not None:
                self.handle.deleteTimer(timer)
            if due is not None:
                self.handle.registerTimer(due)
        if groups:
            self.state.update((json.dumps([_STATE_VERSION, BUCKETS, due, groups], separators=(",", ":")).encode(),))
        else:
            self.state.clear()

    def _put(self, groups: dict[str, list[Any]], state: group_rules.GroupState) -> None:
        if state.empty:
            groups.pop(state.group, None)
        else:
            groups[state.group] = [group_rules.deadline(state, self.limits), group_rules.to_fields(state)]

    # -- output

    def _emit(self, actions: list[group_rules.Action], out: _Output, pending: dict[int, int]) -> None:
        """Output for the rules' actions. A message is a row of this call (``ref`` its position) or a held one
        from an earlier batch (its row in ``held``); ``pending`` holds this call's held rows by number."""
        import pandas as pd

        def row(m: group_rules.Message) -> Any:
            if isinstance(m.ref, int):  # a row of this call; if it was held here, it is held no more
                if m.seq is not None:
                    pending.pop(m.seq, None)
                return m.ref
            if m.seq is not None and m.seq in pending:
                return pending.pop(m.seq)
            key = (m.group, m.seq)
            stored = self.held.getValue(key)
            if stored is None:
                raise LastAgentError(f"group {m.group!r}: held message {m.seq} has no stored row; the state store "
                                     "is inconsistent with the group's state")
            self.held.removeKey(key)
            frame = held_row(bytes(stored[0]))
            assert isinstance(frame, pd.DataFrame)
            return frame

        for a in actions:
            if isinstance(a, group_rules.Deliver):
                out.add(row(a.message))
            elif isinstance(a, group_rules.Refuse):
                out.add(row(a.message), (a.rule, a.reason))
            elif isinstance(a, group_rules.Hold):
                assert isinstance(a.message.ref, int) and a.message.seq is not None
                pending[a.message.seq] = a.message.ref
            elif isinstance(a, group_rules.Duplicate):
                out.counts.append(("duplicate", None))
            elif isinstance(a, group_rules.Terminate):
                out.counts.append(("terminated", a.rule))
            else:
                out.counts.append(("removed", a.rule))

    def _frames(self, frame: Any, out: _Output) -> Iterator[Any]:
        """The output frames: the call's rows and held rows in the rules' order (an ordered group's
        deliveries stay in sequence order), then the rows that only count."""
        import numpy as np
        import pandas as pd

        payload = list(self.payload)
        n = len(out.rows)
        if n:
            if not out.held:
                rows = frame.iloc[np.asarray(out.rows, dtype=np.int64)][payload].reset_index(drop=True)
            else:  # runs of the call's rows between held ones, in order
                parts, run = [], []
                for r in out.rows:
                    if r >= 0:
                        run.append(r)
                        continue
                    if run:
                        parts.append(frame.iloc[run][payload])
                        run = []
                    parts.append(out.held[-1 - r])
                if run:
                    parts.append(frame.iloc[run][payload])
                rows = pd.concat(parts, ignore_index=True)
            rule = np.full(n, None, dtype=object)
            reason = np.full(n, None, dtype=object)
            outcome = np.full(n, _CODE["delivered"], dtype=np.int8)
            for k, (refused_rule, why) in out.refused.items():
                rule[k], reason[k], outcome[k] = refused_rule, why, _CODE["refused"]
            yield rows.assign(**{REFUSED_RULE: rule, REFUSED_REASON: reason, _OUTCOME: outcome})
        if out.counts:
            c = len(out.counts)
            nulls = {col: pd.Series([None] * c, dtype=object) for col in payload}
            yield pd.DataFrame({**nulls, REFUSED_RULE: [r for _, r in out.counts], REFUSED_REASON: [None] * c,
                                _OUTCOME: np.array([_CODE[o] for o, _ in out.counts], dtype=np.int8)})

    # -- the rules

    def _slow(self, frame: Any, plain: tuple[Any, Any, Any], positions: list[int], state: group_rules.GroupState,
              now: int, out: _Output) -> group_rules.GroupState:
        """One group's messages of this call through :func:`lastagent.groups.rules.receive`, one by one, in a
        deterministic order: by sequence number, then by Kafka partition and offset when the input has them.
        A plain row's message is made from its numbers (the plan sent no texts for it)."""
        import pandas as pd

        is_plain, seqs, expiries = plain
        group = state.group
        parsed: list[tuple[int, group_rules.Message | str]] = []
        for i in positions:
            if is_plain[i]:
                parsed.append((i, group_rules.Message(group, int(seqs[i]), int(expiries[i]), ref=i)))
                continue
            values = json.loads(frame[_TEXTS].iat[i])  # the fields' texts, then the Kafka timestamp
            given: dict[str, str | None] = dict.fromkeys(FIELDS)  # absent fields: null
            given.update(zip(self.layout.texts, values))
            given["GroupId"] = group
            base = values[-1] if self.layout.has_timestamp else None
            try:
                parsed.append((i, message(given, now, self.settings.default_expiry,
                                          None if base is None else int(base), self.settings.ordered, i)))
            except ValueError as exc:
                parsed.append((i, str(exc)))

        def rank(item: tuple[int, group_rules.Message | str]) -> tuple[Any, ...]:
            i, m = item
            seq = m.seq if isinstance(m, group_rules.Message) and m.seq is not None else -1
            return (seq, *(0 if pd.isna(v := frame[c].iat[i]) else int(v) for c in self.order))

        parsed.sort(key=rank)
        pending: dict[int, int] = {}
        for i, m in parsed:
            if isinstance(m, str):
                out.add(i, ("invalid-message", m))
                continue
            state, actions = group_rules.receive(state, m, now, self.limits)
            self._emit(actions, out, pending)
        for seq, i in pending.items():
            self.held.updateValue((group, seq), (held_bytes(frame.iloc[[i]][list(self.payload)]),))
        return state

    def _plain(self, frame: Any) -> tuple[Any, Any, Any]:
        """Which rows are plain, with their numbers and ``ExpiryTime`` as int64 arrays (the plan computed them;
        a row that is not plain has -1 and 0)."""
        import numpy as np

        layout = self.layout
        plain = (frame[layout.plain] if layout.plain else frame[layout.seq].notna()).to_numpy(dtype=bool)
        return (plain, frame[layout.seq].where(plain, -1).to_numpy(dtype=np.int64),
                frame[layout.expiry].where(plain, 0).to_numpy(dtype=np.int64))

    # -- Spark's calls

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        """One batch's messages of one bucket's group ids."""
        import numpy as np
        import pandas as pd

        frames = list(rows)
        frame = (pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True))
        if frame.empty:
            return
        # Spark hands the frame over with its own names for some columns (_4, _5 ... for ours): by position.
        if len(frame.columns) != len(self.columns):
            raise LastAgentError(f"lastagent.reliable_groups: the operator's input has {len(frame.columns)} columns, "
                                 f"the plan {len(self.columns)}: {list(frame.columns)} vs {list(self.columns)}")
        frame.columns = list(self.columns)
        # The micro-batch's time (Spark keeps it in the offset log: a replay sees it again), the time of
        # current_timestamp() in the plan. Without it the rules have no clock: stop rather than guess one.
        now = timerValues.getCurrentProcessingTimeInMs()
        if not isinstance(now, int) or now <= 0:
            raise LastAgentError(f"lastagent.reliable_groups: Spark gave the operator no micro-batch time ({now!r}); "
                                 "the rules cannot run without it")
        plain, seqs, expiries = self._plain(frame)
        names = frame[self.layout.key]
        groups_col = (names.fillna("") if names.hasnans else names).to_numpy(dtype=object)  # null: "" (missing)
        codes, _ = pd.factorize(groups_col, sort=True)
        keys = [*(frame[c].fillna(0).to_numpy(dtype=np.int64) for c in reversed(self.order)), seqs, codes]
        sorted_pos = np.lexsort(keys)
        bounds = np.flatnonzero(np.diff(codes[sorted_pos])) + 1
        timer, groups = self._load()
        out = _Output()
        for part in np.split(sorted_pos, bounds):
            group = str(groups_col[part[0]])
            stored = groups.get(group)
            state = group_rules.GroupState(group) if stored is None else group_rules.from_fields(group, stored[1])
            short = None
            if plain[part].all():
                short = group_rules.receive_plain(state, seqs[part].tolist(), expiries[part].tolist(), now,
                                                  self.limits)
            if short is None:
                state = self._slow(frame, (plain, seqs, expiries), part.tolist(), state, now, out)
            else:
                state, actions, outcomes = short
                self._emit(actions, out, {})
                positions = part.tolist()
                if outcomes.count(group_rules.DELIVERED) == len(outcomes):  # most groups: every message new
                    out.rows.extend(positions)
                    positions = []
                for i, o in zip(positions, outcomes):
                    if o is group_rules.DELIVERED:
                        out.add(i)
                    elif o is group_rules.DUPLICATE:
                        out.counts.append(("duplicate", None))
                    else:
                        assert isinstance(o, tuple)
                        out.add(i, o)
            self._put(groups, state)
        self._store(timer, groups)
        yield from self._frames(frame, out)

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        """The bucket's earliest deadline passed: terminations, refusals of expired held messages, removals."""
        # The watermark: the time of the last micro-batch that carried rows.
        now = timerValues.getCurrentWatermarkInMs()
        _, groups = self._load()
        out = _Output()
        for group, (due, fields) in sorted(groups.items()):
            if due is not None and due <= now:
                state, actions = group_rules.advance(group_rules.from_fields(group, fields), now, self.limits)
                self._emit(actions, out, {})
                self._put(groups, state)
        self._store(None, groups)  # Spark removed the timer that fired
        yield from self._frames(None, out)

    def close(self) -> None:
        pass
