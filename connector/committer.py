"""The driver's side of one link's epochs: decide, phase 2, abort, recovery. Driver side.

A thin adapter: the rules live in :mod:`lastagent.protocol` (pure); this module reads the
arbitration store and the broker, feeds what it finds to the rules, and carries out the
actions they return against :class:`~lastagent.kafka_xa.KafkaXAResource` and the
arbitration store.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lastagent import faults
from lastagent.arbitration import ArbitrationRecord, DeltaArbitrationStore
from lastagent.errors import LastAgentError, OptionError
from lastagent.kafka_xa import BranchHandle, EndOutcome, EndResult, KafkaXAResource

log = logging.getLogger("lastagent.committer")


class DecidedBranchLostError(LastAgentError):
    """A branch of a decided epoch can no longer be committed (expired or fenced).

    The epoch's Delta/arbitration record says it committed, so its Kafka records are missing:
    the query stops and names link, epoch and branch; nothing is silently dropped.
    """


def spark_committed_through(checkpoint_location: str) -> int:
    """The newest epoch in Spark's commit log (``<checkpoint>/commits/<epoch>``), -1 for none."""
    from pyarrow import fs

    try:
        filesystem, path = fs.FileSystem.from_uri(checkpoint_location)
    except (ValueError, TypeError, OSError):
        filesystem, path = fs.LocalFileSystem(), checkpoint_location
    infos = filesystem.get_file_info(fs.FileSelector(f"{path.rstrip('/')}/commits", allow_not_found=True))
    epochs = [int(i.base_name) for i in infos if i.base_name.isdigit()]
    return max(epochs, default=-1)


class Committer:
    """Runs one link's protocol steps on the driver.

    Args:
        options: the sink's parsed options (link, arbitrationTable, Kafka settings).
        store: the arbitration store; defaults to the Delta table the options name.
        xa: the Kafka XA resource; defaults to one built from the options.
    """

    def __init__(self, options: Any, store: Any = None, xa: KafkaXAResource | None = None) -> None:
        self.options = options
        self.link: str = options.link
        self.store = store or DeltaArbitrationStore(options.arbitration_table)
        self.xa = xa or KafkaXAResource(options.client_config, options.transaction_timeout_ms)

    def __enter__(self) -> "Committer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.xa.close()

    # -- query start ------------------------------------------------------------------------

    def check(self) -> None:
        """Start-of-query checks: the link owns the arbitration table; the timeout fits the broker."""
        self.store.check_link(self.link)
        broker_max = self.xa.broker_max_timeout_ms()
        if self.options.transaction_timeout_ms > broker_max:
            raise OptionError(
                "kafka.transaction.timeout.ms",
                f"{self.options.transaction_timeout_ms} exceeds the broker's transaction.max.timeout.ms "
                f"({broker_max}); lower the option or raise the broker setting",
            )

    def start(self) -> int:
        """Recovery at query start: finishes the newest decided epoch if Spark did not commit it.

        Spark writes its commit log for epoch N only after the sink's commit(N) returned, that
        is after N's phase 2; and it runs N+1's tasks only after that. So when the checkpoint
        lacks N, N's branches may still be open — and no later task has reused their ids yet —
        so they are committed now, before any task starts. A recorded branch that the broker
        already ended otherwise (expired) raises :class:`DecidedBranchLostError`. Open branches
        of undecided epochs are left to the in-flight epoch's commit or abort (presumed abort).

        Returns:
            The newest decided epoch of the link (-1 for none): re-run tasks of an epoch at or
            below it write nothing.
        """
        self.check()
        latest = self.store.latest_epoch(self.link)
        if latest is None:
            return -1
        if spark_committed_through(self.options.checkpoint_location) < latest:
            record = self.store.get(self.link, latest)
            faults.point("in_recovery")
            if record is not None and record.branches:
                log.warning("link %s: epoch %d is decided but not in Spark's commit log; completing its "
                            "%d branch(es)", self.link, latest, len(record.branches))
                self._phase2(record)
        return latest

    def _decided_branches(self, open_ids: set[str]) -> dict[tuple[str, int, int], int]:
        """(transactional id, producer id, epoch) → Spark epoch, for every branch of every kept decision."""
        if not open_ids:
            return {}
        out: dict[tuple[str, int, int], int] = {}
        for record in self.store.records(self.link):
            for text in record.branches:
                h = BranchHandle.from_json(text)
                if h.transactional_id in open_ids:
                    out[(h.transactional_id, h.producer_id, h.producer_epoch)] = record.epoch
        return out

    def in_doubt(self) -> list[tuple[Any, str, int]]:
        """Every open branch of the link with the decision recovery would give it.

        Returns:
            (open transaction, "commit" or "rollback", decided epoch or -1) per branch.
        """
        open_txns = self.xa.recover(self.options.id_prefix)
        decided = self._decided_branches({t.transactional_id for t in open_txns})
        out = []
        for t in open_txns:
            epoch = decided.get((t.transactional_id, t.producer_id, t.producer_epoch), -1)
            out.append((t, "commit" if epoch >= 0 else "rollback", epoch))
        return out

    # -- epoch --------------------------------------------------------------------------------

    def commit(self, epoch: int, handles: Sequence[BranchHandle]) -> ArbitrationRecord:
        """Decides the epoch (last agent), then commits its branches and rolls back the rest."""
        live = [h for h in handles if not h.read_only]
        record = ArbitrationRecord(
            link=self.link, epoch=epoch, gxid=f"{self.link}:{epoch}",
            branches=tuple(h.to_json() for h in live),
            confirmed_through=epoch - 1,  # commit(epoch) runs only after epoch-1's phase 2
        )
        decision = self.store.decide(record)
        if not decision.won:
            log.warning("link %s epoch %d was already decided; following that record (%d branches)",
                        self.link, epoch, len(decision.record.branches))
        faults.point("after_arbitration")
        self._phase2(decision.record)
        faults.point("after_phase2")
        if epoch % self.options.cleanup_every == 0:
            removed = self.store.cleanup(self.link, self.options.retention_epochs)
            if removed:
                log.info("link %s: cleaned up %d confirmed arbitration rows", self.link, removed)
        return decision.record

    def abort(self, epoch: int, handles: Sequence[BranchHandle]) -> None:
        """Spark gave up on the epoch. If it was decided, its record stands; else roll back all."""
        record = self.store.get(self.link, epoch)
        if record is not None:
            log.warning("link %s epoch %d: abort after the decision; completing the decided epoch", self.link, epoch)
            self._phase2(record)
            return
        reported = [h for h in handles if not h.read_only]
        self.xa.end_all(reported, commit=False, parallelism=self.options.phase2_parallelism)
        self._rollback_others(set())

    def _phase2(self, record: ArbitrationRecord) -> None:
        recorded = [BranchHandle.from_json(b) for b in record.branches]
        decided = {(h.transactional_id, h.producer_id, h.producer_epoch): record.epoch for h in recorded}
        results: list[EndResult] = []
        if recorded:
            # One branch first, so a crash test can stop between two branch commits.
            results.append(self.xa.commit(recorded[0]))
            faults.point("between_branch_commits")
        results += self.xa.end_all(recorded[1:], commit=True, parallelism=self.options.phase2_parallelism)
        self._require_committed(results, decided)
        self._rollback_others({h.transactional_id for h in recorded})

    def _rollback_others(self, keep: set[str]) -> None:
        """Rolls back every other open branch of the link (failed or superseded attempts)."""
        others = [t.handle() for t in self.xa.recover(self.options.id_prefix) if t.transactional_id not in keep]
        if others:
            log.info("link %s: rolling back %d branch(es) no decision covers", self.link, len(others))
            self.xa.end_all(others, commit=False, parallelism=self.options.phase2_parallelism)

    def _require_committed(self, results: Sequence[EndResult], decided: dict[tuple[str, int, int], int]) -> None:
        for r in results:
            if r.outcome in (EndOutcome.COMMITTED, EndOutcome.NOTHING_TO_END):
                continue
            h = r.handle
            epoch = decided.get((h.transactional_id, h.producer_id, h.producer_epoch), -1)
            raise DecidedBranchLostError(
                f"link {self.link!r} epoch {epoch}: decided branch {h.transactional_id} (producer id "
                f"{h.producer_id}, epoch {h.producer_epoch}, {h.records} records) was not committed: "
                f"{r.outcome.value}. {r.detail}. Its records are missing from Kafka although the epoch is "
                "recorded as committed; raise kafka.transaction.timeout.ms, and re-produce the epoch from "
                "the source (needs a deterministic query) or repair by hand (lastagent recover)."
            )
