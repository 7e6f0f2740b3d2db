"""The epoch two-phase commit and its recovery, as pure rules. Pure: no I/O, runs on the driver.

Events in, actions out (in the manner of h11): the caller reads the arbitration store, the
broker and Spark's checkpoint, passes what it found to a function here, and carries out the
returned actions in order — :class:`WriteDecision` (the last agent's one-phase Delta commit),
:class:`CommitBranch` / :class:`RollbackBranch` (``EndTxn`` commit / abort of one Kafka
transaction) and :class:`Fail` (stop the query with the reason). Nothing here touches Kafka,
Delta or Spark, so the model check in ``tests/unit/test_protocol_model.py`` can run these very
functions against simulated crashes.

Carrying out actions:

* ``WriteDecision`` comes first when present. If the store answers that another decider won
  the epoch, drop the remaining actions and call :func:`decide_epoch` again with the winner's
  branches as ``recorded``.
* ``CommitBranch`` actions may run in parallel, in any order. A branch already committed counts
  as done (``EndOutcome.COMMITTED``); a branch the broker ended otherwise (expired, fenced) is
  the expired-decided hazard: fail naming link, epoch and branch.
* ``RollbackBranch`` actions may run in parallel, after the commits.
* ``Fail`` actions come last: carry out everything before them, then stop the query.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# -- branches and actions -------------------------------------------------------------------


@dataclass(frozen=True)
class Branch:
    """Identity of one branch: the Kafka transaction a task attempt left open.

    The transactional id alone is not enough: a run reuses its ids across its epochs, so the producer id
    and producer epoch of the open transaction tell one transaction of the id from the next.
    """

    transactional_id: str
    producer_id: int
    producer_epoch: int

    @classmethod
    def of(cls, handle: Any) -> Branch:
        """The branch of anything with ``transactional_id``, ``producer_id`` and ``producer_epoch``
        (a ``BranchHandle``, an ``OpenTransaction``)."""
        return cls(str(handle.transactional_id), int(handle.producer_id), int(handle.producer_epoch))


@dataclass(frozen=True)
class WriteDecision:
    """Make the last-agent commit: the arbitration record of ``epoch`` naming ``branches``."""

    epoch: int
    branches: tuple[Branch, ...]


@dataclass(frozen=True)
class CommitBranch:
    """End ``branch`` with commit; it is recorded in ``epoch``'s decision."""

    branch: Branch
    epoch: int


@dataclass(frozen=True)
class RollbackBranch:
    """End ``branch`` with abort; no decision covers it (presumed abort)."""

    branch: Branch


@dataclass(frozen=True)
class Fail:
    """Stop the query: ``reason`` names link, epoch and branch and what to do.

    ``decided`` tells the two cases apart: a branch of a *decided* epoch that can no longer be
    committed (the expired-decided hazard), or an epoch that was *not* decided because one of its
    branches could not be (nothing committed; a restart replays the epoch).
    """

    reason: str
    epoch: int = -1
    branch: Branch | None = None
    decided: bool = True


Action = WriteDecision | CommitBranch | RollbackBranch | Fail


def _unique(branches: Iterable[Branch]) -> list[Branch]:
    return list(dict.fromkeys(branches))


def _finish(epoch: int, recorded: Sequence[Branch], others: Iterable[Branch]) -> list[Action]:
    keep = _unique(recorded)
    kept = set(keep)
    actions: list[Action] = [CommitBranch(b, epoch) for b in keep]
    actions += [RollbackBranch(b) for b in _unique(others) if b not in kept]
    return actions


# -- the epoch --------------------------------------------------------------------------------


def decide_epoch(epoch: int, recorded: Sequence[Branch] | None, prepared: Sequence[Branch],
                 open_branches: Sequence[Branch]) -> list[Action]:
    """The sink's ``commit(messages, epoch)``: decide, then phase 2. Pure: no I/O, runs on the driver.

    Precondition: :func:`recover` has completed since the query started, so no branch of an
    older decided epoch is still open.

    Args:
        epoch: Spark's micro-batch id.
        recorded: the branches of this epoch's arbitration record, or None when it has none.
        prepared: the branches the tasks reported (their commit messages; read-only tasks left out).
        open_branches: every open transaction of the link, as the broker lists it.

    Returns:
        When a record exists it stands: CommitBranch for each recorded branch, then
        RollbackBranch for every other prepared or open branch. Otherwise WriteDecision(epoch,
        prepared), then CommitBranch for each prepared branch, then RollbackBranch for every
        other open branch (failed, lost or superseded task attempts).
    """
    if recorded is not None:
        return _finish(epoch, recorded, [*prepared, *open_branches])
    keep = tuple(_unique(prepared))
    return [WriteDecision(epoch, keep), *_finish(epoch, keep, open_branches)]


def unsafe_branches(prepared: Sequence[Branch], open_now: Mapping[Branch, tuple[int, int]], now_ms: int,
                    margin_ms: int) -> dict[Branch, str]:
    """The prepared branches that may not be decided now, each with why. Pure: no I/O, runs on the driver.

    A decision is a promise to commit every branch it names, and the broker aborts an open branch
    on its own once its ``transaction.timeout.ms`` has passed since the transaction began. So a
    branch may be decided only while the broker still holds this very transaction open and enough
    of its timeout is left for the decision's commit and phase 2 to finish (``margin_ms``).

    Args:
        prepared: the branches the tasks reported (read-only tasks left out).
        open_now: for each branch the broker reports open as the handle names it (same producer
            id and epoch): (its transaction's start time, its timeout), both in ms, the start on
            the broker's clock.
        now_ms: the driver's clock.
        margin_ms: the least time a branch must have left.

    Returns:
        Branch → reason, for every branch not open any more or with less than ``margin_ms`` left;
        empty when the epoch may be decided.
    """
    out: dict[Branch, str] = {}
    for b in _unique(prepared):
        times = open_now.get(b)
        if times is None:
            out[b] = ("is no longer open on the broker (aborted after its transaction timeout, or fenced by a newer "
                      "producer of its transactional id)")
            continue
        started_ms, timeout_ms = times
        left = started_ms + timeout_ms - now_ms
        if left < margin_ms:
            out[b] = (f"has {max(left, 0) / 1000:.1f} s left of its {timeout_ms / 1000:g} s transaction timeout; "
                      f"deciding and finishing it needs at least {margin_ms / 1000:g} s")
    return out


#: The most time a decision keeps in hand before a branch's timeout (see :func:`decision_margin_ms`).
MAX_DECISION_MARGIN_MS = 120_000


def decision_margin_ms(timeout_ms: int) -> int:
    """How much of ``kafka.transaction.timeout.ms`` a branch must have left to be decided. Pure.

    A quarter of the timeout, at most two minutes. What has to fit after the check: the decision's
    Delta commit (seconds, on an object store with its retries) and phase 2, whose ``EndTxn`` to a
    moving coordinator is retried within ``kafka.default.api.timeout.ms`` (60 s by default), plus any
    difference between the driver's clock and the broker's (NTP keeps it to milliseconds). Two
    minutes holds all of that; a quarter keeps short timeouts usable (a 20 s timeout keeps 5 s).
    """
    return min(timeout_ms // 4, MAX_DECISION_MARGIN_MS)


def refuse_epoch(epoch: int, prepared: Sequence[Branch], unsafe: Mapping[Branch, str], *, link: str = "",
                 running_ms: int | None = None, timeout_ms: int = 0) -> list[Action]:
    """An epoch with a branch that may not be decided (:func:`unsafe_branches`): no decision. Pure, driver.

    Presumed abort: with no record the epoch never happened, so every prepared branch is rolled
    back and the query stops; Spark replays the epoch from the same offsets when it restarts.
    Never write a decision that names a branch the broker may already have aborted: that would
    record as committed records that are gone.

    Args:
        epoch: Spark's micro-batch id.
        prepared: the branches the tasks reported.
        unsafe: the branches that may not be decided, with why (non-empty).
        link: the link's name, for the reason.
        running_ms: how long the epoch's oldest open branch has been open, when known.
        timeout_ms: the link's ``kafka.transaction.timeout.ms``.

    Returns:
        RollbackBranch for every prepared branch, then one ``Fail`` (``decided=False``).
    """
    first = next(iter(unsafe))
    why = "; ".join(f"branch {b.transactional_id} {reason}" for b, reason in unsafe.items())
    ran = f"; the epoch's oldest open branch has been open {running_ms / 1000:.1f} s" if running_ms else ""
    reason = (f"link {link!r} epoch {epoch} was not decided: {why}{ran}. Nothing of the epoch was committed and its "
              f"branches were rolled back; restart the query to replay it from the same offsets. An epoch must finish "
              f"well inside kafka.transaction.timeout.ms (now {timeout_ms} ms): raise it (up to the broker's "
              "transaction.max.timeout.ms), or make epochs shorter (maxOffsetsPerTrigger, more partitions)")
    return [*(RollbackBranch(b) for b in _unique(prepared)), Fail(reason, epoch, first, decided=False)]


def sweep(recorded: Sequence[Branch], open_branches: Sequence[Branch],
          decided: Mapping[Branch, int] | None = None) -> list[Action]:
    """After an epoch's phase 2: what is still open of this run (or an earlier one) and not in the
    epoch's record. Pure: no I/O, runs on the driver.

    A run's first epoch is where what earlier runs left is finished: the start only completes
    decided branches (:func:`recover` with ``roll_back_undecided=False``), since an earlier run may
    still be running until this run's claim. An earlier run may also have decided an epoch after
    this run's start read the store, so an open branch of an earlier decision is committed here.

    Args:
        recorded: the branches of the epoch's record (committed by now).
        open_branches: the link's open transactions of this run's generation or earlier ones (a
            newer run's branches are that run's to end, and must not be passed here).
        decided: branch → epoch, for the branches of every kept decision; needed only when an
            open branch is not in ``recorded`` (None: read nothing, roll back every other branch).

    Returns:
        CommitBranch for every other open branch an earlier decision names, RollbackBranch for the
        rest (failed or superseded task attempts, undecided branches of earlier runs).
    """
    kept = set(recorded)
    decided = decided or {}
    others = [b for b in _unique(open_branches) if b not in kept]
    return [*(CommitBranch(b, decided[b]) for b in others if b in decided),
            *(RollbackBranch(b) for b in others if b not in decided)]


def abort_epoch(epoch: int, recorded: Sequence[Branch] | None, open_branches: Sequence[Branch],
                reported: Sequence[Branch] = ()) -> list[Action]:
    """The sink's ``abort(messages, epoch)``. Pure: no I/O, runs on the driver.

    Args:
        epoch: Spark's micro-batch id.
        recorded: the branches of this epoch's arbitration record, or None.
        open_branches: every open transaction of the link, as the broker lists it.
        reported: the branches Spark passed to abort (those tasks that did finish).

    Returns:
        A record stands even on abort: commit its branches and roll back every other one.
        Without a record (presumed abort): RollbackBranch for every reported and open branch.
    """
    if recorded is not None:
        return _finish(epoch, recorded, [*reported, *open_branches])
    return [RollbackBranch(b) for b in _unique([*reported, *open_branches])]


def skip_task(epoch: int, newest_decided_epoch: int) -> bool:
    """True when a task of ``epoch`` must write nothing: Spark re-runs an epoch already decided.

    Pure: no I/O. ``newest_decided_epoch`` is the link's newest decided epoch read at query
    start (-1 for none); the decided epoch's records are already in its recorded branches.
    """
    return epoch <= newest_decided_epoch


# -- recovery --------------------------------------------------------------------------------


def recover(spark_committed_through: int, decisions: Mapping[int, Sequence[Branch]],
            open_branches: Sequence[Branch], committed: Collection[Branch] | None = None, *,
            link: str = "", roll_back_undecided: bool = True) -> list[Action]:
    """Recovery at query start (or from ``lastagent recover``). Pure: no I/O, runs on the driver.

    A sink's start calls it before every epoch's tasks with ``roll_back_undecided=False``;
    :meth:`~lastagent.committer.Committer.claim_and_recover` calls it after a claim. If the
    arbitration cannot be read, do not call it: change nothing and retry at the next start.

    Args:
        spark_committed_through: the newest epoch in Spark's commit log (-1 for none); each of
            those epochs finished phase 2 before Spark logged it.
        decisions: epoch → branches of its arbitration record, for every record still kept.
        open_branches: every open transaction of the link, as the broker lists it.
        committed: the recorded branches of epochs newer than ``spark_committed_through``
            that the broker reports ended *committed* (a describe after a commit whose answer
            was lost). None when the caller cannot tell: those branches are then committed
            again, and an ``EndTxn`` that does not come back as committed is the hazard.
        link: the link's name, for the reasons of Fail actions.
        roll_back_undecided: False at a sink's start, which runs before every epoch and cannot tell
            a new run from the running one: an undecided open branch may belong to an earlier run
            that still runs (until the new run's first tasks claim the link), so only decided
            branches are finished, and :func:`sweep` rolls the rest back after the claim.

    Returns:
        CommitBranch for every open branch recorded in any decision (oldest epoch first);
        RollbackBranch for every other open branch (presumed abort; unless not
        ``roll_back_undecided``); then, for each branch
        recorded by a decision newer than ``spark_committed_through`` that is neither open nor
        in ``committed``: Fail naming link, epoch and transactional id (the broker expired or
        fenced a decided branch) — or, when ``committed`` is None, CommitBranch for it.
    """
    decided_in: dict[Branch, int] = {}
    for epoch in sorted(decisions):
        for b in decisions[epoch]:
            decided_in.setdefault(b, epoch)
    opened = _unique(open_branches)
    open_set = set(opened)
    actions: list[Action] = [CommitBranch(b, decided_in[b])
                             for b in sorted((b for b in opened if b in decided_in), key=lambda b: decided_in[b])]
    if roll_back_undecided:
        actions += [RollbackBranch(b) for b in opened if b not in decided_in]
    fails: list[Action] = []
    for epoch in sorted(e for e in decisions if e > spark_committed_through):
        for b in _unique(decisions[epoch]):
            if b in open_set or decided_in[b] != epoch:
                continue
            if committed is None:
                actions.append(CommitBranch(b, epoch))
            elif b not in committed:
                fails.append(Fail(lost_branch_reason(link, epoch, b), epoch, b))
    return actions + fails


def lost_branch_reason(link: str, epoch: int, branch: Branch, detail: str = "") -> str:
    """The message for a decided branch that cannot be committed any more (the expired-decided hazard)."""
    why = detail or "the broker no longer holds it open and did not commit it (expired after " \
                    "transaction.timeout.ms, or fenced by a new producer of the same id)"
    return (f"link {link!r} epoch {epoch}: decided branch {branch.transactional_id} (producer id "
            f"{branch.producer_id}, epoch {branch.producer_epoch}) was not committed: {why}. Its records are "
            "missing from Kafka although the epoch is recorded as committed. Every start of the link stops here until "
            "an operator decides: re-produce the epoch's records from the source by hand, then accept the loss "
            f"with `lastagent recover --link {link} ... --accept-lost {epoch}` (the link then goes on without "
            "them); and raise kafka.transaction.timeout.ms.")
