"""What the connector reads from Spark's checkpoint: the query's id and its commit log. Driver side.

Recovery depends on both, so both fail closed: a checkpoint the connector cannot read (a path
scheme it has no filesystem for, a permission error, a metadata file that is not Spark's) is an
error naming ``checkpointLocation``, never a silent "nothing committed yet".
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from lastagent.errors import OptionError

#: Schemes pyarrow opens itself; ``s3a``/``s3n`` (Hadoop's names for S3) are read as ``s3``.
_SCHEMES = {"s3": "s3", "s3a": "s3", "s3n": "s3", "gs": "gs", "gcs": "gs", "hdfs": "hdfs", "file": "file"}


def filesystem(location: str, option: str = "checkpointLocation") -> tuple[Any, str]:
    """(pyarrow filesystem, path) for a local path or a URI whose scheme pyarrow can open.

    Raises:
        OptionError: for ``option``, when the scheme is unknown or the filesystem cannot be opened.
    """
    from pyarrow import fs

    scheme, sep, rest = location.partition("://")
    if not sep:
        if location.startswith("dbfs:"):
            scheme, rest = "dbfs", location[len("dbfs:"):]
        else:
            return fs.LocalFileSystem(), location.rstrip("/") or "/"
    kind = _SCHEMES.get(scheme.lower())
    if kind is None:
        raise OptionError(option, f"{location!r}: lastagent cannot read paths of scheme {scheme!r} itself (it "
                                  "reads the checkpoint and tables outside Spark); use a local path or one of "
                                  f"{', '.join(sorted(_SCHEMES))}://")
    if kind == "file":
        return fs.LocalFileSystem(), "/" + rest.lstrip("/")
    try:
        return fs.FileSystem.from_uri(f"{kind}://{rest}")
    except (ValueError, TypeError, OSError) as exc:
        raise OptionError(option, f"{location!r}: cannot open its filesystem: {exc}") from exc


def committed_through(location: str) -> int:
    """The newest epoch in Spark's commit log (``<checkpoint>/commits/<epoch>``), -1 for none yet.

    Raises:
        OptionError: the checkpoint cannot be listed (unknown scheme, permissions, I/O error).
    """
    from pyarrow import fs

    filesystem_, path = filesystem(location)
    try:
        infos = filesystem_.get_file_info(fs.FileSelector(f"{path}/commits", allow_not_found=True))
    except OSError as exc:
        raise OptionError("checkpointLocation", f"cannot list the commit log {location}/commits: {exc}; recovery "
                                                "needs it, so nothing was changed") from exc
    return max((int(i.base_name) for i in infos if i.base_name.isdigit()), default=-1)


def query_id(location: str) -> str:
    """Spark's id of the query that owns the checkpoint (``<checkpoint>/metadata``), stable across restarts.

    Spark writes this file when the query is first created, before the sink's writer is built.

    Raises:
        OptionError: the file is missing, unreadable or not Spark's query metadata.
    """
    filesystem_, path = filesystem(location)
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


class CheckpointReader(Protocol):
    """The checkpoint port: what the committer reads from Spark's checkpoint."""

    def committed_through(self) -> int:
        """The newest epoch in the commit log, -1 for none."""
        ...

    def query_id(self) -> str:
        """Spark's id of the query that owns the checkpoint."""
        ...


class SparkCheckpoint:
    """A Spark checkpoint location, read outside Spark (pyarrow). Driver side."""

    def __init__(self, location: str) -> None:
        self.location = location

    def committed_through(self) -> int:
        return committed_through(self.location)

    def query_id(self) -> str:
        return query_id(self.location)
