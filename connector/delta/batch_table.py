"""A ``lastagent.epoch`` link's table, read as the arbitration store: what the block and the command read.

Driver side (the block) or wherever ``lastagent status`` / ``recover`` runs. The block's decisions are the
records in the user's own Delta commits (``userMetadata``, :class:`lastagent.core.batch_epoch.BatchRecord`),
its generations the table's ``txn`` versions under ``lastagent/<link>/g<G>`` (:mod:`lastagent.core.batch_epoch`);
every commit is Spark's. So this store reads (through Delta Kernel: :mod:`lastagent.delta.snapshot`) and writes
nothing: the one write the command would make, the claim that fences a running query before it rolls back, is an
empty append through Spark's Delta writer (lastagent's own commits do not write the tables this path exists for),
so the command refuses it by name.
"""

from __future__ import annotations

from typing import Any

from lastagent.core import batch_epoch as be
from lastagent.core.arbitration import ArbitrationRecord, Decision, Ownership
from lastagent.core.branch_handle import BranchHandle
from lastagent.delta.snapshot import Snapshot, read_snapshot
from lastagent.errors import LastAgentError
from lastagent.storage import StorageConfig, location

#: How many of the table's newest commits the block searches for records and claims.
HISTORY_DEPTH = 200

_NO_CLAIM = ("a lastagent.epoch link is fenced by its own query: its run's claim is a commit through Spark's "
             "Delta writer, which this command does not have. Stop the query and start it again: its first "
             "epoch finishes the link (branches a record names committed, the rest rolled back)")


def is_batch_link(table: Snapshot | None, link: str) -> bool:
    """Whether ``table`` holds a ``lastagent.epoch`` link named ``link``: its first claim put
    ``txn(lastagent/<link>/g0)`` there."""
    return table is not None and table.app_version(be.app_id(link, 0)) is not None


class BatchEpochTable:
    """The Delta table a ``lastagent.epoch`` block decides in: its ``txn`` versions, history, records and claims.

    Implements the read side of :class:`lastagent.core.arbitration.ArbitrationStore` for ``lastagent status`` and
    ``recover``, and for the block's recovery after its claim (the sinks' ``Committer``); ``claim``, ``decide`` and
    ``accept_lost`` refuse (see the module's docstring).

    Args:
        depth: how many of the newest commits the records are read from (None: all the log keeps). The block
            reads :data:`HISTORY_DEPTH`, so that a run's start does not grow with the link's age; the command all.
    """

    def __init__(self, path: str, storage: StorageConfig | None = None, option: str = "table",
                 depth: int | None = None) -> None:
        self.storage = storage or StorageConfig()
        self.depth = depth
        self._where = location(path, option)
        self._records: dict[str, list[ArbitrationRecord]] = {}  # the command reads them several times

    def table(self) -> Snapshot | None:
        """The table at its newest version, or None when there is no Delta table at the path.

        Raises:
            ArbitrationError: it cannot be read.
        """
        return read_snapshot(self._where, self.storage)

    def require(self) -> Snapshot:
        """The table at its newest version; raises when there is none at the path."""
        table = self.table()
        if table is None:
            raise LastAgentError(f"no Delta table at {self._where.given}")
        return table

    @staticmethod
    def txns(table: Snapshot, link: str) -> dict[str, int]:
        """App id → ``txn`` version, for every generation of ``link`` from 0 up to the first one not there."""
        out: dict[str, int] = {}
        while True:  # a few generations per read of the log, until one is not there
            apps = [be.app_id(link, g) for g in range(len(out), len(out) + 8)]
            for app, version in zip(apps, table.app_versions(apps)):
                if version is None:
                    return out
                out[app] = int(version)

    @staticmethod
    def history(table: Snapshot, depth: int | None = HISTORY_DEPTH) -> list[dict[str, Any]]:
        """The newest ``depth`` commits' commit info (None: all the log keeps), newest first."""
        return table.commits(depth)

    @staticmethod
    def commits_since(table: Snapshot, version: int) -> list[be.Commit]:
        """The commits after ``version`` (each commit's version, operation and user metadata), oldest first."""
        newer = table.version - version
        if newer <= 0:
            return []
        return [be.Commit(int(c["version"]), str(c.get("operation") or ""), c.get("userMetadata"))
                for c in reversed(table.commits(newer))]

    # -- the store port, read side ------------------------------------------------------------------------

    def records(self, link: str) -> list[ArbitrationRecord]:
        """Every decision of ``link`` in the kept history, oldest first, as the committer reads records.

        The block finishes an epoch's branches before its next epoch starts, and a run that cannot finish them
        stops; so every record but the newest is confirmed (``confirmed_through``). Read once per instance."""
        if link in self._records:
            return self._records[link]
        table = self.table()
        if table is None:
            return []
        found: dict[int, tuple[be.BatchRecord, int]] = {}
        for commit in self.history(table, depth=self.depth):
            r = be.record_in(commit.get("userMetadata"), link)
            if r is not None and r.epoch not in found:
                found[r.epoch] = (r, int(commit.get("timestamp") or 0))
        epochs = sorted(found)
        confirmed = epochs[-2] if len(epochs) > 1 else -1
        self._records[link] = [
            ArbitrationRecord(link, e, f"{link}:{e}", tuple(BranchHandle(b.transactional_id, b.producer_id,
                                                                         b.producer_epoch, 1).to_json()
                                                             for b in found[e][0].branches), found[e][1], confirmed)
            for e in epochs]
        return self._records[link]

    def get(self, link: str, epoch: int) -> ArbitrationRecord | None:
        return next((r for r in self.records(link) if r.epoch == epoch), None)

    def latest_epoch(self, link: str) -> int | None:
        table = self.table()
        if table is None:
            return None
        # Read to a depth, the store knows the decisions within it only: a txn version beyond them has no record here.
        decided = ([] if self.depth is not None else
                   [v for v in be.link_txns(link, self.txns(table, link)).values() if v < be.FENCED])
        epochs = [r.epoch for r in self.records(link)] + decided
        return max(epochs) if epochs else None

    def ownership(self, link: str) -> Ownership | None:
        """The generation that holds the link (from the ``txn`` versions) and the run whose claim made it."""
        table = self.table()
        if table is None:
            return None
        txns = self.txns(table, link)
        if not txns:
            return None
        generation = be.current_generation(link, txns)
        runs = [c.run for c in (be.claim_in(m.get("userMetadata"), link) for m in self.history(table))
                if c is not None and c.fenced + 1 == generation]
        # The newest claim of that generation is the one that won (a lost claim made no commit).
        return Ownership("", generation, runs[0] if runs else "", ())

    def figures(self, link: str, last: int) -> list[tuple[int, int, Any]]:
        """The block records no figures: (epoch, decided at, None) for the newest ``last`` decisions."""
        return [(r.epoch, r.decided_at_ms, None) for r in self.records(link)[-max(0, last):]] if last > 0 else []

    def size(self) -> tuple[int, int]:
        """No arbitration table of its own: the records are in the user's commits."""
        return 0, 0

    def accepted_lost(self, link: str) -> frozenset[int]:
        return frozenset()

    def empty_through(self, link: str) -> int:
        return -1

    def check_link(self, link: str) -> None:
        return None

    def cleanup(self, link: str, retain_epochs: int) -> int:
        return 0

    # -- what only a run of the query writes --------------------------------------------------------------

    def claim(self, link: str, owner: str, *, takeover: bool = False, run: str = "") -> Ownership:
        raise LastAgentError(f"link {link!r}: rolling back by hand is not offered here: {_NO_CLAIM}")

    def decide(self, record: ArbitrationRecord, generation: int, staged: None = None) -> Decision:
        raise LastAgentError(f"link {record.link!r}: a lastagent.epoch link is decided by the block's own Delta write")

    def accept_lost(self, link: str, epoch: int) -> None:
        raise LastAgentError(f"link {link!r}: --accept-lost is not offered for a lastagent.epoch link yet: the "
                             "record of the acceptance would be a commit through Spark's Delta writer")

    def close(self) -> None:
        return None
