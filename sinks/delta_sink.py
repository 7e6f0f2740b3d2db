"""The ``lastagent-delta`` streaming sink: a Delta table as the last agent, with Kafka side outputs.

* ``__init__`` runs on the driver at query start and again for each epoch's commit: it only
  parses the options. The start runs when the writer is pickled to ship it to an epoch's tasks
  (before every epoch; see :mod:`lastagent.sinks.query_run`): it reads the table's schema, checks the query
  against it and commits the Kafka side-output branches of decided epochs (nothing an earlier run
  still running could depend on: it claims nothing and rolls nothing back).
* A run's first tasks claim the link's next generation for Spark's run id, once per run, in the
  table's properties; that epoch's commit then rolls back what earlier runs left undecided and
  deletes the data files no decision references.
* ``write`` runs on executors, one task attempt at a time, and feeds the task's row chain
  (:class:`lastagent.sinks.row_chain.RowChain`: parse, transform, conform, check against the table's
  row rules worked out at start by :mod:`lastagent.delta.features`, dead letters, file): parquet
  files under the table root (physical names for a column-mapped table; not yet visible), side-topic
  and dead-letter records in a Kafka branch flushed and left open (prepared). The commit message
  holds the files' add actions and the branch handle.
* ``commit`` runs on the driver: one Delta commit with every add action, ``txn(link, epoch)``
  and the arbitration record decides the epoch; the Kafka branches commit after it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import WriterCommitMessage
from pyspark.sql.types import StructType

from lastagent import faults
from lastagent.core import protocol
from lastagent.core.branch_handle import BranchHandle
from lastagent.core.figures import EpochFigures
from lastagent.delta.features import TableRules
from lastagent.delta.files import FileWriter, arrow_schema, delta_arrow_schema, delta_schema_json, physical_fields
from lastagent.delta.target_table import StagedEpoch, TargetTableStore, schema_diff, schema_error
from lastagent.groups.refusals import strip_refusal_columns
from lastagent.sinks import transformer
from lastagent.sinks.delta_sink_options import DeltaSinkOptions
from lastagent.sinks.epoch_timings import keep_timings, previous_timings
from lastagent.sinks.query_run import (
    LATE_TASKS_S,
    Started,
    StartsWhenShipped,
    generation_of,
    require_started,
    require_topics,
    shipped,
    task_epoch,
    task_generation,
    task_run,
)
from lastagent.sinks.row_chain import RowChain
from lastagent.sinks.table_rows import IdentityValues
from lastagent.sinks.task_outputs import TaskOutputs
from lastagent.spark_api import StreamWriter, arrow_input, require_arrow_input
from lastagent.storage import require_reachable

if TYPE_CHECKING:
    from lastagent.delta.snapshot import Snapshot

log = logging.getLogger("lastagent.delta")


@dataclass(frozen=True)
class DeltaMessage(WriterCommitMessage):
    """A task's commit message: its data files (add actions, JSON) and its Kafka branch handle."""

    epoch: int
    generation: int
    partition: int
    attempt: int
    adds: tuple[str, ...]
    schema_json: str | None
    handle: str | None
    rows: int = 0
    dead_letters: int = 0
    dead_letter_adds: tuple[str, ...] = ()
    first_of_run: bool = False  # the task's run claimed the link in this epoch
    rules: TableRules = TableRules()  # what the task did to the rows, for the table as read at the epoch's start


class DeltaStreamWriter(StartsWhenShipped, StreamWriter):
    """Spark's stream writer for ``lastagent-delta``.

    Args:
        options: the writeStream options (case-insensitive map from Spark).
        schema: the query's output schema.
    """

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.options = DeltaSinkOptions.parse(options)
        self.schema = schema  # pyspark 4.0 hands write() rows: arrow_input makes Arrow of them again
        require_arrow_input(schema)
        # The refusal columns of lastagent.reliable_groups go to the dead letters, never to the table.
        self.query_schema_json = strip_refusal_columns(schema.json())
        self.table_schema_json: str | None = None
        # What the tasks do to each row for the table's features (constraints, generated columns, column mapping).
        self.rules = TableRules()
        # An existing table's partition columns win; the option only shapes a table we create.
        self.partition_by: tuple[str, ...] = self.options.partition_by
        self.started: Started | None = None
        if self.options.transformer:
            transformer.load(self.options.transformer)  # fail at start, naming the option

    def start(self) -> Started:
        """Checks the table and finishes decided side-output branches (:meth:`Committer.start`). Driver, before each epoch's tasks."""
        from lastagent.sinks.link_ports import link_committer

        opts = self.options
        require_reachable(opts.storage, {"path": opts.path, "checkpointLocation": opts.checkpoint_location,
                                         "deadLetterTable": opts.dead_letter_table})
        store = self._store()
        table = store.table()
        store.check_dead_letter_table()
        if table is not None:
            self.table_schema_json = table.schema_json
            self.rules = self._rules(store, table)
            existing = table.partition_columns
            if self.options.partition_by and tuple(self.options.partition_by) != existing:
                from lastagent.errors import OptionError

                raise OptionError("partitionBy", f"{list(self.options.partition_by)} differs from the partition "
                                                 f"columns of Delta table {self.options.path}: {list(existing)}")
            self.partition_by = existing
            if not self.options.transformer:
                problems, _ = schema_diff(self.table_schema_json, self.query_schema_json, self.options.merge_schema)
                if problems:
                    raise schema_error(self.options.path, problems)
        if not self.options.transformer:
            columns = [f["name"] for f in json.loads(self.query_schema_json)["fields"]]
            generated = {g.column for g in self.rules.generated}
            unknown = [c for c in self.partition_by if c not in columns and c not in generated]
            if unknown:
                from lastagent.errors import OptionError

                raise OptionError("partitionBy", f"column(s) {unknown} are not among the query's columns {columns}")
        with link_committer(self.options, store=store) as committer:
            if committer.xa is not None:
                require_topics(committer, {"deadLetterTopic": [t for t in [self.options.dead_letter_topic] if t],
                                           "sideTopics": list(self.options.side_topics)})
            owner = committer.checkpoint.query_id()
            ownership, decided_through = committer.start(owner)
        if decided_through >= 0:
            # Only the newest decided epoch can miss its dead-letter commit (epochs run one by one).
            store.complete_dead_letters(self.options.link, decided_through)
        # Files of undecided epochs are removed only after this run's claim (see commit): until then
        # an earlier run may still be about to commit its own.
        return shipped(ownership, decided_through, owner)

    def _rules(self, store: TargetTableStore, table: Snapshot) -> TableRules:
        """The table's rules for the tasks, or an error at start naming what the sink cannot write. Driver.

        Raises:
            UnsupportedTableFeatureError: a feature the sink does not write (``delta_features``).
            UnsupportedExpressionError: a constraint or generation expression outside the subset
                the executors evaluate as Spark does.
            OptionError: mergeSchema on a column-mapped table; a NOT NULL column the query lacks.
        """
        from lastagent.errors import OptionError

        rules = store.rules(table)
        if rules.kernel:
            store.require_kernel_writes(table)
        if rules.constraints or rules.generated or rules.defaults:
            from lastagent.delta.expressions import check_supported

            # The driver's start cannot see Spark's session time zone; it checks as for UTC, and a task in
            # another zone refuses an expression that depends on it before writing a row.
            arrow = delta_arrow_schema(arrow_schema(table.schema_json))
            for c in rules.constraints:
                check_supported(c.sql, arrow, f"CHECK constraint '{c.name}' of Delta table {self.options.path}")
            for g in rules.generated:
                check_supported(g.sql, arrow, f"generated column '{g.column}' of Delta table {self.options.path}",
                                column=g.column)
            for d in rules.defaults:
                check_supported(d.sql, arrow, f"DEFAULT of column '{d.column}' of Delta table {self.options.path}")
        if rules.column_mapping != "none" and self.options.merge_schema:
            raise OptionError("mergeSchema", f"Delta table {self.options.path} uses column mapping (mode "
                                             f"{rules.column_mapping}); new columns would need physical names and ids, "
                                             "which lastagent does not assign. Add the columns with ALTER TABLE ... ADD "
                                             "COLUMNS and drop mergeSchema")
        if not self.options.transformer:
            given = {f["name"] for f in json.loads(self.query_schema_json)["fields"]}
            named = [i.column for i in rules.identity if i.column in given]
            if named:
                from lastagent.errors import SchemaMismatchError

                raise SchemaMismatchError(
                    f"Delta table {self.options.path}: column(s) {named} are identity columns (GENERATED ... AS "
                    "IDENTITY): lastagent-delta assigns their values and does not write values a query gives; leave "
                    "them out of the query. Nothing was claimed or written")
            filled = ({g.column for g in rules.generated} | {d.column for d in rules.defaults}
                      | {i.column for i in rules.identity})
            missing = [c for c in rules.not_null if "." not in c and c not in given and c not in filled]
            if missing:
                raise schema_error(self.options.path, [f"column '{c}' is NOT NULL in the table and the query does "
                                                       "not give it" for c in missing])
        return rules

    def _store(self) -> TargetTableStore:
        return TargetTableStore(self.options.path, self.options.partition_by, self.options.merge_schema,
                                None if self.options.transformer else self.query_schema_json,
                                self.options.checkpoint_location, self.options.dead_letter_table, self.options.storage)

    # -- executor ---------------------------------------------------------------------------

    def write(self, iterator: Iterator[Any]) -> DeltaMessage:
        from pyspark import TaskContext

        started = require_started(self.started)
        ctx = TaskContext.get()
        assert ctx is not None, "write() runs in a Spark task"
        epoch = task_epoch(ctx)
        partition, attempt = ctx.partitionId(), ctx.attemptNumber()
        run = task_run(ctx)
        generation = task_generation(started, run, lambda r: self._store().claim(self.options.link, started.owner,
                                                                                 run=r))
        first = run != started.run  # the run's first epoch: the commit removes what earlier runs left
        if protocol.skip_task(epoch, started.decided_through):
            for _ in iterator:  # the epoch's decision stands: write nothing
                pass
            return DeltaMessage(epoch, generation, partition, attempt, (), None, None, first_of_run=first)
        opts = self.options
        faults.point("before_files")
        target = None
        if self.table_schema_json is not None:  # no Delta library on executors
            target = delta_arrow_schema(arrow_schema(self.table_schema_json))
        physical = None
        if self.rules.column_mapping != "none":
            assert target is not None and self.table_schema_json is not None, "column mapping: the table exists"
            physical = physical_fields(target, self.table_schema_json)
        files = FileWriter(opts.path, opts.link, generation, epoch, partition, attempt, self.partition_by,
                           opts.target_file_bytes, storage=opts.storage, physical=physical)
        outputs = TaskOutputs(opts, epoch, generation, partition, attempt)
        # Spark passes its SQL settings to a query's tasks; expressions that depend on the time zone
        # are evaluated only when it is UTC (an unknown zone refuses them).
        chain = RowChain(opts, self.rules, target, files, outputs,
                         IdentityValues(self.rules.identity, partition) if self.rules.identity else None,
                         ctx.getLocalProperty("spark.sql.session.timeZone") or "unknown")
        try:
            for incoming in arrow_input(iterator, self.schema):
                chain.feed(incoming)
                faults.point("task_mid_write")
            adds = files.close()
            table_adds = outputs.table_adds()
            handle = outputs.prepare()
        except BaseException:
            # Nothing was reported: remove this attempt's files and end its branch here.
            try:
                files.discard()
                outputs.abort()
            except Exception as exc:  # the original failure is what matters
                log.warning("epoch %d task %d.%d: cleanup after a failed write also failed: %s",
                            epoch, partition, attempt, exc)
            raise
        faults.point("after_files")
        schema_json = delta_schema_json(delta_arrow_schema(files.schema)) if files.schema is not None else None
        return DeltaMessage(epoch, generation, partition, attempt, tuple(json.dumps(a) for a in adds),
                            schema_json,
                            None if handle is None else handle.to_json(), files.rows, outputs.dead,
                            tuple(json.dumps(a) for a in table_adds), first_of_run=first, rules=self.rules)

    # -- driver -----------------------------------------------------------------------------

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        from lastagent.errors import EpochNotDecidedError
        from lastagent.sinks.link_ports import link_committer

        msgs = [m for m in messages if isinstance(m, DeltaMessage)]
        generation = generation_of(msgs, batchId)
        if generation is None:
            log.info("link %s epoch %d: no task reported; nothing to decide", self.options.link, batchId)
            return
        staged = self._staged(msgs)
        store = self._store()
        opts = self.options
        handles = _handles(msgs)
        figures = EpochFigures(records=(("kafka", sum(h.records for h in handles)), ("table", sum(m.rows for m in msgs))),
                               dead_letters=sum(m.dead_letters for m in msgs),
                               previous=previous_timings(opts.checkpoint_location, opts.link, batchId, opts.storage))
        with link_committer(self.options, store=store) as committer:
            try:
                committer.commit(batchId, generation, handles, staged=staged, figures=figures)
            except EpochNotDecidedError:
                store.discard(staged)  # no decision names these files; the replayed epoch writes its own
                raise
            keep_timings(opts.checkpoint_location, opts.link, committer.last_timings, opts.storage)
        faults.point("before_dead_letter_table")
        store.complete_dead_letters(self.options.link, batchId)
        if any(m.attempt > 0 or m.first_of_run for m in msgs):
            # Spark retried a task (the failed attempts' files are orphans), or this is the first
            # epoch since this run claimed the link: no earlier run can commit files any more, so
            # what they left of undecided epochs is removed. No task runs between epochs.
            store.sweep(self.options.link, batchId, generation)
        rows, dead = sum(m.rows for m in msgs), sum(m.dead_letters for m in msgs)
        log.info("link %s epoch %d: committed %d rows in %d files to %s; %d dead letters", self.options.link,
                 batchId, rows, len(staged.adds), self.options.path, dead)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        from lastagent.sinks.link_ports import link_committer

        msgs = [m for m in messages if isinstance(m, DeltaMessage)]
        store = self._store()
        with link_committer(self.options, store=store) as committer:
            committer.abort(batchId, generation_of(msgs, batchId), _handles(msgs), settle_s=LATE_TASKS_S)
        if store.get(self.options.link, batchId) is None:
            store.discard(self._staged(msgs, check=False))

    def _staged(self, msgs: list[DeltaMessage], check: bool = True) -> StagedEpoch:
        """The epoch's files; tasks that disagree on the schema fail the epoch before any commit."""
        schemas = {m.schema_json for m in msgs if m.schema_json is not None}
        staged = StagedEpoch(tuple(json.loads(a) for m in msgs for a in m.adds), next(iter(schemas), None),
                             tuple((m.partition, m.attempt) for m in msgs if m.adds or m.dead_letter_adds),
                             tuple(json.loads(a) for m in msgs for a in m.dead_letter_adds),
                             # The driver's writer for the commit is a fresh one: the rules come from the tasks.
                             next((m.rules for m in msgs if m.adds), TableRules()))
        if check and len(schemas) > 1:
            first, *rest = schemas
            problems = [p for other in rest for p in schema_diff(first, other, False)[0]]
            if problems:
                TargetTableStore(self.options.path, storage=self.options.storage).discard(staged)
                raise schema_error(self.options.path, problems)
        return staged


def _handles(messages: list[DeltaMessage]) -> list[BranchHandle]:
    return [BranchHandle.from_json(m.handle) for m in messages if m.handle is not None]
