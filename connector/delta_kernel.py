"""lastagent's Delta commits through Delta Kernel (``lastagent._native``, native/src/delta.rs). Driver only.

Thin: each function reads nothing itself and decides nothing; it hands one commit to kernel on top of
the version the caller read and maps the outcome to what the callers' race loop
(:func:`lastagent.core.arbitration.until_committed`) expects: a version another writer took first is
:class:`~lastagent.core.arbitration.LostRace` (re-read and decide again), anything else that failed is
:class:`~lastagent.errors.ArbitrationError` (nothing decided by this call).

Which commits go this way: every table-property commit (the link's claims, ``lostAccepted``), since
delta-rs's rewrites a table-features protocol; and the epoch's commit to a target table with a feature
only kernel writes (:attr:`lastagent.sinks.delta_features.TableRules.kernel`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from lastagent.errors import ArbitrationError


def _native() -> Any:
    from lastagent import _native

    return _native


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
