"""The Kafka port: what the committer asks of the broker's transactions, and what it gets back. Pure.

:class:`XAResource` is the port (the X/Open XA resource manager's verbs over Kafka's transaction
coordinator); :class:`lastagent.kafka.xa.KafkaXAResource` is its adapter, and the model check
(tests/unit/test_protocol_model.py) its in-memory stand-in.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from lastagent.core.branch_handle import BranchHandle


class EndOutcome(enum.Enum):
    """How ending one branch turned out, as the protocol core needs to know it."""

    COMMITTED = "committed"  # this call, or an earlier one (a retry recognised as done)
    ROLLED_BACK = "rolled_back"
    NOTHING_TO_END = "nothing_to_end"  # read-only branch
    #: Asked to commit, but the broker ended the transaction otherwise (expired after its
    #: timeout, or fenced by a new producer of the same id). A hazard for a decided epoch.
    NOT_COMMITTED = "not_committed"
    #: Asked to roll back, but the transaction was committed (XA's heuristic commit).
    HEURISTIC_COMMIT = "heuristic_commit"


@dataclass(frozen=True)
class EndResult:
    """One branch end: the outcome and the broker's words for it."""

    handle: BranchHandle
    outcome: EndOutcome
    detail: str = ""


@dataclass(frozen=True)
class OpenTransaction:
    """An open transaction the broker reports for a link's id prefix (recovery input)."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    state: str
    started_ms: int
    timeout_ms: int
    partitions: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    def handle(self) -> BranchHandle:
        """The handle to finish it; records unknown, so counted as one (not read-only)."""
        return BranchHandle(self.transactional_id, self.producer_id, self.producer_epoch, 1, self.partitions)


class XAResource(Protocol):
    """The XA resource port: what the committer needs from Kafka. Driver side."""

    def transaction_protocol(self) -> int:
        """The broker's transaction protocol (2: KIP-890, else 1); raises for a broker that cannot serve us."""
        ...

    def broker_max_timeout_ms(self) -> int:
        """The broker's ``transaction.max.timeout.ms``."""
        ...

    def missing_topics(self, topics: Iterable[str]) -> list[str]:
        """Topics that do not exist and will not be created on first write."""
        ...

    def commit(self, handle: BranchHandle) -> EndResult:
        """Ends one branch with commit; a branch already committed counts as done."""
        ...

    def rollback(self, handle: BranchHandle) -> EndResult:
        """Ends one branch with abort; a branch already rolled back counts as done."""
        ...

    def end_all(self, handles: Iterable[BranchHandle], commit: bool, parallelism: int = 8) -> list[EndResult]:
        """Ends many branches (phase 2), results in the order given."""
        ...

    def recover(self, transactional_id_prefix: str) -> list[OpenTransaction]:
        """Every open transaction whose id starts with the prefix, as the broker lists it."""
        ...

    def open_among(self, handles: Iterable[BranchHandle]) -> list[OpenTransaction]:
        """The handles' transactions still open, asked of each id's own coordinator (never a listing)."""
        ...

    def how_ended(self, handle: BranchHandle) -> str:
        """"committed", "aborted", "open" or "unknown", from the broker, without side effects."""
        ...

    def close(self) -> None:
        """Frees connections."""
        ...
