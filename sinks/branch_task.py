"""One Spark task's Kafka branch: the task's Arrow batches written into a transaction left prepared. Executor.

The one branch-writing function of ``lastagent-kafka``'s sink and of ``lastagent.epoch``'s ``to_kafka``: both
write a task's rows as Spark's ``kafka`` sink takes them (:mod:`lastagent.sinks.kafka_rows`) into one
transaction, flush it, capture its handle and leave it open for the driver to end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from lastagent import faults
from lastagent.core.branch_handle import BranchHandle
from lastagent.kafka.branch import BranchWriter
from lastagent.kafka.config import KafkaConfig
from lastagent.sinks.kafka_rows import SinkColumns, records, simple_columns

log = logging.getLogger("lastagent.sink")


def write_branch(client: KafkaConfig, transactional_id: str, timeout_ms: int, batches: Iterable[Any],
                 topic: str | None, columns: SinkColumns) -> BranchHandle:
    """Writes every record of ``batches`` (Arrow record batches) into one prepared branch; returns its handle.

    A task whose write fails ends its transaction here (nothing was reported, so nobody else would end it
    soon, and it would hold its partitions' last stable offset until it times out), then raises. Executor.

    Args:
        client: the Kafka client settings.
        transactional_id: the branch's id (:mod:`lastagent.core.xid`).
        timeout_ms: the transaction's ``transaction.timeout.ms``.
        batches: the task's rows as Arrow record batches, in the columns ``columns`` names.
        topic: the ``topic`` option (it wins over a ``topic`` column), or None.
        columns: which of the sink's columns the rows have (:func:`lastagent.sinks.kafka_rows.check_schema`).
    """
    writer = BranchWriter(client, transactional_id, timeout_ms)
    try:
        simple = topic is not None and not (columns.has_partition or columns.has_headers)
        for batch in batches:
            if simple and topic is not None:
                keys, values = simple_columns(batch)
                writer.send_columns(topic, keys, values)
            else:
                for key, value, row_topic, part, headers in records(batch, topic):
                    writer.send(row_topic, value, key, headers, part)
            faults.point("task_mid_write")
        handle = writer.prepare()
        writer.release()  # the transaction stays open (prepared); only the driver ends it
    except BaseException:
        try:
            writer.abort_local()
        except Exception as exc:  # the original failure is what matters
            log.warning("branch %s: local abort after a failed write also failed: %s", transactional_id, exc)
        raise
    return handle
