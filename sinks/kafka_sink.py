"""The exactly-once ``lastagent-kafka`` streaming sink: Spark's writer, on both sides.

* ``__init__`` runs on the driver when the query starts, and again (pyspark builds a fresh
  writer) for each epoch's commit / abort. At query start only, it finishes what a crash
  left: open branches of decided epochs are committed and every other open branch of the
  link is rolled back, before any task can reuse their transactional ids.
* ``write`` runs on executors, one Spark task attempt = one branch: a Kafka transaction
  with a bounded transactional.id, flushed and left open (prepared). Its handle is the
  commit message.
* ``commit`` / ``abort`` run on the driver and hand the epoch to :mod:`lastagent.committer`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from lastagent import faults
from lastagent.kafka_xa import BranchHandle, BranchWriter
from lastagent.sinks.kafka_rows import check_schema, records, simple_columns
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions

log = logging.getLogger("lastagent.sink")

BATCH_ID_PROPERTY = "streaming.sql.batchId"  # set by Spark's MicroBatchExecution on every task


@dataclass(frozen=True)
class BranchMessage(WriterCommitMessage):
    """A task's commit message: which epoch and attempt, and its branch handle (JSON).

    ``handle`` is None when the task wrote nothing because its epoch was already decided.
    """

    epoch: int
    partition: int
    attempt: int
    handle: str | None
    records: int = 0


class KafkaStreamWriter(DataSourceStreamArrowWriter):
    """Spark's stream writer for ``lastagent-kafka``.

    Args:
        options: the writeStream options (case-insensitive map from Spark).
        schema: the query's output schema.
    """

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        from lastagent.committer import Committer

        self.options = KafkaSinkOptions.parse(options)
        self.columns = check_schema(schema, self.options.topic)
        self.decided_through = -1
        if building_for_commit():
            # The epoch's branches are prepared and open right now: recovery must not touch them.
            return
        with Committer(self.options) as committer:
            # Driver, at query start: finish decided epochs, roll back the rest; learn the newest
            # decided epoch so re-run tasks of it write nothing.
            self.decided_through = committer.start()

    # -- executor ---------------------------------------------------------------------------

    def write(self, iterator: Iterator[Any]) -> BranchMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        epoch = int(ctx.getLocalProperty(BATCH_ID_PROPERTY) or -1)
        partition, attempt = ctx.partitionId(), ctx.attemptNumber()
        if 0 <= epoch <= self.decided_through:
            # Spark re-runs an epoch whose decision stands (crash after the arbitration commit,
            # before Spark's commit log): its branches exist already; write nothing.
            for _ in iterator:
                pass
            return BranchMessage(epoch, partition, attempt, None)
        tid = self.options.transactional_id(partition, attempt)
        writer = BranchWriter(self.options.client_config, tid, self.options.transaction_timeout_ms)
        try:
            cols, topic = self.columns, self.options.topic
            simple = topic is not None and not (cols.has_partition or cols.has_headers)
            for batch in iterator:
                if simple:
                    keys, values = simple_columns(batch)
                    writer.send_many(topic, keys, values)
                else:
                    for key, value, row_topic, part, headers in records(batch, topic):
                        writer.send(row_topic, value, key, headers, part)
                faults.point("task_mid_write")
            handle = writer.prepare()
        except BaseException:
            # Nothing was reported, so nobody else will end this transaction soon: end it here
            # rather than let it hold the partitions' last stable offset until it times out.
            try:
                writer.abort_local()
            except Exception as exc:  # noqa: BLE001 — the original failure is what matters
                log.warning("branch %s: local abort after a failed write also failed: %s", tid, exc)
            raise
        faults.point("after_prepare")
        return BranchMessage(epoch, partition, attempt, handle.to_json(), handle.records)

    # -- driver -----------------------------------------------------------------------------

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        from lastagent.committer import Committer

        with Committer(self.options) as committer:
            committer.commit(batchId, _handles(messages))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        from lastagent.committer import Committer

        with Committer(self.options) as committer:
            committer.abort(batchId, _handles(messages))


#: pyspark's worker module that builds a fresh writer (through ``streamWriter``) to run each
#: epoch's ``commit`` / ``abort``; tests/unit check that the pinned pyspark still has it.
COMMIT_RUNNER = "pyspark.sql.worker.python_streaming_sink_runner"


def building_for_commit() -> bool:
    """True when Spark builds this writer to run commit/abort, not to start the query."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == COMMIT_RUNNER:
            return True
        frame = frame.f_back
    return False


def _handles(messages: list[WriterCommitMessage | None]) -> list[BranchHandle]:
    return [BranchHandle.from_json(m.handle) for m in messages
            if isinstance(m, BranchMessage) and m.handle is not None]
