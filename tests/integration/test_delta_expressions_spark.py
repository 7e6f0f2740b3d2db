"""lastagent.delta.expressions against Spark's Delta writer: same types, values, failures.

For every supported construct, an expression over a table of edge-case rows is made a generated
column of a Delta table, and Spark's Delta writer computes it: the values it stores, the rows whose
write fails (overflow, division by zero) and the expression's type (``typeof``) must be what
:class:`RowRules` gives. Boolean expressions are also CHECK constraints: the rows RowRules rejects
must be those whose Spark value is not TRUE, and a few constraints are checked row by row with
Spark's CHECK enforcement itself (NULL fails a CHECK). Carried generated values are checked row by
row as well. Spark's session time zone is UTC here (the tests' session sets none: the JVM's is
used, so the session's time zone is set for this module).
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pytest

from lastagent.delta.expressions import RowRules, check_supported
from lastagent.delta.features import Constraint, GeneratedColumn

pytestmark = pytest.mark.integration

D = decimal.Decimal
MAX, MIN = 2 ** 31 - 1, -(2 ** 31)
LMAX, LMIN = 2 ** 63 - 1, -(2 ** 63)
UTC = dt.timezone.utc

COLUMNS = ("id INT, i INT, j INT, l BIGINT, t TINYINT, s STRING, u STRING, d DECIMAL(10,2), x DOUBLE, y DOUBLE, "
           "f FLOAT, b BOOLEAN, dt DATE, ts TIMESTAMP, nt TIMESTAMP_NTZ")
NAMES = [c.split()[0] for c in COLUMNS.split(", ")]


def _ts(*a: int) -> dt.datetime:
    return dt.datetime(*a).replace(tzinfo=UTC)  # type: ignore[arg-type]  # year, month, day and the rest


# Edge cases: NULLs, integer limits, -0.0, NaN, infinities, Unicode case mapping, spaces and tabs,
# a newline, LIKE's wildcards as data, times around the epoch. The values that make an expression
# fail are spread over the rows, so that few rows fail several expressions (fewer Spark writes).
ROWS = [
    (0, None, None, None, None, None, None, None, None, None, None, None, None, None, None),
    (1, 1, 2, 10, 1, "abc", "ABC", D("1.00"), 1.5, 2.0, 0.1, True, dt.date(2020, 1, 1), _ts(2020, 1, 1),
     dt.datetime(2020, 1, 1, 12)),
    (2, -1, 1, -10, -1, " ab ", "a\nb", D("-0.01"), -0.0, 0.0, 1.0, False, dt.date(1969, 12, 31),
     _ts(1969, 12, 31, 23, 59, 59, 999999), dt.datetime(1969, 12, 31, 23)),
    (3, 0, 0, 0, 0, "", "ß", D("0"), float("nan"), float("nan"), float("nan"), None, dt.date(1970, 1, 1), _ts(1970, 1, 1),
     dt.datetime(1970, 1, 1)),
    (4, MAX, 1, 5, 5, "Straße", "ǅ", D("99999999.99"), float("inf"), float("-inf"), -0.0, True,
     dt.date(2024, 2, 29), _ts(2024, 2, 29, 13, 30), dt.datetime(2024, 2, 29, 13, 30)),
    (5, MIN, 2, -5, -5, "ΣΑΣ", " x\t", D("-99999999.99"), 1e308, 1e308, 3.4e38, False, dt.date(1, 1, 1),
     _ts(1900, 3, 1, 1), dt.datetime(9999, 12, 31, 23, 59, 59)),
    (6, 5, None, LMAX, 63, "a_b", "a%b", D("2.50"), 3.0, 0.5, 2.5, None, None, None, None),
    (7, None, 5, LMIN, None, "a\nb", "İ", D("-2.50"), -3.0, 1.0, -2.5, True, dt.date(2020, 1, 2),
     _ts(2019, 12, 31, 23, 59, 59), dt.datetime(2019, 12, 31, 23, 59, 59)),
    (8, 2, 0, 3000000000, 2, "abcabc", "", D("0.10"), 7.5, 2.0, 0.5, False, dt.date(2000, 6, 15), _ts(2000, 6, 15, 6),
     dt.datetime(2000, 6, 15, 6)),
    (9, 46341, -46341, 7, -64, "a%", "a_", D("12.34"), -7.5, 2.0, -1.5, True, dt.date(2020, 1, 1),
     _ts(2020, 1, 1, 0, 0, 0, 500000), dt.datetime(2020, 1, 1, 0, 0, 0, 500000)),
    (10, 3, -3, 3, -3, "ABC", "abc", D("-1.00"), 0.1, 0.2, 0.3, False, dt.date(2020, 1, 1), _ts(2020, 1, 1, 0, 0, 0, 1),
     dt.datetime(2020, 1, 1)),
    (11, 10, 20, 3037000499, 127, "Ǆ", "ﬁ", D("0.05"), 7.0, -0.0, 1e-45, True, dt.date(2020, 12, 31),
     _ts(2020, 12, 31, 23, 59, 59), dt.datetime(2020, 12, 31, 23, 59, 59)),
    (12, 1000, 2, -3037000499, -128, "x", "ŉ", D("-0.05"), -1.0, 3.0, -1e-45, False, dt.date(1999, 1, 1),
     _ts(1999, 1, 1), dt.datetime(1999, 1, 1)),
    # i + 1 + j overflows as written, not as Spark's optimizer runs it: (i + j) + 1.
    (13, MAX, -1, 1, 1, "a", "b", D("1"), 1.0, 1.0, 1.0, True, dt.date(2021, 1, 1), _ts(2021, 1, 1),
     dt.datetime(2021, 1, 1)),
]

EXPRESSIONS = [
    # comparisons, with NULLs, NaN, -0.0, mixed numeric types and literals
    "i > 0", "i = j", "i <> j", "i != 1", "i == 1", "i <=> j", "i IS DISTINCT FROM j", "x >= 0", "x = y", "x < y",
    "x <=> y", "f > 0.1", "f = 1", "f < x", "d >= 0", "d > 1.005", "d = i", "l < i", "t < 100", "s = 'abc'",
    "s < u", "s > \"b\"", "b = (i > 0)", "dt >= '2020-01-01'", "dt = DATE '1970-01-01'", "ts >= '2020-01-01'",
    "ts < TIMESTAMP '2020-01-01 00:00:00.5'", "nt <= nt", "dt < dt",
    # logic
    "NOT b", "b AND i > 0", "b OR i > 0", "NOT (i > 0 AND j > 0)", "i IS NULL", "s IS NOT NULL", "b IS TRUE",
    "b IS NOT FALSE", "(i > 0) IS NOT TRUE", "b IS FALSE", "b IS UNKNOWN", "b IS NOT UNKNOWN",
    "i IS NOT DISTINCT FROM j", "i IN (1, 2, 3)", "i IN (1, NULL)", "i NOT IN (1, NULL)", "s IN ('abc', 'x')",
    "d IN (1, 2.5)", "x IN (0, 1.5)", "f IN (0, 2.5)", "dt IN ('2020-01-01', '1969-12-31')",
    # LIKE
    "s LIKE 'a%'", "s LIKE '_b%'", "s NOT LIKE '%c'", "s LIKE 'a_b'", "u LIKE '%'", "s LIKE 'A%'", "u LIKE '_'",
    # arithmetic
    "i + j", "i - j", "i * j", "-i", "l + 1", "l * l", "t + t", "t * 2", "i + 1 + j", "j + (i + 2147483600)",
    "d * 2", "d + i", "d - 1.5", "d * d", "-d", "x + y", "x * 2", "x - 1.5", "f + f", "f * 2", "x / y", "i / j",
    "i % j", "x % y", "l % 3", "abs(i)", "abs(x)", "abs(d)", "i + 1.5", "l + 0.5", "t + 1",
    # CASE, COALESCE
    "CASE WHEN i > 0 THEN 'pos' WHEN i < 0 THEN 'neg' ELSE 'zero' END", "CASE i WHEN 1 THEN 'one' WHEN 2 THEN 'two' END",
    "CASE WHEN j > 1 THEN i + 2147483000 ELSE 0 END", "CASE WHEN b THEN d ELSE i END", "coalesce(i, j, 0)",
    "coalesce(d, 1.5)", "nvl(s, 'none')", "ifnull(x, 0)", "coalesce(i, j + 2147483647)",
    # strings
    "upper(s)", "lower(u)", "upper(u)", "lower(s)", "trim(s)", "ltrim(u)", "rtrim(u)", "length(s)", "char_length(u)",
    "concat(s, '-', u)", "s || u", "upper(s) = 'ABC'", "character_length(s)",
    # dates and times (session time zone UTC)
    "CAST(ts AS DATE)", "to_date(nt)", "year(ts)", "month(dt)", "day(ts)", "dayofmonth(nt)", "hour(ts)", "hour(nt)",
    "CAST(nt AS DATE)", "to_date(ts)", "day(dt)", "CAST('2020-01-01' AS DATE) < dt",
    # casts
    "CAST(i AS BIGINT)", "CAST(l AS INT)", "CAST(i AS STRING)", "CAST(t AS DOUBLE)", "CAST(i AS DECIMAL(12,2))",
    "CAST(f AS DOUBLE)", "CAST(d AS DOUBLE)", "CAST(j AS TINYINT)", "CAST(l AS STRING)", "CAST(t AS SMALLINT)",
    "d * 1.5 + 1", "i * 2 - j * 3 > 0",
]

# Delta refuses BETWEEN and btrim in a generated column; these are CHECK constraints only.
CHECK_ONLY = ["i BETWEEN -5 AND 5", "x NOT BETWEEN 0 AND 1", "d BETWEEN 0 AND 2.5", "ts BETWEEN '2020-01-01' AND ts", "btrim(s) = 'ab'"]

ERROR_CLASSES = ("ARITHMETIC_OVERFLOW", "DIVIDE_BY_ZERO", "REMAINDER_BY_ZERO", "CAST_OVERFLOW")


@pytest.fixture(scope="module")
def utc_spark(spark) -> Iterator:
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    assert spark.conf.get("spark.sql.ansi.enabled") == "true"
    # The failing writes are expected: their stack traces only slow the module down.
    spark.sparkContext.setLogLevel("OFF")
    yield spark
    spark.sparkContext.setLogLevel("WARN")
    spark.conf.set("spark.sql.session.timeZone", before)


def _create(spark, root: Path, columns: str, *checks: str, alter: bool = False) -> str:
    """A new Delta table; CHECK constraints with ALTER TABLE ADD CONSTRAINT, or (seconds faster each)
    as the table properties that command records (``delta.constraints.<name>``)."""
    path = str(root / f"t-{uuid.uuid4().hex[:8]}")
    # In a Spark string literal; the constraints here have no backslash, a quote gets one.
    properties = ", ".join("'delta.constraints.c{}' = '{}'".format(k, c.replace("'", "\\'")) for k, c in enumerate(checks))
    tblproperties = f" TBLPROPERTIES ({properties})" if checks and not alter else ""
    spark.sql(f"CREATE TABLE delta.`{path}` ({columns}) USING delta{tblproperties}")
    if alter:
        for k, c in enumerate(checks):
            spark.sql(f"ALTER TABLE delta.`{path}` ADD CONSTRAINT c{k} CHECK ({c})")
    return path


def _write(spark, path: str, rows, columns: str = COLUMNS) -> str | None:
    """Spark's Delta writer appends ``rows`` (tuples or a DataFrame); None, or the error class that failed it."""
    try:
        df = rows if not isinstance(rows, list) else spark.createDataFrame(rows, columns)
        df.write.format("delta").mode("append").save(path)
        return None
    except Exception as e:  # Py4J wraps Spark's errors
        message = str(e)
        for name in ERROR_CLASSES + ("DELTA_VIOLATE_CONSTRAINT",):
            if name in message:
                return name
        raise


def _arrow_schema(path: str) -> pa.Schema:
    from deltalake import DeltaTable, Schema

    from lastagent.delta.files import delta_arrow_schema

    return delta_arrow_schema(pa.schema(Schema.from_json(DeltaTable(path).schema().to_json()).to_arrow()))


def _batch(rows: list[tuple], schema: pa.Schema, names: list[str] = NAMES) -> pa.RecordBatch:
    dicts = [dict(zip(names, r)) for r in rows]
    return pa.RecordBatch.from_pylist(dicts, schema=schema)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return a == b and type(a) is type(b)


def _read(path: str, column: str) -> dict[int, object]:
    from deltalake import DeltaTable

    table = DeltaTable(path).to_pyarrow_table(columns=["id", column])
    return dict(zip(table.column("id").to_pylist(), table.column(column).to_pylist()))


def _predict(expr: str, schema: pa.Schema, rows: list[tuple]) -> tuple[list[object], set[int]]:
    """RowRules' values of ``expr`` as generated column ``g`` and the ids of the rows that fail."""
    rules = RowRules([], [GeneratedColumn("g", expr)], schema, provided=NAMES)
    out, failed = rules.apply(_batch([r + (None,) for r in rows], schema, NAMES + ["g"]))
    return out.column("g").to_pylist(), {rows[k][0] for k, _ in failed}


def _spark_types(spark) -> dict[str, str]:
    spark.createDataFrame(ROWS, COLUMNS).createOrReplaceTempView("expression_rows")
    selected = ", ".join(f"typeof({e}) AS t{k}" for k, e in enumerate(EXPRESSIONS))
    row = spark.sql(f"SELECT {selected} FROM expression_rows LIMIT 1").collect()[0]
    return {e: row[k] for k, e in enumerate(EXPRESSIONS)}


def test_generated_values_failures_and_types_match_spark(utc_spark, tmp_path):
    spark = utc_spark
    types = _spark_types(spark)
    base = _arrow_schema(_create(spark, tmp_path, COLUMNS))
    for e in EXPRESSIONS:
        check_supported(e, base, f"expression {e}")
    # Every expression has the type Spark gives it (Delta requires it to be the generated column's).
    from lastagent.delta.expressions import _analyze

    assert {e: str(_analyze(e, base, "UTC", generated=False).type) for e in EXPRESSIONS} == types
    predicted = {e: _predict(e, base.append(pa.field("g", _arrow_type(types[e]))), ROWS) for e in EXPRESSIONS}

    # Expressions no row fails: all in one table, one write. Expressions some rows fail: grouped so
    # that no two in a group fail on the same row; the rows that pass are written at once, each
    # failing row alone (the write must fail with an arithmetic error).
    groups: list[list[str]] = [[e for e in EXPRESSIONS if not predicted[e][1]]]
    for e in (e for e in EXPRESSIONS if predicted[e][1]):
        for g in groups[1:]:
            if all(not (predicted[e][1] & predicted[o][1]) for o in g):
                g.append(e)
                break
        else:
            groups.append([e])
    source = spark.createDataFrame(ROWS, COLUMNS).cache()
    paths, bad, jobs = [], [], []
    for group in groups:
        generated = ", ".join(f"g{k} {types[e]} GENERATED ALWAYS AS ({e})" for k, e in enumerate(group))
        paths.append(_create(spark, tmp_path, f"{COLUMNS}, {generated}"))
        bad.append(set().union(*(predicted[e][1] for e in group)))
        passing = source.filter(f"id NOT IN ({', '.join(map(str, bad[-1]))})") if bad[-1] else source
        jobs.append((group, None, paths[-1], passing))
        jobs += [(group, k, paths[-1], source.filter(f"id = {k}")) for k in sorted(bad[-1])]
    outcomes = _in_parallel([lambda job=job: _write(spark, job[2], job[3]) for job in jobs])
    for (group, k, _, _), outcome in zip(jobs, outcomes):
        if k is None:
            assert outcome is None, group
        else:
            assert outcome in ERROR_CLASSES, (group, k, outcome)
    mismatches = []
    for group, path, failing in zip(groups, paths, bad):
        for k, e in enumerate(group):
            stored = _read(path, f"g{k}")
            for row, value in zip(ROWS, predicted[e][0]):
                if row[0] not in failing and not _same(stored[row[0]], value):
                    mismatches.append((e, row[0], stored[row[0]], value))
    assert mismatches == []

    # The boolean expressions as CHECK constraints: RowRules rejects the rows whose value is not TRUE.
    for e in (e for e in EXPRESSIONS if types[e] == "boolean"):
        _, rejected = RowRules([Constraint("c", e)], [], base, provided=NAMES).apply(_batch(ROWS, base))
        values, failed = predicted[e]
        assert {ROWS[k][0] for k, _ in rejected} == {r[0] for r, v in zip(ROWS, values) if v is not True} | failed, e


def _in_parallel(jobs: list[Callable[[], object]]) -> list[object]:
    """Runs Spark writes from 4 threads (Spark runs jobs of several threads at once)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda job: job(), jobs))


def _arrow_type(spark_type: str) -> pa.DataType:
    simple = {"boolean": pa.bool_(), "tinyint": pa.int8(), "smallint": pa.int16(), "int": pa.int32(),
              "bigint": pa.int64(), "float": pa.float32(), "double": pa.float64(), "string": pa.string(),
              "date": pa.date32(), "timestamp": pa.timestamp("us", tz="UTC"), "timestamp_ntz": pa.timestamp("us")}
    if spark_type in simple:
        return simple[spark_type]
    assert spark_type.startswith("decimal("), spark_type
    p, s = spark_type[len("decimal("):-1].split(",")
    return pa.decimal128(int(p), int(s))


CHECKS = {
    # NULL is a violation, like FALSE; TRUE passes.
    "i > 0": [0, 1, 2],
    # Not reordered as a generated column would be: i + 2147483647 overflows even when j is NULL.
    "coalesce((i + 2147483647) + j, 0) >= 0": [0, 2, 6],
    # AND does not evaluate its right side after FALSE, OR after TRUE.
    "(j IS NOT NULL AND i + j > 0) OR s LIKE 'a%'": [0, 4, 6],
    "b": [1, 3],
}


def test_check_constraints_row_by_row_match_spark(utc_spark, tmp_path):
    spark = utc_spark
    by_id = {r[0]: r for r in ROWS}
    jobs = []
    for n, (constraint, ids) in enumerate(CHECKS.items()):
        path = _create(spark, tmp_path, COLUMNS, constraint, alter=n == 0)
        schema = _arrow_schema(path)
        rows = [by_id[k] for k in ids]
        _, failed = RowRules([Constraint("c0", constraint)], [], schema, provided=NAMES).apply(_batch(rows, schema))
        reasons = {rows[k][0]: reason for k, reason in failed}
        for row in rows:
            expected = (None if row[0] not in reasons else
                        ("DELTA_VIOLATE_CONSTRAINT",) if "violated" in reasons[row[0]] else ERROR_CLASSES)
            jobs.append((constraint, row, path, expected))
    outcomes = _in_parallel([lambda job=job: _write(spark, job[2], [job[1]]) for job in jobs])
    for (constraint, row, _, expected), outcome in zip(jobs, outcomes):
        assert outcome is None if expected is None else outcome in expected, (constraint, row[0], outcome)


def test_check_only_expressions_match_spark(utc_spark, tmp_path):
    """Rows RowRules accepts are written at once, each rejected row alone (the write must fail)."""
    spark = utc_spark
    jobs = []
    for constraint in CHECK_ONLY:
        path = _create(spark, tmp_path, COLUMNS, constraint)
        schema = _arrow_schema(path)
        check_supported(constraint, schema, f"CHECK constraint {constraint}")
        _, failed = RowRules([Constraint("c0", constraint)], [], schema, provided=NAMES).apply(_batch(ROWS, schema))
        rejected = {ROWS[k][0] for k, _ in failed}
        assert 0 < len(rejected) < len(ROWS), constraint
        jobs.append((constraint, [r for r in ROWS if r[0] not in rejected], path, None))
        # Each rejected row alone, the first three of them (BETWEEN is >= AND <=, whose values on
        # every row the first test compares).
        jobs += [(constraint, [r], path, "DELTA_VIOLATE_CONSTRAINT") for r in ROWS if r[0] in rejected][:3]
    outcomes = _in_parallel([lambda job=job: _write(spark, job[2], job[1]) for job in jobs])
    for (constraint, rows, _, expected), outcome in zip(jobs, outcomes):
        assert outcome == expected, (constraint, [r[0] for r in rows], outcome)


def test_carried_generated_values_are_checked_as_spark_does(utc_spark, tmp_path):
    spark = utc_spark
    columns = "i INT, j INT, g INT GENERATED ALWAYS AS (i + 1 + j)"
    path = _create(spark, tmp_path, columns)
    schema = _arrow_schema(path)
    carried = RowRules([], [GeneratedColumn("g", "i + 1 + j")], schema, provided=["i", "j", "g"])
    computed = RowRules([], [GeneratedColumn("g", "i + 1 + j")], schema, provided=["i", "j"])
    rows = [(1, 1, 3), (1, 1, 4), (1, 1, None), (None, 1, None), (None, 1, 0), (MAX, -1, MAX)]
    _, failed = carried.apply(_batch(rows, schema, ["i", "j", "g"]))
    reasons = dict(failed)
    # Checked as a CHECK constraint is: i + 1 + j as written, so (MAX, -1) overflows.
    assert [reasons.get(k, "") for k in range(len(rows))] == [
        "", "generated column g: value does not equal its generation expression (i + 1 + j)",
        "generated column g: value does not equal its generation expression (i + 1 + j)", "",
        "generated column g: value does not equal its generation expression (i + 1 + j)",
        "generated column g: arithmetic overflow in (i + 1 + j)"]
    outcomes = _in_parallel([lambda row=row: _write(spark, path, [row], "i INT, j INT, g INT") for row in rows])
    assert outcomes == [None, "DELTA_VIOLATE_CONSTRAINT", "DELTA_VIOLATE_CONSTRAINT", None,
                        "DELTA_VIOLATE_CONSTRAINT", "ARITHMETIC_OVERFLOW"]
    # Computed (the column not carried), Spark's optimizer runs i + 1 + j as (i + j) + 1: no overflow.
    out, failed = computed.apply(_batch([(MAX, -1, None)], schema, ["i", "j", "g"]))
    assert failed == [] and out.column("g").to_pylist() == [MAX]
    assert _write(spark, path, [(MAX, -1)], "i INT, j INT") is None
    assert MAX in _read_all(path, "g")


def _read_all(path: str, column: str) -> list[object]:
    from deltalake import DeltaTable

    return DeltaTable(path).to_pyarrow_table(columns=[column]).column(column).to_pylist()
