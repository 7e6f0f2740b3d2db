"""A target table's row rules on the executor: generated columns, NOT NULL and CHECK constraints.

Executor side. Rows already cast to the table's schema pass through :class:`RowChecker` before
they are written to a file: generated columns are computed (or checked, when the query gives
them), then NOT NULL columns and CHECK constraints are enforced, in that order, as Spark's Delta
writer does. A row that breaks a rule goes to the dead letters with the rule's name as its
reason (``not-null:<column>``, ``check-constraint:<name>``, ``generated-column:<column>``); it is
never written and never dropped.
"""

from __future__ import annotations

from collections.abc import Collection

import pyarrow as pa
import pyarrow.compute as pc

from lastagent.sinks.delta_features import TableRules
from lastagent.sinks.transformer import Failure


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
    """Applies a table's :class:`~lastagent.sinks.delta_features.TableRules` to batches. Executor.

    Args:
        rules: the table's rules, worked out on the driver at the epoch's start.
        schema: the table's Arrow schema (logical names): the batches' schema.
        provided: the columns the query's rows carry (a generated column they lack is computed).
    """

    def __init__(self, rules: TableRules, schema: pa.Schema, provided: Collection[str]) -> None:
        self.rules = rules
        self.expressions = None
        if rules.constraints or rules.generated:
            from lastagent.sinks.delta_expressions import Check, Generated, RowRules

            self.expressions = RowRules([Check(c.name, c.sql) for c in rules.constraints],
                                        [Generated(g.column, g.sql) for g in rules.generated], schema, provided)

    def apply(self, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, list[Failure]]:
        """The batch's rows that keep every rule (generated columns filled) and the ones that break one.

        Returns:
            (the conforming rows as one batch, one failure per breaking row with its input row).
        """
        failed: dict[int, RuleViolation] = {}
        checked = batch
        if self.expressions is not None:
            generated = {g.column for g in self.rules.generated}
            computed, broken = self.expressions.apply(batch)
            # NOT NULL applies to generated values, so it runs on the computed batch.
            checked = computed
            for index, reason in broken:
                kind = next((f"generated-column:{c}" for c in generated if f"generated column {c}" in reason),
                            None)
                failed.setdefault(index, RuleViolation(kind or _check_name(reason, self.rules), reason))
        for path in self.rules.not_null:
            names = path.split(".")
            nulls = _null_rows(checked.column(names[0]), names[1:])
            for index in pc.indices_nonzero(pc.fill_null(nulls, False)).to_pylist():
                failed.setdefault(index, RuleViolation(
                    f"not-null:{path}", f"NOT NULL constraint violated: column '{path}' is null"))
        if not failed:
            return checked, []
        keep = pa.array([i not in failed for i in range(batch.num_rows)])
        failures = [Failure(batch.slice(i, 1), exc.reason, exc) for i, exc in sorted(failed.items())]
        return checked.filter(keep), failures


def _check_name(reason: str, rules: TableRules) -> str:
    """The dead-letter reason of a CHECK failure: the constraint named in the evaluator's text."""
    for c in rules.constraints:
        if f"constraint {c.name} " in reason or f"constraint '{c.name}'" in reason:
            return f"check-constraint:{c.name}"
    return "check-constraint"
