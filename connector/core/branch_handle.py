"""A prepared branch's handle: the task's commit message, and what any process needs to end the branch.

Pure data, written by a task (:meth:`lastagent.kafka.branch.BranchWriter.prepare`), carried to the driver in
Spark's commit message, and kept as JSON in the arbitration record that decides its epoch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class BranchHandle:
    """What any process needs to finish a prepared branch; the task's commit message.

    Carries no payload and no secrets: only ids, counts and partitions.

    Attributes:
        transactional_id: the branch's Kafka transactional.id (one per task partition and attempt of a run).
        producer_id: the producer id that holds the open transaction.
        producer_epoch: the producer epoch of the open transaction.
        records: how many records the branch wrote; 0 means read-only (nothing to finish).
        partitions: the topic partitions the transaction touched.
    """

    transactional_id: str
    producer_id: int
    producer_epoch: int
    records: int
    partitions: tuple[tuple[str, int], ...] = ()

    @property
    def read_only(self) -> bool:
        """XA's XA_RDONLY: the branch wrote nothing, so there is no transaction to end."""
        return self.records == 0

    def to_json(self) -> str:
        return json.dumps({
            "tid": self.transactional_id, "pid": self.producer_id, "epoch": self.producer_epoch,
            "records": self.records, "partitions": [list(tp) for tp in self.partitions],
        }, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BranchHandle:
        d = json.loads(text)
        return cls(d["tid"], int(d["pid"]), int(d["epoch"]), int(d["records"]),
                   tuple((str(t), int(p)) for t, p in d.get("partitions", [])))
