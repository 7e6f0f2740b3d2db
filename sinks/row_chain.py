"""A ``lastagent-delta`` task's rows, step by step, into the table's files, the side topics and the dead letters.

Executor side. :class:`RowChain` takes each Arrow batch Spark hands the task through named steps:

1. **parse**: the headers the options keep (or without those they drop); rows a ``lastagent.reliable_groups``
   step refused, split off;
2. **transform**: the user's ``transformer``, if any; a row it fails on is split off;
3. **conform**: each batch cast to the table's schema (the first batch fixes a new table's schema); a row that
   does not convert is split off;
4. **check**: the table's row rules (generated and identity columns, DEFAULT values, NOT NULL, CHECK
   constraints: :class:`lastagent.sinks.table_rows.RowChecker`); a row that breaks one is split off;
5. **dead letters**: every row split off above, with its rule and reason, goes to the task's dead letters
   (:meth:`lastagent.sinks.task_outputs.TaskOutputs.dead_letter`), never dropped;
6. **file**: the rows that pass, into the task's parquet files and to the side topics.

The chain holds no Spark object and runs no Spark call; :meth:`lastagent.sinks.delta_sink.DeltaStreamWriter.write`
builds it for a task and feeds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from lastagent.delta.features import TableRules
from lastagent.delta.files import FileWriter, delta_arrow_schema
from lastagent.groups.refusals import split_refused
from lastagent.sinks import dead_letters, transformer
from lastagent.sinks.delta_sink_options import DeltaSinkOptions
from lastagent.sinks.table_rows import IdentityValues, RowChecker
from lastagent.sinks.task_outputs import TaskOutputs


class RowChain:
    """One task's row chain (see the module). Executor.

    Args:
        options: the sink's options (headers kept or dropped, transformer, mergeSchema).
        rules: the table's row rules, as the query's start read them.
        target: the table's Arrow schema; None for a table the epoch creates (its first batch fixes it).
        files: the task's parquet files.
        outputs: the task's Kafka outputs (side topics, dead letters).
        identity: the task's identity values, when the table has identity columns.
        time_zone: Spark's session time zone, which expressions that depend on it are evaluated in.
    """

    def __init__(self, options: DeltaSinkOptions, rules: TableRules, target: pa.Schema | None, files: FileWriter,
                 outputs: TaskOutputs, identity: IdentityValues | None, time_zone: str) -> None:
        self.options = options
        self.rules = rules
        self.target = target
        self.files = files
        self.outputs = outputs
        self.identity = identity
        self.time_zone = time_zone
        self._transform: transformer.Transform | None = (transformer.load(options.transformer)
                                                         if options.transformer else None)
        # One checker per set of columns the rows carry (a transformer may vary it): a generated
        # column the rows lack is computed, one they carry is checked.
        self._checkers: dict[tuple[str, ...], RowChecker] = {}

    def feed(self, incoming: pa.RecordBatch) -> None:
        """Takes one of Spark's batches through every step."""
        for produced in self.transform(self.parse(incoming)):
            given = tuple(produced.schema.names)
            for conformed in self.conform(produced):
                self.file(self.check(given, conformed))

    def parse(self, incoming: pa.RecordBatch) -> pa.RecordBatch:
        """The kept headers; the rows a reliable-groups step refused go to the dead letters."""
        kept = dead_letters.filter_headers(incoming, self.options.keep_headers, self.options.drop_headers)
        batch, refused = split_refused(kept)
        for row, rule, reason in refused:
            self.dead_letter(row, rule, reason)
        return batch

    def transform(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        """The transformer's batches (the batch itself without one); the rows it fails on go to the dead letters."""
        if self._transform is None:
            return [batch]
        out, failed = transformer.apply(self._transform, batch)
        self._dead_letters(failed)
        return out

    def conform(self, batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
        """The batch in the table's schema; the rows that do not convert go to the dead letters."""
        b = batch.cast(delta_arrow_schema(batch.schema)) if self.target is None else batch
        # The first batch fixes the schema of a new table for the rest of the task.
        self.target = self.target if self.target is not None else b.schema
        ok, failed = transformer.conform(b, self.target, self.options.merge_schema)
        self._dead_letters(failed)
        yield from ok

    def check(self, given: tuple[str, ...], batch: pa.RecordBatch) -> pa.RecordBatch:
        """The rows that keep the table's rules (filled in: generated, identity, defaults); the others go to the
        dead letters. ``given`` are the columns the rows came with."""
        if not self.rules.rows_checked:
            return batch
        assert self.target is not None, "conform fixed the table's schema"
        if given not in self._checkers:
            self._checkers[given] = RowChecker(self.rules, self.target, given, self.time_zone, self.identity)
        good, broken = self._checkers[given].apply(batch)
        self._dead_letters(broken)
        return good

    def file(self, batch: pa.RecordBatch) -> None:
        """The rows into the task's files and to the side topics."""
        self.files.write(batch)
        self.outputs.side(batch)

    def dead_letter(self, row: pa.RecordBatch | dict[str, Any], rule: str, reason: BaseException | str) -> None:
        """One row split off, with its rule and reason, to the task's dead letters."""
        self.outputs.dead_letter(row, rule, reason)

    def _dead_letters(self, failed: Iterable[transformer.Failure]) -> None:
        for f in failed:
            self.dead_letter(f.row, f.reason, f.error)
