"""The last agent of a ``lastagent-delta`` link: the target table's own commit. Driver side.

:class:`TargetTableStore` has the :class:`~lastagent.core.arbitration.ArbitrationStore` interface,
so the :class:`~lastagent.core.committer.Committer` runs the same protocol for both sinks; here the
decision *is* the epoch's data commit. One Delta commit holds the epoch's add actions, the
``txn`` action (appId = link, version = epoch) and the arbitration record in the commit's
metadata (``lastagent.*`` keys: gxid, Kafka branch handles, the task attempts whose files it
adds). Delta's conflict check on the ``txn`` appId makes two racing deciders end with one
winner; the loser's files are deleted and it follows the winner's record.

The record lives in the table's commit history, so Delta's log retention (30 days by default)
bounds how long it is kept; there is nothing of ours to clean up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from dataclasses import dataclass, replace
from typing import Any

from lastagent.core.arbitration import (
    ArbitrationError,
    ArbitrationRecord,
    Decision,
    LinkMismatchError,
    LostRace,
    Ownership,
    decision_metadata,
    figures_in_history,
    owner_keys,
    ownership_properties,
    stale,
)
from lastagent.core.figures import EpochFigures
from lastagent.delta import files as delta_files
from lastagent.delta import kernel as delta_kernel
from lastagent.delta.arbitration_table import DeltaArbitrationStore
from lastagent.delta.features import IdentityColumn, TableRules, require_plain, rules_of
from lastagent.delta.files import kernel_add
from lastagent.delta.snapshot import Snapshot, read_snapshot
from lastagent.delta.table_properties import (
    accept_lost_on_delta,
    accepted_lost_on_delta,
    alter_properties,
    claim_on_delta,
    delta_ownership,
    until_committed,
)
from lastagent.delta.upkeep import TableUpkeep
from lastagent.errors import SchemaMismatchError, TableChangedError, UnsupportedTableFeatureError
from lastagent.storage import Location, StorageConfig, location

log = logging.getLogger("lastagent.delta")

#: Commits read back from the table's history in the first look for a link's record; the look
#: widens (doubling) until the record or the table's first retained commit is reached.
HISTORY_FIRST_LOOK = 100


@dataclass(frozen=True)
class StagedEpoch:
    """What the epoch's tasks wrote: data files no snapshot references yet.

    Attributes:
        adds: add actions (JSON-able dicts) of every reported file.
        schema_json: the rows' schema (Delta/Spark JSON) as the tasks wrote them, or None.
        attempts: (Spark partition, attempt) of every task whose files are in ``adds`` or
            ``dead_letter_adds``.
        dead_letter_adds: add actions of the epoch's files for the dead-letter table.
        rules: what the tasks did to the rows (:class:`~lastagent.delta.features.TableRules`,
            from the table as read at the epoch's start); the commit refuses a table that has
            changed them since.
    """

    adds: tuple[dict[str, Any], ...]
    schema_json: str | None
    attempts: tuple[tuple[int, int], ...]
    dead_letter_adds: tuple[dict[str, Any], ...] = ()
    rules: TableRules = TableRules()


def _strip(node: Any) -> Any:
    """A schema JSON node without nullability and metadata: what must match exactly."""
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k not in ("nullable", "containsNull",
                                                                   "valueContainsNull", "metadata")}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def schema_diff(table_json: str, rows_json: str, merge: bool) -> tuple[list[str], list[dict[str, Any]]]:
    """Compares the rows' schema with the table's.

    Returns:
        (problems, new fields): problems name each column and both types; new fields are the
        rows' columns the table lacks (allowed, and to be added, only with ``merge``).
    """
    table = {f["name"]: f for f in json.loads(table_json)["fields"]}
    problems, new = [], []
    for f in json.loads(rows_json)["fields"]:
        have = table.get(f["name"])
        if have is None:
            if merge:
                new.append({**f, "nullable": True})
            else:
                problems.append(f"column '{f['name']}' ({json.dumps(_strip(f['type']))}) is not in the table")
        elif _strip(have["type"]) != _strip(f["type"]):
            problems.append(f"column '{f['name']}': the table has {json.dumps(_strip(have['type']))}, "
                            f"the query gives {json.dumps(_strip(f['type']))}")
    return problems, new


def high_water_marks(schema_json: str, identity: tuple[IdentityColumn, ...], adds: tuple[dict[str, Any], ...],
                     path: str) -> str | None:
    """The schema with each identity column's ``delta.identity.highWaterMark`` moved to the furthest value the
    epoch's files hold (their statistics: the maximum, or the minimum for a negative step), or None when no mark
    moves. Pure.

    Raises:
        ArbitrationError: a file with rows has no statistics for an identity column (the mark could not be moved,
            and a later writer would give the same values again); nothing is committed.
    """
    schema = json.loads(schema_json)
    moved = False
    for f in schema["fields"]:
        column = next((i for i in identity if i.column == f["name"]), None)
        if column is None:
            continue
        key = f.get("metadata", {}).get("delta.columnMapping.physicalName", f["name"])
        side = "maxValues" if column.step > 0 else "minValues"
        values = []
        for add in adds:
            stats = json.loads(add.get("stats") or "{}")
            if stats.get("numRecords", 1) and key not in stats.get(side, {}):
                raise ArbitrationError(f"Delta table {path}: file {add['path']} has no statistics for identity column "
                                       f"'{f['name']}', so its high-water mark cannot be moved; nothing was committed")
            if key in stats.get(side, {}):
                values.append(int(stats[side][key]))
        if not values:
            continue
        furthest = max(values) if column.step > 0 else min(values)
        mark = column.high_water_mark
        if mark is None or (furthest > mark if column.step > 0 else furthest < mark):
            f["metadata"]["delta.identity.highWaterMark"] = furthest
            moved = True
    return json.dumps(schema) if moved else None


def _delta_json(schema_json: str) -> str:
    """A schema (Spark's or Delta's JSON: the same format) in the form lastagent has always written into
    ``schemaString`` (compact, keys in Spark's order), so a schema that Delta cannot hold is refused here, before any
    commit.

    Raises:
        ValueError: naming a type Delta cannot hold.
    """
    delta_files.arrow_schema(schema_json)
    return json.dumps(json.loads(schema_json), separators=(",", ":"), ensure_ascii=False)


def schema_error(path: str, problems: list[str]) -> SchemaMismatchError:
    return SchemaMismatchError(
        f"the rows do not fit the schema of Delta table {path}: " + "; ".join(problems)
        + ". Cast the columns in the query, or set option mergeSchema=true to add new columns "
          "(types of existing columns never change); nothing was committed")


class TargetTableStore:
    """The target Delta table as the arbitration store of its link.

    Args:
        path: the table's location.
        partition_by: partition columns for creating the table.
        merge_schema: add the rows' new columns to the table (Delta's mergeSchema).
        fallback_schema_json: the table's schema when an epoch must create it without rows.
        checkpoint_location: Spark's checkpoint, to tell a renamed link from a new one.
        dead_letter_table: the dead-letter Delta table (option ``deadLetterTable``), if any.
        storage: the query's ``storage.*`` settings, for tables and checkpoints on object stores.

    Raises:
        OptionError: a path names a store lastagent cannot reach.
    """

    def __init__(self, path: str, partition_by: tuple[str, ...] = (), merge_schema: bool = False,
                 fallback_schema_json: str | None = None, checkpoint_location: str | None = None,
                 dead_letter_table: str | None = None, storage: StorageConfig | None = None) -> None:
        self.path = path
        self.dead_letter_table = dead_letter_table
        self.storage = storage or StorageConfig()
        self._where = location(path, "path")
        self._dead_where = location(dead_letter_table, "deadLetterTable") if dead_letter_table else None
        self.partition_by = partition_by
        self.merge_schema = merge_schema
        self.fallback_schema_json = fallback_schema_json
        self.checkpoint_location = checkpoint_location

    def table(self) -> Snapshot | None:
        """The table at its newest version, or None while it does not exist.

        Raises:
            ArbitrationError: it cannot be read (nothing may be decided now).
        """
        return read_snapshot(self._where, self.storage)

    # -- ownership ----------------------------------------------------------------------------

    def claim(self, link: str, owner: str, *, takeover: bool = False, run: str = "") -> Ownership:
        """Claims the link's next generation in the target table's properties.

        A table that does not exist yet is created empty first when its schema is known (the
        query's rows, no transformer). Otherwise (a transformer's first run: the schema is known
        only from its first rows) the claim goes to a small Delta table in the checkpoint,
        ``<checkpointLocation>/lastagent/<link>.owner`` (:meth:`_pre_table`), until the first
        decision creates the target table and records the ownership there; generations go on
        from it. Without a checkpoint (tests) such a run has generation 0.
        """
        if self.table() is None:
            if self.fallback_schema_json is None:
                pre = self._pre_table(link)
                return Ownership(owner, 0) if pre is None else pre.claim(link, owner, takeover=takeover, run=run)
            self._create_empty()
        pre = self._pre_table(link)
        return claim_on_delta(self._claimable, f"Delta table {self.path}", link, owner, takeover, run,
                              base=None if pre is None else (lambda: pre.ownership(link)), kept=self._keep)

    def _pre_table(self, link: str) -> DeltaArbitrationStore | None:
        """Where a run claims the link while the target table does not exist and its schema is unknown.

        A Delta table of its own (a metadata commit is a claim that races safely, as in the target
        table), in the query's checkpoint, which every run of the query shares. Without it two first
        runs of one query (a restart while the old driver still runs) would both write under
        generation 0: the same transactional ids, each fencing the other's open transactions.
        """
        if self.checkpoint_location is None:
            return None
        return DeltaArbitrationStore(f"{self.checkpoint_location.rstrip('/')}/lastagent/{link}.owner", self.storage)

    def _superseded(self, link: str, generation: int, current: Ownership | None) -> bool:
        """True when ``generation`` may not decide. Generation 0 is a first run that found no table
        and no checkpoint to claim in (or a table an earlier version created): it may decide while
        the table has no owner of the link, or has itself at generation 0."""
        if generation != 0:
            return current is None or current.generation != generation
        return current is not None and (current.generation != 0 or current.owner != self._owner())

    def _record_first_run(self, link: str) -> None:
        """Records the link's ownership in the table the first decision just created.

        The ownership claimed in the checkpoint before the table existed (:meth:`_pre_table`), read
        now, so a run that claimed meanwhile keeps the link; else the first run, generation 0.
        A commit of its own after the creating one (which a lost race of two first runs may have made the other's);
        a racing commit makes it re-read, and an owner already recorded stays.
        """
        owner_key, gen_key = owner_keys(link)
        pre = self._pre_table(link)
        claimed = None if pre is None else pre.ownership(link)
        recorded = (ownership_properties(link, claimed) if claimed is not None
                    else {owner_key: self._owner(), gen_key: "0"})
        alter_properties(self._claimable, f"Delta table {self.path}", f"the owner of link {link!r}",
                         lambda table: None if delta_ownership(table, link) is not None else recorded, self._keep)

    def _owner(self) -> str:
        """The query that owns the checkpoint: the owner a new table records for generation 0."""
        from lastagent.spark_checkpoint import query_id

        if self.checkpoint_location is None:
            raise ArbitrationError(f"cannot create Delta table {self.path} without the query's checkpointLocation")
        return query_id(self.checkpoint_location, self.storage)

    def _claimable(self) -> Snapshot:
        table = self.table()
        if table is None:
            raise ArbitrationError(f"Delta table {self.path} disappeared while claiming its link")
        return table

    def _create_empty(self) -> None:
        assert self.fallback_schema_json is not None, "only called when the schema is known"
        try:
            delta_kernel.create_table(self._where.uri, self.storage.delta_options(self._where),
                                      {"operation": "CREATE TABLE", "isBlindAppend": True, "operationParameters": {
                                          "partitionBy": json.dumps(list(self.partition_by))}},
                                      delta_kernel.new_table(_delta_json(self.fallback_schema_json), self.partition_by,
                                                             int(time.time() * 1000)), "the empty target table")
        except (LostRace, ArbitrationError) as exc:  # a concurrent creator may have won; table() decides below
            log.info("creating Delta table %s: %s", self.path, exc)

    def ownership(self, link: str) -> Ownership | None:
        table = self.table()
        return self._ownership_in(table, link)

    def _ownership_in(self, table: Snapshot | None, link: str) -> Ownership | None:
        """The ownership the table records, else the one claimed before it existed (:meth:`_pre_table`)."""
        current = None if table is None else delta_ownership(table, link)
        if current is None:
            pre = self._pre_table(link)
            current = None if pre is None else pre.ownership(link)
        return current

    # -- epochs decided before the table exists -------------------------------------------------
    # With a transformer, the table's schema is known only from the first row, so the first
    # decision with rows creates the table. An epoch before that (an empty topic on a first run)
    # is decided with nothing to write and nowhere to record it; Spark still commits it. So that
    # the next start can tell such a checkpoint from one written under another link (which it must
    # refuse), those epochs are recorded in the checkpoint: <checkpoint>/lastagent/<link>.empty.json.

    def _empty_record(self, link: str) -> tuple[Any, str] | None:
        if self.checkpoint_location is None:
            return None
        from lastagent.spark_checkpoint import filesystem

        fs_, base = filesystem(self.checkpoint_location, storage=self.storage)
        return fs_, f"{base}/lastagent/{link}.empty.json"

    def empty_through(self, link: str) -> int:
        where = self._empty_record(link)
        if where is None or self.table() is not None:
            return -1
        fs_, path = where
        try:
            with fs_.open_input_stream(path) as f:
                record = json.loads(f.read())
        except FileNotFoundError:
            return -1
        except (OSError, ValueError) as exc:
            raise ArbitrationError(f"cannot read {path}, the record of link {link!r}'s epochs decided before "
                                   f"Delta table {self.path} existed: {exc}; nothing was changed") from exc
        if record.get("link") != link or record.get("table") != self.path:
            return -1  # written for another link or table: proves nothing here
        return int(record["through"])

    def _record_empty(self, link: str, epoch: int) -> None:
        """Records that ``epoch`` was decided with nothing written while the table does not exist."""
        where = self._empty_record(link)
        if where is None:
            return
        fs_, path = where
        fs_.create_dir(path.rsplit("/", 1)[0], recursive=True)
        body = json.dumps({"link": link, "table": self.path, "through": epoch}).encode()
        with fs_.open_output_stream(f"{path}.tmp") as f:
            f.write(body)
        fs_.move(f"{path}.tmp", path)  # whole or not at all: a torn record must not read as "through -1"

    def _keep(self, table: Snapshot, version: int, where: Location | None = None) -> None:
        """Checkpoints and expired log entries after a commit at ``version`` on ``table`` as read, as Spark's writer
        keeps the tables it commits to (:mod:`lastagent.delta.upkeep`). Driver. No data file is deleted: Spark's
        writer never vacuums a target table, and a dead-letter file a decided epoch names waits there for its commit.
        ``where``: the dead-letter table's location (else the target table's)."""
        where = where or self._where
        name = self.path if where is self._where else str(self.dead_letter_table)
        TableUpkeep(lambda: self.storage.filesystem(where), where.path, where.uri, self.storage.delta_options(where),
                    f"Delta table {name}").after_commit(version, table.id, table.configuration,
                                                        table.protocol.writer_features)

    def decide(self, record: ArbitrationRecord, generation: int, staged: StagedEpoch | None = None) -> Decision:
        """Commits the epoch's files, txn and record in one Delta commit, unless already decided.

        Raises:
            SchemaMismatchError: the rows do not fit the table (nothing committed).
            StaleOwnerError: ``generation`` is no longer the link's (nothing committed).
            ArbitrationError: the table cannot be read or written (nothing decided by this call).
        """
        staged = staged or StagedEpoch((), None, ())
        if not record.decided_at_ms:
            record = replace(record, decided_at_ms=int(time.time() * 1000))
        metadata = {"lastagent.link": record.link, "lastagent.epoch": str(record.epoch),
                    "lastagent.gxid": record.gxid, "lastagent.branches": json.dumps(list(record.branches)),
                    "lastagent.attempts": json.dumps([list(a) for a in staged.attempts]),
                    # Whose files these are: a killed run's files of the same epoch and task attempt differ only in
                    # the generation their names carry (sweep).
                    "lastagent.generation": str(generation),
                    "lastagent.confirmed_through": str(record.confirmed_through)}
        # What Spark's DESCRIBE HISTORY shows: ids and counts only, never payload or secrets.
        metadata["userMetadata"] = decision_metadata(record, files=len(staged.adds))
        if staged.dead_letter_adds:
            # Part of the decision: a restart commits exactly these files to the dead-letter table.
            metadata["lastagent.dead_letter_adds"] = json.dumps(list(staged.dead_letter_adds))

        def attempt() -> Decision:
            table = self.table()
            current = self._ownership_in(table, record.link)
            if self._superseded(record.link, generation, current):
                self.discard(staged)
                raise stale(record.link, generation, current)
            if table is not None:
                decided = table.app_version(record.link)
                if decided is not None and decided >= record.epoch:
                    self.discard(staged)
                    existing = self.get(record.link, record.epoch, table)
                    if existing is None:
                        raise ArbitrationError(f"link {record.link!r} epoch {record.epoch} is decided in "
                                               f"{self.path} but its commit is no longer in the table's history")
                    return Decision(existing, won=False)
            try:
                if table is None:
                    schema_json = staged.schema_json or self.fallback_schema_json
                    if schema_json is None:
                        if staged.adds or record.branches or staged.dead_letter_adds:
                            raise ArbitrationError(
                                f"cannot create Delta table {self.path}: the transformer produced no row yet, so "
                                "its schema is unknown; create the table first or let the first batch have rows")
                        self._record_empty(record.link, record.epoch)
                        return Decision(record, won=True)  # nothing written, nothing to decide
                    delta_kernel.create_table(
                        self._where.uri, self.storage.delta_options(self._where),
                        delta_kernel.streaming_commit_info(record.epoch, metadata, staged.adds),
                        [*delta_kernel.new_table(_delta_json(schema_json), self.partition_by, record.decided_at_ms),
                         *delta_kernel.append_actions(staged.adds, record.link, record.epoch, record.decided_at_ms)],
                        f"epoch {record.epoch} of link {record.link!r}")
                    self._record_first_run(record.link)
                else:
                    rules = self._same_rules(table, staged)
                    merged = self._fit(table, staged, rules)
                    if rules.identity:  # the marks move in the epoch's own commit, as Spark's writer moves them
                        merged = high_water_marks(merged or table.schema_json, rules.identity, staged.adds,
                                                  self.path) or merged
                    storage = self.storage.delta_options(self._where)
                    if rules.kernel:  # a feature only kernel's transaction writes
                        version = delta_kernel.commit_epoch(table.uri, storage, table.version,
                                                            table.id, [kernel_add(a) for a in staged.adds],
                                                            record.link, record.epoch, metadata, record.epoch)
                    else:  # a plain append: commitInfo, txn, adds, written put-if-absent through kernel's storage
                        version = delta_kernel.commit_actions(
                            table.uri, storage, table.version, table.id,
                            delta_kernel.streaming_commit_info(record.epoch, metadata, staged.adds),
                            delta_kernel.append_actions(staged.adds, record.link, record.epoch, record.decided_at_ms),
                            f"epoch {record.epoch} of link {record.link!r}", merged)
                    added = [] if merged is None else sorted(
                        {f["name"] for f in json.loads(merged)["fields"]}
                        - set(table.column_names))
                    if added:
                        log.info("Delta table %s: added column(s) %s (mergeSchema)", self.path, added)
                    self._keep(table, version)
                return Decision(record, won=True)
            except LostRace:
                raise
            except (SchemaMismatchError, ArbitrationError, UnsupportedTableFeatureError):
                raise
            except ValueError as exc:  # a schema Delta cannot hold (_delta_json)
                raise ArbitrationError(f"cannot commit to Delta table {self.path}: {exc}") from exc

        return until_committed(attempt, f"the Delta commit of link {record.link!r} epoch {record.epoch}", self.path)

    def rules(self, table: Snapshot) -> TableRules:
        """What the tasks must do to the target table's rows (:func:`rules_of`). Driver, at each epoch's start."""
        return rules_of(table, self.path, "target table")

    def require_kernel_writes(self, table: Snapshot) -> None:
        """Refuses a table whose commits go through Delta Kernel when kernel's write gate refuses it. Driver, at
        each epoch's start, after :meth:`rules` (whose own list refuses every case known to it first).

        Raises:
            UnsupportedTableFeatureError: naming the feature kernel names (or its gate), before anything is written.
        """
        reason = delta_kernel.write_gate(table.uri, self.storage.delta_options(self._where), table.version,
                                         table.id)
        if reason is not None:
            named = re.search(r"Feature '([^']+)'", reason)
            raise UnsupportedTableFeatureError(named[1] if named else "Delta Kernel's write gate", self.path,
                                               "target table", "lastagent commits to this table through Delta Kernel "
                                               f"0.30.1, which refuses to write to it: {reason}")

    def check_dead_letter_table(self) -> None:
        """Refuses an existing dead-letter table lastagent cannot write as is (:func:`require_plain`). Driver."""
        if self._dead_where is None:
            return
        table = read_snapshot(self._dead_where, self.storage)
        if table is None:
            return
        require_plain(table, str(self.dead_letter_table), "dead-letter table")

    def _same_rules(self, table: Snapshot, staged: StagedEpoch) -> TableRules:
        """The table's rules, which must be the ones the epoch's tasks applied.

        Raises:
            TableChangedError: a constraint, generated column, NOT NULL column, column mapping or
                feature changed after the epoch started (an ALTER TABLE meanwhile); the rows were
                checked against the old ones, so nothing is committed and a restart re-runs the epoch.
        """
        rules = self.rules(table)
        if staged.adds and rules != staged.rules:
            raise TableChangedError(
                f"Delta table {self.path} changed while the epoch ran (its constraints, generated or NOT NULL "
                f"columns, column mapping or features: now {rules}, the tasks applied {staged.rules}); nothing was "
                "committed. Restart the query: it checks the rows against the table as it is now")
        return rules

    def _fit(self, table: Snapshot, staged: StagedEpoch, rules: TableRules) -> str | None:
        """The schema the epoch's commit sets (the table's with the rows' new columns, when merging), or None when the
        table's schema stays.

        Raises:
            SchemaMismatchError: the rows do not fit, or would add columns to a table whose commits go through
                Delta Kernel's transaction (mergeSchema there is not built yet: a new column is an ALTER TABLE first).
        """
        if staged.schema_json is None:
            return None
        current = table.schema_json
        problems, new = schema_diff(current, staged.schema_json, self.merge_schema)
        if not problems and new and rules.kernel:
            problems = [f"column {f['name']!r} is not in the table, and mergeSchema does not add columns to a table "
                        "whose commits go through Delta Kernel (row tracking, clustering, in-commit timestamps, "
                        "domain metadata, column defaults, type widening); add it with ALTER TABLE ... ADD COLUMN "
                        "first" for f in new]
        if problems:
            raise schema_error(self.path, problems)
        if not new:
            return None
        # Nullable columns at the end, in the epoch's own commit (Spark's mergeSchema on a streaming append).
        merged = json.loads(current)
        merged["fields"] = [*merged["fields"], *new]
        return _delta_json(json.dumps(merged))

    def discard(self, staged: StagedEpoch) -> None:
        """Deletes staged files that no decision references."""
        for where, adds in ((self._where, staged.adds), (self._dead_where, staged.dead_letter_adds)):
            if not adds or where is None:
                continue
            fs, root = self.storage.filesystem(where), where.path
            for a in adds:
                with contextlib.suppress(FileNotFoundError):
                    fs.delete_file(f"{root}/{a['path']}")

    def complete_dead_letters(self, link: str, epoch: int) -> int:
        """Commits a decided epoch's dead-letter files to the dead-letter table, exactly once.

        The dead-letter table is a one-phase participant after the last agent: its commit
        carries ``txn(link, epoch)``, so running this again (after a crash, at the next start)
        adds nothing twice. Driver side.

        Returns:
            The number of files committed now (0 when none or already committed).
        """
        if self.dead_letter_table is None:
            return 0
        commit = self._commit_of(link, epoch)
        adds = json.loads(commit.get("lastagent.dead_letter_adds", "[]")) if commit else []
        if not adds:
            return 0
        from lastagent.delta.dead_letter_table import TABLE_SCHEMA

        dead = self._dead_where
        assert dead is not None, "dead_letter_table is set"

        def attempt() -> int:
            table = read_snapshot(dead, self.storage)
            done = None if table is None else table.app_version(link)
            if done is not None and done >= epoch:
                return 0
            now = int(time.time() * 1000)
            info = {"operation": "WRITE", "operationParameters": {"mode": "Append", "partitionBy": "[]"},
                    "isBlindAppend": True, "lastagent.link": link, "lastagent.epoch": str(epoch)}
            what = f"the dead letters of link {link!r} epoch {epoch}"
            if table is None:
                schema = delta_files.delta_schema_json(TABLE_SCHEMA)
                delta_kernel.create_table(dead.uri, self.storage.delta_options(dead), info,
                                          [*delta_kernel.new_table(schema, (), now),
                                           *delta_kernel.append_actions(adds, link, epoch, now)], what)
            else:
                version = delta_kernel.commit_actions(
                    table.uri, self.storage.delta_options(dead), table.version, table.id,
                    info, delta_kernel.append_actions(adds, link, epoch, now), what)
                self._keep(table, version, dead)
            log.info("link %s epoch %d: %d dead-letter file(s) committed to %s", link, epoch, len(adds),
                     self.dead_letter_table)
            return len(adds)

        return until_committed(attempt, f"the dead letters of link {link!r} epoch {epoch}", str(self.dead_letter_table))

    # -- reading records --------------------------------------------------------------------

    def _commits(self, table: Snapshot | None = None, link: str | None = None, epoch: int | None = None) -> list[dict[str, Any]]:
        """The lastagent commits of the table's recent history, newest first.

        With ``link`` and ``epoch``, the look widens until it holds that epoch's commit or reaches
        the oldest commit the log still keeps: a busy table (or OPTIMIZE runs) never pushes a
        record out of sight.
        """
        table = table or self.table()
        if table is None:
            return []
        limit = HISTORY_FIRST_LOOK
        while True:
            history = table.commits(limit)
            found = [c for c in history if "lastagent.link" in c]
            if epoch is None or len(history) < limit or any(
                    c["lastagent.link"] == link and int(c["lastagent.epoch"]) == epoch for c in found):
                return found
            limit *= 4

    def _commit_of(self, link: str, epoch: int, table: Snapshot | None = None) -> dict[str, Any] | None:
        """The commit that decided ``epoch``, or None when it was not decided.

        Raises:
            ArbitrationError: the table's ``txn`` says the epoch is the link's newest decision but
                its commit is no longer in the log (cleaned up): its record cannot be read, so
                nothing may be inferred from it.
        """
        table = table or self.table()
        if table is None:
            return None
        commit = next((c for c in self._commits(table, link, epoch)
                       if c["lastagent.link"] == link and int(c["lastagent.epoch"]) == epoch), None)
        if commit is None and table.app_version(link) == epoch:
            raise ArbitrationError(
                f"link {link!r}: epoch {epoch} is the newest decided epoch of Delta table {self.path}, but its commit "
                "(the arbitration record) is no longer in the table's log, so its Kafka branches cannot be told "
                "apart; nothing was changed. Keep the log longer (delta.logRetentionDuration) and decide the "
                "link's open branches by hand with `lastagent recover`")
        return commit

    @staticmethod
    def _record(c: dict[str, Any]) -> ArbitrationRecord:
        return ArbitrationRecord(c["lastagent.link"], int(c["lastagent.epoch"]), c["lastagent.gxid"],
                                 tuple(json.loads(c["lastagent.branches"])), int(c.get("timestamp", 0)),
                                 int(c.get("lastagent.confirmed_through", -1)))

    def records(self, link: str) -> list[ArbitrationRecord]:
        """The link's decisions in recent history, always including the newest one (or an error)."""
        table = self.table()
        if table is None:
            return []
        latest = table.app_version(link)
        if latest is not None:
            self._commit_of(link, latest, table)  # fails closed when the newest record is gone
        return sorted((self._record(c) for c in self._commits(table, link, latest) if c["lastagent.link"] == link),
                      key=lambda r: r.epoch)

    def figures(self, link: str, last: int) -> list[tuple[int, int, EpochFigures | None]]:
        """The newest ``last`` decisions' figures, from the commits' ``userMetadata`` (newest first)."""
        return figures_in_history(self._commits(), link, last) if last > 0 else []

    def attempts(self, link: str) -> dict[int, tuple[int | None, set[tuple[int, int]]]]:
        """Per decided epoch still in history: the generation whose files it committed (None in a commit older than
        the key) and the task attempts."""
        return {int(c["lastagent.epoch"]): (int(c["lastagent.generation"]) if "lastagent.generation" in c else None,
                                            {tuple(a) for a in json.loads(c.get("lastagent.attempts", "[]"))})
                for c in self._commits() if c["lastagent.link"] == link}

    def get(self, link: str, epoch: int, table: Snapshot | None = None) -> ArbitrationRecord | None:
        commit = self._commit_of(link, epoch, table)
        return None if commit is None else self._record(commit)

    def latest_epoch(self, link: str) -> int | None:
        table = self.table()
        return None if table is None else table.app_version(link)

    def cleanup(self, link: str, retain_epochs: int) -> int:
        """Nothing to do: records are commits of the table; Delta's log retention ages them out."""
        return 0

    def check_link(self, link: str) -> None:
        """Fails when a restarted query's link has no commits but another link's are there (renamed)."""
        if self.checkpoint_location is None or self.latest_epoch(link) is not None:
            return
        from lastagent.spark_checkpoint import committed_through

        if committed_through(self.checkpoint_location, self.storage) < 0:
            return  # a new query: a table shared with other links is fine
        others = sorted({c["lastagent.link"] for c in self._commits()})
        if others:
            raise LinkMismatchError(
                f"option 'link': the checkpoint has committed epochs but Delta table {self.path} has no commit of "
                f"link {link!r}, only of {others}. A link's name must stay stable (its epochs are found by it); "
                "use the old name, or a new checkpointLocation for a new link")

    def accepted_lost(self, link: str) -> frozenset[int]:
        return accepted_lost_on_delta(self.table(), link)

    def accept_lost(self, link: str, epoch: int) -> None:
        accept_lost_on_delta(self._claimable, f"Delta table {self.path}", link, epoch, kept=self._keep)

    def size(self) -> tuple[int, int]:
        """(lastagent commits in recent history, data files) for ``lastagent status``."""
        table = self.table()
        if table is None:
            return 0, 0
        return len(self._commits(table)), len(table.files())

    # -- files of undecided epochs ------------------------------------------------------------

    def sweep(self, link: str, decided_through: int, through_generation: int) -> int:
        """Deletes the link's data files that no decision references, in the table and the dead-letter table.

        Driver, at query start (and after an epoch whose tasks Spark retried).

        A file of an epoch newer than the newest decision was never committed; a file of a
        decided epoch from an attempt the decision does not list belongs to a failed or
        superseded attempt. No task of this run or an earlier one runs while this runs; files of
        a newer run (a generation above ``through_generation``) are that run's and left alone.

        Returns:
            The number of files deleted.
        """
        attempts = self.attempts(link) if decided_through >= 0 else {}
        removed = 0
        for where in (self._where, self._dead_where):
            if where is not None:
                removed += self._sweep(where, link, decided_through, through_generation, attempts)
        return removed

    def _sweep(self, where: Location, link: str, decided_through: int, through_generation: int,
               attempts: dict[int, tuple[int | None, set[tuple[int, int]]]]) -> int:
        from pyarrow import fs as pafs

        path = where.given
        filesystem, root = self.storage.filesystem(where), where.path
        try:
            infos = filesystem.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        except OSError as exc:
            log.warning("cannot list %s to remove files of undecided epochs: %s", path, exc)
            return 0
        oldest_known = min(attempts, default=decided_through + 1)
        removed = 0
        for info in infos:
            if info.type != pafs.FileType.File or "/_delta_log/" in info.path:
                continue
            named = delta_files.parse_file_name(info.base_name)
            if named is None or named[0] != link or named[1] > through_generation:
                continue
            _, generation, epoch, partition, attempt = named
            decided_by, committed = attempts.get(epoch, (None, None))
            # Not committed: an epoch no decision covers yet, or a decided one whose decision lists other files
            # (another task attempt, or the same attempt of another run: each killed run rewrites the epoch).
            orphan = epoch > decided_through or (epoch >= oldest_known and committed is not None and (
                (partition, attempt) not in committed or decided_by not in (None, generation)))
            if orphan:
                filesystem.delete_file(info.path)
                removed += 1
        if removed:
            log.info("link %s: deleted %d data file(s) of undecided epochs or failed attempts in %s",
                     link, removed, path)
        return removed
