"""The exactly-once ``lastagent-kafka`` streaming sink: Spark's writer, on both sides.

* ``__init__`` runs on the driver before each epoch's tasks, and again (pyspark builds a fresh
  writer from the same options) for each epoch's commit / abort. It only parses and checks:
  it cannot know which of the two it is, so it changes nothing.
* The start is told apart positively: pyspark pickles the writer only to ship it to the tasks,
  which happens before every epoch's tasks (:class:`~lastagent.sinks.query_run.StartsWhenShipped`).
  Before each pickle, the driver checks the link and commits the open branches of decided epochs
  (nothing an earlier run still running could depend on). The pickled writer carries what it read.
* A run's first tasks claim the link's next generation for Spark's run id, once per run
  (:func:`~lastagent.sinks.query_run.task_generation`); the generation names the run's
  transactional ids, reused across its epochs, and its commit messages prove which run they belong to.
* ``write`` runs on executors, one Spark task attempt = one branch: a Kafka transaction
  with a transactional.id named by link, generation, partition and attempt, flushed and left
  open (prepared). Its handle is the commit message.
* ``commit`` / ``abort`` run on the driver and hand the epoch to :mod:`lastagent.core.committer`,
  with the generation the tasks reported; the decision is refused if a newer run owns the link.
"""

from __future__ import annotations

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
from lastagent.sinks.branch_task import write_branch
from lastagent.sinks.epoch_timings import keep_timings, previous_timings
from lastagent.sinks.kafka_rows import check_schema
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions
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
from lastagent.spark_api import StreamWriter, arrow_input, require_arrow_input
from lastagent.storage import require_reachable

if TYPE_CHECKING:
    from collections.abc import Callable

    from lastagent.core.arbitration import Ownership

log = logging.getLogger("lastagent.sink")


@dataclass(frozen=True)
class BranchMessage(WriterCommitMessage):
    """A task's commit message: which epoch and attempt, and its branch handle (JSON).

    ``handle`` is None when the task wrote nothing because its epoch was already decided.
    ``generation`` is the run's, claimed at query start: the driver decides only for it.
    """

    epoch: int
    generation: int
    partition: int
    attempt: int
    handle: str | None
    records: int = 0


class KafkaStreamWriter(StartsWhenShipped, StreamWriter):
    """Spark's stream writer for ``lastagent-kafka``.

    Args:
        options: the writeStream options (case-insensitive map from Spark).
        schema: the query's output schema.
    """

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.options = KafkaSinkOptions.parse(options)
        self.columns = check_schema(schema, self.options.topic)
        self.schema = schema  # pyspark 4.0 hands write() rows: arrow_input makes Arrow of them again
        require_arrow_input(schema)
        self.started: Started | None = None

    def start(self) -> Started:
        """Checks the link and finishes its decided branches (:meth:`Committer.start`). Driver, before each epoch's tasks."""
        from lastagent.sinks.link_ports import link_committer

        require_reachable(self.options.storage, {"arbitrationTable": self.options.arbitration_table,
                                                 "checkpointLocation": self.options.checkpoint_location})
        with link_committer(self.options) as committer:
            require_topics(committer, {"topic": [self.options.topic] if self.options.topic else []})
            owner = committer.checkpoint.query_id()
            ownership, decided_through = committer.start(owner)
        return shipped(ownership, decided_through, owner)

    def _claim(self, owner: str) -> Callable[[str], Ownership]:
        """Claims the link for a run in the arbitration table. Executor, a run's first tasks."""
        from lastagent.delta.arbitration_table import DeltaArbitrationStore

        return lambda run: DeltaArbitrationStore(self.options.arbitration_table, self.options.storage).claim(
            self.options.link, owner, run=run)

    # -- executor ---------------------------------------------------------------------------

    def write(self, iterator: Iterator[Any]) -> BranchMessage:
        from pyspark import TaskContext

        started = require_started(self.started)
        ctx = TaskContext.get()
        assert ctx is not None, "write() runs in a Spark task"
        epoch = task_epoch(ctx)
        partition, attempt = ctx.partitionId(), ctx.attemptNumber()
        generation = task_generation(started, task_run(ctx), self._claim(started.owner))
        if protocol.skip_task(epoch, started.decided_through):
            # Spark re-runs an epoch whose decision stands (crash after the arbitration commit,
            # before Spark's commit log): its branches exist already; write nothing.
            for _ in iterator:
                pass
            return BranchMessage(epoch, generation, partition, attempt, None)
        tid = self.options.transactional_id(generation, partition, attempt)
        handle = write_branch(self.options.client_config, tid, self.options.transaction_timeout_ms,
                              arrow_input(iterator, self.schema), self.options.topic, self.columns)
        faults.point("after_prepare")
        return BranchMessage(epoch, generation, partition, attempt, handle.to_json(), handle.records)

    # -- driver -----------------------------------------------------------------------------

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Driver, once per epoch: decide, then phase 2 (:meth:`Committer.commit`)."""
        from lastagent.sinks.link_ports import link_committer

        msgs = [m for m in messages if isinstance(m, BranchMessage)]
        generation = generation_of(msgs, batchId)
        if generation is None:
            # No task ran: nothing was prepared, so there is nothing to decide (and no sign of
            # which run this is, so nothing else of the link is touched).
            log.info("link %s epoch %d: no task reported; nothing to decide", self.options.link, batchId)
            return
        opts = self.options
        figures = EpochFigures(records=(("kafka", sum(m.records for m in msgs)),),
                               previous=previous_timings(opts.checkpoint_location, opts.link, batchId, opts.storage))
        with link_committer(opts) as committer:
            committer.commit(batchId, generation, _handles(msgs), figures=figures)
            keep_timings(opts.checkpoint_location, opts.link, committer.last_timings, opts.storage)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Driver: Spark gave up on the epoch (:meth:`Committer.abort`)."""
        from lastagent.sinks.link_ports import link_committer

        msgs = [m for m in messages if isinstance(m, BranchMessage)]
        with link_committer(self.options) as committer:
            committer.abort(batchId, generation_of(msgs, batchId), _handles(msgs), settle_s=LATE_TASKS_S)


def _handles(messages: list[BranchMessage]) -> list[BranchHandle]:
    return [BranchHandle.from_json(m.handle) for m in messages if m.handle is not None]
