"""A Delta table's CHECK constraints and generated columns, evaluated on Arrow batches as Spark does.

Delta stores both as Spark SQL text: a CHECK constraint in the table property
``delta.constraints.<name>`` (``amount >= 0``), a generated column's expression in the column's
metadata ``delta.generationExpression`` (``amount * 2``). Spark's Delta writer (delta-spark 4.4 on
Spark 4.2, ANSI mode, the default) does the following, found by experiment with that writer
(tests/integration/test_delta_expressions_spark.py repeats the experiments):

* A row passes a CHECK constraint only when the constraint is TRUE: NULL is a violation, like
  FALSE (``a > 0`` rejects a NULL ``a``).
* A generated column the rows do not carry is computed. One they carry is checked with
  ``(<value> <=> <expression>) IS TRUE``: a NULL value passes only when the expression is NULL.
  Generated values are computed before the CHECKs, which may reference them. Delta accepts a
  generated column only when the expression's type is the column's type, so nothing is cast.
* Integer overflow (``+ - *``, unary minus, ``abs``, narrowing casts) and division or remainder by
  zero are errors (ANSI mode): Spark's write fails. Here such a row is reported as failing, with
  the reason, and no value is written for it.
* Spark evaluates lazily, so an error counts only where Spark evaluates: the right side of AND
  when the left is not FALSE, of OR when the left is not TRUE, CASE branches in order, COALESCE
  arguments until one is not NULL, the right operand of ``+ - * < = ...`` only when the left is
  not NULL, the left operand of ``/ %`` only when the right is not NULL.
* CHECK constraints (and the check of a carried generated value) are evaluated as analyzed, but a
  computed generated column goes through Spark's optimizer, whose ``ReorderAssociativeOperator``
  regroups integer ``+`` and ``*`` chains (``a + 1 + b`` runs as ``(a + b) + 1``), which changes
  which rows overflow; it is emulated here. Other optimizer rules can drop the evaluation of a
  subexpression (duplicates, literal TRUE/FALSE/NULL operands), so a generation expression that
  can raise an error is refused when it has those.

Evaluation runs in DataFusion (the ``datafusion`` package) on executors. DataFusion's SQL differs
from Spark's (integer ``/`` divides integers, overflow wraps, ``concat`` skips NULLs, literal and
result types, case-sensitive names...), so the expression is not run as written: it is parsed by
DataFusion's parser (Databricks dialect: backquoted names, double-quoted strings), walked node by
node against an allow-list with Spark's type rules (ANSI coercion, decimal precision, literal
types), and re-emitted as DataFusion SQL with every cast explicit: each node a column, computed
layer by layer, with a failure code that follows Spark's evaluation order (nothing in that SQL
itself fails: overflow is computed in a wider type, division by zero divides by NULL). Anything
outside the allow-list is refused at query start by :func:`check_supported`, naming the rule and
the construct. Allowed (each compared with Spark's Delta writer in the integration test):

* column references (case-insensitive, backquotes allowed) of types BOOLEAN, TINYINT, SMALLINT,
  INT, BIGINT, FLOAT, DOUBLE, DECIMAL, STRING, DATE, TIMESTAMP, TIMESTAMP_NTZ;
* literals: integers, decimals (``1.5`` is DECIMAL(2,1) as in Spark), strings, TRUE/FALSE, NULL,
  ``DATE 'yyyy-mm-dd'``, ``TIMESTAMP 'yyyy-mm-dd hh:mm:ss[.ffffff]'``;
* ``= == <> != < <= > >= <=>``, ``IS [NOT] DISTINCT FROM``, AND, OR, NOT, ``IS [NOT] NULL``,
  ``IS [NOT] TRUE/FALSE/UNKNOWN``, ``[NOT] BETWEEN``, ``[NOT] IN (literals)``, ``[NOT] LIKE 'pattern'``;
  a DATE or TIMESTAMP compared with a string literal in the strict form above;
* ``+ - *`` (integers, decimals whose result needs at most 38 digits, floating point), unary minus,
  ``/`` and ``%`` on integers and floating point (``/`` gives DOUBLE), ``abs``; a DECIMAL mixed
  with a FLOAT/DOUBLE only up to precision 15 (converted identically);
* CASE (searched and simple), ``coalesce``, ``nvl``, ``ifnull``;
* ``upper``, ``lower``, ``trim``, ``btrim``, ``ltrim``, ``rtrim`` (one argument), ``length``,
  ``char_length``, ``character_length``, ``concat`` and ``||`` (of strings);
* ``CAST(x AS DATE)`` and ``to_date(x)`` of DATE/TIMESTAMP/TIMESTAMP_NTZ, ``year``, ``month``,
  ``day``, ``dayofmonth`` of those and ``hour`` of timestamps; numeric casts that widen, narrowing
  integer casts (overflow checked), integer to STRING.

Refused, among what users write: ``/`` or ``%`` with a DECIMAL operand (Spark's decimal division
rounds to a computed scale), exponent literals (``1e3`` is a DOUBLE in Spark), literal suffixes
(``1L``, ``1.5D``), string literals with a backslash (Spark reads escapes), comments, other
functions (``date_format``, ``substring``, ``if``, ``regexp``...), casts of strings to numbers or
of numbers to DATE/TIMESTAMP, CHAR/VARCHAR and DECIMAL without precision, subqueries, struct
fields. Expressions that depend on the session time zone (a TIMESTAMP turned into a date or a
field, TIMESTAMP literals) are refused unless the session time zone is UTC (``time_zone``).

Known limits. Results assume ``spark.sql.ansi.enabled=true`` (Spark 4's default): with ANSI off,
Spark wraps overflows and writes NULL for division by zero, where this module reports failing
rows. ``upper``/``lower`` use Rust's Unicode tables where Spark uses ICU's (they agree on the
characters tested, including ß, ǅ, final sigma, İ, ligatures; a character newer than one of them
may map differently). A STRING column with a non-default collation (Spark 4 ``COLLATE``) is not
visible in the Arrow schema and is compared byte-wise. Delta itself refuses some of these in a
generated column (``BETWEEN``, ``btrim``); they are still supported in CHECK constraints.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import re
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from lastagent.delta.features import ColumnDefault, Constraint, GeneratedColumn
from lastagent.errors import UnsupportedExpressionError

__all__ = ["RowRules", "UnsupportedExpressionError", "check_supported"]

UTC_NAMES = frozenset({"UTC", "Etc/UTC", "GMT", "Etc/GMT", "Z", "+00:00", "Zulu", "UCT", "Etc/UCT", "Universal",
                       "Etc/Universal", "GMT0", "Etc/GMT0", "Etc/GMT+0", "Etc/GMT-0", "Greenwich", "Etc/Greenwich"})


class _Refuse(Exception):
    """Internal: the construct that makes an expression unsupported."""


# --- Spark types ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _T:
    """A Spark SQL type: name, and precision and scale for decimals."""

    name: str
    p: int = 0
    s: int = 0

    def __str__(self) -> str:
        return f"decimal({self.p},{self.s})" if self.name == "decimal" else self.name

    @property
    def integral(self) -> bool:
        return self.name in _INT_RANGE

    @property
    def floating(self) -> bool:
        return self.name in ("float", "double")

    @property
    def numeric(self) -> bool:
        return self.integral or self.floating or self.name == "decimal"

    @property
    def arrow_name(self) -> str:
        """The type as DataFusion's ``arrow_cast`` spells it."""
        if self.name == "decimal":
            return f"Decimal128({self.p}, {self.s})"
        return _ARROW_NAMES[self.name]

    @property
    def arrow(self) -> pa.DataType:
        if self.name == "decimal":
            return pa.decimal128(self.p, self.s)
        return _ARROW_TYPES[self.name]


_INT_RANGE = {"tinyint": (-(2 ** 7), 2 ** 7 - 1), "smallint": (-(2 ** 15), 2 ** 15 - 1),
              "int": (-(2 ** 31), 2 ** 31 - 1), "bigint": (-(2 ** 63), 2 ** 63 - 1)}
_INT_RANK = {"tinyint": 0, "smallint": 1, "int": 2, "bigint": 3}
_INT_DIGITS = {"tinyint": 3, "smallint": 5, "int": 10, "bigint": 20}  # Spark's DecimalType.forType
_ARROW_NAMES = {"boolean": "Boolean", "tinyint": "Int8", "smallint": "Int16", "int": "Int32", "bigint": "Int64",
                "float": "Float32", "double": "Float64", "string": "Utf8", "date": "Date32",
                "timestamp": 'Timestamp(Microsecond, Some("UTC"))', "timestamp_ntz": "Timestamp(Microsecond, None)"}
_ARROW_TYPES = {"boolean": pa.bool_(), "tinyint": pa.int8(), "smallint": pa.int16(), "int": pa.int32(),
                "bigint": pa.int64(), "float": pa.float32(), "double": pa.float64(), "string": pa.string(),
                "date": pa.date32(), "timestamp": pa.timestamp("us", tz="UTC"), "timestamp_ntz": pa.timestamp("us")}
_TRY_CAST_NAMES = {"tinyint": "TINYINT", "smallint": "SMALLINT", "int": "INT", "bigint": "BIGINT"}
BOOL, INT, BIGINT, DOUBLE, FLOAT, STRING, DATE = (_T("boolean"), _T("int"), _T("bigint"), _T("double"), _T("float"),
                                                  _T("string"), _T("date"))
VOID = _T("void")


def _spark_type(t: pa.DataType) -> _T | None:
    """The Spark type a Delta column of Arrow type ``t`` has, or None when not supported here."""
    if pa.types.is_boolean(t):
        return BOOL
    for name, arrow in (("tinyint", pa.int8()), ("smallint", pa.int16()), ("int", pa.int32()), ("bigint", pa.int64()),
                        ("float", pa.float32()), ("double", pa.float64())):
        if t == arrow:
            return _T(name)
    if pa.types.is_decimal128(t):
        return _T("decimal", t.precision, t.scale)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return STRING
    if pa.types.is_date32(t):
        return DATE
    if pa.types.is_timestamp(t) and t.unit == "us":
        if t.tz is None:
            return _T("timestamp_ntz")
        if t.tz in UTC_NAMES:
            return _T("timestamp")
    return None


# --- the typed expression tree ------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _N:
    """A node of the analyzed expression, typed as Spark types it.

    kind: col (value = column name), lit (value = Python value), cast, neg, abs, arith (op + - * / %),
    cmp (op = < <= > >= <=>), and, or, not, is (op NULL, NOT NULL, TRUE, NOT TRUE, FALSE, NOT FALSE),
    in (args = value, items), like (value = pattern), case (args = c1, v1, c2, v2, ..., [else]; value =
    has else), coalesce, func (op = upper, lower, btrim, ltrim, rtrim, length, concat), part (op = year,
    month, day, hour).
    """

    kind: str
    type: _T
    args: tuple[_N, ...] = ()
    op: str = ""
    value: Any = None
    literal: bool = False  # written as a literal (Spark's decimal precision of integer literals)

    def key(self) -> str:
        """A canonical text: equal keys, equal expressions."""
        inner = ",".join(a.key() for a in self.args)
        return f"{self.kind}:{self.op}:{self.type}:{self.value!r}({inner})"

    def walk(self) -> list[_N]:
        out = [self]
        for a in self.args:
            out.extend(a.walk())
        return out

    @property
    def foldable(self) -> bool:
        return all(n.kind != "col" for n in self.walk())

    @property
    def can_fail(self) -> bool:
        """True when evaluating this node itself may raise an error in ANSI mode."""
        if self.kind in ("neg", "abs"):
            return self.type.integral
        if self.kind == "arith":
            return self.op in "/%" or self.type.integral
        if self.kind == "cast":
            return self.type.integral and self.args[0].type.integral and \
                _INT_RANK[self.type.name] < _INT_RANK[self.args[0].type.name]
        return False


def _lit(value: Any, t: _T, literal: bool = True) -> _N:
    return _N("lit", t, value=value, literal=literal)


def _null_lit(n: _N) -> bool:
    return n.kind == "lit" and n.value is None


# --- parsing ----------------------------------------------------------------------------------------

_PARSER_LOCK = threading.Lock()
_PARSE_DEPTH = 100  # nesting of the rules' SQL; the emitted SQL nests deeper (guards, casts)
_EVAL_DEPTH = 2000
_PLACEHOLDERS = ("year", "month", "day", "dayofmonth", "hour")


def _parser_context() -> Any:
    """A DataFusion session that parses Spark-like SQL: Databricks dialect, decimal literals, and
    placeholder functions for Spark's date-field functions DataFusion does not have (never run)."""
    from datafusion import SessionConfig, SessionContext, udf

    config = (SessionConfig().with_target_partitions(1)
              .set("datafusion.sql_parser.dialect", "databricks")
              .set("datafusion.sql_parser.parse_float_as_decimal", "true")
              .set("datafusion.sql_parser.recursion_limit", str(_PARSE_DEPTH)))
    ctx = SessionContext(config)

    def never(*_: Any) -> Any:
        raise RuntimeError("placeholder: parsed, never evaluated")

    for name in _PLACEHOLDERS:
        ctx.register_udf(udf(never, [pa.timestamp("us", tz="UTC")], pa.int32(), "immutable", name=name))
    return ctx


_NUMBER = re.compile(r"(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?([A-Za-z_]\w*)?")
_SQL_TYPES_REFUSED = re.compile(r"\b(?:VAR)?CHAR\s*\(|\b(?:DECIMAL|DEC|NUMERIC)\b(?!\s*\()", re.IGNORECASE)


def _lex_guard(sql: str) -> tuple[list[str], str]:
    """Checks the text for what Spark's and DataFusion's lexers read differently.

    Returns the backquoted identifiers and the text with string literals blanked out.
    """
    if "\\" in sql:
        raise _Refuse("a backslash (Spark reads escape sequences in string literals)")
    quoted: list[str] = []
    blanked: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch in "'\"":
            j = i + 1
            while True:
                k = sql.find(ch, j)
                if k < 0:
                    raise _Refuse("an unterminated string literal")
                if k + 1 < n and sql[k + 1] == ch:  # a doubled quote, the same in both
                    j = k + 2
                    continue
                break
            blanked.append("''")
            i = k + 1
            continue
        if ch == "`":
            k = sql.find("`", i + 1)
            if k < 0:
                raise _Refuse("an unterminated backquoted name")
            if k + 1 < n and sql[k + 1] == "`":
                raise _Refuse("a backquote inside a backquoted name")
            quoted.append(sql[i + 1:k])
            blanked.append("``")
            i = k + 1
            continue
        if sql.startswith("--", i) or sql.startswith("/*", i):
            raise _Refuse("a comment")
        if (ch.isdigit() or (ch == "." and i + 1 < n and sql[i + 1].isdigit())) and \
                not (i > 0 and (sql[i - 1].isalnum() or sql[i - 1] in "_$")):
            m = _NUMBER.match(sql, i)
            assert m is not None
            if m.group(2):
                raise _Refuse(f"the exponent literal {m.group(0)} (Spark reads it as a DOUBLE)")
            if m.group(3):
                raise _Refuse(f"the literal {m.group(0)} (a suffixed or malformed number)")
            blanked.append(m.group(0))
            i = m.end()
            continue
        blanked.append(ch)
        i += 1
    text = "".join(blanked)
    m = _SQL_TYPES_REFUSED.search(text)
    if m:
        raise _Refuse(f"the type {m.group(0).strip()} (CHAR/VARCHAR, or DECIMAL without precision, which is "
                      "DECIMAL(10,0) in Spark)")
    return quoted, text


def _parse(sql: str, schema: pa.Schema) -> tuple[Any, dict[str, str]]:
    """Parses ``sql`` with DataFusion against the table's columns, case-insensitively as Spark does.

    Returns the DataFusion expression and the map from the names it may use to the table's column names.
    """
    quoted, _ = _lex_guard(sql)
    by_lower = {f.name.lower(): f for f in schema}
    names: dict[str, str] = {}
    fields: list[pa.Field] = []

    def add(name: str, f: pa.Field) -> None:
        if name not in names:
            names[name] = f.name
            t = f.type if _spark_type(f.type) is not None else pa.null()
            fields.append(pa.field(name, t))

    for f in schema:
        add(f.name, f)
        add(f.name.lower(), f)  # unquoted names, which DataFusion lowercases
    for q in quoted:
        if q.lower() in by_lower:
            add(q, by_lower[q.lower()])
    with _PARSER_LOCK:
        global _PARSER
        if _PARSER is None:
            _PARSER = _parser_context()
        df = _PARSER.from_arrow(pa.RecordBatch.from_pylist([], schema=pa.schema(fields)))
        try:
            expr = df.parse_sql_expr(sql)
        except Exception as e:  # DataFusion raises plain Exceptions
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise _Refuse(f"it does not parse as supported SQL ({first})") from None
    return expr, names


_PARSER: Any = None


# --- analysis: DataFusion expression -> typed tree -----------------------------------------------------

_DATE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})$")
_TIMESTAMP = re.compile(r"^(\d{4})-(\d{2})-(\d{2})(?: (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,6}))?)?$")
_EPOCH = dt.datetime(1970, 1, 1)


def _date_value(text: str) -> dt.date:
    m = _DATE.match(text)
    try:
        if m:
            return dt.date(int(m[1]), int(m[2]), int(m[3]))
    except ValueError:
        pass
    raise _Refuse(f"the date '{text}' (only 'yyyy-mm-dd' of a real date)")


def _timestamp_micros(text: str) -> int:
    m = _TIMESTAMP.match(text)
    try:
        if m:
            t = dt.datetime(int(m[1]), int(m[2]), int(m[3]), int(m[4] or 0), int(m[5] or 0), int(m[6] or 0),
                            int((m[7] or "0").ljust(6, "0")))
            delta = t - _EPOCH
            return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
    except ValueError:
        pass
    raise _Refuse(f"the timestamp '{text}' (only 'yyyy-mm-dd[ hh:mm:ss[.ffffff]]' of a real time)")


def _decimal_type_of(value: decimal.Decimal) -> _T:
    """Spark's type of a decimal literal: DECIMAL(max(precision, scale), scale)."""
    _, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    scale = max(-exponent, 0)
    precision = len(digits) + max(exponent, 0)
    return _T("decimal", max(precision, scale, 1), scale)


_CAST_TARGET = re.compile(r" AS ([A-Za-z0-9]+(?:\((?:[^()]|\([^()]*\))*\))?)\)$")
_SIMPLE_TARGETS = {"Boolean": pa.bool_(), "Int8": pa.int8(), "Int16": pa.int16(), "Int32": pa.int32(),
                   "Int64": pa.int64(), "Float32": pa.float32(), "Float64": pa.float64(), "Utf8": pa.string(),
                   "Utf8View": pa.string(), "LargeUtf8": pa.string(), "Date32": pa.date32()}


def _cast_target(canonical: str) -> pa.DataType:
    """The Arrow type a DataFusion CAST converts to, read from its canonical text (``CAST(x AS Int64)``)."""
    m = _CAST_TARGET.search(canonical)
    name = m.group(1) if m else ""
    if name in _SIMPLE_TARGETS:
        return _SIMPLE_TARGETS[name]
    d = re.fullmatch(r"Decimal128\((\d+), (-?\d+)\)", name)
    if d and 0 <= int(d[2]) <= int(d[1]) <= 38:
        return pa.decimal128(int(d[1]), int(d[2]))
    if name.startswith("Timestamp(") and "," not in name:
        return pa.timestamp("ns")
    raise _Refuse(f"CAST to {name or canonical}")


class _Analyzer:
    """Turns a DataFusion expression into the typed tree, enforcing the allow-list. Driver and executor."""

    def __init__(self, schema: pa.Schema, names: dict[str, str], utc: bool) -> None:
        self.schema = schema
        self.names = names
        self.utc = utc

    def need_utc(self, what: str) -> None:
        if not self.utc:
            raise _Refuse(f"{what}, which depends on the session time zone (supported only when it is UTC)")

    # -- nodes --

    def node(self, e: Any) -> _N:
        kind = e.variant_name()
        v: Any = e.to_variant() if kind != "ScalarFunction" else None  # no variant for functions
        if kind == "Alias":
            return self.node(v.expr())
        if kind == "Column":
            return self.column(v)
        if kind == "Literal":
            return self.literal(e)
        if kind == "BinaryExpr":
            return self.binary(v.op(), self.node(v.left()), self.node(v.right()))
        if kind == "Negative":
            return self.negate(self.node(v.expr()))
        if kind == "Not":
            return _N("not", BOOL, (self.boolean(self.node(v.expr()), "NOT"),))
        if kind in ("IsNull", "IsNotNull"):
            return _N("is", BOOL, (self.node(v.expr()),), op="NULL" if kind == "IsNull" else "NOT NULL")
        if kind in ("IsTrue", "IsNotTrue", "IsFalse", "IsNotFalse", "IsUnknown", "IsNotUnknown"):
            op = {"IsTrue": "TRUE", "IsNotTrue": "NOT TRUE", "IsFalse": "FALSE", "IsNotFalse": "NOT FALSE",
                  "IsUnknown": "NULL", "IsNotUnknown": "NOT NULL"}[kind]
            return _N("is", BOOL, (self.boolean(self.node(v.expr()), f"IS {op}"),), op=op)
        if kind == "Between":
            x, lo, hi = self.node(v.expr()), self.node(v.low()), self.node(v.high())
            both = _N("and", BOOL, (self.compare(">=", x, lo), self.compare("<=", x, hi)))
            return _N("not", BOOL, (both,)) if v.negated() else both
        if kind == "InList":
            return self.in_list(self.node(v.expr()), [self.node(i) for i in v.list()], v.negated())
        if kind == "Like":
            return self.like(e, v)
        if kind == "Case":
            return self.case(v)
        if kind == "Cast":
            return self.cast(e, v)
        if kind == "ScalarFunction":
            return self.function(e.rex_call_operator(), [self.node(a) for a in e.rex_call_operands()])
        raise _Refuse(f"the construct {kind} ({e.canonical_name()})")

    def column(self, v: Any) -> _N:
        name = self.names.get(v.name())
        if name is None:
            raise _Refuse(f"the name {v.qualified_name()}")
        t = _spark_type(self.schema.field(name).type)
        if t is None:
            raise _Refuse(f"column {name} of type {self.schema.field(name).type}")
        return _N("col", t, value=name)

    def literal(self, e: Any) -> _N:
        scalar = e.python_value()
        t = scalar.type
        value = scalar.as_py()
        if pa.types.is_null(t):
            return _lit(None, VOID)
        if pa.types.is_boolean(t):
            return _lit(value, BOOL)
        if pa.types.is_int64(t):
            return _lit(value, INT if _INT_RANGE["int"][0] <= value <= _INT_RANGE["int"][1] else BIGINT)
        if pa.types.is_decimal128(t):
            if t.scale < 0:
                raise _Refuse(f"the literal {value}")
            dt_ = _decimal_type_of(value)
            if dt_.p > 38:
                raise _Refuse(f"the literal {value} (more than 38 digits)")
            return _lit(value, dt_)
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
            return _lit(value, STRING)
        raise _Refuse(f"the literal {e.canonical_name()} of type {t}")

    @staticmethod
    def boolean(n: _N, where: str) -> _N:
        if n.type == VOID:
            return _lit(None, BOOL)
        if n.type != BOOL:
            raise _Refuse(f"{where} of a {n.type}")
        return n

    def binary(self, op: str, left: _N, right: _N) -> _N:
        if op in ("AND", "OR"):
            return _N(op.lower(), BOOL, (self.boolean(left, op), self.boolean(right, op)))
        if op in ("=", "!=", "<", "<=", ">", ">="):
            if op == "!=":
                return _N("not", BOOL, (self.compare("=", left, right),))
            return self.compare(op, left, right)
        if op in ("IS NOT DISTINCT FROM", "IS DISTINCT FROM"):
            same = self.compare("<=>", left, right)
            return same if op == "IS NOT DISTINCT FROM" else _N("not", BOOL, (same,))
        if op in ("+", "-", "*", "/", "%"):
            return self.arith(op, left, right)
        if op == "||":
            return self.function("concat", [left, right])
        raise _Refuse(f"the operator {op}")

    # -- types --

    def to_decimal(self, n: _N, literal_rule: bool) -> _T:
        """The decimal type an integer operand takes next to a decimal (Spark's DecimalPrecision)."""
        if literal_rule and n.kind == "lit" and n.literal and n.value is not None:
            return _T("decimal", max(len(str(abs(n.value))), 1), 0)
        return _T("decimal", _INT_DIGITS[n.type.name], 0)

    def numeric_pair(self, a: _N, b: _N, literal_rule: bool) -> tuple[_T, _T]:
        """The types two numeric operands are cast to (ANSI coercion); equal except decimal-decimal."""
        ta, tb = a.type, b.type
        if ta.integral and tb.integral:
            w = ta if _INT_RANK[ta.name] >= _INT_RANK[tb.name] else tb
            return w, w
        if ta.name == "double" or tb.name == "double":
            return DOUBLE, DOUBLE
        if ta.name == "float" or tb.name == "float":
            other = tb if ta.name == "float" else ta
            if other.name in ("float", "tinyint", "smallint"):
                return FLOAT, FLOAT
            return DOUBLE, DOUBLE
        if ta.integral:
            ta = self.to_decimal(a, literal_rule)
        if tb.integral:
            tb = self.to_decimal(b, literal_rule)
        return ta, tb

    def coerce(self, n: _N, t: _T) -> _N:
        """``n`` as type ``t`` (an implicit cast Spark inserts); literals are converted here."""
        if n.type == t:
            return n
        if n.kind == "lit":
            return _lit(self.convert(n, t), t, n.literal)
        if n.type.name == "decimal" and t.floating and n.type.p > 15:
            raise _Refuse(f"a {n.type} used as a {t} (only up to precision 15 converts identically)")
        return _N("cast", t, (n,))

    @staticmethod
    def convert(n: _N, t: _T) -> Any:
        v = n.value
        if v is None:
            return None
        if t.floating:
            if isinstance(v, decimal.Decimal):
                _, digits, exponent = v.as_tuple()
                assert isinstance(exponent, int)
                if int("".join(map(str, digits)) or "0") >= 2 ** 53 or -exponent > 22:
                    raise _Refuse(f"the literal {v} used as a {t} (too many digits to convert identically)")
            return float(v)
        if t.name == "decimal":
            return decimal.Decimal(v).quantize(decimal.Decimal(1).scaleb(-t.s))
        return v

    def wider(self, types: list[_T], where: str) -> _T:
        """Spark's wider common type of CASE values, COALESCE and IN arguments."""
        known = [t for t in types if t != VOID]
        if not known:
            raise _Refuse(f"{where} of only NULLs")
        out = known[0]
        for t in known[1:]:
            out = self.wider2(out, t, where)
        return out

    def wider2(self, a: _T, b: _T, where: str) -> _T:
        if a == b:
            return a
        if a.numeric and b.numeric:
            if a.integral and b.integral:
                return a if _INT_RANK[a.name] >= _INT_RANK[b.name] else b
            if a.name == "double" or b.name == "double":
                return DOUBLE
            if a.name == "float" or b.name == "float":
                other = b if a.name == "float" else a
                return FLOAT if other.name in ("float", "tinyint", "smallint") else DOUBLE
            da = _T("decimal", _INT_DIGITS[a.name], 0) if a.integral else a
            db = _T("decimal", _INT_DIGITS[b.name], 0) if b.integral else b
            scale = max(da.s, db.s)
            p = max(da.p - da.s, db.p - db.s) + scale
            if p > 38:
                raise _Refuse(f"{where} of {a} and {b} (their common decimal type exceeds precision 38)")
            return _T("decimal", p, scale)
        raise _Refuse(f"{where} of {a} and {b}")

    # -- operators --

    def compare(self, op: str, left: _N, right: _N) -> _N:
        if op != "<=>" and (_null_lit(left) or _null_lit(right)):
            raise _Refuse(f"a comparison {op} with a NULL literal")
        if left.type == VOID and right.type == VOID:
            return _lit(True, BOOL)
        if left.type == VOID:
            left = _lit(None, right.type)
        if right.type == VOID:
            right = _lit(None, left.type)
        lt, rt = left.type, right.type
        if lt.numeric and rt.numeric:
            ta, tb = self.numeric_pair(left, right, literal_rule=True)
            if ta != tb:
                ta = tb = self.wider2(ta, tb, "a comparison")
            return _N("cmp", BOOL, (self.coerce(left, ta), self.coerce(right, tb)), op=op)
        if lt == rt and lt.name in ("string", "boolean", "date", "timestamp_ntz"):
            return _N("cmp", BOOL, (left, right), op=op)
        if lt == rt and lt.name == "timestamp":
            return _N("cmp", BOOL, (left, right), op=op)
        # A DATE or TIMESTAMP column compared with a string literal: Spark casts the string.
        for a, b, flip in ((left, right, False), (right, left, True)):
            if b.kind == "lit" and b.type == STRING and a.type.name in ("date", "timestamp"):
                if a.type == DATE:
                    lit = _lit(_date_value(b.value), DATE)
                else:
                    self.need_utc("a TIMESTAMP compared with a string")
                    lit = _lit(_timestamp_micros(b.value), a.type)
                pair = (lit, a) if flip else (a, lit)
                return _N("cmp", BOOL, pair, op=op)
        raise _Refuse(f"a comparison of {lt} with {rt}")

    def arith(self, op: str, left: _N, right: _N) -> _N:
        if _null_lit(left) or _null_lit(right):
            raise _Refuse(f"arithmetic {op} with a NULL literal")
        if not (left.type.numeric and right.type.numeric):
            raise _Refuse(f"arithmetic {op} on {left.type} and {right.type}")
        if op in "/%":
            if (left.type.name == "decimal" and not right.type.floating) or \
                    (right.type.name == "decimal" and not left.type.floating):
                raise _Refuse(f"{op} with a DECIMAL operand (Spark rounds decimal {'division' if op == '/' else 'remainder'} "
                              "to a computed scale)")
            if op == "/":
                return _N("arith", DOUBLE, (self.coerce(left, DOUBLE), self.coerce(right, DOUBLE)), op=op)
        ta, tb = self.numeric_pair(left, right, literal_rule=True)
        if ta.name == "decimal":
            scale = max(ta.s, tb.s)
            if op in "+-":
                result = _T("decimal", max(ta.p - ta.s, tb.p - tb.s) + scale + 1, scale)
            else:
                result = _T("decimal", ta.p + tb.p + 1, ta.s + tb.s)
            if result.p > 38:
                raise _Refuse(f"{op} of {ta} and {tb} (the result needs more than 38 digits; Spark rounds it)")
        else:
            result = ta
        return _N("arith", result, (self.coerce(left, ta), self.coerce(right, tb)), op=op)

    def negate(self, x: _N) -> _N:
        if not x.type.numeric:
            raise _Refuse(f"unary minus of a {x.type}")
        return _N("neg", x.type, (x,))

    def in_list(self, x: _N, items: list[_N], negated: bool) -> _N:
        if _null_lit(x):
            raise _Refuse("IN with a NULL literal value")
        if not all(i.kind == "lit" for i in items):
            raise _Refuse("IN with a list that is not all literals")
        if x.type.name in ("date", "timestamp") and all(i.type in (STRING, VOID) for i in items):
            t = x.type
            conv = [_lit(None if i.value is None else (_date_value(i.value) if t == DATE else self.ts_lit(i.value)), t)
                    for i in items]
        else:
            t = self.wider([x.type] + [i.type for i in items], "IN")
            conv = [self.coerce(i if i.type != VOID else _lit(None, t), t) for i in items]
        if not (t.numeric or t.name in ("string", "boolean", "date", "timestamp", "timestamp_ntz")):
            raise _Refuse(f"IN of {t}")
        node = _N("in", BOOL, (self.coerce(x, t), *conv))
        return _N("not", BOOL, (node,)) if negated else node

    def ts_lit(self, text: str) -> int:
        self.need_utc("a TIMESTAMP compared with a string")
        return _timestamp_micros(text)

    def like(self, e: Any, v: Any) -> _N:
        if e.rex_call_operator() not in ("like", "not like"):
            raise _Refuse(f"the operator {e.rex_call_operator().upper()}")
        if v.escape_char() is not None:
            raise _Refuse("LIKE ... ESCAPE")
        x, pattern = self.node(v.expr()), self.node(v.pattern())
        if x.type != STRING or pattern.kind != "lit" or pattern.type != STRING or pattern.value is None:
            raise _Refuse("LIKE other than <string> LIKE '<literal pattern>'")
        node = _N("like", BOOL, (x,), value=pattern.value)
        return _N("not", BOOL, (node,)) if v.negated() else node

    def case(self, v: Any) -> _N:
        operand = v.expr()
        key = self.node(operand) if operand is not None else None
        conds: list[_N] = []
        values: list[_N] = []
        for when, then in v.when_then_expr():
            w = self.node(when)
            conds.append(self.compare("=", key, w) if key is not None else self.boolean(w, "a CASE condition"))
            values.append(self.node(then))
        else_expr = v.else_expr()
        if else_expr is not None:
            values.append(self.node(else_expr))
        t = self.wider([x.type for x in values], "CASE")
        values = [self.coerce(x if x.type != VOID else _lit(None, t), t) for x in values]
        args: list[_N] = []
        for c, x in zip(conds, values):
            args += [c, x]
        if else_expr is not None:
            args.append(values[-1])
        return _N("case", t, tuple(args), value=else_expr is not None)

    def cast(self, e: Any, v: Any) -> _N:
        x = self.node(v.expr())
        target = _cast_target(e.canonical_name())
        if x.kind == "lit" and x.type == STRING and x.value is not None:
            if pa.types.is_date32(target):
                return _lit(_date_value(x.value), DATE)
            if pa.types.is_timestamp(target) and target.tz is None:  # TIMESTAMP '...': a TIMESTAMP (LTZ) in Spark
                self.need_utc("a TIMESTAMP literal")
                return _lit(_timestamp_micros(x.value), _T("timestamp"))
        if pa.types.is_date32(target):
            return self.to_date(x, "CAST AS DATE")
        t = _spark_type(target)
        if t is None or t.name in ("timestamp", "timestamp_ntz", "boolean", "date"):
            raise _Refuse(f"CAST of a {x.type} to {target}")
        s = x.type
        if t == s:
            return x
        if t == STRING and (s.integral or s == STRING):
            return _N("cast", t, (x,))
        if s.integral and t.integral:
            return _N("cast", t, (x,))
        if s.integral and t.floating and (t.name == "double" or s.name in ("tinyint", "smallint")):
            return self.coerce(x, t)
        if s.name == "float" and t.name == "double":
            return _N("cast", t, (x,))
        if s.name == "decimal" and t.name == "double" and s.p <= 15:
            return self.coerce(x, t)
        if t.name == "decimal":
            src = _T("decimal", _INT_DIGITS[s.name], 0) if s.integral else s
            if src.name == "decimal" and t.p - t.s >= src.p - src.s and t.s >= src.s:
                return _N("cast", t, (x,)) if x.kind != "lit" else self.coerce(x, t)
        raise _Refuse(f"CAST of a {s} to {t}")

    def to_date(self, x: _N, what: str) -> _N:
        if x.type == DATE:
            return x
        if x.type.name == "timestamp":
            self.need_utc(f"{what} of a TIMESTAMP")
            return _N("cast", DATE, (x,))
        if x.type.name == "timestamp_ntz":
            return _N("cast", DATE, (x,))
        raise _Refuse(f"{what} of a {x.type}")

    def function(self, name: str, args: list[_N]) -> _N:
        def strings(k: int | None = None) -> None:
            if k is not None and len(args) != k:
                raise _Refuse(f"{name} with {len(args)} arguments")
            for a in args:
                if a.type not in (STRING, VOID):
                    raise _Refuse(f"{name} of a {a.type}")

        if name in ("upper", "lower", "btrim", "ltrim", "rtrim"):
            strings(1)
            return _N("func", STRING, (self.coerce(args[0], STRING) if args[0].type == VOID else args[0],), op=name)
        if name == "character_length":
            strings(1)
            return _N("func", INT, (args[0] if args[0].type != VOID else _lit(None, STRING),), op="length")
        if name == "concat":
            if not args:
                raise _Refuse("concat without arguments")
            strings()
            return _N("func", STRING, tuple(a if a.type != VOID else _lit(None, STRING) for a in args), op="concat")
        if name in ("coalesce", "nvl"):
            if not args:
                raise _Refuse(f"{name} without arguments")
            t = self.wider([a.type for a in args], name)
            return _N("coalesce", t, tuple(self.coerce(a if a.type != VOID else _lit(None, t), t) for a in args))
        if name == "abs":
            if len(args) != 1 or not args[0].type.numeric:
                raise _Refuse("abs other than of one number")
            return _N("abs", args[0].type, (args[0],))
        if name == "to_date":
            if len(args) != 1:
                raise _Refuse("to_date with a format")
            return self.to_date(args[0], "to_date")
        if name in _PLACEHOLDERS:
            if len(args) != 1:
                raise _Refuse(f"{name} with {len(args)} arguments")
            x = args[0]
            field = "day" if name == "dayofmonth" else name
            if field == "hour":
                if x.type.name == "timestamp":
                    self.need_utc("hour of a TIMESTAMP")
                elif x.type.name != "timestamp_ntz":
                    raise _Refuse(f"hour of a {x.type}")
                return _N("part", INT, (x,), op=field)
            return _N("part", INT, (self.to_date(x, name),), op=field)
        raise _Refuse(f"the function {name}")


# --- Spark's optimizer, for generated columns -----------------------------------------------------------


def _constant(n: _N) -> int:
    """The value of a constant integer subexpression, or _Refuse when it overflows or is not simple."""
    t = n.type
    if not t.integral:
        raise _Refuse("a constant that is not an integer in an integer + or * chain")
    if n.kind == "lit":
        if n.value is None:
            raise _Refuse("a NULL literal in an integer + or * chain")
        value = int(n.value)
    elif n.kind == "neg":
        value = -_constant(n.args[0])
    elif n.kind == "abs":
        value = abs(_constant(n.args[0]))
    elif n.kind == "cast":
        value = _constant(n.args[0])
    elif n.kind == "arith" and n.op in "+-*":
        a, b = _constant(n.args[0]), _constant(n.args[1])
        value = a + b if n.op == "+" else a - b if n.op == "-" else a * b
    else:
        raise _Refuse("a constant subexpression other than integer literals and + - * in an integer + or * chain")
    lo, hi = _INT_RANGE[t.name]
    if not lo <= value <= hi:
        raise _Refuse("a constant integer subexpression that overflows (every Spark write would fail)")
    return value


def _flatten(n: _N, op: str) -> list[_N]:
    if n.kind == "arith" and n.op == op:
        return _flatten(n.args[0], op) + _flatten(n.args[1], op)
    return [n]


def _reorder(n: _N) -> _N:
    """Spark 4.2's ReorderAssociativeOperator, applied top-down as the optimizer applies it to a
    generated column's projection: an integer + (or *) chain becomes its non-constant operands, left
    to right, then its constants folded into one; a folded 0 (or 1) is dropped."""
    if n.kind == "arith" and n.op in "+*" and n.type.integral:
        operands = _flatten(n, n.op)
        foldables = [o for o in operands if o.foldable]
        others = [o for o in operands if not o.foldable]
        if foldables:
            lo, hi = _INT_RANGE[n.type.name]
            value = _constant(foldables[0])
            for f in foldables[1:]:
                value = value + _constant(f) if n.op == "+" else value * _constant(f)
                if not lo <= value <= hi:
                    raise _Refuse("an integer + or * chain whose constants overflow when Spark's optimizer folds them "
                                  "(every Spark write would fail)")
            if not others:
                return _lit(value, n.type, literal=False)
            if n.op == "*" and value == 0:
                raise _Refuse("an integer product with a constant 0")
            chain = others[0]
            for o in others[1:]:
                chain = _N("arith", n.type, (chain, o), op=n.op)
            if (n.op == "+" and value == 0) or (n.op == "*" and value == 1):
                n = chain
            else:
                n = _N("arith", n.type, (chain, _lit(value, n.type, literal=False)), op=n.op)
    # The rule then goes on with the children (a rewritten chain has no constants left, so its own
    # + or * nodes stay as they are).
    return replace(n, args=tuple(_reorder(a) for a in n.args))


def _generated_hazards(n: _N) -> None:
    """Refuses what Spark's optimizer may rewrite so that a row's error comes or goes (generated columns)."""
    nodes = n.walk()
    if not any(x.can_fail for x in nodes):
        return
    for x in nodes:
        if x.kind == "lit" and x.type == BOOL:
            raise _Refuse("a TRUE/FALSE literal in an expression that can fail (Spark's optimizer may drop the "
                          "evaluation next to it)")
    allowed_nulls: set[int] = set()
    for x in nodes:
        if x.kind in ("case", "coalesce", "in"):
            for i, a in enumerate(x.args):
                if x.kind != "case" or i % 2 == 1 or (x.value and i == len(x.args) - 1):
                    allowed_nulls.add(id(a))
    for x in nodes:
        if _null_lit(x) and id(x) not in allowed_nulls:
            raise _Refuse("a NULL literal operand in an expression that can fail")
    seen: set[str] = set()
    for x in nodes:
        if x.kind == "lit" or (x.kind == "col" and x.type != BOOL):
            continue
        k = x.key()
        if k in seen:  # BooleanSimplification factors out repeated terms, CSE evaluates them once
            raise _Refuse("a repeated subexpression in an expression that can fail (Spark's optimizer may "
                          "evaluate it once, or what is next to it not at all)")
        seen.add(k)
        if x.kind == "case":
            values = [x.args[i] for i in range(1, len(x.args), 2)] + ([x.args[-1]] if x.value else [])
            if len(values) > 1 and len({v.key() for v in values}) == 1:
                raise _Refuse("a CASE whose branches are all the same (Spark's optimizer drops its conditions)")
        if x.kind == "cmp" and x.args[0].key() == x.args[1].key():
            raise _Refuse("a comparison of an expression with itself (Spark's optimizer may drop it)")


# --- emitting DataFusion SQL -------------------------------------------------------------------------


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _cast(sql: str, t: _T) -> str:
    return f"arrow_cast({sql}, {_string(t.arrow_name)})"


def _literal_sql(value: Any, t: _T) -> str:
    if value is None:
        return _cast("NULL", t)
    if t == BOOL:
        return "TRUE" if value else "FALSE"
    if t == STRING:
        return _cast(_string(value), t)
    if t == DATE:
        return _cast(_string(value.isoformat()), t)
    if t.name in ("timestamp", "timestamp_ntz"):
        return _cast(_cast(_string(str(value)), BIGINT), t)
    if t.floating:
        text = "NaN" if math.isnan(value) else ("inf" if value == float("inf") else "-inf" if value == float("-inf")
                                              else repr(float(value)))
        return _cast(_string(text), t)
    return _cast(_string(str(value)), t)


_OVERFLOW, _ZERO = 1, 2
_FAILURES = {_OVERFLOW: "arithmetic overflow", _ZERO: "division by zero"}


def _code(*steps: tuple[str, str]) -> str:
    """A failure code (0: none) from steps in Spark's evaluation order, each ``("", <a child's code>)``
    (the child is evaluated: its failure, if any) or ``(<condition>, <code>)`` (when the condition
    holds, the evaluation ends with that code). Returns ``0`` when nothing can fail."""
    whens: list[str] = []
    can_fail = False
    for condition, code in steps:
        if not condition:
            if code != "0":
                whens.append(f"WHEN {code} <> 0 THEN {code}")
                can_fail = True
        else:
            whens.append(f"WHEN {condition} THEN {code}")
            can_fail = can_fail or code != "0"
    return f"(CASE {' '.join(whens)} ELSE 0 END)" if can_fail else "0"


class _Program:
    """DataFusion SQL computing rules on a table's rows. Executor (and driver, to try it on no rows).

    Every node of the rules' trees is a column, computed in layers (a node after its children), so
    that the SQL grows with the trees, not faster. Each node also has a failure code: 0, or the first
    error Spark's evaluation of it raises, in Spark's evaluation order (see the module doc): 1 for an
    overflow, 2 for a division by zero. Nothing in the SQL itself fails (wider types, TRY_CAST, NULLIF).
    """

    def __init__(self, schema: pa.Schema) -> None:
        k = 0
        while any(name.startswith(f"__le{k}_") for name in schema.names):
            k += 1
        self.prefix = f"__le{k}_"
        self.layers: list[list[tuple[str, str]]] = []
        self.outputs: list[str] = []

    def add(self, tree: _N, check: bool) -> int:
        """Adds a rule: its value (``IS TRUE`` for a check) and its failure code are outputs 2i and 2i+1."""
        value, code, _ = self.node(tree)
        self.outputs += [f"(({value}) IS TRUE)" if check else value, code]
        return len(self.outputs) // 2 - 1

    def query(self, table: str) -> str:
        source = table
        for k, layer in enumerate(self.layers):
            columns = ", ".join(f"{sql} AS {_quote(name)}" for name, sql in layer)
            source = f"(SELECT *, {columns} FROM {source}) AS {_quote(f'{self.prefix}layer{k}')}"
        outputs = ", ".join(f"{sql} AS {_quote(f'{self.prefix}out{i}')}" for i, sql in enumerate(self.outputs))
        return f"SELECT {outputs} FROM {source}"

    def column(self, height: int, sql: str) -> str:
        while len(self.layers) < height:
            self.layers.append([])
        name = f"{self.prefix}{sum(len(layer) for layer in self.layers)}"
        self.layers[height - 1].append((name, sql))
        return _quote(name)

    def node(self, n: _N) -> tuple[str, str, int]:
        """(value, failure code, layer) of ``n``: SQL, a column of the program or a literal."""
        if n.kind == "col":
            return _quote(n.value), "0", 0
        if n.kind == "lit":
            return _literal_sql(n.value, n.type), "0", 0
        if n.kind in ("and", "or"):  # a chain is one node: fewer layers, the same evaluation
            n = replace(n, args=tuple(_flatten_kind(n, n.kind)))
        kids = [self.node(a) for a in n.args]
        height = 1 + max(h for _, _, h in kids)
        value, code = self.sql(n, [v for v, _, _ in kids], [c for _, c, _ in kids])
        return self.column(height, value), (self.column(height, code) if code != "0" else "0"), height

    @staticmethod
    def sql(n: _N, values: list[str], codes: list[str]) -> tuple[str, str]:
        k, t = n.kind, n.type
        every = [("", c) for c in codes]  # each child evaluated, in order
        if k == "cast":
            x, src = values[0], n.args[0].type
            if t == DATE:
                return _cast(x, DATE), _code(*every)
            if src.integral and t.integral and _INT_RANK[t.name] < _INT_RANK[src.name]:
                lo, hi = (_literal_sql(v, src) for v in _INT_RANGE[t.name])
                return f"TRY_CAST({x} AS {_TRY_CAST_NAMES[t.name]})", _code(*every, (f"({x} < {lo} OR {x} > {hi})", "1"))
            return _cast(x, t), _code(*every)
        if k in ("neg", "abs"):
            x = values[0]
            if t.integral:  # only the smallest value overflows; computed wider, nothing does
                widened = _cast(x, _wider_int(t))
                result = f"(- {widened})" if k == "neg" else f"abs({widened})"
                value = f"TRY_CAST({result} AS {_TRY_CAST_NAMES[t.name]})"
                return value, _code(*every, (f"{x} = {_literal_sql(_INT_RANGE[t.name][0], t)}", "1"))
            return _cast(f"(- {x})" if k == "neg" else f"abs({x})", t), _code(*every)
        if k == "arith":
            (left, right), (cl, cr), (a, b) = values, codes, n.args
            if n.op in "/%":  # Spark evaluates the divisor first, the dividend only when it is not NULL
                zero = _literal_sql(0, b.type)
                # Java's remainder (the dividend's sign; the smallest integer % -1 is 0), as DataFusion's.
                value = _cast(f"({left} {n.op} nullif({right}, {zero}))", t)
                return value, _code(("", cr), (f"{right} IS NULL", "0"), ("", cl), (f"{left} IS NULL", "0"),
                                    (f"{right} = {zero}", str(_ZERO)))
            steps = [("", cl), (f"{left} IS NULL", "0"), ("", cr)]
            if t.integral:
                wide = _wider_int(t)
                w = f"({_cast(left, wide)} {n.op} {_cast(right, wide)})"
                lo, hi = (_literal_sql(v, wide) for v in _INT_RANGE[t.name])
                return (f"TRY_CAST({w} AS {_TRY_CAST_NAMES[t.name]})",
                        _code(*steps, (f"{right} IS NULL", "0"), (f"({w} < {lo} OR {w} > {hi})", str(_OVERFLOW))))
            if t.name == "decimal":
                return _cast(f"({_cast(left, a.type)} {n.op} {_cast(right, b.type)})", t), _code(*steps)
            return f"({_cast(left, t)} {n.op} {_cast(right, t)})", _code(*steps)
        if k == "cmp":
            left, right = values
            if n.args[0].type.floating:
                left, right = _nan(left, n.args[0].type), _nan(right, n.args[1].type)
            op = "IS NOT DISTINCT FROM" if n.op == "<=>" else n.op
            if n.op == "<=>":
                return f"({left} {op} {right})", _code(*every)
            return f"({left} {op} {right})", _code(("", codes[0]), (f"{values[0]} IS NULL", "0"), ("", codes[1]))
        if k in ("and", "or"):  # the next operand only while the result is not decided
            stop = "FALSE" if k == "and" else "TRUE"
            steps = []
            for i, (v, c) in enumerate(zip(values, codes)):
                steps.append(("", c))
                if i < len(values) - 1:
                    steps.append((f"({v}) IS {stop}", "0"))
            return "(" + f" {k.upper()} ".join(values) + ")", _code(*steps)
        if k == "not":
            return f"(NOT {values[0]})", _code(*every)
        if k == "is":
            return f"(({values[0]}) IS {n.op})", _code(*every)
        if k == "in":
            x, items = values[0], values[1:]
            if n.args[0].type.floating:  # DataFusion's IN tells -0.0 from 0.0; Spark's does not
                x = _nan(x, n.args[0].type)
                return "(" + " OR ".join(f"({x} = {_nan(i, n.args[0].type)})" for i in items) + ")", _code(*every)
            return f"({x} IN ({', '.join(items)}))", _code(*every)
        if k == "like":
            return f"({values[0]} LIKE {_string(n.value)})", _code(*every)
        if k == "case":
            has_else = bool(n.value)
            pairs = len(values) - (1 if has_else else 0)
            whens, steps = [], []
            for i in range(0, pairs, 2):
                whens.append(f"WHEN {values[i]} THEN {values[i + 1]}")
                steps += [("", codes[i]), (f"({values[i]}) IS TRUE", codes[i + 1])]
            if has_else:
                whens.append(f"ELSE {values[-1]}")
                steps.append(("", codes[-1]))
            return f"(CASE {' '.join(whens)} END)", _code(*steps)
        if k == "coalesce":
            steps = []
            for i, (v, c) in enumerate(zip(values, codes)):
                steps.append(("", c))
                if i < len(values) - 1:
                    steps.append((f"{v} IS NOT NULL", "0"))
            return f"coalesce({', '.join(values)})", _code(*steps)
        if k == "func":
            if n.op == "concat":
                return "(" + " || ".join(_cast(v, STRING) for v in values) + ")", _code(*every)
            if n.op == "length":
                return _cast(f"character_length({values[0]})", INT), _code(*every)
            return _cast(f"{n.op}({values[0]})", STRING), _code(*every)
        if k == "part":
            return _cast(f"date_part({_string(n.op)}, {values[0]})", INT), _code(*every)
        raise AssertionError(k)


def _flatten_kind(n: _N, kind: str) -> list[_N]:
    """The operands of a chain of AND (or OR), in evaluation order."""
    if n.kind == kind:
        return [x for a in n.args for x in _flatten_kind(a, kind)]
    return [n]


def _nan(sql: str, t: _T) -> str:
    """Every NaN as the same NaN: Spark compares all NaNs equal and above every number (DataFusion
    puts a NaN with its sign bit set below every number)."""
    return f"nanvl({sql}, {_literal_sql(float('nan'), t)})"


def _wider_int(t: _T) -> _T:
    """A type that holds any sum, difference or product of two values of integer type ``t`` exactly."""
    return BIGINT if t != BIGINT else _T("decimal", 20, 0)


def _eval_context() -> Any:
    """The DataFusion session that runs programs (one partition: rows keep their order)."""
    from datafusion import SessionConfig, SessionContext

    return SessionContext(SessionConfig().with_target_partitions(1)
                          .set("datafusion.sql_parser.enable_ident_normalization", "false")
                          .set("datafusion.sql_parser.dialect", "generic")
                          .set("datafusion.sql_parser.recursion_limit", str(_EVAL_DEPTH)))


def _run(ctx: Any, batch: pa.RecordBatch, program: _Program) -> list[pa.Array]:
    """The program's outputs on ``batch``, row for row."""
    name = "__lastagent_rows"
    ctx.register_record_batches(name, [[batch]])
    try:
        table = ctx.sql(program.query(_quote(name))).to_arrow_table()
    finally:
        ctx.deregister_table(name)
    if table.num_rows != batch.num_rows:
        raise AssertionError(f"DataFusion returned {table.num_rows} rows for {batch.num_rows}")
    return [table.column(i).combine_chunks() for i in range(len(program.outputs))]


def _tried(ctx: Any, schema: pa.Schema, tree: _N, check: bool) -> None:
    """Runs one rule on no rows, so that what DataFusion cannot run fails at query start."""
    program = _Program(schema)
    program.add(tree, check)
    try:
        _run(ctx, pa.RecordBatch.from_pylist([], schema=schema), program)
    except Exception as e:  # DataFusion raises plain Exceptions
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _Refuse(f"DataFusion cannot run it ({first})") from None


def _carried_check(tree: _N, column: str) -> _N:
    """Delta's check of a carried generated value: ``<value> <=> <expression>`` (then IS TRUE)."""
    return _N("cmp", BOOL, (_N("col", tree.type, value=column), tree), op="<=>")


# --- the public API ---------------------------------------------------------------------------------


def _analyze(sql: str, schema: pa.Schema, time_zone: str, generated: bool) -> _N:
    """The typed tree of ``sql``; for a computed generated column, as Spark's optimizer leaves it."""
    e, names = _parse(sql, schema)
    tree = _Analyzer(schema, names, time_zone in UTC_NAMES).node(e)
    if tree.type == VOID:
        raise _Refuse("an expression that is only NULL")
    if generated:
        tree = _reorder(tree)
        _generated_hazards(tree)
    return tree


def check_supported(sql: str, schema: pa.Schema, what: str, *, column: str | None = None,
                    time_zone: str = "UTC") -> None:
    """Refuses, at query start, a CHECK constraint or generation expression not evaluated exactly as Spark.

    Runs on the driver. Does what :class:`RowRules` does with the expression, up to running it on
    no rows (so that DataFusion has planned it), but not on the query's rows.

    Args:
        sql: the Spark SQL text as Delta stores it.
        schema: the table's Arrow schema (Delta's types: timestamps in microseconds, ``UTC``).
        what: names the rule in the message, e.g. ``CHECK constraint 'positive'``.
        column: for a generation expression, its column: its type must be the expression's, and the
            expression is checked both as computed (after Spark's optimizer) and as checked (rows
            that carry the column). Without it, a BOOLEAN expression is checked as a CHECK
            constraint and any other as a generation expression (without the type match).
        time_zone: Spark's session time zone (``spark.sql.session.timeZone``); expressions that
            depend on it are supported only when it is UTC.

    Raises:
        UnsupportedExpressionError: naming ``what``, the SQL and the construct.
    """
    try:
        ctx = _eval_context()
        tree = _analyze(sql, schema, time_zone, generated=False)
        if column is None and tree.type == BOOL:
            _tried(ctx, schema, tree, check=True)
            return
        _tried(ctx, schema, _analyze(sql, schema, time_zone, generated=True), check=False)
        if column is not None:
            _column_type_matches(tree, schema, column)
            _tried(ctx, schema, _carried_check(tree, column), check=True)
    except _Refuse as r:
        raise UnsupportedExpressionError(what, sql, str(r)) from None


def _column_type_matches(tree: _N, schema: pa.Schema, column: str) -> None:
    if column not in schema.names:
        raise _Refuse(f"the generated column {column} is not in the table's schema")
    t = _spark_type(schema.field(column).type)
    if t is None:
        raise _Refuse(f"the generated column's type {schema.field(column).type}")
    if tree.type != t:
        raise _Refuse(f"the expression's type {tree.type} is not the column's type {t} (Spark requires them equal)")


class RowRules:
    """A table's CHECK constraints and generated columns, applied to the rows of a task. Executor.

    Built once per task. Raises :class:`UnsupportedExpressionError` for an expression
    :func:`check_supported` refuses (it should have refused it at query start).

    Args:
        checks: the table's CHECK constraints.
        generated: the table's generated columns.
        schema: the table's Arrow schema, the schema of the batches :meth:`apply` gets.
        provided: the columns the query's rows carry. A generated column not among them is
            computed; one among them is checked: ``(<value> <=> <expression>) IS TRUE``, evaluated
            as CHECK constraints are (as written, not as Spark's optimizer rewrites it).
        time_zone: Spark's session time zone (see :func:`check_supported`).
    """

    def __init__(self, checks: Sequence[Constraint], generated: Sequence[GeneratedColumn], schema: pa.Schema,
                 provided: Collection[str], *, time_zone: str = "UTC", defaults: Sequence[ColumnDefault] = ()) -> None:
        self.schema = schema
        self._ctx = _eval_context()
        self._computed = _Program(schema)
        # (column, the reason of a row whose value fails, with {failure}): generated columns the rows lack, then
        # defaults they lack.
        self._computed_rules: list[tuple[str, str]] = []
        self._checked = _Program(schema)
        self._checked_rules: list[tuple[str, str, str]] = []  # (rule, sql, reason when not TRUE)
        for g in generated:
            try:
                tree = _analyze(g.sql, schema, time_zone, generated=g.column not in provided)
                _column_type_matches(tree, schema, g.column)
                if g.column in provided:
                    tree = _carried_check(tree, g.column)
                    _tried(self._ctx, schema, tree, check=True)
                    self._checked.add(tree, check=True)
                    self._checked_rules.append((f"generated column {g.column}", g.sql,
                                                f"generated column {g.column}: value does not equal its generation "
                                                f"expression ({g.sql})"))
                else:
                    _tried(self._ctx, schema, tree, check=False)
                    self._computed.add(tree, check=False)
                    self._computed_rules.append((g.column, f"generated column {g.column}: {{failure}} in its generation "
                                                           f"expression ({g.sql})"))
            except _Refuse as r:
                raise UnsupportedExpressionError(f"generated column '{g.column}'", g.sql, str(r)) from None
        # A DEFAULT fills only a column the rows lack (Spark's writer, batch and streaming alike); its value is
        # cast to the column's type, as Spark's analyzer does when the DEFAULT is declared.
        for d in defaults:
            if d.column in provided:
                continue
            try:
                tree = _analyze(d.sql, schema, time_zone, generated=True)
                _tried(self._ctx, schema, tree, check=False)
            except _Refuse as r:
                raise UnsupportedExpressionError(f"DEFAULT of column '{d.column}'", d.sql, str(r)) from None
            self._computed.add(tree, check=False)
            self._computed_rules.append((d.column, f"DEFAULT of column {d.column}: {{failure}} in ({d.sql})"))
        for c in checks:
            try:
                tree = _analyze(c.sql, schema, time_zone, generated=False)
                if tree.type != BOOL:
                    raise _Refuse(f"its type is {tree.type}, not BOOLEAN")
                _tried(self._ctx, schema, tree, check=True)
            except _Refuse as r:
                raise UnsupportedExpressionError(f"CHECK constraint '{c.name}'", c.sql, str(r)) from None
            self._checked.add(tree, check=True)
            self._checked_rules.append((f"CHECK constraint {c.name}", c.sql, f"CHECK constraint {c.name} ({c.sql}) violated"))

    def apply(self, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, list[tuple[int, str]]]:
        """Fills the generated columns the rows do not carry and finds the rows that break a rule.

        Runs on executors. Generated values are computed first; the CHECKs (and the check of carried
        generated values) then see them.

        Args:
            batch: rows in the table's schema (a computed generated column's values are ignored).

        Returns:
            The batch with computed generated columns filled (NULL for a row whose expression
            fails), and the failing rows as (row index, reason), one per row, the first rule it
            breaks: generated columns in order, then the checks in order. A reason names the rule
            and its SQL, never a row's values.
        """
        failures: dict[int, str] = {}
        if batch.num_rows == 0 or not (self._computed_rules or self._checked_rules):
            return batch, []
        if self._computed_rules:
            out = _run(self._ctx, batch, self._computed)
            columns = list(batch.columns)
            for i, (column, reason) in enumerate(self._computed_rules):
                idx = batch.schema.get_field_index(column)
                columns[idx] = out[2 * i].cast(batch.schema.field(idx).type)
                for row, code in _failed(out[2 * i + 1]):
                    failures.setdefault(row, reason.replace("{failure}", _FAILURES[code], 1))
            batch = pa.RecordBatch.from_arrays(columns, schema=batch.schema)
        if self._checked_rules:
            out = _run(self._ctx, batch, self._checked)
            for i, (rule, sql, violated) in enumerate(self._checked_rules):
                for row, code in _failed(out[2 * i + 1]):
                    failures.setdefault(row, f"{rule}: {_FAILURES[code]} in ({sql})")
                for row in _false_rows(out[2 * i]):
                    failures.setdefault(row, violated)
        return batch, sorted(failures.items())


def _failed(codes: pa.Array) -> list[tuple[int, int]]:
    """(row, failure code) of the rows whose code is not 0."""
    import pyarrow.compute as pc

    rows = pc.indices_nonzero(pc.not_equal(codes, 0))
    return list(zip(rows.to_pylist(), codes.take(rows).to_pylist()))


def _false_rows(passed: pa.Array) -> list[int]:
    import pyarrow.compute as pc

    return pc.indices_nonzero(pc.invert(pc.fill_null(passed, False))).to_pylist()
