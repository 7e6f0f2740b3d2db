"""lastagent.delta.expressions without Spark: the allow-list, NULLs, failing rows, reasons.

What Spark's Delta writer does with the same expressions is compared in
tests/integration/test_delta_expressions_spark.py; the expectations here are those results.
"""

from __future__ import annotations

import decimal
import random

import pyarrow as pa
import pytest

from lastagent.delta.expressions import RowRules, check_supported
from lastagent.delta.features import Constraint, GeneratedColumn
from lastagent.errors import LastAgentError, UnsupportedExpressionError

pytestmark = pytest.mark.unit

D = decimal.Decimal
MAX, MIN = 2 ** 31 - 1, -(2 ** 31)

SCHEMA = pa.schema([
    ("id", pa.int64()), ("amount", pa.int32()), ("other", pa.int32()), ("big", pa.int64()), ("tiny", pa.int8()),
    ("Name", pa.string()), ("price", pa.decimal128(10, 2)), ("x", pa.float64()), ("flag", pa.bool_()),
    ("day", pa.date32()), ("ts", pa.timestamp("us", tz="UTC")), ("local", pa.timestamp("us")), ("raw", pa.binary()),
    ("doubled", pa.int32()), ("ok", pa.bool_()),
])


def batch(**columns: list) -> pa.RecordBatch:
    """A batch of SCHEMA; columns not given are NULL."""
    n = len(next(iter(columns.values())))
    arrays = [pa.array(columns.get(f.name, [None] * n), f.type) for f in SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


def checked(sql: str, **columns: list) -> list[str | None]:
    """Per row: None when the CHECK passes, else the reason."""
    _, failed = RowRules([Constraint("c", sql)], [], SCHEMA, provided=SCHEMA.names).apply(batch(**columns))
    reasons = dict(failed)
    return [reasons.get(k) for k in range(len(next(iter(columns.values()))))]


def computed(sql: str, column: str = "doubled", **columns: list) -> tuple[list, list[tuple[int, str]]]:
    provided = [n for n in SCHEMA.names if n != column]
    out, failed = RowRules([], [GeneratedColumn(column, sql)], SCHEMA, provided=provided).apply(batch(**columns))
    return out.column(column).to_pylist(), failed


@pytest.mark.parametrize("sql", [
    "amount >= 0", "amount > 0 AND other < 10 OR NOT flag", "`AMOUNT` = 1", "name = \"abc\"", "NAME <> 'x'",
    "amount <=> other", "amount IS DISTINCT FROM other", "amount BETWEEN -5 AND 5", "amount NOT IN (1, 2, NULL)",
    "name LIKE 'a_%'", "name NOT LIKE '%z'", "amount + other * 2 - 1 > big", "price * 2 >= 1.50", "x / 2 < amount % 3",
    "-amount < abs(other)", "CASE WHEN amount > 0 THEN 'p' WHEN amount < 0 THEN 'n' ELSE 'z' END = 'p'",
    "CASE amount WHEN 1 THEN true ELSE false END", "coalesce(amount, other, 0) > 0", "nvl(name, '') <> ''",
    "ifnull(x, 0) >= 0", "upper(name) = lower(name)", "trim(name) = ltrim(rtrim(name))", "length(name) < 10",
    "char_length(name) < character_length(name) + 1", "concat(name, '-', name) = name || '-' || name",
    "CAST(ts AS DATE) >= '2020-01-01'", "to_date(local) = day", "year(ts) > 2000 AND month(day) < 13",
    "dayofmonth(local) + day(ts) > 0", "hour(ts) < 24", "ts < TIMESTAMP '2030-01-01 00:00:00'", "day >= DATE '2020-01-01'",
    "CAST(amount AS BIGINT) + big > 0", "CAST(big AS INT) > 0", "CAST(amount AS STRING) = name",
    "CAST(tiny AS DOUBLE) < x", "CAST(amount AS DECIMAL(12,2)) < price", "flag IS TRUE", "flag IS NOT FALSE",
    "flag IS UNKNOWN", "name IS NOT NULL", "day IN ('2020-01-01', '2020-01-02')",
])
def test_supported(sql):
    check_supported(sql, SCHEMA, "CHECK constraint 'c'")


@pytest.mark.parametrize("sql, construct", [
    ("price / 2 > 1", "/ with a DECIMAL operand"),
    ("price % 2 = 0", "% with a DECIMAL operand"),
    ("amount > 1e3", "exponent literal 1e3"),
    ("big > 10L", "the literal 10L"),
    ("name = 'it\\'s'", "backslash"),
    ("amount > 0 -- positive", "a comment"),
    ("substring(name, 1, 2) = 'ab'", "the function substr"),
    ("date_format(ts, 'yyyy') = '2020'", "the function to_char"),  # DataFusion's name for it
    ("CAST(name AS INT) > 0", "CAST of a string to int"),
    ("CAST(amount AS DECIMAL) > 0", "DECIMAL without precision"),
    ("CAST(name AS VARCHAR(3)) = 'abc'", "CHAR/VARCHAR"),
    ("CAST(amount AS TIMESTAMP) > ts", "CAST of a int to timestamp"),
    ("name = 1", "comparison of string with int"),
    ("amount = NULL", "comparison = with a NULL literal"),
    ("amount + NULL > 0", "arithmetic + with a NULL literal"),
    ("raw IS NULL", "column raw of type binary"),
    ("nosuch > 0", "does not parse"),
    ("amount IN (other, 1)", "not all literals"),
    ("name LIKE 'a%' ESCAPE '#'", "ESCAPE"),
    ("name ILIKE 'a%'", "ILIKE"),
    ("name RLIKE 'a'", "does not parse"),
    ("hour(day) = 0", "hour of a date"),
    ("amount & 1 = 1", "the operator &"),
    ("day = '2020-1-1'", "the date '2020-1-1'"),
    ("amount IN (SELECT 1)", "InSubquery"),
    ("CAST(price AS DECIMAL(5,2)) > 0", "CAST of a decimal(10,2) to decimal(5,2)"),
])
def test_refused_naming_rule_and_construct(sql, construct):
    with pytest.raises(UnsupportedExpressionError) as e:
        check_supported(sql, SCHEMA, "CHECK constraint 'c'")
    assert isinstance(e.value, LastAgentError)
    assert str(e.value).startswith(f"CHECK constraint 'c' ({sql}) cannot be evaluated")
    assert construct in e.value.construct


def test_time_zone_dependent_expressions_need_utc():
    for sql in ("CAST(ts AS DATE) = day", "year(ts) = 2020", "hour(ts) = 1", "ts > '2020-01-01'",
                "ts > TIMESTAMP '2020-01-01 00:00:00'"):
        check_supported(sql, SCHEMA, "c", time_zone="Etc/UTC")
        with pytest.raises(UnsupportedExpressionError, match="session time zone"):
            check_supported(sql, SCHEMA, "c", time_zone="Europe/Paris")
    # TIMESTAMP_NTZ and DATE do not depend on it.
    check_supported("CAST(local AS DATE) = day AND year(day) = 2020", SCHEMA, "c", time_zone="Europe/Paris")


def test_null_fails_a_check_like_false():
    assert checked("amount > 0", amount=[1, 0, None]) == [None, "CHECK constraint c (amount > 0) violated",
                                                          "CHECK constraint c (amount > 0) violated"]
    # ... and three-valued logic decides what is NULL.
    assert checked("amount > 0 OR flag", amount=[None, None, None], flag=[True, False, None]) == [
        None, "CHECK constraint c (amount > 0 OR flag) violated", "CHECK constraint c (amount > 0 OR flag) violated"]
    assert checked("amount IN (1, NULL)", amount=[1, 2]) == [None, "CHECK constraint c (amount IN (1, NULL)) violated"]
    assert checked("amount <=> other", amount=[None, None, 1], other=[None, 1, 1]) == [
        None, "CHECK constraint c (amount <=> other) violated", None]


def test_overflow_and_division_by_zero_fail_the_row():
    assert checked("amount + other > 0", amount=[MAX, MAX, 1], other=[1, 0, 1]) == [
        "CHECK constraint c: arithmetic overflow in (amount + other > 0)", None, None]
    assert checked("big * 2 > 0", big=[2 ** 62, 2 ** 61]) == ["CHECK constraint c: arithmetic overflow in (big * 2 > 0)", None]
    assert checked("-amount > 0 OR abs(other) > 0", amount=[MIN, 1], other=[1, MIN]) == [
        "CHECK constraint c: arithmetic overflow in (-amount > 0 OR abs(other) > 0)",
        "CHECK constraint c: arithmetic overflow in (-amount > 0 OR abs(other) > 0)"]
    assert checked("amount / other > 0", amount=[1, None, 0], other=[0, 0, 0]) == [
        "CHECK constraint c: division by zero in (amount / other > 0)", "CHECK constraint c (amount / other > 0) violated",
        "CHECK constraint c: division by zero in (amount / other > 0)"]
    assert checked("x % 0.0 > 0", x=[1.0]) == ["CHECK constraint c: division by zero in (x % 0.0 > 0)"]
    assert checked("CAST(big AS INT) > 0", big=[2 ** 31, 1]) == [
        "CHECK constraint c: arithmetic overflow in (CAST(big AS INT) > 0)", None]
    # TINYINT + TINYINT is a TINYINT in Spark, and overflows as one.
    assert checked("tiny + tiny > 0", tiny=[127, 63]) == ["CHECK constraint c: arithmetic overflow in (tiny + tiny > 0)", None]
    values, failed = computed("amount * 2", amount=[2 ** 30, 3, None])
    assert values == [None, 6, None]
    assert failed == [(0, "generated column doubled: arithmetic overflow in its generation expression (amount * 2)")]


def test_errors_count_only_where_spark_evaluates():
    # AND stops at FALSE, OR at TRUE; CASE and COALESCE evaluate in order; + skips its right side
    # when the left is NULL; / and % evaluate the divisor first and skip the dividend when it is NULL.
    assert checked("other > 0 AND amount + 1 > 0", amount=[MAX, MAX, MAX], other=[0, None, 1]) == [
        "CHECK constraint c (other > 0 AND amount + 1 > 0) violated",
        "CHECK constraint c: arithmetic overflow in (other > 0 AND amount + 1 > 0)",
        "CHECK constraint c: arithmetic overflow in (other > 0 AND amount + 1 > 0)"]
    assert checked("other > 0 OR amount + 1 > 0", amount=[MAX, MAX], other=[1, 0])[0] is None
    assert checked("CASE WHEN other > 0 THEN amount + 1 > 0 ELSE true END", amount=[MAX, MAX], other=[0, 1])[0] is None
    assert checked("coalesce(other, amount + 1) > 0", amount=[MAX, MAX], other=[1, None])[0] is None
    assert checked("other + (amount + 1) IS NULL", amount=[MAX, MAX], other=[None, 1]) == [
        None, "CHECK constraint c: arithmetic overflow in (other + (amount + 1) IS NULL)"]
    assert checked("(amount + 1) + other IS NULL", amount=[MAX], other=[None]) == [
        "CHECK constraint c: arithmetic overflow in ((amount + 1) + other IS NULL)"]
    assert checked("(amount + 1) / other IS NULL", amount=[MAX], other=[None]) == [None]


def test_generated_columns_are_computed_as_optimized_and_checked_as_written():
    # Computed, Spark's optimizer runs amount + 1 + other as (amount + other) + 1.
    values, failed = computed("amount + 1 + other", amount=[MAX, MAX], other=[-1, 1])
    assert values == [MAX, None]
    assert failed == [(1, "generated column doubled: arithmetic overflow in its generation expression (amount + 1 + other)")]
    # Carried, the value is compared with the expression as written (which overflows on the first row).
    rules = RowRules([], [GeneratedColumn("doubled", "amount + 1 + other")], SCHEMA, provided=SCHEMA.names)
    _, failed = rules.apply(batch(amount=[MAX, 1, 1, None, None], other=[-1, 1, 1, 1, 1], doubled=[MAX, 3, 4, None, 0]))
    assert failed == [
        (0, "generated column doubled: arithmetic overflow in (amount + 1 + other)"),
        (2, "generated column doubled: value does not equal its generation expression (amount + 1 + other)"),
        (4, "generated column doubled: value does not equal its generation expression (amount + 1 + other)")]


def test_checks_see_computed_generated_values():
    rules = RowRules([Constraint("small", "doubled < 10"), Constraint("positive", "amount > 0")],
                     [GeneratedColumn("doubled", "amount * 2")], SCHEMA, provided=[n for n in SCHEMA.names if n != "doubled"])
    out, failed = rules.apply(batch(amount=[1, 5, -1, 2 ** 30], doubled=[99, 99, 99, 99]))
    assert out.schema == SCHEMA
    assert out.column("doubled").to_pylist() == [2, 10, -2, None]
    assert failed == [(1, "CHECK constraint small (doubled < 10) violated"),
                      (2, "CHECK constraint positive (amount > 0) violated"),
                      (3, "generated column doubled: arithmetic overflow in its generation expression (amount * 2)")]


def test_reasons_never_show_row_values():
    secret_text, secret_number = "SECRET-7f3a", 987654321
    rules = RowRules([Constraint("named", "Name = 'x'"), Constraint("sum", "amount + other < 0")],
                     [GeneratedColumn("doubled", "amount * 3")], SCHEMA, provided=[n for n in SCHEMA.names if n != "doubled"])
    _, failed = rules.apply(batch(Name=[secret_text, "x", "x"], amount=[secret_number, secret_number, MAX],
                                  other=[1, 1, MAX]))
    assert len(failed) == 3
    for _, reason in failed:
        assert secret_text not in reason and str(secret_number) not in reason and str(MAX) not in reason


def test_generated_column_type_must_be_the_expressions():
    check_supported("amount * 2", SCHEMA, "generated column 'doubled'", column="doubled")
    with pytest.raises(UnsupportedExpressionError, match="type bigint is not the column's type int"):
        check_supported("big * 2", SCHEMA, "generated column 'doubled'", column="doubled")
    with pytest.raises(UnsupportedExpressionError, match="generated column 'doubled'"):
        RowRules([], [GeneratedColumn("doubled", "amount * 2.5")], SCHEMA, provided=["amount"])


def test_generated_expressions_spark_may_rewrite_are_refused():
    for sql, construct in [("CASE WHEN other > 0 THEN amount + 1 ELSE amount + 1 END", "branches are all the same"),
                           ("(amount + 1) * (amount + 1)", "repeated subexpression"),
                           ("amount + 2147483647 + 1", "constants overflow"),
                           ("CASE WHEN other > 0 AND true THEN amount + 1 ELSE 0 END", "TRUE/FALSE literal")]:
        with pytest.raises(UnsupportedExpressionError, match=construct):
            check_supported(sql, SCHEMA, "generated column 'doubled'", column="doubled")
    # The same, without anything that can fail, is fine.
    check_supported("CASE WHEN other > 0 AND true THEN amount ELSE 0 END", SCHEMA, "g", column="doubled")


def test_names_are_case_insensitive_and_backquotes_work():
    assert checked("`NAME` = name AND NaMe = 'a'", Name=["a", "b"]) == [
        None, "CHECK constraint c (`NAME` = name AND NaMe = 'a') violated"]


def test_floating_point_compares_as_spark():
    nan, negative_nan = float("nan"), -float("nan")
    # NaN equals NaN and is above every number, whatever its sign bit; -0.0 equals 0.0.
    assert checked("x >= 0", x=[nan, negative_nan, -0.0, float("-inf")]) == [
        None, None, None, "CHECK constraint c (x >= 0) violated"]
    assert checked("x = 0", x=[-0.0])[0] is None
    assert checked("x IN (0, 1.5)", x=[-0.0, 1.5, nan]) == [None, None, "CHECK constraint c (x IN (0, 1.5)) violated"]
    assert checked("x / 0.5 > 1", x=[1.0, None]) == [None, "CHECK constraint c (x / 0.5 > 1) violated"]


def test_integer_remainder_is_javas():
    values, _ = computed("amount % other", amount=[MIN, -7, 7, None], other=[-1, 3, -3, 0])
    assert values == [0, -1, 1, None]


def test_decimal_arithmetic_is_exact():
    rng = random.Random(7)
    prices = [D(rng.randint(-10 ** 10 + 1, 10 ** 10 - 1)).scaleb(-2) for _ in range(200)]
    amounts = [rng.randint(MIN, MAX) for _ in range(200)]
    schema = SCHEMA.append(pa.field("g", pa.decimal128(21, 4))).append(pa.field("h", pa.decimal128(13, 2)))
    rules = RowRules([], [GeneratedColumn("g", "price * price"), GeneratedColumn("h", "price + amount")], schema,
                     provided=SCHEMA.names)
    b = batch(price=prices, amount=amounts)
    b = pa.RecordBatch.from_arrays(list(b.columns) + [pa.nulls(200, pa.decimal128(21, 4)), pa.nulls(200, pa.decimal128(13, 2))],
                                   schema=schema)
    out, failed = rules.apply(b)
    assert failed == []
    assert out.column("g").to_pylist() == [p * p for p in prices]
    assert out.column("h").to_pylist() == [p + a for p, a in zip(prices, amounts)]


def test_decimal_as_double_is_correctly_rounded():
    # Spark converts a DECIMAL of precision <= 15 as unscaled / 10^scale in doubles: correctly rounded.
    rng = random.Random(11)
    prices = [D(rng.randint(-10 ** 10 + 1, 10 ** 10 - 1)).scaleb(-2) for _ in range(500)]
    schema = SCHEMA.append(pa.field("g", pa.float64()))
    rules = RowRules([], [GeneratedColumn("g", "CAST(price AS DOUBLE)")], schema, provided=SCHEMA.names)
    b = batch(price=prices)
    b = pa.RecordBatch.from_arrays(list(b.columns) + [pa.nulls(500, pa.float64())], schema=schema)
    assert rules.apply(b)[0].column("g").to_pylist() == [float(p) for p in prices]


def test_strings_as_spark():
    schema = SCHEMA.append(pa.field("g", pa.string()))
    for sql, inputs, expected in [
        ("upper(Name)", ["ß", "ǅ", "ﬁ", None], ["SS", "Ǆ", "FI", None]),
        ("lower(Name)", ["ΑΣ Σ", "İ"], ["ας σ", "i̇"]),
        ("trim(Name)", [" a\t ", "\n a "], ["a\t", "\n a"]),
        ("concat(Name, '-', Name)", ["a", None], ["a-a", None]),
    ]:
        rules = RowRules([], [GeneratedColumn("g", sql)], schema, provided=SCHEMA.names)
        b = batch(Name=inputs)
        b = pa.RecordBatch.from_arrays(list(b.columns) + [pa.nulls(len(inputs), pa.string())], schema=schema)
        assert rules.apply(b)[0].column("g").to_pylist() == expected, sql
    assert checked("Name LIKE 'a_c'", Name=["a\nc", "a.c", "abbc"]) == [
        None, None, "CHECK constraint c (Name LIKE 'a_c') violated"]
    assert checked("Name LIKE 'a.c'", Name=["abc"]) == ["CHECK constraint c (Name LIKE 'a.c') violated"]


def test_no_rules_and_empty_batches():
    rules = RowRules([], [], SCHEMA, provided=SCHEMA.names)
    b = batch(amount=[1])
    assert rules.apply(b) == (b, [])
    rules = RowRules([Constraint("c", "amount > 0")], [GeneratedColumn("doubled", "amount * 2")], SCHEMA, provided=["amount"])
    empty = pa.RecordBatch.from_pylist([], schema=SCHEMA)
    assert rules.apply(empty) == (empty, [])


def test_smallest_integers_overflow_when_negated():
    assert checked("-tiny > 0 OR abs(tiny) > 0", tiny=[-128, -127, None]) == [
        "CHECK constraint c: arithmetic overflow in (-tiny > 0 OR abs(tiny) > 0)", None,
        "CHECK constraint c (-tiny > 0 OR abs(tiny) > 0) violated"]
    assert checked("abs(big) > 0", big=[-(2 ** 63), -(2 ** 63) + 1]) == [
        "CHECK constraint c: arithmetic overflow in (abs(big) > 0)", None]


def test_long_and_nested_expressions():
    chain = " AND ".join(f"amount + {k} > other" for k in range(60))
    assert checked(chain, amount=[100, MAX], other=[0, 0]) == [None, f"CHECK constraint c: arithmetic overflow in ({chain})"]
    nested = "-" * 1 + "(" * 30 + "amount" + " + 1)" * 30 + " < 0"
    assert checked(nested, amount=[1, MAX - 29]) == [None, f"CHECK constraint c: arithmetic overflow in ({nested})"]
    negations = "(" + "-(" * 25 + "amount" + ")" * 25 + ") > 0"
    assert checked(negations, amount=[-1, MIN]) == [None, f"CHECK constraint c: arithmetic overflow in ({negations})"]


def test_generated_expressions_with_repeated_terms_are_refused_when_they_can_fail():
    # Spark's optimizer turns (flag OR a) AND (flag OR b) into flag OR (a AND b): b's evaluation changes.
    with pytest.raises(UnsupportedExpressionError, match="repeated subexpression"):
        check_supported("(flag OR amount + 1 > 0) AND (flag OR other + 1 > 0)", SCHEMA, "g", column="ok")
    # As a CHECK constraint (not optimized) it is fine, and so is a generated one that cannot fail.
    check_supported("(flag OR amount + 1 > 0) AND (flag OR other + 1 > 0)", SCHEMA, "c")
    check_supported("CASE WHEN (flag OR amount > 0) AND (flag OR other > 0) THEN 1 ELSE 0 END", SCHEMA, "g",
                    column="other")


def test_a_default_fills_only_the_column_the_rows_lack_cast_to_its_type():
    """Spark's delta writer fills a missing column's DEFAULT (cast to the column's type: an INT literal in a BIGINT
    column); a column the rows give keeps its values, nulls included."""
    from lastagent.delta.features import ColumnDefault

    defaults = [ColumnDefault("big", "3"), ColumnDefault("Name", "concat('n', '/a')"), ColumnDefault("amount", "7")]
    rules = RowRules([], [], SCHEMA, provided={"id", "amount"}, defaults=defaults)
    out, failed = rules.apply(batch(id=[1, 2], amount=[5, None]))
    assert failed == []
    assert out.column("big").to_pylist() == [3, 3] and out.column("big").type == pa.int64()
    assert out.column("Name").to_pylist() == ["n/a", "n/a"]
    assert out.column("amount").to_pylist() == [5, None]  # given: kept as given


def test_a_default_outside_the_subset_is_refused_at_start_naming_the_column():
    from lastagent.delta.features import ColumnDefault

    with pytest.raises(UnsupportedExpressionError, match=r"DEFAULT of column 'ts'"):
        check_supported("current_timestamp()", SCHEMA, "DEFAULT of column 'ts' of Delta table /t")
    with pytest.raises(UnsupportedExpressionError, match=r"DEFAULT of column 'ts'"):
        RowRules([], [], SCHEMA, provided={"id"}, defaults=[ColumnDefault("ts", "current_timestamp()")])
