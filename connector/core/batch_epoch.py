"""The epoch inside ``foreachBatch``, with Spark's own Delta writer as the last agent: pure rules. Driver side.

A ``foreachBatch`` function writes the epoch's Kafka records into prepared branches, then makes one
Delta commit of its own (a ``MERGE``, an ``UPDATE``, an append) through Spark. That commit is the
decision: Delta's idempotent-write settings give it ``txn(app id, epoch)`` and its commit info carries
the arbitration record (:class:`BatchRecord`) naming the branches. Nothing here touches Spark, Delta
or Kafka: the caller reads the table's ``txn`` versions and history, passes them in, and carries out
what comes back (in the manner of :mod:`lastagent.core.protocol`, whose phase-2 and recovery rules
apply unchanged once a record stands).

**The fence lives in what the user's commit reads.** Each run decides under an app id of its own
generation (:func:`app_id`). Spark's Delta commands skip a write whose app id's ``txn`` version is at
or above the one given (``hasBeenExecuted``), and reading that version puts the app id in the
transaction's read set, so a commit that changes it concurrently fails the write
(``ConcurrentTransactionException``). A new run claims by committing ``txn(app id of the current
generation, FENCED)``: a superseded run's later write is then skipped by Delta itself, or fails at
commit; it can never decide after the claim, which is what presumed abort needs.

**A claim is one commit, and exactly one claimer wins it.** Spark's writer carries one ``txn`` per
commit, so a claim fences only the current generation (the ones before it were fenced by the claims
that superseded them). Two claimers that read the same current generation both write the same
``txn``: the first commits, the second is skipped (or fails at commit). Each claim's commit info
names its claimer (:func:`claim_metadata`), so a claimer learns whether it won by finding its own
claim in the history after its write (:func:`claim_won`); the loser reads again and fences the
winner's generation in turn. The claimer that wins the fence of generation ``g`` runs as ``g + 1``.

**Generations are read from the ``txn`` versions alone** (:func:`current_generation`): the newest
generation with a ``txn`` is current, unless it is fenced, in which case the claim that fenced it
made the next one current (it may not have decided anything yet, so has no ``txn`` of its own).
Generation 0 is never a run: the first claim fences it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lastagent.core.protocol import Branch
from lastagent.errors import ArbitrationError

#: The ``txn`` version that fences an app id: above any epoch Spark will ever reach, so every later
#: write under the app id is skipped as "already executed".
FENCED = 1 << 62

#: The key of lastagent's document in a commit's ``userMetadata`` (the same key the sinks use).
_KEY = "lastagent"


def app_id(link: str, generation: int) -> str:
    """The Delta app id under which ``generation``'s run of ``link`` decides its epochs."""
    return f"lastagent/{link}/g{generation}"


def generation_of(link: str, app: str) -> int | None:
    """The generation an app id of ``link`` names; None for an app id that is not one of the link's."""
    m = re.fullmatch(rf"lastagent/{re.escape(link)}/g(\d+)", app)
    return int(m.group(1)) if m else None


def link_txns(link: str, txns: Mapping[str, int]) -> dict[int, int]:
    """Generation → ``txn`` version, for the app ids of ``link`` among a table's ``txn`` versions."""
    out = {}
    for app, version in txns.items():
        g = generation_of(link, app)
        if g is not None:
            out[g] = version
    return out


def current_generation(link: str, txns: Mapping[str, int]) -> int:
    """The generation that holds ``link`` now, from the table's ``txn`` versions (0: no run has claimed yet)."""
    gens = link_txns(link, txns)
    if not gens:
        return 0
    newest = max(gens)
    return newest + 1 if gens[newest] >= FENCED else newest


# -- records in commit info ------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchRecord:
    """The arbitration record in the deciding commit's ``userMetadata``: the epoch, the deciding
    generation and the prepared branches it commits."""

    link: str
    epoch: int
    generation: int
    branches: tuple[Branch, ...]

    def to_metadata(self) -> str:
        """The ``spark.databricks.delta.commitInfo.userMetadata`` value that carries this record."""
        return json.dumps({_KEY: {"link": self.link, "epoch": self.epoch, "generation": self.generation,
                                  "branches": [[b.transactional_id, b.producer_id, b.producer_epoch]
                                               for b in self.branches]}}, sort_keys=True)


@dataclass(frozen=True)
class Claim:
    """A claim's commit info: ``run`` fenced ``fenced`` and holds ``link`` as ``fenced + 1``; ``nonce`` tells
    this claim from any other of the same run."""

    link: str
    fenced: int
    run: str
    nonce: str

    def to_metadata(self) -> str:
        return json.dumps({_KEY: {"link": self.link, "claim": {"fenced": self.fenced, "run": self.run,
                                                               "nonce": self.nonce}}}, sort_keys=True)


def _document(user_metadata: str | None, link: str) -> dict[str, Any] | None:
    if not user_metadata:
        return None
    try:
        doc = json.loads(user_metadata)
    except ValueError:
        return None  # another writer's free text
    inner = doc.get(_KEY) if isinstance(doc, dict) else None
    return inner if isinstance(inner, dict) and inner.get("link") == link else None


def record_in(user_metadata: str | None, link: str) -> BatchRecord | None:
    """The record of ``link`` a commit's ``userMetadata`` carries, or None (not a decision of the link).

    Raises:
        ArbitrationError: the metadata names the link but is not a record this version can read.
    """
    doc = _document(user_metadata, link)
    if doc is None or "epoch" not in doc:
        return None
    try:
        branches = tuple(Branch(str(t), int(p), int(e)) for t, p, e in doc.get("branches", []))
        return BatchRecord(link, int(doc["epoch"]), int(doc["generation"]), branches)
    except (KeyError, TypeError, ValueError) as exc:
        raise ArbitrationError(f"link {link!r}: a commit's userMetadata names the link but is no record this "
                               f"lastagent can read ({exc!r}): {str(user_metadata)[:200]}") from None


def claim_in(user_metadata: str | None, link: str) -> Claim | None:
    """The claim of ``link`` a commit's ``userMetadata`` carries, or None."""
    doc = _document(user_metadata, link)
    claim = doc.get("claim") if doc else None
    if not isinstance(claim, dict):
        return None
    return Claim(link, int(claim["fenced"]), str(claim["run"]), str(claim["nonce"]))


# -- the claim -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimCommit:
    """Commit, through Spark's Delta writer, an empty append with ``txn(app, FENCED)`` and ``metadata``."""

    app: str
    version: int
    metadata: str


def claim(link: str, run: str, nonce: str, txns: Mapping[str, int]) -> tuple[ClaimCommit, Claim]:
    """The commit that fences the current generation of ``link`` for ``run``; then :func:`claim_won`."""
    fenced = current_generation(link, txns)
    c = Claim(link, fenced, run, nonce)
    return ClaimCommit(app_id(link, fenced), FENCED, c.to_metadata()), c


def claim_won(mine: Claim, history: Sequence[str | None]) -> bool:
    """Whether ``mine`` is in the commits' ``userMetadata`` read after its write. Spark's writer skips the
    write of a claimer that lost (the fence was there already) or fails it at commit: then it is absent."""
    return any(claim_in(m, mine.link) == mine for m in history)


# -- entering and leaving the block -----------------------------------------------------------------


@dataclass(frozen=True)
class Fresh:
    """Decide the epoch: the block's Delta commit goes under ``txn(app, epoch)`` with the record."""

    app: str
    epoch: int


@dataclass(frozen=True)
class Replay:
    """The epoch was decided already (``record``): Delta skips the block's writes under ``app`` (whose
    ``txn`` is at or above the epoch), Kafka writes are skipped, and the exit finishes ``record``."""

    app: str
    epoch: int
    record: BatchRecord


@dataclass(frozen=True)
class Superseded:
    """This run no longer holds the link: write nothing, fail the batch with ``reason``."""

    reason: str


Entry = Fresh | Replay | Superseded


def enter(link: str, epoch: int, generation: int, txns: Mapping[str, int],
          record: BatchRecord | None) -> Entry:
    """What the block does with ``epoch``, from the table as read at the block's start.

    Args:
        link: the link.
        epoch: Spark's batch id.
        generation: the generation this run won by its claim.
        txns: the table's ``txn`` versions (app id → version).
        record: the record of ``epoch`` in the table's history, if any.
    """
    current = current_generation(link, txns)
    if current != generation:
        return Superseded(f"link {link!r}: this run held it as generation {generation}, and a newer run "
                          f"(generation {current}) has claimed it since; this run writes nothing more")
    if record is not None:
        return Replay(app_id(link, record.generation), epoch, record)
    mine = link_txns(link, txns).get(generation, -1)
    if mine >= epoch:
        raise ArbitrationError(f"link {link!r} epoch {epoch}: the table's txn for {app_id(link, generation)} is at "
                         f"{mine}, but its history holds no record of the epoch")
    return Fresh(app_id(link, generation), epoch)


def may_write_kafka(link: str, entry: Entry, record: BatchRecord | None) -> str | None:
    """Why ``e.to_kafka`` must not write (a reason), or None. ``record``: the epoch's record as read now.

    A Replay writes nothing to Kafka (its branches were decided by the run that decided the epoch). A
    Fresh epoch whose record appeared after the block began was decided by the block's own Delta write:
    records written now would be in no record, so the call is refused before it writes anything.
    """
    if isinstance(entry, Superseded):
        return entry.reason
    if isinstance(entry, Fresh) and record is not None:
        return (f"link {link!r} epoch {entry.epoch}: the block's Delta write was made before this e.to_kafka, and "
                "that commit decided the epoch without these records; call every e.to_kafka before the Delta "
                "write (the Kafka records are prepared first, then the one Delta commit decides them)")
    return None


@dataclass(frozen=True)
class DecideByEmptyCommit:
    """The body made no Delta commit but prepared Kafka branches: decide with an empty append under
    ``txn(app, epoch)`` carrying ``metadata``, then read the record again (:func:`leave` with ``decided_here=True``).
    A body that made neither has nothing to decide."""

    app: str
    epoch: int
    metadata: str


@dataclass(frozen=True)
class Finish:
    """Phase 2 against the standing record: commit ``commit`` (each still open, or committed already), roll
    back ``roll_back``; then, when ``fail`` is set, fail the batch with it (after the branches are ended):
    ``stray`` says the failure is a Delta write of the body's that the block's settings did not reach
    (:func:`stray_writes`), else this run was superseded."""

    commit: tuple[Branch, ...]
    roll_back: tuple[Branch, ...]
    fail: str | None = None
    stray: bool = False


# -- what the body committed --------------------------------------------------------------------------


@dataclass(frozen=True)
class Commit:
    """One commit of the block's table as its ``commitInfo`` gives it: version, operation, user metadata."""

    version: int
    operation: str
    user_metadata: str | None


#: ``commitInfo.operation`` values of Spark's Delta that change no row a reader sees (file layout, statistics,
#: table properties, constraints, the log itself). Any other operation is taken as a data write: an operation
#: this list does not know fails the block rather than pass unseen.
KEEPS_DATA = frozenset({
    "OPTIMIZE", "VACUUM START", "VACUUM END", "SET TBLPROPERTIES", "UNSET TBLPROPERTIES", "ADD CONSTRAINT",
    "DROP CONSTRAINT", "CHANGE COLUMN", "ADD COLUMNS", "REPLACE COLUMNS", "RENAME COLUMN", "UPGRADE PROTOCOL",
    "ADD FEATURE", "DROP FEATURE", "COMPUTE STATS", "REORG", "CLUSTER BY", "ROW TRACKING BACKFILL",
    "ROW TRACKING UNBACKFILL", "DOMAIN METADATA CLEANUP", "SET TABLE COMMENT", "UPDATE SCHEMA", "CHECKPOINT"})


def stray_writes(commits: Sequence[Commit]) -> list[Commit]:
    """The commits among ``commits`` (the block's table, made while the block was open) that changed data and
    carry no lastagent document (no record, no claim, no other link's): writes the block's Delta settings did not
    reach, which therefore decide nothing (a session other than the batch's, a second write, another job)."""
    return [c for c in commits if c.operation.strip().upper() not in KEEPS_DATA
            and not _is_lastagent(c.user_metadata)]


def _is_lastagent(user_metadata: str | None) -> bool:
    try:
        doc = json.loads(user_metadata or "")
    except ValueError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get(_KEY), dict)


def stray_reason(link: str, epoch: int, table: str, stray: Sequence[Commit], decided_by: int | None) -> str:
    """Why the block fails for ``stray`` commits; ``decided_by``: the version whose record decided the epoch."""
    named = ", ".join(f"version {c.version} ({c.operation})" for c in stray)
    head = (f"link {link!r} epoch {epoch}: the table {table} changed while the block was open by a commit that does "
            f"not carry the block's txn and record: {named}. ")
    if decided_by is not None:
        return head + (f"The epoch was decided by version {decided_by} (its Kafka branches are committed); the other "
                       "commit is a second Delta write in the block or a write through another session. Make exactly "
                       "one Delta write per block, through the batch's own session (batch.sparkSession), and none "
                       "to this table from elsewhere while the query runs.")
    first = min(c.version for c in stray)
    return head + ("Its changes are in the table but the epoch is not decided: the block's Kafka branches were rolled "
                   "back. The block's Delta settings reach only writes through the batch's own session: write with "
                   "batch.write, batch.sparkSession.sql(...) or DeltaTable.forPath(batch.sparkSession, ...), not "
                   "with the global spark, SparkSession.builder.getOrCreate() or newSession(). The restarted query "
                   "replays the epoch and writes it again: undo the commit first where a second apply would differ "
                   f"(RESTORE TABLE delta.`{table}` TO VERSION AS OF {first - 1}).")


Exit = DecideByEmptyCommit | Finish


def leave(link: str, entry: Entry, generation: int, prepared: Sequence[Branch], open_branches: Sequence[Branch],
          record: BatchRecord | None, body_failed: bool, decided_here: bool = False,
          stray: str | None = None) -> Exit:
    """What the block does at its end, from the epoch's record as read after the body ran.

    Args:
        link: the link.
        entry: what :func:`enter` said.
        generation: this run's generation.
        prepared: the branches the block's ``to_kafka`` calls prepared.
        open_branches: the link's open transactions of this generation and earlier ones, as the broker lists
            them (failed task attempts' branches among them).
        record: the epoch's record in the table's history, read now.
        body_failed: the body raised (the block re-raises after the returned Finish).
        decided_here: a :class:`DecideByEmptyCommit` was carried out.
        stray: the body's Delta writes did not all go under the block's settings (:func:`stray_reason`): the
            record, when one stands, is finished and the batch fails; without one nothing is decided.
    """
    everything = list(dict.fromkeys([*prepared, *open_branches]))
    if isinstance(entry, Superseded):
        return Finish((), tuple(prepared), entry.reason)
    if stray is not None:
        if record is None:
            return Finish((), tuple(everything), stray, stray=True)
        named = set(record.branches)
        return Finish(record.branches, tuple(b for b in everything if b not in named), stray, stray=True)
    if record is None:
        if isinstance(entry, Fresh) and not body_failed and not decided_here and prepared:
            metadata = BatchRecord(link, entry.epoch, generation, tuple(dict.fromkeys(prepared))).to_metadata()
            return DecideByEmptyCommit(entry.app, entry.epoch, metadata)
        fenced = decided_here and not body_failed  # the block's own decision commit was skipped or refused
        why = None if not fenced else (f"link {link!r} epoch {entry.epoch}: the epoch's decision was not "
                                       "committed (a newer run fenced this one); nothing of it was written")
        return Finish((), tuple(everything), why)
    named = set(record.branches)
    rest = tuple(b for b in everything if b not in named)
    if isinstance(entry, Fresh) and record.generation != generation:  # a newer run decided it: ours are not in it
        return Finish(record.branches, rest, f"link {link!r} epoch {entry.epoch}: decided by generation "
                                             f"{record.generation}, which superseded this run ({generation})")
    return Finish(record.branches, rest)
