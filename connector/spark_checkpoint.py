"""What the connector reads from Spark's checkpoint, read outside Spark (pyarrow): the query's id and its commit
log. Driver side; the adapter of the committer's checkpoint port (:class:`lastagent.core.checkpoint.CheckpointReader`).

Recovery depends on both, so both fail closed: a checkpoint the connector cannot read (a path
scheme it has no filesystem for, a permission error, a metadata file that is not Spark's) is an
error naming ``checkpointLocation``, never a silent "nothing committed yet".
"""

from __future__ import annotations

import json
from typing import Any

from lastagent.errors import OptionError
from lastagent.storage import StorageConfig, open_path


def filesystem(location: str, option: str = "checkpointLocation",
               storage: StorageConfig | None = None) -> tuple[Any, str]:
    """(pyarrow filesystem, path) for a local path or a URI of a store lastagent reaches (:mod:`lastagent.storage`).

    Raises:
        OptionError: for ``option``, when the scheme is unknown or the filesystem cannot be opened.
    """
    return open_path(location, option, storage)


def committed_through(location: str, storage: StorageConfig | None = None) -> int:
    """The newest epoch in Spark's commit log (``<checkpoint>/commits/<epoch>``), -1 for none yet.

    Raises:
        OptionError: the checkpoint cannot be listed (unknown scheme, permissions, I/O error).
    """
    from pyarrow import fs

    filesystem_, path = filesystem(location, storage=storage)
    try:
        infos = filesystem_.get_file_info(fs.FileSelector(f"{path}/commits", allow_not_found=True))
    except OSError as exc:
        raise OptionError("checkpointLocation", f"cannot list the commit log {location}/commits: {exc}; recovery "
                                                "needs it, so nothing was changed") from exc
    return max((int(i.base_name) for i in infos if i.base_name.isdigit()), default=-1)


def query_id(location: str, storage: StorageConfig | None = None) -> str:
    """Spark's id of the query that owns the checkpoint (``<checkpoint>/metadata``), stable across restarts.

    Spark writes this file when the query is first created, before the sink's writer is built.

    Raises:
        OptionError: the file is missing, unreadable or not Spark's query metadata.
    """
    filesystem_, path = filesystem(location, storage=storage)
    try:
        with filesystem_.open_input_stream(f"{path}/metadata") as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        raise OptionError("checkpointLocation", f"{location} has no Spark query metadata file; lastagent names "
                                                "the owner of a link by the query id Spark writes there") from None
    except OSError as exc:
        raise OptionError("checkpointLocation", f"cannot read {location}/metadata: {exc}") from exc
    try:
        found = json.loads(text.splitlines()[0])["id"]
    except (IndexError, ValueError, KeyError, TypeError):
        raise OptionError("checkpointLocation", f"{location}/metadata is not Spark's query metadata "
                                                f"(expected a JSON line with 'id'): {text[:80]!r}") from None
    return str(found)


class SparkCheckpoint:
    """A Spark checkpoint location, read outside Spark (pyarrow). Driver side."""

    def __init__(self, location: str, storage: StorageConfig | None = None) -> None:
        self.location = location
        self.storage = storage

    def committed_through(self) -> int:
        return committed_through(self.location, self.storage)

    def query_id(self) -> str:
        return query_id(self.location, self.storage)
