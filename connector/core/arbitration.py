"""The arbitration store: the proof that an epoch was decided, in a Delta table. Driver side.

For a link whose only target is Kafka, the last agent's one-phase commit is one Delta commit
to a dedicated arbitration table: one row per decided epoch (link, epoch, gxid, branches,
decided_at, confirmed_through) plus a Delta ``txn`` action (appId = link, version = epoch).
The ``txn`` action makes the decision idempotent and race-safe: of two deciders that commit the
same epoch concurrently, Delta's conflict check lets exactly one win, and the other reads the
winner's record and follows it. Spark reads the table with ``spark.read.format("delta")``.

Completion is recorded without extra commits: each decision row carries
``confirmed_through``, the newest epoch whose branches were all confirmed committed before it
was written. Cleanup deletes only rows at or below that mark, minus a retention window.

Rows carry ids, counts and partitions only: never payload, never secrets.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from lastagent.core.figures import EpochFigures, figures_from_user_metadata
from lastagent.errors import ArbitrationError, LastAgentError, LinkMismatchError, LinkOwnedError, StaleOwnerError
from lastagent.storage import StorageConfig, location

log = logging.getLogger("lastagent.core.arbitration")


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


class ArbitrationStore(Protocol):
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

    def decide(self, record: ArbitrationRecord, generation: int, staged: Any = None) -> Decision:
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


def delta_ownership(table: Any, link: str) -> Ownership | None:
    """A link's ownership from a Delta table's properties (a snapshot read, no history)."""
    owner_key, gen_key = owner_keys(link)
    run_key, retired_key = run_keys(link)
    conf = table.metadata().configuration
    if gen_key not in conf:
        return None
    retired = tuple(r for r in conf.get(retired_key, "").split(",") if r)
    return Ownership(conf.get(owner_key, ""), int(conf[gen_key]), conf.get(run_key, ""), retired)


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


def accepted_lost_on_delta(table: Any, link: str) -> frozenset[int]:
    """The epochs in a Delta table's ``lostAccepted`` property (none when the table does not exist)."""
    if table is None:
        return frozenset()
    raw = table.metadata().configuration.get(lost_key(link), "")
    return frozenset(int(e) for e in raw.split(",") if e.strip())


#: How many times a Delta commit that lost to another writer is re-read, decided again and tried again.
COMMIT_TRIES = 10

_T = TypeVar("_T")


class LostRace(LastAgentError):
    """Raised inside a commit attempt: another writer got there first (e.g. created the table); re-read."""


def lost_races() -> tuple[type[BaseException], ...]:
    """What a commit that lost to another writer raises: delta-rs's ``CommitFailedError`` (the version
    was taken, with ``max_commit_retries=0``, or Delta's conflict check refused the commit: a txn of the
    same appId, a metadata or protocol change) and :class:`LostRace`. Driver side."""
    from deltalake.exceptions import CommitFailedError

    return (CommitFailedError, LostRace)


def until_committed(attempt: Callable[[], _T], what: str, where: str) -> _T:
    """Runs ``attempt`` (read the table, decide, commit) until it does not lose a race, at most
    :data:`COMMIT_TRIES` times: each try reads the table anew, so it decides against what won. Driver.

    Raises:
        ArbitrationError: every try lost a race.
    """
    for _ in range(COMMIT_TRIES):
        try:
            return attempt()
        except lost_races() as exc:
            log.info("%s in %s lost a race to another writer (%s); re-reading", what, where, exc)
    raise ArbitrationError(f"{what}: too many concurrent commits to {where} ({COMMIT_TRIES} tries)")


def alter_properties(open_table: Callable[[], Any], where: str, what: str,
                     properties_of: Callable[[Any], dict[str, str] | None]) -> dict[str, str] | None:
    """Sets Delta table properties worked out from the table's newest version. Driver side.

    A property change is a metadata commit, which Delta refuses when another commit raced it: then
    the table is read again and ``properties_of`` asked again (:func:`until_committed`).

    Args:
        open_table: the table at its newest version.
        where: the table, for messages.
        what: what the properties record, for messages (e.g. "the owner of link 'x'").
        properties_of: the properties to set, from the table as read; None when nothing is to be
            set; it may raise to refuse.

    Returns:
        The properties set, or None when ``properties_of`` said nothing was to be set.

    Raises:
        ArbitrationError: the table could not be written, or lost the race every time.
    """
    from lastagent import delta_kernel

    def attempt() -> dict[str, str] | None:
        table = open_table()
        properties = properties_of(table)
        if properties is None:
            return None
        # Through Delta Kernel's log writer, not delta-rs's set_table_properties: delta-rs 1.6.6 rewrites a
        # table-features protocol with it (a reader-version-3 table gains variantType, which older readers
        # refuse), and cannot commit to a table with in-commit timestamps at all. This commit is the table's
        # metaData with these keys set and nothing else; a race re-reads (until_committed).
        delta_kernel.set_properties(table.table_uri, table._storage_options, table.version(), table.metadata().id,
                                    properties, what)
        return properties

    return until_committed(attempt, f"recording {what}", where)


def accept_lost_on_delta(open_table: Callable[[], Any], where: str, link: str, epoch: int) -> None:
    """Adds ``epoch`` to the table's ``lostAccepted`` property (a metadata commit, re-read on a race)."""
    alter_properties(open_table, where, f"the accepted loss of link {link!r} epoch {epoch}", lambda table: {
        lost_key(link): ",".join(map(str, sorted(accepted_lost_on_delta(table, link) | {epoch})))})


def claim_on_delta(open_table: Callable[[], Any], where: str, link: str, owner: str, takeover: bool,
                   run: str = "", base: Callable[[], Ownership | None] | None = None) -> Ownership:
    """Claims the next generation in a Delta table's properties, unless ``run`` holds it already.

    A property change is a metadata commit: Delta refuses any commit (a decision, another claim)
    that raced with it, so a decider that read the old generation must re-read and is refused.
    Runs once per run of a query (by its first tasks), not per epoch: a run that holds the link
    reads the table and changes nothing. ``base`` gives the ownership to continue from when the
    table records none (claims made elsewhere before the table existed).
    """
    claimed: list[Ownership] = []

    def claim(table: Any) -> dict[str, str] | None:
        current = delta_ownership(table, link)
        if current is None and base is not None:
            current = base()
        after = next_ownership(link, where, current, owner, run, takeover)
        stands = after or current  # None only when the run holds the link already
        assert stands is not None
        claimed[:] = [stands]
        return None if after is None else ownership_properties(link, after)

    changed = alter_properties(open_table, where, f"the owner of link {link!r}", claim)
    ownership = claimed[0]
    if changed is not None:
        log.info("link %s: generation %d claimed by %s (run %s) in %s", link, ownership.generation, ownership.owner,
                 ownership.run or "-", where)
    return ownership


def _holds_no_data(record: ArbitrationRecord, staged: Any) -> None:
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

    def decide(self, record: ArbitrationRecord, generation: int, staged: Any = None) -> Decision:
        _holds_no_data(record, staged)
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


class LatestTable:
    """A Delta table at its newest version, opened once per thread and brought up to date on each call. Driver.

    Opening a table reads every log entry since its last checkpoint; an update reads only the
    entries written since the previous call (delta-rs' incremental update), so a query start
    that looks at the table several times reads its log once. Every call still returns the
    newest version. Each thread keeps its own DeltaTable: a decider commits on the snapshot it
    checked, and another thread's commit must not move that snapshot under it.
    """

    def __init__(self, uri: str, storage_options: dict[str, str] | None) -> None:
        self.uri = uri
        self.storage_options = storage_options
        self._local = threading.local()

    def get(self) -> Any:
        """The DeltaTable; raises as ``deltalake.DeltaTable`` does (TableNotFoundError, I/O errors)."""
        from deltalake import DeltaTable

        table = getattr(self._local, "table", None)
        try:
            if table is None:
                table = DeltaTable(self.uri, storage_options=self.storage_options)
            else:
                table.update_incremental()
        except BaseException:
            self._local.table = None
            raise
        self._local.table = table
        return table


class DeltaArbitrationStore:
    """Arbitration rows in a Delta table, written with deltalake (delta-rs) from the driver.

    Args:
        path: the table's location: a local path or a URI of a store :mod:`lastagent.storage` reaches.
        storage: the query's ``storage.*`` settings, for object stores.

    Raises:
        OptionError: ``arbitrationTable`` names a store lastagent cannot reach.
    """

    SCHEMA_FIELDS = ("link", "epoch", "gxid", "branches", "decided_at", "confirmed_through")

    def __init__(self, path: str, storage: StorageConfig | None = None) -> None:
        self.path = str(path)
        self._config = storage or StorageConfig()
        self._where = location(self.path, "arbitrationTable")
        self._storage = self._config.delta_options(self._where)
        self._latest = LatestTable(self._where.uri, self._storage)
        self._plain_at: int | None = None  # the table version whose features were last checked

    def _table(self) -> Any:  # a deltalake DeltaTable, or None
        from deltalake.exceptions import TableNotFoundError

        try:
            table = self._latest.get()
        except TableNotFoundError:
            return None
        except Exception as exc:  # any read failure means "cannot decide now"
            raise ArbitrationError(f"cannot read arbitration table {self.path}: {exc}") from exc
        names = tuple(f.name for f in table.schema().fields)
        if names != self.SCHEMA_FIELDS:
            raise ArbitrationError(
                f"option 'arbitrationTable': {self.path} is a Delta table of another schema (columns {list(names)}), "
                f"not a lastagent arbitration table (columns {list(self.SCHEMA_FIELDS)}); give a path of its own")
        if table.version() != self._plain_at:  # the features are checked once per version read, not per call
            from lastagent.sinks.delta_features import require_plain

            require_plain(table, self.path, "arbitration table", nullable=False)
            self._plain_at = table.version()
        return table

    def _ensure_table(self) -> Any:
        """Opens the table, creating it empty first; a creation race leaves one table.

        A path that holds other files but no Delta table is refused, not turned into a table.
        """
        table = self._table()
        if table is not None:
            return table
        from deltalake import DeltaTable
        from pyarrow import fs

        filesystem_, root = self._config.filesystem(self._where), self._where.path
        try:
            found = filesystem_.get_file_info(fs.FileSelector(root, allow_not_found=True))
        except FileNotFoundError:
            # The directory went missing between the listing's stat and its read: another task of the
            # run's first epoch creating the table at the same moment (seen in CI). Nothing else is there.
            found = []
        except OSError as exc:
            raise ArbitrationError(f"option 'arbitrationTable': cannot list {self.path}: {exc}") from exc
        others = sorted(i.base_name for i in found if i.base_name != "_delta_log")
        if others:
            raise ArbitrationError(
                f"option 'arbitrationTable': {self.path} holds other files ({', '.join(others[:3])}) and no Delta "
                "table; lastagent creates its arbitration table only in an empty or new directory")

        try:
            # Created empty, so every decision (epoch 0 too) is a commit against an existing
            # table, where the txn-appId conflict check applies.
            DeltaTable.create(self._where.uri, self._arrow([]).schema, mode="ignore",
                              storage_options=self._storage, name="lastagent_arbitration")
        except Exception as exc:  # a concurrent creator may have won; re-open below
            log.info("creating arbitration table %s: %s", self.path, exc)
        table = self._table()
        if table is None:
            raise ArbitrationError(f"cannot create arbitration table {self.path}")
        return table

    def _arrow(self, rows: list[ArbitrationRecord]) -> Any:
        import pyarrow as pa

        return pa.table({
            "link": pa.array([r.link for r in rows], pa.string()),
            "epoch": pa.array([r.epoch for r in rows], pa.int64()),
            "gxid": pa.array([r.gxid for r in rows], pa.string()),
            "branches": pa.array([json.dumps(list(r.branches)) for r in rows], pa.string()),
            "decided_at": pa.array([r.decided_at_ms * 1000 for r in rows], pa.timestamp("us", tz="UTC")),
            "confirmed_through": pa.array([r.confirmed_through for r in rows], pa.int64()),
        })

    @staticmethod
    def _record(row: dict) -> ArbitrationRecord:
        decided = row["decided_at"]
        decided_ms = int(decided.timestamp() * 1000) if hasattr(decided, "timestamp") else int(decided or 0)
        return ArbitrationRecord(row["link"], int(row["epoch"]), row["gxid"], tuple(json.loads(row["branches"])),
                                 decided_ms, int(row["confirmed_through"]))

    def check_link(self, link: str) -> None:
        """Fails when the table already holds decisions of a different link name.

        Raises:
            LinkMismatchError: naming both links; renaming a link breaks recovery.
        """
        table = self._table()
        if table is None:
            return
        links = set(table.to_pyarrow_table(columns=["link"]).column("link").to_pylist())
        if links and link not in links:
            raise LinkMismatchError(
                f"option 'link': the arbitration table {self.path} belongs to link(s) {sorted(links)}, "
                f"not {link!r}. A link's name must stay stable (its in-doubt branches are found by it); "
                "use the old name, or a new arbitrationTable for a new link"
            )

    def claim(self, link: str, owner: str, *, takeover: bool = False, run: str = "") -> Ownership:
        return claim_on_delta(self._ensure_table, f"arbitration table {self.path}", link, owner, takeover, run)

    def ownership(self, link: str) -> Ownership | None:
        table = self._table()
        return None if table is None else delta_ownership(table, link)

    def empty_through(self, link: str) -> int:
        return -1  # created by the first claim, before any decision

    def decide(self, record: ArbitrationRecord, generation: int, staged: Any = None) -> Decision:
        from deltalake import CommitProperties, Transaction, write_deltalake

        _holds_no_data(record, staged)
        if not record.decided_at_ms:
            record = replace(record, decided_at_ms=int(time.time() * 1000))

        def attempt() -> Decision:
            table = self._ensure_table()
            current = delta_ownership(table, record.link)
            if current is None or current.generation != generation:
                raise stale(record.link, generation, current)
            decided = table.transaction_version(record.link)
            if decided is not None and decided >= record.epoch:
                existing = self.get(record.link, record.epoch, table)
                if existing is None:
                    raise ArbitrationError(
                        f"link {record.link!r} epoch {record.epoch} is decided in {self.path} but its row is gone")
                return Decision(existing, won=False)
            # No delta-rs re-try of a lost commit (it would not check it against the winner's txn); the
            # loop re-reads and decides (TargetTableStore.decide says what was seen without this).
            props = CommitProperties(
                max_commit_retries=0,
                app_transactions=[Transaction(app_id=record.link, version=record.epoch,
                                              last_updated=record.decided_at_ms)],
                custom_metadata={"lastagent.link": record.link, "lastagent.epoch": str(record.epoch),
                                 "lastagent.gxid": record.gxid,
                                 "lastagent.branches": str(len(record.branches)),
                                 "userMetadata": decision_metadata(record)},
            )
            try:
                write_deltalake(table, self._arrow([record]), mode="append", commit_properties=props)
                return Decision(record, won=True)
            except lost_races():
                raise  # another decider committed first (same txn appId) or the table moved on: re-read
            except Exception as exc:
                raise ArbitrationError(f"cannot write arbitration table {self.path}: {exc}") from exc

        return until_committed(attempt, f"the arbitration of link {record.link!r} epoch {record.epoch}", self.path)

    def get(self, link: str, epoch: int, table: Any = None) -> ArbitrationRecord | None:
        table = table or self._table()
        if table is None:
            return None
        import pyarrow.compute as pc

        data = table.to_pyarrow_table(filters=[("link", "=", link), ("epoch", "=", epoch)])
        rows = data.filter(pc.and_(pc.equal(data["link"], link), pc.equal(data["epoch"], epoch))).to_pylist()
        return self._record(rows[0]) if rows else None

    def records(self, link: str) -> list[ArbitrationRecord]:
        table = self._table()
        if table is None:
            return []
        rows = table.to_pyarrow_table(filters=[("link", "=", link)]).to_pylist()
        return sorted((self._record(r) for r in rows if r["link"] == link), key=lambda r: r.epoch)

    def latest_epoch(self, link: str) -> int | None:
        table = self._table()
        if table is None:
            return None
        return table.transaction_version(link)

    def cleanup(self, link: str, retain_epochs: int) -> int:
        rows = self.records(link)
        if not rows:
            return 0
        limit = max(r.confirmed_through for r in rows) - retain_epochs
        doomed = [r for r in rows if r.epoch <= limit]
        if not doomed:
            return 0
        table = self._table()
        escaped = link.replace("'", "''")
        table.delete(f"link = '{escaped}' AND epoch <= {limit}")
        table.optimize.compact()
        return len(doomed)

    def figures(self, link: str, last: int) -> list[tuple[int, int, EpochFigures | None]]:
        table = self._table()
        if table is None or last <= 0:
            return []
        # Every decision is one commit; claims and cleanups are few, so a little more than ``last``
        # commits of history hold the newest ``last`` decisions (fewer when the log was cleaned up).
        return figures_in_history(table.history(2 * last + 10), link, last)

    def accepted_lost(self, link: str) -> frozenset[int]:
        return accepted_lost_on_delta(self._table(), link)

    def accept_lost(self, link: str, epoch: int) -> None:
        accept_lost_on_delta(self._ensure_table, f"arbitration table {self.path}", link, epoch)

    def size(self) -> tuple[int, int]:
        """(rows, data files) of the table, for ``lastagent status``."""
        table = self._table()
        if table is None:
            return 0, 0
        return table.to_pyarrow_table(columns=["epoch"]).num_rows, len(table.file_uris())
