"""The arbitration table of a ``lastagent-kafka`` link: one row per decided epoch, in a Delta table. Driver side.

For a link whose only target is Kafka, the last agent's one-phase commit is one Delta commit to a dedicated
arbitration table: one row per decided epoch (link, epoch, gxid, branches, decided_at, confirmed_through) plus a
Delta ``txn`` action (appId = link, version = epoch). The ``txn`` action makes the decision idempotent and
race-safe: of two deciders that commit the same epoch concurrently, Delta's conflict check lets exactly one win,
and the other reads the winner's record and follows it. Spark reads the table with ``spark.read.format("delta")``.

Completion is recorded without extra commits: each decision row carries ``confirmed_through``, the newest epoch
whose branches were all confirmed committed before it was written. Cleanup deletes only rows at or below that
mark, minus a retention window. Rows carry ids, counts and partitions only: never payload, never secrets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import replace
from typing import Any

from lastagent.core.arbitration import (
    ArbitrationRecord,
    Decision,
    LostRace,
    Ownership,
    decision_metadata,
    figures_in_history,
    holds_no_data,
    stale,
)
from lastagent.core.figures import EpochFigures
from lastagent.delta import kernel as delta_kernel
from lastagent.delta.files import kernel_add, write_table_file
from lastagent.delta.snapshot import Snapshot, read_snapshot
from lastagent.delta.table_properties import (
    accept_lost_on_delta,
    accepted_lost_on_delta,
    claim_on_delta,
    delta_ownership,
    until_committed,
)
from lastagent.delta.upkeep import TableUpkeep
from lastagent.errors import ArbitrationError, LinkMismatchError
from lastagent.storage import StorageConfig, location

log = logging.getLogger("lastagent.delta")


class DeltaArbitrationStore:
    """Arbitration rows in a Delta table, read and committed through Delta Kernel, from the driver.

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
        self._plain_at: int | None = None  # the table version whose features were last checked

    def _keep(self, table: Snapshot, version: int) -> None:
        """Checkpoints and cleanups after a commit at ``version`` on ``table`` as read (:mod:`lastagent.delta.upkeep`):
        the table's files stay bounded by its retention, not by the link's age."""
        TableUpkeep(lambda: self._config.filesystem(self._where), self._where.path, self._where.uri, self._storage,
                    f"arbitration table {self.path}", vacuum=True).after_commit(
            version, table.id, table.configuration, table.protocol.writer_features)

    def _table(self) -> Snapshot | None:
        """The table at its newest version, or None before its first claim creates it.

        Raises:
            ArbitrationError: it cannot be read (nothing may be decided now), or is not an arbitration table.
        """
        table = read_snapshot(self._where, self._config)
        if table is None:
            return None
        names = table.column_names
        if names != self.SCHEMA_FIELDS:
            raise ArbitrationError(
                f"option 'arbitrationTable': {self.path} is a Delta table of another schema (columns {list(names)}), "
                f"not a lastagent arbitration table (columns {list(self.SCHEMA_FIELDS)}); give a path of its own")
        if table.version != self._plain_at:  # the features are checked once per version read, not per call
            from lastagent.delta.features import require_plain

            require_plain(table, self.path, "arbitration table", nullable=False)
            self._plain_at = table.version
        return table

    def _ensure_table(self) -> Snapshot:
        """Opens the table, creating it empty first; a creation race leaves one table.

        A path that holds other files but no Delta table is refused, not turned into a table.
        """
        table = self._table()
        if table is not None:
            return table
        from pyarrow import fs

        from lastagent.delta.files import delta_schema_json

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
            schema = delta_schema_json(self._arrow([]).schema)
            delta_kernel.create_table(self._where.uri, self._storage, {"operation": "CREATE TABLE",
                                                                       "isBlindAppend": True},
                                      delta_kernel.new_table(schema, (), int(time.time() * 1000),
                                                             "lastagent_arbitration"), "the arbitration table")
        except (LostRace, ArbitrationError) as exc:  # a concurrent creator may have won; re-open below
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
        links = set(table.rows(["link"]).column("link").to_pylist())
        if links and link not in links:
            raise LinkMismatchError(
                f"option 'link': the arbitration table {self.path} belongs to link(s) {sorted(links)}, "
                f"not {link!r}. A link's name must stay stable (its in-doubt branches are found by it); "
                "use the old name, or a new arbitrationTable for a new link"
            )

    def claim(self, link: str, owner: str, *, takeover: bool = False, run: str = "") -> Ownership:
        return claim_on_delta(self._ensure_table, f"arbitration table {self.path}", link, owner, takeover, run,
                              kept=self._keep)

    def ownership(self, link: str) -> Ownership | None:
        table = self._table()
        return None if table is None else delta_ownership(table, link)

    def empty_through(self, link: str) -> int:
        return -1  # created by the first claim, before any decision

    def decide(self, record: ArbitrationRecord, generation: int, staged: None = None) -> Decision:
        holds_no_data(record, staged)
        if not record.decided_at_ms:
            record = replace(record, decided_at_ms=int(time.time() * 1000))
        info = {"operation": "WRITE", "operationParameters": {"mode": "Append", "partitionBy": "[]"},
                "isBlindAppend": True, "lastagent.link": record.link, "lastagent.epoch": str(record.epoch),
                "lastagent.gxid": record.gxid, "lastagent.branches": str(len(record.branches)),
                "userMetadata": decision_metadata(record)}
        what = f"the arbitration of link {record.link!r} epoch {record.epoch}"

        def attempt() -> Decision:
            table = self._ensure_table()
            current = delta_ownership(table, record.link)
            if current is None or current.generation != generation:
                raise stale(record.link, generation, current)
            decided = table.app_version(record.link)
            if decided is not None and decided >= record.epoch:
                existing = self.get(record.link, record.epoch, table)
                if existing is None:
                    raise ArbitrationError(
                        f"link {record.link!r} epoch {record.epoch} is decided in {self.path} but its row is gone")
                return Decision(existing, won=False)
            # The row's file, then the commit (its add, txn(link, epoch), the record's keys), put-if-absent: a
            # decider that lost the version re-reads and follows what won (until_committed).
            filesystem, root = self._config.filesystem(self._where), self._where.path
            add = write_table_file(filesystem, root, self._arrow([record]))
            try:
                version = delta_kernel.commit_actions(
                    table.uri, self._storage, table.version, table.id, info,
                    delta_kernel.append_actions([add], record.link, record.epoch, record.decided_at_ms), what)
            except (LostRace, ArbitrationError):
                with contextlib.suppress(FileNotFoundError):
                    filesystem.delete_file(f"{root}/{add['path']}")  # referenced by no commit
                raise
            self._keep(table, version)
            return Decision(record, won=True)

        return until_committed(attempt, what, self.path)

    def get(self, link: str, epoch: int, table: Snapshot | None = None) -> ArbitrationRecord | None:
        table = table or self._table()
        if table is None:
            return None
        import pyarrow.compute as pc

        data = table.rows()
        rows = data.filter(pc.and_(pc.equal(data["link"], link), pc.equal(data["epoch"], epoch))).to_pylist()
        return self._record(rows[0]) if rows else None

    def records(self, link: str) -> list[ArbitrationRecord]:
        table = self._table()
        if table is None:
            return []
        rows = table.rows().to_pylist()
        return sorted((self._record(r) for r in rows if r["link"] == link), key=lambda r: r.epoch)

    def latest_epoch(self, link: str) -> int | None:
        table = self._table()
        if table is None:
            return None
        return table.app_version(link)

    def cleanup(self, link: str, retain_epochs: int) -> int:
        rows = self.records(link)
        if not rows:
            return 0
        limit = max(r.confirmed_through for r in rows) - retain_epochs
        doomed = [r for r in rows if r.epoch <= limit]
        if not doomed:
            return 0

        def attempt() -> None:
            # One commit that removes every file and adds one with the rows that stay (a delete and a compaction).
            import pyarrow.compute as pc

            table = self._table()
            if table is None:
                raise ArbitrationError(f"arbitration table {self.path} is gone")
            rows = table.rows()
            keep = rows.filter(pc.invert(pc.and_(pc.equal(rows["link"], link), pc.less_equal(rows["epoch"], limit))))
            now = int(time.time() * 1000)
            # The paths as the log holds them (already URL-encoded), so each remove names its add exactly.
            actions: list[dict[str, Any]] = [
                {"remove": {"path": f.path, "deletionTimestamp": now, "dataChange": True,
                            "extendedFileMetadata": True, "partitionValues": {}, "size": f.size}}
                for f in table.files()]
            filesystem, root = self._config.filesystem(self._where), self._where.path
            add = write_table_file(filesystem, root, keep) if keep.num_rows else None
            if add is not None:
                actions.append({"add": kernel_add(add)})
            try:
                version = delta_kernel.commit_actions(
                    table.uri, self._storage, table.version, table.id,
                    {"operation": "DELETE", "isBlindAppend": False, "operationParameters": {
                        "predicate": json.dumps([f"link = '{link}' AND epoch <= {limit}"])}},
                    actions, f"the cleanup of link {link!r} through epoch {limit}")
            except (LostRace, ArbitrationError):
                if add is not None:
                    with contextlib.suppress(FileNotFoundError):
                        filesystem.delete_file(f"{root}/{add['path']}")
                raise
            self._keep(table, version)

        until_committed(attempt, f"the cleanup of link {link!r}", self.path)
        return len(doomed)

    def figures(self, link: str, last: int) -> list[tuple[int, int, EpochFigures | None]]:
        table = self._table()
        if table is None or last <= 0:
            return []
        # Every decision is one commit; claims and cleanups are few, so a little more than ``last``
        # commits of history hold the newest ``last`` decisions (fewer when the log was cleaned up).
        return figures_in_history(table.commits(2 * last + 10), link, last)

    def accepted_lost(self, link: str) -> frozenset[int]:
        return accepted_lost_on_delta(self._table(), link)

    def accept_lost(self, link: str, epoch: int) -> None:
        accept_lost_on_delta(self._ensure_table, f"arbitration table {self.path}", link, epoch, kept=self._keep)

    def size(self) -> tuple[int, int]:
        """(rows, data files) of the table, for ``lastagent status``."""
        table = self._table()
        if table is None:
            return 0, 0
        return table.rows(["epoch"]).num_rows, len(table.files())
