"""The epoch two-phase commit and its recovery, as pure rules. Pure: no I/O, runs on the driver.

Events in, actions out (in the manner of h11): the caller reads the arbitration store, the
broker and Spark's checkpoint, passes what it found to a function here, and carries out the
returned actions in order — :class:`WriteDecision` (the last agent's one-phase Delta commit) or
:class:`FollowDecision`, :class:`FinishEpoch` (phase 2 against the record that stands),
:class:`CommitBranch` / :class:`RollbackBranch` (``EndTxn`` commit / abort of one Kafka
transaction). Nothing here touches Kafka, Delta or Spark, so the model check in
``tests/unit/test_protocol_model.py`` runs these very functions, through the real interpreter
(:class:`lastagent.core.committer.Committer`), against simulated crashes.

Carrying out actions, in the order given:

* ``WriteDecision`` (the last agent's one-phase commit) or ``FollowDecision`` (the epoch may
  not be decided here) comes first. Either way the interpreter learns the epoch's *standing
  record*: the store keeps the first record of an epoch, so a decider that lost a race gets the
  winner's; ``FollowDecision`` reads any record another decider wrote.
* ``FinishEpoch`` is phase 2 against the standing record: commit every branch it names, roll
  back the others. With no standing record (a ``FollowDecision`` found none) nothing of the
  epoch was decided: every branch is rolled back and the query stops with the reason.
* ``CommitBranch`` actions may run in parallel, in any order. A branch already committed counts
  as done (``EndOutcome.COMMITTED``); a branch the broker ended otherwise (expired, fenced) is
  the expired-decided hazard: fail naming link, epoch and branch.
* ``RollbackBranch`` actions may run in parallel, after the commits.
* Only then does the query stop, if it must (an undecided epoch, a lost decided branch).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# -- branches and actions -------------------------------------------------------------------


@dataclass(frozen=True)
class Branch:
    """Identity of one branch: the Kafka transaction a task attempt left open.

    The transactional id names the run, the task and the attempt, not the epoch; an id lives on
    past its transaction (a retried EndTxn, a describe), so the producer id and producer epoch of
    the open transaction tell this transaction of the id from any other.
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
    """Make the last-agent commit: the arbitration record of ``epoch`` naming ``branches``.

    ``confirmed_through`` goes into the record: every epoch up to it finished phase 2 (the
    decision of ``epoch`` is made only after ``epoch - 1``'s phase 2), so cleanup may drop them.
    """

    epoch: int
    branches: tuple[Branch, ...]
    confirmed_through: int = -1


@dataclass(frozen=True)
class FollowDecision:
    """The epoch may not be decided here (``reason``, first about ``branch``): follow any standing record.

    Another decider may have decided the epoch already; its record then stands and
    :class:`FinishEpoch` completes it. Without one, nothing of the epoch was decided.
    """

    epoch: int
    reason: str
    branch: Branch | None = None


@dataclass(frozen=True)
class FinishEpoch:
    """Phase 2 of ``epoch``: commit every branch of its standing record, roll back each of ``others`` it does not name.

    With no standing record (after a :class:`FollowDecision` that found none) every one of
    ``others`` is rolled back and the query stops with the FollowDecision's reason.
    """

    epoch: int
    others: tuple[Branch, ...]


@dataclass(frozen=True)
class CommitBranch:
    """End ``branch`` with commit; it is recorded in ``epoch``'s decision."""

    branch: Branch
    epoch: int


@dataclass(frozen=True)
class RollbackBranch:
    """End ``branch`` with abort; no decision covers it (presumed abort)."""

    branch: Branch


Action = WriteDecision | FollowDecision | FinishEpoch | CommitBranch | RollbackBranch


def _unique(branches: Iterable[Branch]) -> list[Branch]:
    return list(dict.fromkeys(branches))


def _finish(epoch: int, recorded: Sequence[Branch], others: Iterable[Branch]) -> list[Action]:
    keep = _unique(recorded)
    kept = set(keep)
    actions: list[Action] = [CommitBranch(b, epoch) for b in keep]
    actions += [RollbackBranch(b) for b in _unique(others) if b not in kept]
    return actions


# -- the epoch --------------------------------------------------------------------------------


def commit_epoch(epoch: int, prepared: Sequence[Branch], open_now: Mapping[Branch, tuple[int, int]],
                 decided: Mapping[Branch, int], *, now_ms: int, timeout_ms: int, link: str = "") -> list[Action]:
    """The sink's ``commit(messages, epoch)``: decide, phase 2, and what earlier attempts left. Pure, driver.

    The whole situation at once, read before anything changes: what the tasks prepared, what the
    broker holds open, what the store has decided. An epoch is decided only if the broker still
    holds each prepared branch open with enough of its timeout left (:func:`unsafe_branches`): a
    decision never names a branch the broker may already have aborted.

    Precondition: this run holds the link (its tasks claimed it), so no earlier run can decide an
    epoch any more, and every open branch of this run's generation or an earlier one that no
    decision names is presumed aborted.

    Args:
        epoch: Spark's micro-batch id.
        prepared: the branches the tasks reported (their commit messages; read-only tasks left out).
        open_now: every open transaction of the link of this run's generation or earlier ones (a
            newer run's branches are that run's to end), as the broker lists it: (its start on the
            broker's clock, its timeout), in ms.
        decided: branch → epoch for the branches of every kept decision; may be left empty when
            every open branch is a prepared one.
        now_ms: the driver's clock.
        timeout_ms: the link's ``kafka.transaction.timeout.ms``.
        link: the link's name, for the reason of a refusal.

    Returns:
        ``WriteDecision(epoch, prepared, epoch - 1)``, or ``FollowDecision`` naming why the epoch may
        not be decided; then ``FinishEpoch`` with every other open branch no decision names (failed,
        lost or superseded task attempts, and undecided branches of earlier runs); then
        ``CommitBranch`` for each open branch an earlier decision names (an earlier run may have
        decided after this run's start read the store).
    """
    keep = tuple(_unique(prepared))
    unsafe = unsafe_branches(keep, open_now, now_ms, decision_margin_ms(timeout_ms))
    first: Action
    if unsafe:
        started = [open_now[b][0] for b in keep if b in open_now]
        running_ms = now_ms - min(started) if started else None
        first = FollowDecision(epoch, not_decided_reason(link, epoch, unsafe, running_ms, timeout_ms), next(iter(unsafe)))
    else:
        first = WriteDecision(epoch, keep, epoch - 1)
    kept = set(keep)
    others = [b for b in _unique(open_now) if b not in kept]
    return [first, FinishEpoch(epoch, (*keep, *(b for b in others if b not in decided))),
            *(CommitBranch(b, decided[b]) for b in others if b in decided)]


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


def not_decided_reason(link: str, epoch: int, unsafe: Mapping[Branch, str], running_ms: int | None,
                       timeout_ms: int) -> str:
    """Why an epoch was not decided, and what to do (:class:`FollowDecision`'s reason)."""
    why = "; ".join(f"branch {b.transactional_id} {reason}" for b, reason in unsafe.items())
    ran = f"; the epoch's oldest open branch has been open {running_ms / 1000:.1f} s" if running_ms else ""
    return (f"link {link!r} epoch {epoch} was not decided: {why}{ran}. Nothing of the epoch was committed and its "
            f"branches were rolled back; restart the query to replay it from the same offsets. An epoch must finish "
            f"well inside kafka.transaction.timeout.ms (now {timeout_ms} ms): raise it (up to the broker's "
            "transaction.max.timeout.ms), or make epochs shorter (maxOffsetsPerTrigger, more partitions)")


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
            open_branches: Sequence[Branch], *, roll_back_undecided: bool = True) -> list[Action]:
    """Recovery at query start (or from ``lastagent recover``). Pure: no I/O, runs on the driver.

    A sink's start calls it before every epoch's tasks with ``roll_back_undecided=False``;
    :meth:`~lastagent.core.committer.Committer.claim_and_recover` calls it after a claim. If the
    arbitration cannot be read, do not call it: change nothing and retry at the next start.

    Args:
        spark_committed_through: the newest epoch in Spark's commit log (-1 for none); each of
            those epochs finished phase 2 before Spark logged it.
        decisions: epoch → branches of its arbitration record, for every record still kept.
        open_branches: every open transaction of the link, as the broker lists it.
        roll_back_undecided: False at a sink's start, which runs before every epoch and cannot tell
            a new run from the running one: an undecided open branch may belong to an earlier run
            that still runs (until the new run's first tasks claim the link), so only decided
            branches are finished, and the new run's first :func:`commit_epoch` rolls the rest back.

    Returns:
        CommitBranch for every open branch recorded in any decision (oldest epoch first);
        RollbackBranch for every other open branch (presumed abort; unless not
        ``roll_back_undecided``); then CommitBranch for each branch recorded by a decision newer
        than ``spark_committed_through`` that is not open: its phase 2 may not have been
        confirmed, and committing it again is how the broker tells. A committed branch answers
        committed; one the broker expired or fenced answers otherwise, which the interpreter
        reports as the expired-decided hazard (:func:`lost_branch_reason`).
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
    for epoch in sorted(e for e in decisions if e > spark_committed_through):
        actions += [CommitBranch(b, epoch) for b in _unique(decisions[epoch])
                    if b not in open_set and decided_in[b] == epoch]
    return actions


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
