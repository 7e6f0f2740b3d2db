"""The driver's side of one link's epochs: decide, phase 2, abort, recovery. Driver side.

The one interpreter of the protocol: the rules live in :mod:`lastagent.core.protocol` (pure); this
module reads the arbitration store, the broker and Spark's checkpoint through three ports
(:class:`~lastagent.core.arbitration.ArbitrationStore`, :class:`~lastagent.core.kafka_port.XAResource`,
:class:`~lastagent.core.checkpoint.CheckpointReader`), feeds what it finds to the rules, and carries
out the actions they return. It builds no port: whoever starts a link wires the adapters
(:func:`lastagent.sinks.link_ports.link_committer` for the sinks and the command, the epoch block its own).
The model check (tests/unit/test_protocol_model.py) runs this very class against in-memory ports
that crash at every call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Generic, Protocol, TypeVar

from lastagent import faults
from lastagent.core import protocol, xid
from lastagent.core.arbitration import ArbitrationRecord, ArbitrationStore, Ownership, require_owner
from lastagent.core.branch_handle import BranchHandle
from lastagent.core.checkpoint import CheckpointReader
from lastagent.core.figures import EpochFigures, EpochTimings, oldest_age_ms
from lastagent.core.kafka_port import EndOutcome, EndResult, OpenTransaction, XAResource
from lastagent.core.protocol import Branch, CommitBranch, RollbackBranch, WriteDecision
from lastagent.errors import ArbitrationError, DecidedBranchLostError, EpochNotDecidedError, LastAgentError, LinkMismatchError, OptionError

log = logging.getLogger("lastagent.core.committer")

#: How often :meth:`Committer.abort` looks for branches that late tasks opened, while it settles.
_SETTLE_POLL_S = 0.25


class LinkSettings(Protocol):
    """What the committer reads of a link's parsed options (either sink's, or the epoch block's)."""

    @property
    def link(self) -> str: ...
    @property
    def checkpoint_location(self) -> str: ...
    @property
    def id_prefix(self) -> str: ...
    @property
    def transaction_timeout_ms(self) -> int: ...
    @property
    def phase2_parallelism(self) -> int: ...
    @property
    def cleanup_every(self) -> int: ...
    @property
    def retention_epochs(self) -> int: ...


#: What the link's store commits beside a record (:data:`lastagent.core.arbitration.Staged_contra`).
Staged = TypeVar("Staged")


class Committer(Generic[Staged]):
    """Runs one link's protocol steps on the driver.

    Args:
        options: the link's parsed options (link, id prefix, timeouts, cleanup).
        store: the arbitration store: a ``lastagent-kafka`` link's arbitration table, the
            ``lastagent-delta`` sink's target table (the last agent), the block's table.
        xa: the Kafka XA resource; None when the link has no Kafka branches.
        checkpoint: Spark's checkpoint.
        now_ms: the clock that branch start times are compared with (the broker's clock, which
            the driver's wall clock stands for); the model check passes its own.
    """

    def __init__(self, options: LinkSettings, store: ArbitrationStore[Staged], xa: XAResource | None,
                 checkpoint: CheckpointReader, now_ms: Callable[[], int] | None = None) -> None:
        self.options = options
        self.link: str = options.link
        self.store: ArbitrationStore[Staged] = store
        self.xa = xa
        self.checkpoint: CheckpointReader = checkpoint
        self.now_ms = now_ms or (lambda: int(time.time() * 1000))
        #: The last epoch this committer decided: how long its decision and phase 2 took (None until
        #: it wrote one). Known only after the record was written, so it goes into the next epoch's.
        self.last_timings: EpochTimings | None = None
        self._decide_ms: int | None = None
        self._phase2_ms = 0

    def __enter__(self) -> Committer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.xa is not None:
            self.xa.close()

    # -- query start ------------------------------------------------------------------------

    def check(self) -> None:
        """Start-of-query checks: the link owns the arbitration table; the timeout fits the broker."""
        self.store.check_link(self.link)
        if self.xa is None:
            return
        protocol_version = self.xa.transaction_protocol()  # refuses a broker that cannot serve us
        log.info("link %s: the broker runs transaction protocol %d", self.link, protocol_version)
        broker_max = self.xa.broker_max_timeout_ms()
        if self.options.transaction_timeout_ms > broker_max:
            raise OptionError(
                "kafka.transaction.timeout.ms",
                f"{self.options.transaction_timeout_ms} exceeds the broker's transaction.max.timeout.ms "
                f"({broker_max}); lower the option or raise the broker setting",
            )

    def start(self, owner: str | None = None) -> tuple[Ownership | None, int]:
        """A sink's start, before every epoch's tasks: checks, and finishes decided branches. Driver.

        pyspark starts a sink's writer before each epoch, and nothing there tells a new run of the
        query from the running one, nor shows that an earlier run has stopped. So the start changes
        nothing an earlier run could still depend on: it claims nothing (a run's first tasks claim
        the link, keyed by Spark's run id: :func:`lastagent.sinks.query_run.task_generation`) and
        rolls nothing back; it only commits the open branches that a kept decision names (and
        stops on a decided branch that is lost: :class:`DecidedBranchLostError`). The undecided
        branches of earlier runs are rolled back after the new run's claim, by its first epoch's
        commit (:func:`lastagent.core.protocol.commit_epoch`).

        Args:
            owner: the Spark query id of the checkpoint; defaults to the one in ``checkpointLocation``.

        Returns:
            (the link's ownership as read, None before any claim; the newest decided epoch or -1):
            re-run tasks of an epoch at or below that epoch write nothing.

        Raises:
            LinkOwnedError: another query owns the link (nothing changed).
        """
        self.check()
        self._check_checkpoint_belongs_here()
        if owner is None:
            owner = self.checkpoint.query_id()
        ownership = self.store.ownership(self.link)
        require_owner(self.link, getattr(self.store, "path", "the arbitration store"), ownership, owner)
        return ownership, self._recover(ownership, roll_back_undecided=False)

    def claim_and_recover(self, owner: str | None = None) -> tuple[Ownership, int]:
        """Claims a new generation, then finishes everything earlier runs left. Driver.

        What a run's claim plus its first epoch's commit do in a query, in one call, for the admin
        command and tests: after the claim no earlier run can decide an epoch, so every open branch
        of earlier generations that no decision names is rolled back (presumed abort).

        Returns:
            (the claimed ownership, the newest decided epoch or -1).
        """
        self.check()
        self._check_checkpoint_belongs_here()
        ownership = self.store.claim(self.link, owner if owner is not None else self.checkpoint.query_id())
        return ownership, self._recover(ownership, roll_back_undecided=True)

    def recover_claimed(self, ownership: Ownership) -> int:
        """After a claim made elsewhere (``lastagent.epoch``'s, through Spark): finishes what earlier runs left,
        decided branches committed and the rest rolled back. Returns the newest decided epoch or -1. Driver."""
        return self._recover(ownership, roll_back_undecided=True)

    def _recover(self, ownership: Ownership | None, roll_back_undecided: bool) -> int:
        """Carries out :func:`lastagent.core.protocol.recover` over the store and the broker; returns the newest decided epoch."""
        latest = self.store.latest_epoch(self.link)
        generation = 0 if ownership is None else ownership.generation
        # A newer generation's branches are its run's; at a start every generation is looked at,
        # but only decided branches are ended.
        open_now = self._open(generation - 1 if roll_back_undecided else None)
        if not open_now and (latest is None or latest <= self.checkpoint.committed_through()):
            # Nothing open, and Spark logged every decided epoch (so its phase 2 finished): the
            # usual start before an epoch, which then reads no decision.
            return -1 if latest is None else latest
        decisions = {r.epoch: r for r in self.store.records(self.link)} if latest is not None else {}
        if latest is not None and latest not in decisions:
            raise ArbitrationError(f"link {self.link!r}: the record of its newest decided epoch {latest} cannot be "
                                   "read; nothing was changed")
        handles = {Branch.of(h): h for r in decisions.values() for h in map(BranchHandle.from_json, r.branches)}
        handles.update((Branch.of(t), t.handle()) for t in open_now)
        actions = protocol.recover(
            self.checkpoint.committed_through(),
            {e: tuple(Branch.of(BranchHandle.from_json(b)) for b in r.branches) for e, r in decisions.items()},
            [Branch.of(t) for t in open_now], roll_back_undecided=roll_back_undecided)
        if actions:
            log.warning("link %s: recovery at start (generation %d): %d branch(es) to commit, %d to roll back",
                        self.link, generation, sum(isinstance(a, CommitBranch) for a in actions),
                        sum(isinstance(a, RollbackBranch) for a in actions))
            faults.point("in_recovery")
            self._carry_out(actions, handles)
        return -1 if latest is None else latest

    def _check_checkpoint_belongs_here(self) -> None:
        """A checkpoint with committed epochs must find its link already owned in this store.

        Otherwise the query was restarted under another ``link`` name or with another arbitration
        store than the one that decided its epochs, and the old link's branches would be left to
        nobody: refuse, naming both. The exception: every committed epoch was decided with nothing
        to write before the store existed (a ``lastagent-delta`` first run on an empty topic), which
        the store has a record of.
        """
        if self.store.ownership(self.link) is not None:
            return
        through = self.checkpoint.committed_through()
        if through >= 0 and self.store.empty_through(self.link) < through:
            where = getattr(self.store, "path", "the arbitration store")
            raise LinkMismatchError(
                f"option 'link': checkpoint {self.options.checkpoint_location} has committed epochs 0..{through}, but "
                f"{where} has never seen link {self.link!r}: the checkpoint was written under another link name or "
                "arbitration table. Restart with the link and arbitrationTable it was started with (they are in "
                "the old query's options), or use a new checkpointLocation for a new link")

    def _open(self, through_generation: int | None = None) -> list[OpenTransaction]:
        """The link's open transactions, of generations up to ``through_generation`` (all when None).

        Ids of another link that shares the prefix are not ours; a newer generation's branches
        belong to a run that superseded this one, and only that run may end them.
        """
        if self.xa is None:
            return []
        out = []
        for t in self.xa.recover(self.options.id_prefix):
            parsed = xid.parse_transactional_id(self.link, t.transactional_id)
            if parsed is not None and (through_generation is None or parsed[0] <= through_generation):
                out.append(t)
        return out

    def in_doubt(self) -> list[tuple[OpenTransaction, str, int]]:
        """Every open branch of the link with the decision recovery would give it.

        Returns:
            (open transaction, "commit" or "rollback", decided epoch or -1) per branch.
        """
        open_now = self._open()
        decided = self._decided() if open_now else {}
        return [(t, "commit" if Branch.of(t) in decided else "rollback", decided.get(Branch.of(t), -1))
                for t in open_now]

    def hazards(self) -> list[dict[str, Any]]:
        """Decided branches the broker ended without committing (expired): never silent.

        Looks at the decided epochs not yet confirmed (newer than the newest record's
        ``confirmed_through``): a recorded branch that is not open and whose transaction the
        broker reports aborted lost its records although its epoch is recorded as committed.
        ``accepted`` says whether an operator accepted that epoch's loss (``--accept-lost``).
        """
        records = self.store.records(self.link)
        accepted = self.store.accepted_lost(self.link) if records else frozenset()
        confirmed = max((r.confirmed_through for r in records), default=-1)
        open_now = {Branch.of(t) for t in self._open()}
        out = []
        for r in records:
            if r.epoch <= confirmed:
                continue
            for h in map(BranchHandle.from_json, r.branches):
                if Branch.of(h) in open_now or h.read_only:
                    continue
                if self._xa().how_ended(h) == "aborted":
                    out.append({"epoch": r.epoch, "transactional_id": h.transactional_id, "producer_id": h.producer_id,
                                "producer_epoch": h.producer_epoch, "records": h.records,
                                "accepted": r.epoch in accepted,
                                "reason": protocol.lost_branch_reason(self.link, r.epoch, Branch.of(h),
                                                                      "the broker aborted it (expired)")})
        return out

    # -- epoch --------------------------------------------------------------------------------

    def commit(self, epoch: int, generation: int, handles: Sequence[BranchHandle],
               staged: Staged | None = None, figures: EpochFigures | None = None) -> ArbitrationRecord:
        """Decides the epoch (last agent), then commits its branches and rolls back the rest. Driver.

        Reads the situation once, before anything changes: the link's open branches of this run's
        generation or earlier ones (one listing, with their start times), and the store's
        decisions when something beyond the prepared branches is open. Then carries out
        :func:`lastagent.core.protocol.commit_epoch`: the decision (or the refusal when a branch is gone
        or too close to its timeout), phase 2 against the record that stands, and whatever failed
        attempts and earlier runs left open.

        ``generation`` is the run's (its tasks carried it in their commit messages): the store
        writes the decision only while it is the link's, atomically with the commit, so a
        superseded run stops here with nothing decided. ``staged`` is what the last agent commits
        beside the record (the ``lastagent-delta`` sink's staged data files); the store drops it if
        another decision already stands. A broker outage after the decision leaves a decided epoch
        that the next start completes.

        ``figures`` are the sink's counts for the record (records per output, dead letters, the
        previous epoch's timings); the committer adds the branches, the oldest branch's age at the
        decision and the transaction timeout. They change nothing of the decision. After a
        decision this committer wrote, :attr:`last_timings` holds its decide and phase-2 times.

        Raises:
            EpochNotDecidedError: a branch was gone or too close to its timeout; nothing was
                decided and the branches were rolled back.
            StaleOwnerError: a newer run owns the link; nothing was decided.
            DecidedBranchLostError: a decided branch could not be committed.
        """
        live = [h for h in handles if not h.read_only]
        prepared = [Branch.of(h) for h in live]
        known = dict(zip(prepared, live))
        open_now = self._open_with(generation, live)
        known.update((Branch.of(t), t.handle()) for t in open_now if Branch.of(t) not in known)
        beyond = {Branch.of(t) for t in open_now} - set(prepared)
        now = self.now_ms()
        actions = protocol.commit_epoch(
            epoch, prepared, {Branch.of(t): (t.started_ms, t.timeout_ms) for t in open_now},
            self._decided() if beyond else {}, now_ms=now,
            timeout_ms=self.options.transaction_timeout_ms, link=self.link)
        started = {Branch.of(t): t.started_ms for t in open_now}
        figures = replace(figures or EpochFigures(),
                          oldest_branch_age_ms=oldest_age_ms([started[b] for b in prepared if b in started], now),
                          transaction_timeout_ms=self.options.transaction_timeout_ms)
        self._decide_ms = None
        record = self._carry_out(actions, known, generation, staged, figures)
        if self._decide_ms is not None:
            self.last_timings = EpochTimings(epoch, self._decide_ms, self._phase2_ms)
        faults.point("after_phase2")
        if epoch % self.options.cleanup_every == 0 and epoch > 0:
            removed = self.store.cleanup(self.link, self.options.retention_epochs)
            if removed:
                log.info("link %s: cleaned up %d confirmed arbitration rows", self.link, removed)
        if record is None:  # commit_epoch always starts with the epoch's decision or refusal
            raise LastAgentError(f"link {self.link!r} epoch {epoch}: the rules named no decision")
        return record

    def _open_with(self, generation: int, live: Sequence[BranchHandle]) -> list[OpenTransaction]:
        """The link's open transactions up to ``generation``, and every one of ``live`` that is open."""
        open_now = self._open(generation)
        listed = {Branch.of(t) for t in open_now}
        if self.xa is not None and any(Branch.of(h) not in listed for h in live):
            # The listing can miss a transaction whose coordinator is moving; its own coordinator cannot.
            wanted = {Branch.of(h) for h in live}
            open_now += [t for t in self.xa.open_among(h for h in live if Branch.of(h) not in listed)
                         if Branch.of(t) in wanted]
        return open_now

    def require_time_left(self, epoch: int, generation: int, handles: Sequence[BranchHandle]) -> None:
        """The rule before a decision made elsewhere (``lastagent.epoch``'s, by the body's Delta write): every
        one of ``handles`` still open with the decision margin of its timeout left. Driver.

        Raises:
            EpochNotDecidedError: a branch is gone or too close to its timeout; the caller rolls back.
        """
        live = [h for h in handles if not h.read_only]
        if not live:
            return
        open_now = self._open_with(generation, live)
        times = {Branch.of(t): (t.started_ms, t.timeout_ms) for t in open_now}
        now = self.now_ms()
        unsafe = protocol.unsafe_branches([Branch.of(h) for h in live], times, now,
                                          protocol.decision_margin_ms(self.options.transaction_timeout_ms))
        if unsafe:
            started = [s for s, _ in times.values()]
            raise EpochNotDecidedError(protocol.not_decided_reason(
                self.link, epoch, unsafe, now - min(started) if started else None,
                self.options.transaction_timeout_ms))

    def end_branches(self, commits: Sequence[CommitBranch], rollbacks: Sequence[RollbackBranch],
                     known: dict[Branch, BranchHandle]) -> None:
        """Phase 2 of a decision that stands elsewhere (``lastagent.epoch``'s record): commits, then rollbacks.

        Raises:
            DecidedBranchLostError: a decided branch could not be committed.
        """
        self._carry_out([*commits, *rollbacks], known)

    def _decided(self) -> dict[Branch, int]:
        """Branch → epoch, for the branches of every decision the store keeps."""
        return {Branch.of(BranchHandle.from_json(b)): r.epoch for r in self.store.records(self.link) for b in r.branches}

    def abort(self, epoch: int, generation: int | None, handles: Sequence[BranchHandle],
              settle_s: float = 0.0) -> None:
        """Spark gave up on the epoch. If it was decided, its record stands; else roll back. Driver.

        Rolled back: the reported branches and the open branches of this run's generation or
        earlier ones; with no report (``generation`` None) only the reported ones, since it is not
        known which run this is. An undecided epoch of a link this query still holds is then
        closed for good (:meth:`_close_run`): the link's next generation is claimed and what the
        run left is finished, and for ``settle_s`` seconds more whatever its late tasks open.

        Args:
            settle_s: how long to keep rolling back branches that the aborted epoch's tasks open
                after this call began (0: not at all; the sinks pass :data:`lastagent.sinks.query_run.LATE_TASKS_S`).
        """
        record = self.store.get(self.link, epoch)
        reported = [h for h in handles if not h.read_only]
        if generation is None and not reported and record is None:
            self._close_run(None, settle_s)
            return
        known = {Branch.of(h): h for h in reported}
        open_now = [] if generation is None else self._open(generation)
        known.update((Branch.of(t), t.handle()) for t in open_now if Branch.of(t) not in known)
        recorded = None
        if record is not None:
            log.warning("link %s epoch %d: abort after the decision; completing the decided epoch", self.link, epoch)
            handles_of_record = [BranchHandle.from_json(b) for b in record.branches]
            known.update((Branch.of(h), h) for h in handles_of_record)
            recorded = [Branch.of(h) for h in handles_of_record]
        self._carry_out(protocol.abort_epoch(epoch, recorded, [Branch.of(t) for t in open_now],
                                             [Branch.of(h) for h in reported]), known)
        if record is None and generation is not None:
            self._close_run(generation, settle_s)

    def _close_run(self, generation: int | None, settle_s: float) -> None:
        """After an undecided epoch's abort, on a link this query holds: claim it, finish what its runs left. Driver.

        Spark aborts an epoch when ``query.stop()`` interrupts it (or a task failed every attempt), and the
        query's run ends there. Its tasks may not have ended: the stop kills them in the JVM, but a Python
        worker that already received its input goes on, opens its branch and prepares it, after the abort
        listed the open transactions (seen with pyspark 4.2: up to 0.3 s after the abort began). Such a
        branch would hold its partitions' last stable offset, so every read_committed reader of the output
        stalls until the query is restarted or ``transaction.timeout.ms`` passes (issue 44). So, as a new
        run would, this claims the link's next generation (no run of an earlier one can decide an epoch
        after that; that also holds when no task reported and the run's generation is unknown), finishes
        what earlier generations left (decided branches committed, the others rolled back), and keeps
        doing so for ``settle_s`` seconds. Nothing happens when the link is another query's, or (with
        ``generation`` known) a newer run of this query holds it.
        """
        if self.xa is None:
            return
        ownership = self.store.ownership(self.link)
        owner = self.checkpoint.query_id()
        if ownership is None or ownership.owner != owner or (generation is not None
                                                             and ownership.generation != generation):
            return
        log.warning("link %s: epoch aborted (query stopped, or a task failed); claiming the link to roll back "
                    "what its tasks left open", self.link)
        claimed, _ = self.claim_and_recover(owner)
        deadline = time.monotonic() + settle_s
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(_SETTLE_POLL_S, left))
            if self._open(claimed.generation - 1):
                self._recover(claimed, roll_back_undecided=True)

    def _xa(self) -> XAResource:
        if self.xa is None:
            raise LastAgentError(f"link {self.link!r}: a Kafka branch to end, but the link has no Kafka options")
        return self.xa

    def _carry_out(self, actions: Sequence[protocol.Action], known: dict[Branch, BranchHandle],
                   generation: int | None = None, staged: Staged | None = None,
                   figures: EpochFigures | None = None) -> ArbitrationRecord | None:
        """The interpreter: carries out the rules' actions in order, through the ports. Driver.

        The decision first (``WriteDecision`` writes it, ``FollowDecision`` reads what stands),
        which resolves ``FinishEpoch`` into commits and rollbacks; then every commit (in parallel),
        then every rollback, then the stop, if any.

        Returns:
            The epoch's standing record, when the actions named a decision.
        """
        standing: ArbitrationRecord | None = None
        refused: protocol.FollowDecision | None = None
        commits: list[CommitBranch] = []
        rollbacks: list[Branch] = []
        for a in actions:
            if isinstance(a, WriteDecision):
                standing = self._write_decision(a, generation, known, staged, figures)
                faults.point("after_arbitration")
            elif isinstance(a, protocol.FollowDecision):
                standing = self.store.get(self.link, a.epoch)
                if standing is None:
                    refused = a
                    log.warning("link %s epoch %d may not be decided; rolling the epoch back", self.link, a.epoch)
                else:
                    log.warning("link %s epoch %d was decided by another run; following that record", self.link,
                                a.epoch)
            elif isinstance(a, protocol.FinishEpoch):
                recorded = [] if standing is None else list(map(BranchHandle.from_json, standing.branches))
                known.update((Branch.of(h), h) for h in recorded)
                commits += [CommitBranch(Branch.of(h), a.epoch) for h in recorded if not h.read_only]
                named = {Branch.of(h) for h in recorded}
                rollbacks += [b for b in a.others if b not in named]
            elif isinstance(a, CommitBranch):
                commits.append(a)
            elif isinstance(a, RollbackBranch):
                rollbacks.append(a.branch)
        phase2_began = time.monotonic()
        if commits:
            results = self._xa().end_all([known[c.branch] for c in commits], commit=True,
                                         parallelism=self.options.phase2_parallelism)
            self._require_committed(results, {c.branch: c.epoch for c in commits})
        if rollbacks:
            log.info("link %s: rolling back %d branch(es) no decision covers", self.link, len(rollbacks))
            self._xa().end_all([known[b] for b in rollbacks], commit=False, parallelism=self.options.phase2_parallelism)
        self._phase2_ms = int((time.monotonic() - phase2_began) * 1000)
        if refused is not None:
            raise EpochNotDecidedError(refused.reason)
        return standing

    def _write_decision(self, decision: WriteDecision, generation: int | None, known: dict[Branch, BranchHandle],
                        staged: Staged | None, figures: EpochFigures | None = None) -> ArbitrationRecord:
        """The last agent's one-phase commit; returns the record that stands (ours, or a racing decider's)."""
        if generation is None:
            raise LastAgentError(f"link {self.link!r} epoch {decision.epoch}: a decision needs the run's generation")
        record = ArbitrationRecord(
            link=self.link, epoch=decision.epoch, gxid=xid.gxid_text(self.link, decision.epoch),
            branches=tuple(known[b].to_json() for b in decision.branches),
            confirmed_through=decision.confirmed_through,
            figures=None if figures is None else replace(figures, branches=len(decision.branches)))
        began = time.monotonic()
        outcome = self.store.decide(record, generation, staged)
        if outcome.won:
            self._decide_ms = int((time.monotonic() - began) * 1000)
        else:
            log.warning("link %s epoch %d was already decided; following that record (%d branches)",
                        self.link, decision.epoch, len(outcome.record.branches))
        return outcome.record

    def _require_committed(self, results: Sequence[EndResult], epoch_of: dict[Branch, int]) -> None:
        """Every decided branch ended committed, or its epoch's loss was accepted by an operator.

        Raises:
            DecidedBranchLostError: a decided branch ended otherwise (expired, fenced), naming link,
                epoch and branch, unless ``lastagent recover --accept-lost <epoch>`` accepted it.
        """
        accepted: frozenset[int] | None = None
        for r in results:
            if r.outcome in (EndOutcome.COMMITTED, EndOutcome.NOTHING_TO_END):
                continue
            h = r.handle
            branch = Branch.of(h)
            epoch = epoch_of.get(branch, -1)
            if accepted is None:
                accepted = self.store.accepted_lost(self.link)
            if epoch in accepted:
                log.warning("link %s epoch %d: decided branch %s was lost (%d records); the operator accepted the loss "
                            "(lastagent recover --accept-lost %d), so the link goes on without it", self.link, epoch,
                            h.transactional_id, h.records, epoch)
                continue
            raise DecidedBranchLostError(protocol.lost_branch_reason(
                self.link, epoch, branch, f"{r.outcome.value} ({h.records} records); {r.detail}"))
