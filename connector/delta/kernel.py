"""lastagent's Delta commits through Delta Kernel (``lastagent._native``, native/src/delta.rs). Driver only.

Thin: each function reads nothing itself and decides nothing; it hands one commit to kernel on top of
the version the caller read and maps the outcome to what the callers' race loop
(:func:`lastagent.delta.table_properties.until_committed`) expects: a version another writer took first is
:class:`~lastagent.core.arbitration.LostRace` (re-read and decide again), anything else that failed is
:class:`~lastagent.errors.ArbitrationError` (nothing decided by this call).

Every commit lastagent makes to a Delta table goes this way. Through kernel's transaction: an epoch's commit to a
target table with a feature only kernel writes (:attr:`lastagent.delta.features.TableRules.kernel`). Composed by
lastagent and written put-if-absent by kernel's storage layer (:func:`commit_actions`, :func:`create_table`,
:func:`set_properties`): the table-property commits (claims, ``lostAccepted``; delta-rs's rewrote a table-features
protocol), an epoch's plain append to any other target table (with mergeSchema's new columns), the dead-letter
table's and the arbitration table's commits, and the commit that creates each of these tables. Every read goes
through kernel as well (:mod:`lastagent.delta.snapshot`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from lastagent.errors import ArbitrationError


def _native() -> Any:
    import lastagent._native as native

    return native


def _outcome(outcome: tuple[str, int], what: str, where: str) -> int:
    from lastagent.core.arbitration import LostRace

    state, version = outcome
    if state == "conflict":
        raise LostRace(f"another writer committed version {version} of {where} first ({what})")
    return version


def set_properties(uri: str, storage: Mapping[str, str] | None, read_version: int, table_id: str,
                   properties: Mapping[str, str], what: str) -> int:
    """Sets ``properties`` on top of ``read_version``, changing nothing else of the table. Driver.

    ``table_id`` is the table's id as read (its metaData): kernel refuses a table dropped and made again since.

    Returns:
        The version committed.

    Raises:
        LostRace: another writer took the next version first.
        ArbitrationError: the commit failed.
    """
    native = _native()
    try:
        outcome = native.delta_set_properties(uri, dict(storage or {}), read_version, table_id,
                                              sorted(properties.items()))
    except native.DeltaKernelError as exc:
        raise ArbitrationError(f"cannot record {what} in Delta table {uri}: {exc}") from exc
    return _outcome(outcome, what, uri)


def commit_epoch(uri: str, storage: Mapping[str, str] | None, read_version: int, table_id: str,
                 adds: Sequence[Mapping[str, Any]], app_id: str, app_version: int, commit_info: Mapping[str, str],
                 epoch: int) -> int:
    """Commits an epoch's files with ``txn(app_id, app_version)`` and ``commit_info`` on ``read_version``. Driver.

    The operation is Spark's streaming append (``STREAMING UPDATE``, outputMode Append, the epoch).

    Returns:
        The version committed.

    Raises:
        LostRace: another writer took the next version first (nothing written).
        ArbitrationError: kernel refused the commit or it failed.
    """
    native = _native()
    try:
        outcome = native.delta_commit_epoch(uri, dict(storage or {}), read_version, table_id, [json.dumps(a) for a in adds],
                                            app_id, app_version, sorted(commit_info.items()),
                                            [("outputMode", "Append"), ("epochId", str(epoch))])
    except native.DeltaKernelError as exc:
        raise ArbitrationError(f"cannot commit epoch {epoch} of link {app_id!r} to Delta table {uri}: {exc}") from exc
    return _outcome(outcome, f"epoch {epoch} of link {app_id!r}", uri)


def commit_actions(uri: str, storage: Mapping[str, str] | None, read_version: int, table_id: str,
                   commit_info: Mapping[str, Any], actions: Sequence[Mapping[str, Any]], what: str,
                   schema_json: str | None = None) -> int:
    """Commits ``actions`` (as the log holds them: ``{"txn": ...}``, ``{"add": ...}``) with ``commit_info`` on top of
    ``read_version``, put-if-absent; kernel adds the timestamps, ``readVersion`` and ``engineInfo``. Driver.

    With ``schema_json``, the commit first sets the table's schema to it (the table's ``metaData`` as read, with
    that ``schemaString``): mergeSchema's new columns in the epoch's own commit, as Spark's writer makes it.

    Returns:
        The version committed.

    Raises:
        LostRace: another writer took the next version first (nothing written).
        ArbitrationError: the commit failed.
    """
    native = _native()
    try:
        outcome = native.delta_commit_actions(uri, dict(storage or {}), read_version, table_id,
                                              json.dumps(commit_info), [json.dumps(a) for a in actions], schema_json)
    except native.DeltaKernelError as exc:
        raise ArbitrationError(f"cannot commit {what} to Delta table {uri}: {exc}") from exc
    return _outcome(outcome, what, uri)


def create_table(uri: str, storage: Mapping[str, str] | None, commit_info: Mapping[str, Any],
                 actions: Sequence[Mapping[str, Any]], what: str) -> None:
    """Creates a table with its version 0 (``actions``: :func:`new_table`'s, then any ``txn`` and adds), put-if-absent.
    Driver.

    Raises:
        LostRace: another writer created the table first (nothing written).
        ArbitrationError: the commit failed.
    """
    native = _native()
    try:
        outcome = native.delta_create_table(uri, dict(storage or {}), json.dumps(commit_info),
                                            [json.dumps(a) for a in actions])
    except native.DeltaKernelError as exc:
        raise ArbitrationError(f"cannot create Delta table {uri} ({what}): {exc}") from exc
    _outcome(outcome, what, uri)


#: Delta's table features a column type needs (PROTOCOL.md; Spark's writer adds them when it creates such a table).
_TYPE_FEATURES = {"timestamp_ntz": "timestampNtz", "variant": "variantType"}


def new_table(schema_json: str, partition_by: Sequence[str], created_ms: int, name: str | None = None) -> list[dict[str, Any]]:
    """The ``protocol`` and ``metaData`` of a new table with this schema (Delta JSON), as lastagent creates its tables:
    reader 1 / writer 2 (Delta's defaults, as Spark's and delta-rs's writers create them), or table features where a
    column's type needs one (``timestampNtz``). Pure.
    """
    import uuid

    from lastagent.delta.features import column_types

    features = sorted({_TYPE_FEATURES[t] for t in column_types(json.loads(schema_json)) if t in _TYPE_FEATURES})
    protocol: dict[str, Any] = ({"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": features,
                                 "writerFeatures": features} if features else {"minReaderVersion": 1,
                                                                               "minWriterVersion": 2})
    metadata = {"id": str(uuid.uuid4()), **({"name": name} if name else {}),
                "format": {"provider": "parquet", "options": {}}, "schemaString": schema_json,
                "partitionColumns": list(partition_by), "configuration": {}, "createdTime": created_ms}
    return [{"protocol": protocol}, {"metaData": metadata}]


def append_actions(adds: Sequence[Mapping[str, Any]], app_id: str, app_version: int,
                   last_updated_ms: int) -> list[dict[str, Any]]:
    """The actions of a plain append with a ``txn``, as Spark's writer logs them: the ``txn`` first, then each add
    (its path URI-encoded, :func:`lastagent.delta.files.kernel_add`). Pure."""
    from lastagent.delta.files import kernel_add

    txn = {"txn": {"appId": app_id, "version": app_version, "lastUpdated": last_updated_ms}}
    return [txn, *({"add": kernel_add(dict(a))} for a in adds)]


def streaming_commit_info(epoch: int, fields: Mapping[str, str], adds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A streaming epoch's commitInfo as Spark's writer makes it (``STREAMING UPDATE``, outputMode Append, the
    epoch, its metrics), with lastagent's fields (its record, ``userMetadata``). Pure."""
    rows = sum(int(json.loads(a["stats"]).get("numRecords", 0)) for a in adds if a.get("stats"))
    metrics = {"numAddedFiles": str(len(adds)), "numRemovedFiles": "0", "numOutputRows": str(rows),
               "numOutputBytes": str(sum(int(a["size"]) for a in adds))}
    return {"operation": "STREAMING UPDATE", "operationParameters": {"outputMode": "Append", "epochId": str(epoch)},
            "isBlindAppend": True, "operationMetrics": metrics, **fields}


def write_gate(uri: str, storage: Mapping[str, str] | None, version: int, table_id: str) -> str | None:
    """Delta Kernel's reason for not writing to the table at ``version`` (its write gate), or None. Driver.

    Raises:
        ArbitrationError: the table could not be read.
    """
    native = _native()
    try:
        return native.delta_write_gate(uri, dict(storage or {}), version, table_id)
    except native.DeltaKernelError as exc:
        raise ArbitrationError(f"cannot read Delta table {uri}: {exc}") from exc


def checkpoint(uri: str, storage: Mapping[str, str] | None, version: int, table_id: str) -> None:
    """Writes a checkpoint of ``version``, of the kind the table's features say (classic or V2). Driver.

    Raises:
        ArbitrationError: the checkpoint could not be written (the caller logs it: the commit stands).
    """
    native = _native()
    try:
        native.delta_checkpoint(uri, dict(storage or {}), version, table_id)
    except native.DeltaKernelError as exc:
        raise ArbitrationError(f"cannot write a checkpoint of Delta table {uri} at version {version}: {exc}") from exc
