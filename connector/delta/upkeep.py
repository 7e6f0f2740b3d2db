"""What Spark's Delta writer does to a table after a commit, done after the commits lastagent makes. Driver only.

Spark's writer keeps every table it commits to: a checkpoint every ``delta.checkpointInterval`` versions, and after
it the log entries past ``delta.logRetentionDuration`` removed (PROTOCOL.md, "Metadata Cleanup"). lastagent commits
through Delta Kernel, which does neither on its own, so without this a table only lastagent writes (the arbitration
table, the dead-letter table) keeps every JSON commit, and each read of it replays a log that grows with the link's
age. :class:`TableUpkeep` does both after each of lastagent's commits, as Spark does:

- **Checkpoint** at a version that is a multiple of the interval (10 where the table does not set it), written by
  kernel, classic or V2 as the table's features say.
- **Expired log entries** (:func:`expired_log_files`): every commit, checkpoint and checksum below the newest complete
  checkpoint whose previous commit is older than the cutoff: now minus ``delta.logRetentionDuration`` (30 days),
  truncated to midnight UTC as Spark truncates it. Spark's ``BufferingLogDeletionIterator`` rules: a commit's time
  is its file's, raised to one millisecond past the previous commit's where the clock went back. Not where
  ``delta.enableExpiredLogCleanup`` is false, nor on a ``v2Checkpoint`` table (its sidecars are Spark's to keep).
  The cleanup always ends at a checkpoint, which is what ``checkpointProtection`` asks of a writer.
- **Unreferenced data files**, on lastagent's arbitration table only (:func:`unreferenced_files`): VACUUM's rule,
  read from the checkpoint just written (its adds, and its tombstones: removes within
  ``delta.deletedFileRetentionDuration``, 7 days): a file neither holds, written before that retention and
  :data:`MIN_FILE_AGE_MS` ago, is deleted. Not on target tables (Spark's writer never vacuums; users run VACUUM) and not
  on the dead-letter table, whose files a decided epoch names before its commit there (a restart commits them).

The log listing runs when the cutoff moved since this process last cleaned the table (so once a day per table at
Spark's granularity, not at every checkpoint): a log kept 30 days holds millions of entries at a one-second trigger,
and listing them at each checkpoint would make the epoch cost grow with them. A failed upkeep is logged and never
fails the commit it follows: the decision stands, only the table is kept later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import unquote

from lastagent.delta import kernel as delta_kernel
from lastagent.errors import ArbitrationError

log = logging.getLogger("lastagent.delta")

#: ``DeltaConfigs.CHECKPOINT_INTERVAL``'s default: Spark's writer checkpoints every 10 versions.
CHECKPOINT_INTERVAL = 10
_DAY_MS = 24 * 3600 * 1000
#: Spark's defaults: ``delta.logRetentionDuration`` 30 days, ``delta.deletedFileRetentionDuration`` 7 days.
LOG_RETENTION_MS = 30 * _DAY_MS
DELETED_FILE_RETENTION_MS = 7 * _DAY_MS
#: A data file younger than this is never deleted, whatever the retention: it may be a decider's file not yet
#: committed (written, then committed put-if-absent; a decider stalled this long has lost its race anyway).
MIN_FILE_AGE_MS = 10 * 60 * 1000
#: How the log's cutoff is truncated: Spark truncates to midnight UTC ("day"). ``LASTAGENT_DELTA_LOG_CUTOFF`` set to
#: "hour", "minute" or "none" truncates less, for a benchmark or test that shows the cleanup within one run.
_GRANULARITY_MS = {"day": _DAY_MS, "hour": 3600 * 1000, "minute": 60 * 1000, "none": 1}

_UNITS_MS = {"week": 7 * _DAY_MS, "day": _DAY_MS, "hour": 3600 * 1000, "minute": 60 * 1000, "second": 1000,
             "millisecond": 1, "microsecond": 0.001}
_LOG_FILE = re.compile(r"^(\d{20})\.(?:json|crc|checkpoint\.parquet|checkpoint\.(\d+)\.(\d+)\.parquet|"
                       r"checkpoint\.[0-9a-fA-F-]{36}\.(?:json|parquet))$")
_COMPACTED = re.compile(r"^(\d{20})\.(\d{20})\.compacted\.json$")


def interval_ms(text: str, option: str) -> int:
    """A Delta interval property (``"interval 30 days"``, ``"1 hour"``, ``"interval 2 days 3 hours"``) in ms. Pure.

    Raises:
        ArbitrationError: not an interval Delta takes for this property (months and years are refused, as Delta
            refuses them for durations), naming the property.
    """
    words = text.strip().lower().split()
    if words[:1] == ["interval"]:
        words = words[1:]
    if not words or len(words) % 2:
        raise ArbitrationError(f"table property {option} = {text!r} is not an interval such as 'interval 7 days'")
    total = 0.0
    for amount, named in zip(words[::2], words[1::2]):
        unit = named[:-1] if named.endswith("s") else named
        try:
            total += float(amount) * _UNITS_MS[unit]
        except (KeyError, ValueError):
            raise ArbitrationError(f"table property {option} = {text!r}: {amount} {unit} is not a duration Delta "
                                   f"takes (units: {', '.join(_UNITS_MS)})") from None
    return int(total)


@dataclass(frozen=True)
class Retention:
    """A table's upkeep settings, from its properties (Spark's defaults where it sets none). Pure."""

    checkpoint_interval: int = CHECKPOINT_INTERVAL
    clean_log: bool = True
    log_retention_ms: int = LOG_RETENTION_MS
    deleted_file_retention_ms: int = DELETED_FILE_RETENTION_MS

    @classmethod
    def of(cls, configuration: Mapping[str, str]) -> Retention:
        def get(key: str) -> str | None:
            value = configuration.get(key)
            return None if value is None or not str(value).strip() else str(value)

        interval = get("delta.checkpointInterval")  # not a number: ValueError, which after_commit logs
        log_retention = get("delta.logRetentionDuration")
        file_retention = get("delta.deletedFileRetentionDuration")
        return cls(int(interval) if interval else CHECKPOINT_INTERVAL,
                   (get("delta.enableExpiredLogCleanup") or "true").lower() != "false",
                   interval_ms(log_retention, "delta.logRetentionDuration") if log_retention else LOG_RETENTION_MS,
                   interval_ms(file_retention, "delta.deletedFileRetentionDuration") if file_retention
                   else DELETED_FILE_RETENTION_MS)


class LogFile(NamedTuple):
    """A file of ``_delta_log``: its name, modification time (ms) and size."""

    name: str
    mtime_ms: int
    size: int


def cutoff(now_ms: int, retention_ms: int, granularity_ms: int = _DAY_MS) -> int:
    """Now minus the retention, truncated (to midnight UTC by default, as Spark's metadata cleanup does). Pure."""
    moment = now_ms - retention_ms
    return moment - moment % granularity_ms


def expired_log_files(files: Iterable[LogFile], cutoff_ms: int, newest_checkpoint: int) -> list[str]:
    """The log files a metadata cleanup deletes: every commit, checkpoint, checksum (and compaction ending) below
    the cleanup's boundary, oldest first. Pure.

    The boundary is the newest complete checkpoint at or below ``newest_checkpoint`` (``_last_checkpoint``'s) whose
    previous file, in the listing's order, is at or older than ``cutoff_ms`` after the times are made to rise with the
    versions (Spark's ``BufferingLogDeletionIterator``: a time not past the previous file's becomes that plus one).
    Nothing at or above the boundary goes, so the oldest version kept has its checkpoint; empty when there is none.
    """
    parsed = []
    for f in files:
        named = _LOG_FILE.match(f.name)
        if named:
            parsed.append((f.name, int(named[1]), f))
    parsed.sort()
    parts: dict[tuple[int, int], int] = {}
    boundary = -1
    previous: tuple[int, int] | None = None  # (version, adjusted time) of the file before, in listing order
    below: tuple[int, int] | None = None  # the same, of the last file of a lower version
    for name, version, f in parsed:
        mtime = f.mtime_ms
        if previous is not None and previous[0] < version:
            below = previous
            if previous[1] >= mtime:
                mtime = previous[1] + 1
        if ".checkpoint" in name and f.size > 0 and version <= newest_checkpoint:
            named = _LOG_FILE.match(name)
            assert named is not None
            complete = True
            if named[2]:  # a multi-part checkpoint counts once every part is there
                key = (version, int(named[3]))
                parts[key] = parts.get(key, 0) + 1
                complete = parts[key] == int(named[3])
            if complete and below is not None and below[1] <= cutoff_ms:
                boundary = max(boundary, version)
        previous = (version, mtime)
    if boundary <= 0:
        return []
    doomed = [name for name, version, _ in parsed if version < boundary]
    for f in files:
        compacted = _COMPACTED.match(f.name)
        if compacted and int(compacted[2]) < boundary:
            doomed.append(f.name)
    return doomed


def unreferenced_files(files: Iterable[LogFile], referenced: set[str], tombstones: Mapping[str, int],
                       removed_before_ms: int, written_before_ms: int) -> list[str]:
    """The data files VACUUM deletes: held by neither the snapshot (``referenced``) nor a tombstone (``tombstones``:
    path to deletion time) newer than ``removed_before_ms``, and written at or before ``written_before_ms``. Paths
    relative to the table's root, decoded; hidden files and directories (``_`` or ``.``) are never data. Pure."""
    doomed = []
    for f in files:
        if any(part.startswith(("_", ".")) for part in f.name.split("/")):
            continue
        if f.name in referenced or tombstones.get(f.name, -1) > removed_before_ms or f.mtime_ms > written_before_ms:
            continue
        doomed.append(f.name)
    return sorted(doomed)


def _granularity() -> int:
    name = os.environ.get("LASTAGENT_DELTA_LOG_CUTOFF", "day").strip().lower()
    return _GRANULARITY_MS.get(name, _DAY_MS)


#: Per table URI: the (log cutoff, file cutoff) of this process's last cleanup of it.
_cleaned: dict[str, tuple[int, int]] = {}
_cleaned_lock = threading.Lock()


class TableUpkeep:
    """Keeps one Delta table as Spark's writer keeps it, after each commit lastagent makes to it. Driver.

    Args:
        filesystem: makes a pyarrow filesystem that reaches the table (:meth:`lastagent.storage.StorageConfig.filesystem`),
            when a cleanup first needs it.
        root: the table's root on ``filesystem``.
        uri: the table's URI, as kernel takes it.
        storage: kernel's storage options for it.
        what: the table, as messages name it ("arbitration table /data/arb").
        vacuum: whether unreferenced data files go too (only a table whose files lastagent alone writes and commits
            at once: the arbitration table).
    """

    def __init__(self, filesystem: Callable[[], Any], root: str, uri: str, storage: Mapping[str, str] | None,
                 what: str, vacuum: bool = False) -> None:
        self._filesystem = filesystem
        self.root = root.rstrip("/")
        self.uri = uri
        self.storage = dict(storage or {})
        self.what = what
        self.vacuum = vacuum

    @property
    def filesystem(self) -> Any:
        if not hasattr(self, "_made"):
            self._made = self._filesystem()
        return self._made

    def after_commit(self, version: int, table_id: str, configuration: Mapping[str, str],
                     writer_features: Sequence[str] | None = None) -> None:
        """A checkpoint when ``version`` is a multiple of the interval, then the cleanups when their cutoff moved.

        ``configuration`` and ``writer_features`` are the table's as the commit read them. Never raises: what fails
        is logged (the commit it follows stands; only readers are slower or the files stay longer), so a caller's
        commit is never reported as failed for what came after it.
        """
        try:
            self._after_commit(version, table_id, configuration, writer_features)
        except Exception:  # not the commit's failure: logged with its cause, the next checkpoint tries again
            log.warning("%s: keeping the table after version %d failed", self.what, version, exc_info=True)

    def _after_commit(self, version: int, table_id: str, configuration: Mapping[str, str],
                      writer_features: Sequence[str] | None) -> None:
        try:
            retention = Retention.of(configuration)
        except (ArbitrationError, ValueError) as exc:  # a property Spark would refuse too; the commit stands
            log.warning("%s: not kept (checkpoints, log cleanup): %s", self.what, exc)
            return
        if version == 0 or retention.checkpoint_interval <= 0 or version % retention.checkpoint_interval:
            return
        try:
            delta_kernel.checkpoint(self.uri, self.storage, version, table_id)
        except ArbitrationError as exc:
            log.warning("%s: checkpoint at version %d failed (readers replay the JSON log until the next one): %s",
                        self.what, version, exc)
            return
        now = int(time.time() * 1000)
        granularity = _granularity()
        cutoffs = (cutoff(now, retention.log_retention_ms, granularity),
                   cutoff(now, retention.deleted_file_retention_ms, 1))
        with _cleaned_lock:
            last = _cleaned.get(self.uri)
            if last is not None and last[0] == cutoffs[0] and cutoffs[1] - last[1] < granularity:
                return
            _cleaned[self.uri] = cutoffs
        try:
            log_files = self._list(f"{self.root}/_delta_log")  # listed once for both cleanups
            if retention.clean_log and "v2Checkpoint" not in (writer_features or ()):
                self._clean_log(log_files, version, cutoffs[0])
            if self.vacuum:
                self._vacuum(log_files, version, cutoffs[1], min(cutoffs[1], now - MIN_FILE_AGE_MS))
        except (OSError, ArbitrationError) as exc:  # the files stay until the next cleanup
            log.warning("%s: cleanup after version %d failed: %s", self.what, version, exc)

    def _delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):  # another process cleaning the same table took it first
            self.filesystem.delete_file(path)

    def _list(self, directory: str) -> list[LogFile]:
        from pyarrow import fs

        found = self.filesystem.get_file_info(fs.FileSelector(directory, allow_not_found=True))
        return [LogFile(i.path[len(directory) + 1:], (i.mtime_ns or 0) // 1_000_000, i.size or 0)
                for i in found if i.type == fs.FileType.File]

    def _clean_log(self, log_files: list[LogFile], checkpoint_version: int, cutoff_ms: int) -> None:
        log_dir = f"{self.root}/_delta_log"
        doomed = expired_log_files(log_files, cutoff_ms, checkpoint_version)
        for name in doomed:
            self._delete(f"{log_dir}/{name}")
        if doomed:
            log.info("%s: removed %d log file(s) older than %s (delta.logRetentionDuration)", self.what,
                     len(doomed), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(cutoff_ms / 1000)))

    def _vacuum(self, log_files: list[LogFile], checkpoint_version: int, removed_before_ms: int,
                written_before_ms: int) -> None:
        import pyarrow.parquet as pq

        log_dir = f"{self.root}/_delta_log"
        prefix = f"{checkpoint_version:020}.checkpoint"
        referenced: set[str] = set()
        tombstones: dict[str, int] = {}
        checkpoints = [f for f in log_files if f.name.startswith(prefix) and f.name.endswith(".parquet")]
        if not checkpoints:
            raise ArbitrationError(f"no checkpoint file of version {checkpoint_version} to read the files from")
        for f in checkpoints:
            with self.filesystem.open_input_file(f"{log_dir}/{f.name}") as stream:
                data = pq.read_table(stream, columns=["add", "remove"]).to_pydict()
            for add in data["add"]:
                if add:
                    referenced.add(unquote(add["path"]))
            for remove in data["remove"]:
                if remove:
                    tombstones[unquote(remove["path"])] = int(remove.get("deletionTimestamp") or 0)
        # The arbitration table has no partitions: its data files are the root's own.
        doomed = unreferenced_files(self._list(self.root), referenced, tombstones, removed_before_ms,
                                    written_before_ms)
        for name in doomed:
            self._delete(f"{self.root}/{name}")
        if doomed:
            log.info("%s: deleted %d data file(s) no version within delta.deletedFileRetentionDuration references",
                     self.what, len(doomed))
