"""What an operator watches: one epoch's figures, and the source's lag. Pure: no I/O.

An epoch's figures travel with its decision: the committer puts them in the arbitration record
(:attr:`~lastagent.core.arbitration.ArbitrationRecord.figures`), and the store writes them into the
decision's Delta commit as ``userMetadata`` (what ``DESCRIBE HISTORY`` shows) and reads them back
from there (``lastagent status --json``, :func:`lastagent.cli.status_document`).

Two figures are known only after the record was written: how long writing the decision took and
how long phase 2 took. They reach the next epoch's record as :attr:`EpochFigures.previous` (the
sinks keep them in the checkpoint between the two epochs: :mod:`lastagent.sinks.epoch_timings`), so
the newest epoch's timings show up once the following epoch is decided.

Pyspark's Python data source API gives a source no way to report ``sources[].metrics`` (pyspark
4.2: ``PythonMicroBatchStream`` implements no ``ReportsSourceMetrics``), so the lag that Spark's
``kafka`` source reports there is computed from what the progress does carry: each source's
``endOffset`` and ``latestOffset`` (:func:`offsets_behind_latest`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The version of the figures' JSON form; a reader ignores keys it does not know.
FIGURES_VERSION = 1


@dataclass(frozen=True)
class EpochTimings:
    """How long one epoch's decision and phase 2 took, measured by the committer. Driver.

    Attributes:
        epoch: the epoch measured.
        decide_ms: writing the decision (the last agent's one-phase commit), milliseconds.
        phase2_ms: committing the decided branches and rolling back the rest, milliseconds.
    """

    epoch: int
    decide_ms: int
    phase2_ms: int

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "decide_ms": self.decide_ms, "phase2_ms": self.phase2_ms}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EpochTimings:
        return cls(int(d["epoch"]), int(d["decide_ms"]), int(d["phase2_ms"]))


@dataclass(frozen=True)
class EpochFigures:
    """One epoch's figures as its decision records them.

    Attributes:
        branches: Kafka branches the decision covers (read-only ones included).
        records: records written per output: ``kafka`` (records in the epoch's Kafka branches:
            the topic of a ``lastagent-kafka`` link; side topics and dead-letter topic of a
            ``lastagent-delta`` link) and ``table`` (rows committed to a ``lastagent-delta``
            link's table).
        dead_letters: records routed to the dead letters (topic or table) in the epoch.
        oldest_branch_age_ms: how long the oldest branch had been open when the decision was
            taken (None when no branch was open).
        transaction_timeout_ms: ``kafka.transaction.timeout.ms``: the age at which the broker
            aborts a branch.
        previous: the timings of the epoch before (known only after its record was written).
    """

    branches: int = 0
    records: tuple[tuple[str, int], ...] = ()
    dead_letters: int = 0
    oldest_branch_age_ms: int | None = None
    transaction_timeout_ms: int | None = None
    previous: EpochTimings | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"v": FIGURES_VERSION, "branches": self.branches, "records": dict(self.records),
                "dead_letters": self.dead_letters, "oldest_branch_age_ms": self.oldest_branch_age_ms,
                "transaction_timeout_ms": self.transaction_timeout_ms,
                "previous": None if self.previous is None else self.previous.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EpochFigures:
        """The figures from their JSON form; keys a newer writer added are ignored."""
        prev = d.get("previous")
        age, timeout = d.get("oldest_branch_age_ms"), d.get("transaction_timeout_ms")
        return cls(int(d.get("branches", 0)), tuple(sorted((str(k), int(v)) for k, v in d.get("records", {}).items())),
                   int(d.get("dead_letters", 0)), None if age is None else int(age),
                   None if timeout is None else int(timeout), None if not prev else EpochTimings.from_dict(prev))


def figures_from_user_metadata(text: str | None) -> EpochFigures | None:
    """The figures in a decision commit's ``userMetadata``; None for a commit written before they existed.

    A commit of an older lastagent (no figures) or an unreadable text reads as None: figures are
    for operators, and a record without them is still a valid decision.
    """
    if not text:
        return None
    try:
        meta = json.loads(text)
        figures = meta.get("lastagent", {}).get("figures")
        return None if figures is None else EpochFigures.from_dict(figures)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def oldest_age_ms(started_ms: list[int], now_ms: int) -> int | None:
    """The age of the oldest of the branches started at ``started_ms`` (broker times; 0 = unknown)."""
    known = [s for s in started_ms if s > 0]
    return None if not known else max(0, now_ms - min(known))


def epoch_rows(records: list[tuple[int, int, EpochFigures | None]], last: int) -> list[dict[str, Any]]:
    """The last ``last`` decided epochs, newest first, each with its figures and timings.

    Args:
        records: (epoch, decided_at_ms, figures or None) per decided epoch still kept.
        last: how many epochs to give.

    Returns:
        One dict per epoch: ``epoch``, ``decided_at_ms``, the figures' fields (None when the epoch's
        record has none), ``decide_ms`` / ``phase2_ms`` taken from the next epoch's record (None
        until the next epoch is decided), and ``branch_age_ratio`` (oldest branch age over the
        transaction timeout).
    """
    by_epoch = {e: (at, f) for e, at, f in records}
    timings = {f.previous.epoch: f.previous for _, _, f in records if f is not None and f.previous is not None}
    out = []
    for epoch in sorted(by_epoch, reverse=True)[:max(0, last)]:
        at, f = by_epoch[epoch]
        t = timings.get(epoch)
        age = None if f is None else f.oldest_branch_age_ms
        timeout = None if f is None else f.transaction_timeout_ms
        out.append({
            "epoch": epoch, "decided_at_ms": at,
            "branches": None if f is None else f.branches,
            "records": None if f is None else dict(f.records),
            "dead_letters": None if f is None else f.dead_letters,
            "oldest_branch_age_ms": age, "transaction_timeout_ms": timeout,
            "branch_age_ratio": None if age is None or not timeout else round(age / timeout, 4),
            "decide_ms": None if t is None else t.decide_ms,
            "phase2_ms": None if t is None else t.phase2_ms,
        })
    return out


@dataclass(frozen=True)
class OffsetsBehind:
    """How far a micro-batch's end is behind the newest offsets: Spark's kafka source's three metrics."""

    min: int
    max: int
    avg: float
    per_partition: dict[str, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, str]:
        """Under the names (and string values) Spark's ``kafka`` source reports in ``sources[].metrics``."""
        return {"minOffsetsBehindLatest": str(self.min), "maxOffsetsBehindLatest": str(self.max),
                "avgOffsetsBehindLatest": str(self.avg)}


def _offsets(value: Any) -> dict[str, int] | None:
    """``{"topic": {"0": 42}}`` (a dict, or its JSON text as the progress carries it) → ``{"topic-0": 42}``."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, Mapping):
        return None
    return {f"{topic}-{p}": int(o) for topic, parts in value.items() if isinstance(parts, Mapping)
            for p, o in parts.items()}


def offsets_behind_latest(source: Mapping[str, Any] | Any) -> OffsetsBehind | None:
    """The lag of one source of a ``StreamingQueryProgress``, as Spark's kafka source computes it.

    Runs wherever the progress is read (a listener on the driver, a notebook). Per partition:
    ``latestOffset - endOffset`` (never below 0), over the partitions both name (as Spark's kafka
    source computes it over the partitions it consumed).

    Args:
        source: one entry of ``progress["sources"]`` (a dict, or pyspark's ``SourceProgress``).

    Returns:
        None when the source reported no latest offset or no end (another kind of source, or a
        trigger that planned no batch).
    """
    get = source.get if isinstance(source, Mapping) else (lambda k: getattr(source, k, None))
    latest, end = _offsets(get("latestOffset")), _offsets(get("endOffset"))
    if not latest or not end:
        return None
    behind = {tp: max(0, off - end[tp]) for tp, off in latest.items() if tp in end}
    if not behind:
        return None
    values = list(behind.values())
    return OffsetsBehind(min(values), max(values), sum(values) / len(values), behind)


def run_figures(progress: Sequence[Any], epochs: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """One row per micro-batch of a run that read records, for a chart: where the link stood each epoch.

    Runs where the query's progress is read (a notebook, a listener).

    Args:
        progress: the query's ``recentProgress`` (pyspark's objects or their dicts).
        epochs: the ``epochs`` of ``lastagent status --json`` (:func:`lastagent.cli.link_status`).

    Returns:
        (epoch, input rows, max offsets behind latest, decide + phase-2 ms, Spark's addBatch ms)
        per batch, oldest first; None where a figure is not known (the newest epoch's timings
        arrive with the next epoch's record; a source other than ``lastagent-kafka`` has no lag).
    """
    timings = {e["epoch"]: e for e in epochs}
    rows = []
    for p in progress:
        if not p["numInputRows"]:
            continue
        epoch = int(p["batchId"])
        lags = [lag for lag in map(offsets_behind_latest, p["sources"] or []) if lag is not None]
        e = timings.get(epoch, {})
        commit = None if e.get("decide_ms") is None else int(e["decide_ms"]) + int(e.get("phase2_ms") or 0)
        add_batch = (p["durationMs"] or {}).get("addBatch")
        rows.append((epoch, int(p["numInputRows"]), max((lag.max for lag in lags), default=None), commit,
                     None if add_batch is None else int(add_batch)))
    return sorted(rows)
