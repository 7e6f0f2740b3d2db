"""The ``lastagent-delta`` streaming sink: a Delta table as the last agent, with Kafka side outputs.

* ``__init__`` runs on the driver at query start and again for each epoch's commit: it only
  parses the options. The start runs when the writer is pickled to ship it to an epoch's tasks
  (before every epoch; see :mod:`lastagent.sinks.query_run`): it reads the table's schema, checks the query
  against it and commits the Kafka side-output branches of decided epochs (nothing an earlier run
  still running could depend on: it claims nothing and rolls nothing back).
* A run's first tasks claim the link's next generation for Spark's run id, once per run, in the
  table's properties; that epoch's commit then rolls back what earlier runs left undecided and
  deletes the data files no decision references.
* ``write`` runs on executors, one task attempt at a time: headers filter, transformer, cast to
  the table's schema, the table's row rules (generated columns, NOT NULL, CHECK constraints:
  :mod:`lastagent.sinks.table_rows`, worked out at start by :mod:`lastagent.sinks.delta_features`,
  which refuses a feature the sink does not write), parquet files under the table root (physical
  names for a column-mapped table; not yet visible), side-topic and
  dead-letter records in a Kafka branch flushed and left open (prepared). The commit message
  holds the files' add actions and the branch handle.
* ``commit`` runs on the driver: one Delta commit with every add action, ``txn(link, epoch)``
  and the arbitration record decides the epoch; the Kafka branches commit after it.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from lastagent import faults, protocol
from lastagent.kafka_xa import BranchHandle, BranchWriter, RecordTooLarge, TransactionFailed
from lastagent.refusals import split_refused, strip_refusal_columns
from lastagent.sinks import dead_letters, transformer
from lastagent.sinks.delta_commit import StagedEpoch, TargetTableStore, schema_diff, schema_error
from lastagent.sinks.delta_features import TableRules
from lastagent.sinks.delta_files import FileWriter, delta_arrow_schema, physical_fields
from lastagent.sinks.delta_sink_options import DeltaSinkOptions
from lastagent.sinks.query_run import (
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
from lastagent.sinks.table_rows import RowChecker
from lastagent.storage import require_reachable

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


def _delta_schema_json(schema: pa.Schema) -> str:
    from deltalake import Schema

    return Schema.from_arrow(delta_arrow_schema(schema)).to_json()


def side_record(marks: list[tuple[int, int, int]], topics: tuple[str, ...], index: int) -> tuple[int, str] | None:
    """(row, side topic) of the branch's record ``index``, or None if it is no side record. Pure.

    Side records run in order, row by row and for each row topic by topic, from each mark
    (branch index, row, topic offset); a mark is set where that order breaks (a new batch, a record
    that went to the dead letters instead). Records between marks that are not side records (dead
    letters) are looked up elsewhere, before this.
    """
    at = bisect.bisect_right(marks, index, key=lambda mark: mark[0]) - 1
    if at < 0 or not topics:
        return None
    first, row, offset = marks[at]
    k = offset + index - first
    return row + k // len(topics), topics[k % len(topics)]


class _Outputs:
    """One task attempt's Kafka side outputs and dead letters, in one lazily started branch. Executor."""

    #: Dead-letter table rows buffered before they are written to a file (bounded memory).
    TABLE_CHUNK = 1000

    def __init__(self, options: DeltaSinkOptions, epoch: int, generation: int, partition: int, attempt: int) -> None:
        self.options, self.epoch = options, epoch
        self.task = f"{partition}.{attempt}"
        self.tid = options.transactional_id(generation, partition, attempt)
        self.branch: BranchWriter | None = None
        self.dead = 0
        # Which record of the branch is which, to name a record the broker refuses later (its delivery
        # report has only the branch's index): side records run in order (row by row, topic by topic)
        # from each mark (branch index, row, topic offset); dead letters are listed by branch index.
        self._side_rows = 0
        self._marks: list[tuple[int, int, int]] = []
        self._dead_at: dict[int, int] = {}
        self.table_files = (FileWriter(options.dead_letter_table, options.link, generation, epoch, partition, attempt,
                                       storage=options.storage, option="deadLetterTable")
                            if options.dead_letter_table else None)
        self._table_rows: list[dict[str, Any]] = []

    def _writer(self) -> BranchWriter:
        if self.branch is None:
            self.branch = BranchWriter(self.options.client_config, self.tid, self.options.transaction_timeout_ms)
        return self.branch

    def side(self, batch: pa.RecordBatch) -> None:
        """Every delivered row, as JSON, to every side topic; a row too large goes to the dead letters."""
        if not self.options.side_topics or batch.num_rows == 0:
            return
        writer = self._writer()
        self._marks.append((writer.records, self._side_rows, 0))
        for row in batch.to_pylist():
            value, key = dead_letters.row_json(row), row.get("key")
            key = key.encode() if isinstance(key, str) else key if isinstance(key, bytes) else None
            for i, topic in enumerate(self.options.side_topics):
                try:
                    writer.send(topic, value, key)
                except RecordTooLarge as exc:
                    self.dead_letter(row, "record-too-large", f"side topic {topic}: {exc}")
                    self._marks.append((writer.records, self._side_rows, i + 1))
                except TransactionFailed as exc:
                    raise self._refused_later(exc) from None
            self._side_rows += 1

    def position(self, index: int | None) -> str:
        """Which output a record of the branch is, by its index there (no contents)."""
        topics = self.options.side_topics
        if index is None:
            return "a record of the task's branch"
        if index in self._dead_at:
            return (f"dead letter #{self._dead_at[index]} of task {self.task} (option deadLetterTopic: "
                    f"{self.options.dead_letter_topic})")
        found = side_record(self._marks, topics, index)
        if found is None:
            return f"record #{index} of the task's branch"
        row, topic = found
        return f"the side-topic record of row #{row} of task {self.task}'s rows (option sideTopics: {topic})"

    def _refused_later(self, exc: TransactionFailed) -> TransactionFailed:
        """The error for a side-topic or dead-letter record the broker refused: the task fails.

        Such a record cannot be routed to the dead letters after the fact. The broker's refusal
        arrives as a delivery report, after the record was added to the task's Kafka transaction,
        and it fails that whole transaction: librdkafka drops every record of it and refuses new
        ones until it is aborted, so every side-topic and dead-letter record of the task goes with
        it. Only a record the client refuses at once (larger than ``kafka.message.max.bytes``) is
        left out alone and goes to the dead letters.
        """
        if not (exc.refused or exc.failed or exc.dropped):
            return exc  # not a refusal (a flush that timed out, say): its own message says it all
        records = "; ".join(f"{self.position(r.index)} ({r.topic}"
                            + (f" partition {r.partition}" if r.partition is not None else "")
                            + f", {r.key}, {r.size} bytes): {r.text} ({r.error})" for r in exc.refused)
        what = (f"the broker refused {max(exc.failed, len(exc.refused))} Kafka record(s) of the task: {records}"
                if records else "the task's Kafka transaction failed (see the branch's error at the end)")
        return TransactionFailed(
            f"link {self.options.link} epoch {self.epoch} task {self.task}: {what}. A record the "
            "broker refuses cannot go to the dead letters: the refusal fails the task's whole Kafka transaction "
            "(every side-topic and dead-letter record of the task is dropped with it), so the task fails. Only "
            "records the client refuses at once go to the dead letters: set kafka.message.max.bytes and "
            "kafka.batch.size at or below the topic's max.message.bytes (options sideTopics / deadLetterTopic), "
            f"or raise the topic's limit, or fix the record. Nothing was committed for this batch. ({exc})",
            exc.refused, exc.failed, exc.dropped, exc.aborted)

    def dead_letter(self, row: pa.RecordBatch | dict[str, Any], reason: str, error: BaseException | str) -> None:
        """Sends one record to the dead-letter topic, or fails the batch naming the record."""
        if isinstance(row, pa.RecordBatch):
            row = row.to_pylist()[0]
        where = dead_letters.describe(row)
        # The full text goes with the dead letter only; logs and errors show what cannot quote the record.
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        shown = dead_letters.shown_error(error)
        opts = self.options
        if not (opts.dead_letter_topic or opts.dead_letter_table):
            raise dead_letters.DeadLetterError(
                f"{where} failed ({reason}: {shown}) in task {self.task}, and no dead-letter target is configured; "
                "set option deadLetterTopic (or deadLetterTable) to route such records, or fix the record. Nothing "
                "was committed for this batch")
        key, value, headers = dead_letters.dead_letter(row, reason, text, opts.link, self.epoch)
        refused = ""
        if opts.dead_letter_topic:
            last: Exception | None = None
            for _ in range(opts.dead_letter_attempts):
                try:
                    index = self._writer().records
                    self._writer().send(opts.dead_letter_topic, value, key, headers)
                    self._dead_at[index] = self.dead
                    self.dead += 1
                    log.warning("link %s epoch %d: %s sent to dead-letter topic %s (%s: %s)", opts.link,
                                self.epoch, where, opts.dead_letter_topic, reason, shown[:300])
                    return
                except TransactionFailed as exc:  # an earlier record failed the branch: nothing more goes in
                    raise self._refused_later(exc) from None
                except Exception as exc:  # retried, then the next target in the chain
                    last = exc
            refused = (f"dead-letter topic {opts.dead_letter_topic} did not take it after "
                       f"{opts.dead_letter_attempts} attempt(s): {last}")
        if self.table_files is None:
            raise dead_letters.DeadLetterError(f"{where} failed ({reason}: {shown}) in task {self.task}, and "
                                               f"{refused}; nothing was committed for this batch")
        # The next link of the chain: a row for the dead-letter table, committed after the epoch's decision.
        self._table_rows.append(dead_letters.table_row(key, value, headers))
        self.dead += 1
        log.warning("link %s epoch %d: %s goes to dead-letter table %s (%s: %s)%s", opts.link, self.epoch, where,
                    opts.dead_letter_table, reason, shown[:300], f"; {refused}" if refused else "")
        if len(self._table_rows) >= self.TABLE_CHUNK:
            self._flush_table_rows()

    def _flush_table_rows(self) -> None:
        if self._table_rows and self.table_files is not None:
            self.table_files.write(pa.RecordBatch.from_pylist(self._table_rows, schema=dead_letters.TABLE_SCHEMA))
            self._table_rows = []

    def table_adds(self) -> list[dict[str, Any]]:
        """Closes the dead-letter table's files; their add actions (empty without that table)."""
        if self.table_files is None:
            return []
        self._flush_table_rows()
        return self.table_files.close()

    def prepare(self) -> BranchHandle | None:
        if self.branch is None:
            return None
        try:
            handle = self.branch.prepare()
        except TransactionFailed as exc:
            raise self._refused_later(exc) from None
        self.branch.release()  # the transaction stays open (prepared); only the driver ends it
        return handle

    def abort(self) -> None:
        if self.table_files is not None:
            self.table_files.discard()
        if self.branch is not None:
            self.branch.abort_local()


class DeltaStreamWriter(StartsWhenShipped, DataSourceStreamArrowWriter):
    """Spark's stream writer for ``lastagent-delta``.

    Args:
        options: the writeStream options (case-insensitive map from Spark).
        schema: the query's output schema.
    """

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.options = DeltaSinkOptions.parse(options)
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
        from lastagent.committer import Committer

        opts = self.options
        require_reachable(opts.storage, {"path": opts.path, "checkpointLocation": opts.checkpoint_location,
                                         "deadLetterTable": opts.dead_letter_table})
        store = self._store()
        table = store.table()
        store.check_dead_letter_table()
        if table is not None:
            self.table_schema_json = table.schema().to_json()
            self.rules = self._rules(store, table)
            existing = tuple(table.metadata().partition_columns)
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
        with Committer(self.options, store=store) as committer:
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

    def _rules(self, store: TargetTableStore, table: Any) -> TableRules:
        """The table's rules for the tasks, or an error at start naming what the sink cannot write. Driver.

        Raises:
            UnsupportedTableFeatureError: a feature the sink does not write (``delta_features``).
            UnsupportedExpressionError: a constraint or generation expression outside the subset
                the executors evaluate as Spark does.
            OptionError: mergeSchema on a column-mapped table; a NOT NULL column the query lacks.
        """
        from lastagent.errors import OptionError

        rules = store.rules(table)
        if rules.constraints or rules.generated:
            from lastagent.sinks.delta_expressions import check_supported

            # The driver's start cannot see Spark's session time zone; it checks as for UTC, and a task in
            # another zone refuses an expression that depends on it before writing a row.
            arrow = delta_arrow_schema(pa.schema(table.schema().to_arrow()))
            for c in rules.constraints:
                check_supported(c.sql, arrow, f"CHECK constraint '{c.name}' of Delta table {self.options.path}")
            for g in rules.generated:
                check_supported(g.sql, arrow, f"generated column '{g.column}' of Delta table {self.options.path}",
                                column=g.column)
        if rules.column_mapping != "none" and self.options.merge_schema:
            raise OptionError("mergeSchema", f"Delta table {self.options.path} uses column mapping (mode "
                                             f"{rules.column_mapping}); new columns would need physical names and ids, "
                                             "which lastagent does not assign. Add the columns with ALTER TABLE ... ADD "
                                             "COLUMNS and drop mergeSchema")
        if not self.options.transformer:
            given = {f["name"] for f in json.loads(self.query_schema_json)["fields"]}
            generated = {g.column for g in rules.generated}
            missing = [c for c in rules.not_null if "." not in c and c not in given and c not in generated]
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
        fn = transformer.load(opts.transformer) if opts.transformer else None
        target = None
        if self.table_schema_json is not None:
            from deltalake import Schema

            target = delta_arrow_schema(pa.schema(Schema.from_json(self.table_schema_json).to_arrow()))
        physical = None
        if self.rules.column_mapping != "none":
            assert target is not None and self.table_schema_json is not None, "column mapping: the table exists"
            physical = physical_fields(target, self.table_schema_json)
        # One checker per set of columns the rows carry (a transformer may vary it): a generated
        # column the rows lack is computed, one they carry is checked.
        checkers: dict[tuple[str, ...], RowChecker] = {}
        # Spark passes its SQL settings to a query's tasks; expressions that depend on the time zone
        # are evaluated only when it is UTC (an unknown zone refuses them).
        time_zone = ctx.getLocalProperty("spark.sql.session.timeZone") or "unknown"
        files = FileWriter(opts.path, opts.link, generation, epoch, partition, attempt, self.partition_by,
                           opts.target_file_bytes, storage=opts.storage, physical=physical)
        outputs = _Outputs(opts, epoch, generation, partition, attempt)
        try:
            for incoming in iterator:
                kept = dead_letters.filter_headers(incoming, opts.keep_headers, opts.drop_headers)
                batch, refused = split_refused(kept)
                for row, rule, reason in refused:
                    outputs.dead_letter(row, rule, reason)
                out = [batch]
                if fn is not None:
                    out, failed = transformer.apply(fn, batch)
                    for f in failed:
                        outputs.dead_letter(f.row, f.reason, f.error)
                for produced in out:
                    b = produced.cast(delta_arrow_schema(produced.schema)) if target is None else produced
                    # The first batch fixes the schema of a new table for the rest of the task.
                    target = target if target is not None else b.schema
                    ok, failed = transformer.conform(b, target, opts.merge_schema)
                    for f in failed:
                        outputs.dead_letter(f.row, f.reason, f.error)
                    for conformed in ok:
                        good = conformed
                        if self.rules.rows_checked:
                            given = tuple(b.schema.names)
                            if given not in checkers:
                                checkers[given] = RowChecker(self.rules, target, given, time_zone)
                            good, broken = checkers[given].apply(conformed)
                            for f in broken:
                                outputs.dead_letter(f.row, f.reason, f.error)
                        files.write(good)
                        outputs.side(good)
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
        schema_json = _delta_schema_json(files.schema) if files.schema is not None else None
        return DeltaMessage(epoch, generation, partition, attempt, tuple(json.dumps(a) for a in adds),
                            schema_json,
                            None if handle is None else handle.to_json(), files.rows, outputs.dead,
                            tuple(json.dumps(a) for a in table_adds), first_of_run=first, rules=self.rules)

    # -- driver -----------------------------------------------------------------------------

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        from lastagent.committer import Committer, EpochNotDecidedError

        msgs = [m for m in messages if isinstance(m, DeltaMessage)]
        generation = generation_of(msgs, batchId)
        if generation is None:
            log.info("link %s epoch %d: no task reported; nothing to decide", self.options.link, batchId)
            return
        staged = self._staged(msgs)
        store = self._store()
        with Committer(self.options, store=store) as committer:
            try:
                committer.commit(batchId, generation, _handles(msgs), staged=staged)
            except EpochNotDecidedError:
                store.discard(staged)  # no decision names these files; the replayed epoch writes its own
                raise
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
        from lastagent.committer import Committer

        msgs = [m for m in messages if isinstance(m, DeltaMessage)]
        store = self._store()
        with Committer(self.options, store=store) as committer:
            committer.abort(batchId, generation_of(msgs, batchId), _handles(msgs))
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
