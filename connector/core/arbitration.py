"""The arbitration port: the record that decides an epoch, the store it is kept in, and who owns a link. Pure.

A decision is an :class:`ArbitrationRecord` (link, epoch, gxid, the Kafka branches, decided_at,
confirmed_through) written once by the last agent's one-phase commit; an :class:`ArbitrationStore` keeps them
race-safely (of two deciders of one epoch exactly one wins, the other reads the winner's record and follows it).
A link's runs claim generations under the rules of :func:`next_ownership`. The stores are adapters:
:mod:`lastagent.delta` holds the Delta ones (a lastagent-kafka link's arbitration table, a lastagent-delta link's
target table, a lastagent.epoch block's table); :class:`InMemoryArbitrationStore` is this interface in memory,
for unit tests and the model check. This module imports no Delta library.

Records carry ids, counts and partitions only: never payload, never secrets.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from lastagent.core.figures import EpochFigures, figures_from_user_metadata
from lastagent.errors import ArbitrationError, LastAgentError, LinkMismatchError, LinkOwnedError, StaleOwnerError


@dataclass(frozen=True)
class Ownership:
    """Who owns a link: the Spark query id of its checkpoint, the generation of its current run, and that run.

    A run of the query (Spark's run id, new at every ``start()`` of the query) claims the next
    generation once, race-safely, in the arbitration store, before any of its tasks writes; all its
    epochs are decided under that generation and its tasks' transactional ids carry it. A decision
    is written only for the generation that stands, so a run that was superseded can never decide
    an epoch, and a superseded run (in ``retired``) can never claim again.

    Attributes:
        owner: the query id of the checkpoint ("" after ``lastagent recover`` fenced the link).
        generation: the current run's generation.
        run: the current run's id ("" when no run claimed it: a claim by a test, an older
            version's, or ``lastagent recover``'s).
        retired: the ids of the runs this link had before, newest last (at most :data:`RETIRED_RUNS`).
    """

    owner: str
    generation: int
    run: str = ""
    retired: tuple[str, ...] = ()


#: How many superseded run ids a link remembers, so that a zombie run cannot claim the link back.
RETIRED_RUNS = 16


def next_ownership(link: str, where: str, current: Ownership | None, owner: str, run: str = "",
                   takeover: bool = False) -> Ownership | None:
    """What a claim changes: the next ownership, or None when ``run`` holds the link already. Pure.

    Args:
        link, where: for messages.
        current: the ownership as read.
        owner: the claiming query's id.
        run: the claiming run's id ("" for a claim that is not a run's: tests, the admin command).
        takeover: the admin command fences the running owner without replacing it.

    Raises:
        LinkOwnedError: another query owns the link (unless ``takeover``).
        StaleOwnerError: ``run`` was superseded already (a zombie run).
    """
    if not takeover:
        require_owner(link, where, current, owner)
    if run and current is not None:
        if current.run == run:
            return None
        if run in current.retired:
            raise StaleOwnerError(
                f"link {link!r}: run {run} was superseded (run {current.run or '(none)'}, generation "
                f"{current.generation}, holds the link now: the query was started again, or `lastagent recover` ran); "
                "this run writes nothing more and stops")
    retired = current.retired if current else ()
    if current is not None and current.run:
        retired = (*retired, current.run)[-RETIRED_RUNS:]
    # A takeover (the admin command) moves the generation but keeps the owner ("" for none).
    return Ownership(current.owner if (current and takeover) else owner,
                     (current.generation if current else 0) + 1, run, retired)


@dataclass(frozen=True)
class ArbitrationRecord:
    """One decided epoch.

    Attributes:
        link: the link name (the ``link`` option).
        epoch: Spark's micro-batch id.
        gxid: the global transaction id in its text form.
        branches: the commit messages (branch handles, JSON) the decision covers.
        decided_at_ms: wall-clock time of the decision, for operators.
        confirmed_through: newest epoch whose branches were all confirmed committed when this
            record was written (-1 for none).
        figures: what an operator watches of the epoch (branches, records, dead letters, branch
            age, the previous epoch's timings), written into the decision commit's ``userMetadata``;
            None for a record read from the table's rows (:meth:`ArbitrationStore.figures` reads
            them) or written before they existed. Never part of the decision's meaning.
    """

    link: str
    epoch: int
    gxid: str
    branches: tuple[str, ...]
    decided_at_ms: int = 0
    confirmed_through: int = -1
    figures: EpochFigures | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Decision:
    """The outcome of :meth:`ArbitrationStore.decide`: the record that stands, and whether we wrote it."""

    record: ArbitrationRecord
    won: bool


#: What a store commits beside a record, in the same commit: the ``lastagent-delta`` target table's staged files
#: (``lastagent.delta.target_table.StagedEpoch``); ``None`` for a store of records only. Opaque to core.
Staged_contra = TypeVar("Staged_contra", contravariant=True)


class ArbitrationStore(Protocol[Staged_contra]):
    """The arbitration store port: what the protocol needs from wherever decisions live.

    Implemented by the dedicated arbitration table (:class:`DeltaArbitrationStore`), the
    ``lastagent-delta`` target table (``TargetTableStore``) and, for tests, memory.
    """

    def claim(self, link: str, owner: str, *, takeover: bool = False, run: str = "") -> Ownership:
        """Claims the link's next generation for ``owner``'s ``run``, race-safely (:func:`next_ownership`).

        Called by a run's first tasks (executors) with the run's id: a run that holds the link
        already changes nothing. Tests and the admin command claim with no run.

        Raises:
            LinkOwnedError: another owner holds the link (unless ``takeover``: the admin command
                fences the running owner without replacing it).
            StaleOwnerError: ``run`` was superseded already.
        """
        ...

    def ownership(self, link: str) -> Ownership | None:
        """The link's current owner and generation, or None before the first claim."""
        ...

    def empty_through(self, link: str) -> int:
        """The newest epoch the link decided while the store did not exist yet, or -1.

        Only a store that a decision creates (the ``lastagent-delta`` target table) has such
        epochs: each wrote nothing, and the store keeps a record of them elsewhere.
        """
        ...

    def decide(self, record: ArbitrationRecord, generation: int, staged: Staged_contra | None = None) -> Decision:
        """Records the epoch unless already decided; returns the record that stands.

        Args:
            record: the decision.
            generation: the run's; the record is written only while it is the link's.
            staged: what the last agent commits in the same commit as the record (the
                ``lastagent-delta`` target table's staged data files, dropped when another record
                stands); None for a store that holds no data.

        Raises:
            StaleOwnerError: ``generation`` is no longer the link's (checked atomically with the commit).
        """
        ...

    def get(self, link: str, epoch: int) -> ArbitrationRecord | None:
        """The decision of one epoch, or None (presumed abort)."""
        ...

    def records(self, link: str) -> list[ArbitrationRecord]:
        """Every decision of the link still kept, oldest first."""
        ...

    def latest_epoch(self, link: str) -> int | None:
        """The newest decided epoch of the link (from the ``txn`` action), or None."""
        ...

    def cleanup(self, link: str, retain_epochs: int) -> int:
        """Deletes confirmed decisions older than the retention; returns rows deleted."""
        ...

    def figures(self, link: str, last: int) -> list[tuple[int, int, EpochFigures | None]]:
        """The newest ``last`` decisions' figures: (epoch, decided_at_ms, figures or None), newest first.

        Read from the decision commits' ``userMetadata``; a decision written before figures existed
        (or one whose commit the log no longer keeps) has None. For operators only: no decision
        depends on it.
        """
        ...

    def check_link(self, link: str) -> None:
        """Fails when the store holds decisions of another link (a renamed link)."""
        ...

    def size(self) -> tuple[int, int]:
        """(rows, files) kept, for ``lastagent status``."""
        ...

    def accepted_lost(self, link: str) -> frozenset[int]:
        """The decided epochs whose lost branches an operator accepted as gone (``lastagent recover --accept-lost``)."""
        ...

    def accept_lost(self, link: str, epoch: int) -> None:
        """Records that the lost branches of decided ``epoch`` are accepted as gone, so the link can go on."""
        ...


def require_owner(link: str, where: str, current: Ownership | None, owner: str) -> None:
    """Refuses a query other than the link's owner (no owner yet, or one fenced by the admin command, admits any).

    Raises:
        LinkOwnedError: naming the link, the owner and where it is recorded.
    """
    if current is not None and current.owner not in ("", owner):
        raise owned(link, where, current, owner)


def stale(link: str, generation: int, current: Ownership | None) -> StaleOwnerError:
    """The error of a run whose generation is no longer the link's."""
    now = "no owner" if current is None else f"generation {current.generation} of query {current.owner}"
    return StaleOwnerError(
        f"link {link!r}: this run (generation {generation}) was superseded ({now} holds the link now: the query "
        "was started again, or `lastagent recover` ran); it decides nothing more and stops. Nothing of this "
        "epoch was committed; the current run recovers it")


def owned(link: str, where: str, current: Ownership, owner: str) -> LinkOwnedError:
    """The error of a query refused at start because another query owns the link."""
    return LinkOwnedError(
        f"option 'link': link {link!r} is owned by query {current.owner} (generation {current.generation}, "
        f"recorded in {where}); this query ({owner}) has another checkpoint. Two queries on one link would fence "
        "each other: stop this one, or restart the owner from its own checkpointLocation, or give this query a "
        "new link name (and, for lastagent-kafka, a new arbitrationTable). Nothing was changed")


def owner_keys(link: str) -> tuple[str, str]:
    """The Delta table properties that hold a link's owner and generation."""
    return f"lastagent.link.{link}.owner", f"lastagent.link.{link}.generation"


def run_keys(link: str) -> tuple[str, str]:
    """The Delta table properties that hold a link's current run and its retired runs."""
    return f"lastagent.link.{link}.run", f"lastagent.link.{link}.retiredRuns"


def ownership_properties(link: str, ownership: Ownership) -> dict[str, str]:
    """The Delta table properties that record ``ownership``."""
    owner_key, gen_key = owner_keys(link)
    run_key, retired_key = run_keys(link)
    return {owner_key: ownership.owner, gen_key: str(ownership.generation), run_key: ownership.run,
            retired_key: ",".join(ownership.retired)}


def decision_metadata(record: ArbitrationRecord, **extra: Any) -> str:
    """A decision commit's ``userMetadata`` (what Spark's ``DESCRIBE HISTORY`` shows): ids, counts and
    the epoch's figures, never payload or secrets. ``extra`` adds store-specific counts."""
    body: dict[str, Any] = {"link": record.link, "epoch": record.epoch, "gxid": record.gxid,
                            "kafka_branches": len(record.branches), **extra}
    if record.figures is not None:
        body["figures"] = record.figures.to_dict()
    return json.dumps({"lastagent": body}, separators=(",", ":"))


def figures_in_history(commits: list[dict[str, Any]], link: str, last: int) -> list[tuple[int, int, EpochFigures | None]]:
    """The figures of ``link``'s newest ``last`` decisions in a Delta history (newest first), newest first."""
    out: list[tuple[int, int, EpochFigures | None]] = []
    seen: set[int] = set()
    for c in commits:
        if c.get("lastagent.link") != link or "lastagent.epoch" not in c:
            continue
        epoch = int(c["lastagent.epoch"])
        if epoch in seen:
            continue
        seen.add(epoch)
        out.append((epoch, int(c.get("timestamp", 0)), figures_from_user_metadata(c.get("userMetadata"))))
        if len(out) >= last:
            break
    return out


def lost_key(link: str) -> str:
    """The Delta table property that lists the decided epochs whose lost branches an operator accepted."""
    return f"lastagent.link.{link}.lostAccepted"


class LostRace(LastAgentError):
    """Raised inside a commit attempt: another writer got there first (e.g. created the table); re-read."""


def holds_no_data(record: ArbitrationRecord, staged: object) -> None:
    """A store of records only: data to commit beside a record has nowhere to go (a wiring error)."""
    if staged is not None:
        raise ArbitrationError(f"link {record.link!r} epoch {record.epoch}: this arbitration store holds records "
                               "only, not the data of a lastagent-delta sink")


class InMemoryArbitrationStore:
    """The same interface, in memory; for unit tests and the model check."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int], ArbitrationRecord] = {}
        self._latest: dict[str, int] = {}
        self._owners: dict[str, Ownership] = {}
        self._accepted: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    def claim(self, link: str, owner: str, *, takeover: bool = False, run: str = "") -> Ownership:
        with self._lock:
            current = self._owners.get(link)
            claimed = next_ownership(link, "memory", current, owner, run, takeover)
            if claimed is None:
                assert current is not None
                return current
            self._owners[link] = claimed
            return claimed

    def ownership(self, link: str) -> Ownership | None:
        return self._owners.get(link)

    def empty_through(self, link: str) -> int:
        return -1  # claimed in memory: exists from the first claim

    def decide(self, record: ArbitrationRecord, generation: int, staged: None = None) -> Decision:
        holds_no_data(record, staged)
        with self._lock:
            current = self._owners.get(record.link)
            if current is None or current.generation != generation:
                raise stale(record.link, generation, current)
            if self._latest.get(record.link, -1) >= record.epoch:
                existing = self._rows.get((record.link, record.epoch))
                if existing is None:
                    raise ArbitrationError(
                        f"link {record.link!r} epoch {record.epoch} is decided but its record was cleaned up")
                return Decision(existing, won=False)
            self._rows[(record.link, record.epoch)] = record
            self._latest[record.link] = record.epoch
            return Decision(record, won=True)

    def get(self, link: str, epoch: int) -> ArbitrationRecord | None:
        return self._rows.get((link, epoch))

    def records(self, link: str) -> list[ArbitrationRecord]:
        return sorted((r for (lk, _), r in self._rows.items() if lk == link), key=lambda r: r.epoch)

    def latest_epoch(self, link: str) -> int | None:
        return self._latest.get(link)

    def check_link(self, link: str) -> None:
        links = {lk for lk, _ in self._rows}
        if links and link not in links:
            raise LinkMismatchError(f"option 'link': this arbitration store belongs to {sorted(links)}, not {link!r}")

    def size(self) -> tuple[int, int]:
        return len(self._rows), 0

    def accepted_lost(self, link: str) -> frozenset[int]:
        return frozenset(self._accepted.get(link, ()))

    def accept_lost(self, link: str, epoch: int) -> None:
        self._accepted.setdefault(link, set()).add(epoch)

    def figures(self, link: str, last: int) -> list[tuple[int, int, EpochFigures | None]]:
        return [(r.epoch, r.decided_at_ms, r.figures) for r in reversed(self.records(link))][:max(0, last)]

    def cleanup(self, link: str, retain_epochs: int) -> int:
        rows = self.records(link)
        if not rows:
            return 0
        limit = rows[-1].confirmed_through - retain_epochs
        doomed = [r for r in rows if r.epoch <= limit]
        for r in doomed:
            del self._rows[(link, r.epoch)]
        return len(doomed)
