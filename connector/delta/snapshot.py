"""A Delta table at one version, as Delta Kernel reads it (``lastagent._native``, native/src/delta.rs). Driver only.

Every Delta read lastagent makes goes through here, and every commit (:mod:`lastagent.delta.kernel`) goes on top of
a version read here, so a decision reads the table once, through the engine that commits it. A :class:`Snapshot` is
a value: its version, id, configuration, protocol and schema as the log holds them; what it reads further (``txn``
versions, the commits' ``commitInfo``, the data files and their rows) is of that version, however the table moves
meanwhile. Reading the newest version brings the process's last snapshot of the table forward (kernel lists and reads
only the commits since), so a link's every read costs the commits since its previous one, not the table's age.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lastagent.errors import ArbitrationError
from lastagent.storage import Location, StorageConfig

#: How many commits' ``commitInfo`` the process keeps (a commit never changes once written; a decision reads the
#: newest few hundred, the block its :data:`~lastagent.delta.batch_table.HISTORY_DEPTH`).
_KEPT_COMMITS = 20_000

#: How many commit files one read asks for at a time, newest first.
_COMMITS_PER_READ = 64


def _native() -> Any:
    import lastagent._native as native

    return native


class _CommitCache:
    """The ``commitInfo`` of commits read before, by table (URI and id) and version. Driver, any thread."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._kept: OrderedDict[tuple[str, str, int], dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str, int]) -> dict[str, Any] | None:
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
            return found

    def put(self, key: tuple[str, str, int], info: dict[str, Any]) -> None:
        with self._lock:
            self._kept[key] = info
            while len(self._kept) > self._size:
                self._kept.popitem(last=False)


_COMMITS = _CommitCache(_KEPT_COMMITS)


@dataclass(frozen=True)
class Protocol:
    """A table's ``protocol`` action: its reader and writer versions and, from versions 3 and 7, its features."""

    min_reader_version: int
    min_writer_version: int
    reader_features: tuple[str, ...] | None = None
    writer_features: tuple[str, ...] | None = None


@dataclass(frozen=True)
class DataFile:
    """One data file of a snapshot: its path as the log holds it (URL-encoded, relative to the table's root), size
    in bytes and partition values."""

    path: str
    size: int
    partition_values: Mapping[str, str]


@dataclass(frozen=True)
class Snapshot:
    """A Delta table at ``version``, read through Delta Kernel. Driver.

    Attributes:
        where: the table's location (:mod:`lastagent.storage`).
        storage: the ``storage.*`` settings its store takes (None for a local path).
        version: the table version read.
        id: the table's id (its ``metaData``): a table dropped and made again at the same path has another.
        configuration: the table's properties.
        partition_columns: its partition columns, in order.
        schema_json: its schema as the log holds it (``schemaString``, Delta's JSON).
        protocol: its ``protocol`` action.
        filesystem: builds the pyarrow filesystem of ``where`` (for :meth:`rows`).
    """

    where: Location
    storage: Mapping[str, str] | None
    version: int
    id: str
    configuration: Mapping[str, str]
    partition_columns: tuple[str, ...]
    schema_json: str
    protocol: Protocol
    filesystem: Callable[[], Any] = field(repr=False, compare=False)
    _apps: dict[str, int | None] = field(default_factory=dict, repr=False, compare=False)

    @property
    def uri(self) -> str:
        """The table's URI as Delta Kernel and :mod:`lastagent.delta.kernel` take it."""
        return self.where.uri

    @property
    def column_names(self) -> tuple[str, ...]:
        """The names of the schema's top-level columns, in order."""
        return tuple(f["name"] for f in json.loads(self.schema_json)["fields"])

    def _storage(self) -> dict[str, str]:
        return dict(self.storage or {})

    def app_versions(self, apps: Sequence[str]) -> list[int | None]:
        """The ``txn`` version of each of ``apps`` at this version (None: none, or expired under
        ``delta.setTransactionRetentionDuration``, as Spark reads it). Read once per app and snapshot.

        Raises:
            ArbitrationError: the log cannot be read.
        """
        wanted = [a for a in dict.fromkeys(apps) if a not in self._apps]
        if wanted:
            native = _native()
            try:
                found = native.delta_app_versions(self.uri, self._storage(), self.version, self.id, wanted)
            except native.DeltaKernelError as exc:
                raise ArbitrationError(f"cannot read Delta table {self.where.given}: {exc}") from exc
            self._apps.update(zip(wanted, found))
        return [self._apps[a] for a in apps]

    def app_version(self, app: str) -> int | None:
        """The ``txn`` version of ``app`` (:meth:`app_versions`)."""
        return self.app_versions([app])[0]

    def commits(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` commits' ``commitInfo`` (None: every commit the log still keeps), newest first, each
        with its ``version``, as Delta's history shows them. Stops at the oldest commit file the log keeps (a log
        cleanup removes the oldest first).

        Raises:
            ArbitrationError: the log cannot be read.
        """
        native = _native()
        out: list[dict[str, Any]] = []
        version = self.version
        while version >= 0 and (limit is None or len(out) < limit):
            count = _COMMITS_PER_READ if limit is None else min(_COMMITS_PER_READ, limit - len(out))
            versions = list(range(version, max(-1, version - count), -1))
            infos = {v: _COMMITS.get((self.uri, self.id, v)) for v in versions}
            missing = [v for v, info in infos.items() if info is None]
            if missing:
                try:
                    read = native.delta_commit_infos(self.uri, self._storage(), missing)
                except native.DeltaKernelError as exc:
                    raise ArbitrationError(f"cannot read the history of Delta table {self.where.given}: {exc}") from exc
                for v, text in zip(missing, read):
                    if text is not None:
                        fresh = {**json.loads(text), "version": v}
                        _COMMITS.put((self.uri, self.id, v), fresh)
                        infos[v] = fresh
            for v in versions:
                info = infos[v]
                if info is None:  # cleaned up: every older commit is gone too
                    return out
                out.append(info)
            version -= count
        return out

    def files(self) -> list[DataFile]:
        """The data files of this version.

        Raises:
            ArbitrationError: the log cannot be read, or a file has a deletion vector (lastagent reads only its own
                tables' rows, which have none).
        """
        native = _native()
        try:
            listed = native.delta_scan_files(self.uri, self._storage(), self.version, self.id)
        except native.DeltaKernelError as exc:
            raise ArbitrationError(f"cannot read Delta table {self.where.given}: {exc}") from exc
        with_vectors = [path for path, _, _, dv in listed if dv]
        if with_vectors:
            raise ArbitrationError(f"Delta table {self.where.given} has rows deleted by deletion vectors (in "
                                   f"{with_vectors[0]}); lastagent reads only its own tables, which have none")
        return [DataFile(path, size, partitions) for path, size, partitions, _ in listed]

    def rows(self, columns: Sequence[str] | None = None) -> Any:
        """The rows of this version (a ``pyarrow.Table``; ``columns`` only, when given), read from its data files
        with pyarrow. For lastagent's own small, unpartitioned tables (the arbitration table).

        Raises:
            ArbitrationError: a file cannot be listed or read.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        from lastagent.delta.files import arrow_schema

        schema = arrow_schema(self.schema_json)
        if columns is not None:
            schema = pa.schema([schema.field(c) for c in columns])
        files = self.files()
        if any(f.partition_values for f in files):
            raise ArbitrationError(f"Delta table {self.where.given} is partitioned; lastagent reads the rows of its "
                                   "own tables only, which are not")
        filesystem, parts = self.filesystem(), []
        for f in files:
            # PROTOCOL.md: a relative path, or an absolute URI ("file:/…", "s3://…": a shallow clone's files).
            if urllib.parse.urlsplit(f.path).scheme or f.path.startswith("/"):
                raise ArbitrationError(f"Delta table {self.where.given} names a file outside its directory "
                                       f"({f.path}); lastagent reads only its own tables, which do not")
            try:
                part = pq.read_table(f"{self.where.path}/{urllib.parse.unquote(f.path)}", filesystem=filesystem,
                                     columns=list(schema.names))
            except OSError as exc:
                raise ArbitrationError(f"cannot read {f.path} of Delta table {self.where.given}: {exc}") from exc
            parts.append(part.select(schema.names).cast(schema))
        return pa.concat_tables(parts) if parts else schema.empty_table()


def read_snapshot(where: Location, storage: StorageConfig) -> Snapshot | None:
    """The table at ``where`` at its newest version, or None when there is no Delta table there. Driver.

    Raises:
        ArbitrationError: the table cannot be read (its store, its log); nothing may be decided from it now.
    """
    native = _native()
    options = storage.delta_options(where)
    try:
        read = native.delta_snapshot(where.uri, dict(options or {}))
    except native.DeltaKernelError as exc:
        raise ArbitrationError(f"cannot read Delta table {where.given}: {exc}") from exc
    if read is None:
        return None
    version, metadata_json, protocol_json = read
    metadata, protocol = json.loads(metadata_json), json.loads(protocol_json)

    def features(key: str) -> tuple[str, ...] | None:
        return None if protocol.get(key) is None else tuple(protocol[key])

    return Snapshot(where, options, int(version), str(metadata["id"]), dict(metadata.get("configuration") or {}),
                    tuple(metadata.get("partitionColumns") or ()), str(metadata["schemaString"]),
                    Protocol(int(protocol["minReaderVersion"]), int(protocol["minWriterVersion"]),
                             features("readerFeatures"), features("writerFeatures")),
                    lambda: storage.filesystem(where))
