"""The checkpoint port: what the committer reads from Spark's checkpoint (the query's id and its commit log). Pure.

Its adapter, :class:`lastagent.spark_checkpoint.SparkCheckpoint`, reads the checkpoint location outside Spark;
the epoch block's (:class:`lastagent.foreach_batch.BlockCheckpoint`) answers from the batch in hand.
"""

from __future__ import annotations

from typing import Protocol


class CheckpointReader(Protocol):
    """The checkpoint port: what the committer reads from Spark's checkpoint."""

    def committed_through(self) -> int:
        """The newest epoch in the commit log, -1 for none."""
        ...

    def query_id(self) -> str:
        """Spark's id of the query that owns the checkpoint."""
        ...
