"""One task's Kafka outputs of a ``lastagent-delta`` link: side topics and the dead-letter chain. Executor side.

Every delivered row goes, as JSON, to each side topic; a record that cannot be delivered goes down
the dead-letter chain (topic, then table, then a failed batch). Both Kafka outputs share the task's
one branch, started on first use, flushed and left open (prepared) at the end of the task, so they
commit in the same epoch as the table's data (after the Delta commit) or not at all. A record the
broker refuses later, in a delivery report, is named by its position in the branch
(:func:`side_record`, :meth:`TaskOutputs.position`), never by its contents.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import pyarrow as pa

from lastagent.core.branch_handle import BranchHandle
from lastagent.delta import dead_letter_table
from lastagent.delta.files import FileWriter
from lastagent.errors import DeadLetterError, RecordTooLarge, TransactionFailed
from lastagent.kafka.branch import BranchWriter
from lastagent.sinks import dead_letters
from lastagent.sinks.delta_sink_options import DeltaSinkOptions

log = logging.getLogger("lastagent.delta")


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


class TaskOutputs:
    """One task attempt's Kafka side outputs and dead letters, in one lazily started branch. Executor.

    The dead-letter chain (:meth:`dead_letter`): the dead-letter topic, tried
    ``deadLetterAttempts`` times inside the task's branch; then the dead-letter table, whose files
    commit after the epoch's decision; then the batch fails, naming the record. Nothing is dropped.
    """

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
            raise DeadLetterError(
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
            raise DeadLetterError(f"{where} failed ({reason}: {shown}) in task {self.task}, and "
                                               f"{refused}; nothing was committed for this batch")
        # The next link of the chain: a row for the dead-letter table, committed after the epoch's decision.
        self._table_rows.append(dead_letter_table.table_row(key, value, headers))
        self.dead += 1
        log.warning("link %s epoch %d: %s goes to dead-letter table %s (%s: %s)%s", opts.link, self.epoch, where,
                    opts.dead_letter_table, reason, shown[:300], f"; {refused}" if refused else "")
        if len(self._table_rows) >= self.TABLE_CHUNK:
            self._flush_table_rows()

    def _flush_table_rows(self) -> None:
        if self._table_rows and self.table_files is not None:
            self.table_files.write(pa.RecordBatch.from_pylist(self._table_rows, schema=dead_letter_table.TABLE_SCHEMA))
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
