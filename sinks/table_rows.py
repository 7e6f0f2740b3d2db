"""A target table's row rules on the executor: identity, generated and defaulted columns, NOT NULL and CHECK
constraints.

Executor side. Rows already cast to the table's schema pass through :class:`RowChecker` before
they are written to a file: identity values are assigned (:class:`IdentityValues`), generated columns are computed
(or checked, when the query gives them), then CHAR/VARCHAR lengths, NOT NULL columns and CHECK constraints are
enforced, in that order, as Spark's Delta writer does. A row that breaks a rule goes to the dead letters with the rule's name as its
reason (``not-null:<column>``, ``check-constraint:<name>``, ``generated-column:<column>``,
``length:<column>`` for a CHAR/VARCHAR value longer than the column's length); it is
never written and never dropped.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from lastagent.delta.features import IdentityColumn, TableRules
from lastagent.errors import IdentityExhaustedError, SchemaMismatchError
from lastagent.sinks.transformer import Failure

#: How many tasks an epoch's identity values interleave: a task's n-th row gets the slot ``n * IDENTITY_SLOTS + p``
#: (``p`` its Spark partition), so no two tasks of an epoch share a value without asking each other.
IDENTITY_SLOTS = 1 << 16


class IdentityValues:
    """The identity values of one task attempt, over all its batches. Executor.

    The task's n-th row (counted over the attempt's batches, rows that later break a rule included) gets
    ``base + step * (n * IDENTITY_SLOTS + partition)`` in each identity column the rows do not give, ``base`` being
    one step past the high-water mark the epoch's start read (:attr:`IdentityColumn.base`). Unique across the
    epoch's tasks and beyond the mark in the step's direction; the epoch's commit moves the mark to the furthest
    value its files hold. A retried attempt gives the same values again (only one attempt's files are committed);
    gaps are allowed, as in Spark's own identity values.

    Raises:
        IdentityExhaustedError: the partition is past :data:`IDENTITY_SLOTS`, or a value would pass BIGINT's range.
    """

    def __init__(self, columns: Sequence[IdentityColumn], partition: int) -> None:
        if partition >= IDENTITY_SLOTS:
            raise IdentityExhaustedError(f"task partition {partition}: identity values interleave at most "
                                         f"{IDENTITY_SLOTS} partitions of an epoch; repartition the query to fewer")
        self.columns = tuple(columns)
        self.partition = partition
        self.rows = 0

    def fill(self, batch: pa.RecordBatch, provided: Collection[str]) -> pa.RecordBatch:
        """The batch with each identity column the rows do not give filled with the attempt's next values.

        Raises:
            SchemaMismatchError: the rows give an identity column (a transformer's output; a query's is refused at
                start).
        """
        given = [c.column for c in self.columns if c.column in provided]
        if given:
            raise SchemaMismatchError(f"the rows give identity column(s) {given}: lastagent-delta assigns identity "
                                      "values and does not write values the rows give; leave the column out")
        if not self.columns or batch.num_rows == 0:
            return batch
        index = pa.array(range(self.rows, self.rows + batch.num_rows), pa.int64())
        self.rows += batch.num_rows
        arrays = list(batch.columns)
        try:
            slots = pc.add_checked(pc.multiply_checked(index, IDENTITY_SLOTS), self.partition)
            for c in self.columns:
                at = batch.schema.get_field_index(c.column)
                arrays[at] = pc.add_checked(pc.multiply_checked(slots, c.step), c.base)
        except pa.ArrowInvalid as exc:  # overflow
            raise IdentityExhaustedError(f"identity values of this epoch's task {self.partition} would pass BIGINT's "
                                         f"range ({exc}); nothing of the epoch is committed") from exc
        return pa.RecordBatch.from_arrays(arrays, schema=batch.schema)


class RuleViolation(ValueError):
    """A row breaks one of the table's rules; the message names the rule, never the row's values.

    Attributes:
        reason: the dead letter's reason (``not-null:<column>``, ``check-constraint:<name>``, ...).
        summary: what logs and errors may show (the same text: it quotes no value).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.summary = message


def _null_rows(column: pa.Array, path: list[str]) -> pa.Array:
    """Booleans: the rows whose field at ``path`` (below ``column``) is null while every struct above it is not."""
    if not path:
        return pc.is_null(column)
    assert isinstance(column, pa.StructArray), "NOT NULL paths go through structs only"
    return pc.and_kleene(pc.is_valid(column), _null_rows(column.field(path[0]), path[1:]))


class RowChecker:
    """Applies a table's :class:`~lastagent.delta.features.TableRules` to batches. Executor.

    Args:
        rules: the table's rules, worked out on the driver at the epoch's start.
        schema: the table's Arrow schema (logical names): the batches' schema.
        provided: the columns the query's rows carry (a generated column they lack is computed).
        time_zone: Spark's session time zone, as the task sees it (``spark.sql.session.timeZone``).
        identity: the task attempt's identity values (one for every checker of the attempt), for a table with
            identity columns.
    """

    def __init__(self, rules: TableRules, schema: pa.Schema, provided: Collection[str], time_zone: str,
                 identity: IdentityValues | None = None) -> None:
        self.rules = rules
        self.provided = provided
        self.identity = identity
        self.expressions = None
        if rules.constraints or rules.generated or rules.defaults:
            from lastagent.delta.expressions import RowRules

            self.expressions = RowRules(rules.constraints, rules.generated, schema, provided, time_zone=time_zone,
                                        defaults=rules.defaults)

    def apply(self, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, list[Failure]]:
        """The batch's rows that keep every rule (generated columns filled) and the ones that break one.

        Returns:
            (the conforming rows as one batch, one failure per breaking row with its input row).
        """
        failed: dict[int, RuleViolation] = {}
        # Identity values first (the attempt's own, one task's batches in order), then generated values: NOT NULL and
        # the CHECKs apply to them. A dead letter keeps the row as it came.
        checked = batch if self.identity is None else self.identity.fill(batch, self.provided)
        broken: list[tuple[int, str]] = []
        if self.expressions is not None:
            checked, broken = self.expressions.apply(checked)
        # Spark's order for a row that breaks several rules: a generated value that cannot be
        # computed, then CHAR/VARCHAR lengths, NOT NULL, the CHECK constraints; the dead letter names the first.
        reasons = [(index, _reason(text, self.rules), text) for index, text in broken]
        for index, reason, text in reasons:
            if reason.startswith(("generated-column:", "column-default:")):
                failed.setdefault(index, RuleViolation(reason, text))
        for column, limit in self.rules.lengths:
            longer = pc.greater(pc.utf8_length(checked.column(column)), limit)
            for index in pc.indices_nonzero(pc.fill_null(longer, False)).to_pylist():
                failed.setdefault(index, RuleViolation(
                    f"length:{column}", f"column '{column}' is longer than its CHAR/VARCHAR length {limit}"))
        for path in self.rules.not_null:
            names = path.split(".")
            nulls = _null_rows(checked.column(names[0]), names[1:])
            for index in pc.indices_nonzero(pc.fill_null(nulls, False)).to_pylist():
                failed.setdefault(index, RuleViolation(
                    f"not-null:{path}", f"NOT NULL constraint violated: column '{path}' is null"))
        for index, reason, text in reasons:
            failed.setdefault(index, RuleViolation(reason, text))
        if not failed:
            return checked, []
        keep = pa.array([i not in failed for i in range(batch.num_rows)])
        failures = [Failure(batch.slice(i, 1), exc.reason, exc) for i, exc in sorted(failed.items())]
        return checked.filter(keep), failures


def _reason(text: str, rules: TableRules) -> str:
    """The dead-letter reason of a failure the evaluator describes: the rule its text starts with."""
    # The evaluator's text is "<rule>: ..." or "<rule> (<sql>) violated"; a name may prefix another's.
    for g in rules.generated:
        if text.startswith(f"generated column {g.column}:"):
            return f"generated-column:{g.column}"
    for d in rules.defaults:
        if text.startswith(f"DEFAULT of column {d.column}:"):
            return f"column-default:{d.column}"
    for c in rules.constraints:
        if text.startswith((f"CHECK constraint {c.name}:", f"CHECK constraint {c.name} (")):
            return f"check-constraint:{c.name}"
    raise AssertionError(f"a rule failure that names no rule of the table: {text}")
