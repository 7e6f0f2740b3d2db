"""What operators watch: epoch figures, their round trip through a decision commit, lag from a progress."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from lastagent import cli
from lastagent.core import xid
from lastagent.core.arbitration import (
    ArbitrationRecord,
    InMemoryArbitrationStore,
    decision_metadata,
    figures_in_history,
)
from lastagent.core.branch_handle import BranchHandle
from lastagent.core.committer import Committer
from lastagent.core.figures import (
    EpochFigures,
    EpochTimings,
    epoch_rows,
    figures_from_user_metadata,
    offsets_behind_latest,
    oldest_age_ms,
    run_figures,
)
from lastagent.core.kafka_port import EndOutcome, EndResult, OpenTransaction
from lastagent.sinks.epoch_timings import keep_timings, previous_timings
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions

pytestmark = pytest.mark.unit

LINK = "orders"
TIMEOUT_MS = 60_000


def test_figures_round_trip_through_user_metadata():
    f = EpochFigures(3, (("kafka", 40), ("table", 39)), 1, 1200, TIMEOUT_MS, EpochTimings(6, 85, 40))
    record = ArbitrationRecord(LINK, 7, "g", ("{}",) * 3, figures=f)
    meta = decision_metadata(record, files=2)
    assert json.loads(meta)["lastagent"]["files"] == 2
    assert figures_from_user_metadata(meta) == f


def test_commits_of_older_versions_read_as_no_figures():
    old = json.dumps({"lastagent": {"link": LINK, "epoch": 1, "gxid": "g", "kafka_branches": 2, "files": 1}})
    assert figures_from_user_metadata(old) is None
    assert figures_from_user_metadata(None) is None
    assert figures_from_user_metadata("not json") is None
    # A newer writer's keys are ignored; missing ones take their defaults.
    assert figures_from_user_metadata(json.dumps({"lastagent": {"figures": {"branches": 2, "later": 1}}})) == \
        EpochFigures(branches=2)


def test_history_gives_the_links_newest_decisions_once_each():
    def commit(link, epoch, ts, figures=None):
        r = ArbitrationRecord(link, epoch, "g", (), figures=figures)
        return {"lastagent.link": link, "lastagent.epoch": str(epoch), "timestamp": ts,
                "userMetadata": decision_metadata(r)}

    history = [commit(LINK, 3, 30, EpochFigures(branches=3)), commit("other", 9, 29), {"operation": "OPTIMIZE"},
               commit(LINK, 2, 20, EpochFigures(branches=2)), commit(LINK, 2, 19), commit(LINK, 1, 10)]
    got = figures_in_history(history, LINK, 2)
    assert [(e, at, f.branches if f else None) for e, at, f in got] == [(3, 30, 3), (2, 20, 2)]


def test_epoch_rows_take_timings_from_the_next_record():
    rows = epoch_rows([(9, 900, EpochFigures(2, (("kafka", 5),), 0, 30_000, TIMEOUT_MS, EpochTimings(8, 11, 22))),
                       (8, 800, EpochFigures(1, (("kafka", 3),), 2, 100, TIMEOUT_MS, EpochTimings(7, 1, 2))),
                       (7, 700, None)], 2)
    assert [r["epoch"] for r in rows] == [9, 8]
    newest, before = rows
    assert (newest["decide_ms"], newest["phase2_ms"]) == (None, None)  # known once epoch 10 is decided
    assert (before["decide_ms"], before["phase2_ms"]) == (11, 22)
    assert newest["branch_age_ratio"] == 0.5 and before["dead_letters"] == 2 and before["records"] == {"kafka": 3}
    old = epoch_rows([(7, 700, None)], 5)[0]
    assert old["branches"] is None and old["branch_age_ratio"] is None


def test_oldest_age_ignores_unknown_start_times():
    assert oldest_age_ms([0, 1_000, 4_000], 5_000) == 4_000
    assert oldest_age_ms([0], 5_000) is None and oldest_age_ms([], 5_000) is None


def test_offsets_behind_latest_as_sparks_kafka_source_reports_them():
    source = {"endOffset": json.dumps({"t": {"0": 10, "1": 10, "2": 5}}),
              "latestOffset": json.dumps({"t": {"0": 30, "1": 10, "2": 20}})}
    lag = offsets_behind_latest(source)
    assert lag is not None and lag.per_partition == {"t-0": 20, "t-1": 0, "t-2": 15}
    assert lag.metrics() == {"minOffsetsBehindLatest": "0", "maxOffsetsBehindLatest": "20",
                             "avgOffsetsBehindLatest": str(35 / 3)}


def test_offsets_behind_latest_of_a_source_that_reports_no_latest_offset():
    assert offsets_behind_latest({"endOffset": {"t": {"0": 1}}, "latestOffset": None}) is None
    assert offsets_behind_latest({"endOffset": None, "latestOffset": {"t": {"0": 1}}}) is None

    @dataclass
    class SourceProgress:  # pyspark's object form
        endOffset: str = '{"t": {"0": 4}}'
        latestOffset: str = '{"t": {"0": 6}}'

    lag = offsets_behind_latest(SourceProgress())
    assert lag is not None and (lag.min, lag.max, lag.avg) == (2, 2, 2.0)


def test_timings_kept_in_the_checkpoint_reach_only_the_next_epoch(tmp_path, caplog):
    ckpt = str(tmp_path / "ckpt")
    assert previous_timings(ckpt, LINK, 5) is None
    keep_timings(ckpt, LINK, EpochTimings(4, 12, 34))
    assert previous_timings(ckpt, LINK, 5) == EpochTimings(4, 12, 34)
    assert previous_timings(ckpt, LINK, 6) is None  # epoch 5's were never kept: no stale figures
    assert previous_timings(ckpt, "other", 5) is None
    (tmp_path / "ckpt" / "lastagent" / f"{LINK}.timings.json").write_text("{torn")
    assert previous_timings(ckpt, LINK, 5) is None and "cannot read" in caplog.text


# -- the committer fills in what it measures --------------------------------------------------------


@dataclass
class FakeXA:
    """A broker whose open transactions are the prepared branches, each started at ``started``."""

    started: dict[str, int]
    ended: list[str] = field(default_factory=list)

    def recover(self, prefix: str) -> list[OpenTransaction]:
        return [OpenTransaction(tid, 1, 0, "Ongoing", ms, TIMEOUT_MS) for tid, ms in self.started.items()
                if tid.startswith(prefix) and tid not in self.ended]

    def open_among(self, handles) -> list[OpenTransaction]:
        return [t for t in self.recover("") if t.transactional_id in {h.transactional_id for h in handles}]

    def end_all(self, handles, commit, parallelism=8):
        self.ended += [h.transactional_id for h in handles]
        return [EndResult(h, EndOutcome.COMMITTED) for h in handles]

    def close(self) -> None:
        return None


class FakeCheckpoint:
    def committed_through(self) -> int:
        return -1

    def query_id(self) -> str:
        return "q"


def _two_branches(xa_type: type[FakeXA]) -> tuple[Committer, InMemoryArbitrationStore, int, list[str], FakeXA]:
    """A committer at 10 s over two prepared branches of a claimed run, opened at 1 s and 4 s."""
    options = KafkaSinkOptions.parse({"kafka.bootstrap.servers": "x:9092", "link": LINK, "arbitrationTable": "a",
                                      "checkpointLocation": "c", "kafka.transaction.timeout.ms": str(TIMEOUT_MS)})
    store = InMemoryArbitrationStore()
    generation = store.claim(LINK, "q").generation
    tids = [xid.transactional_id(LINK, generation, p, 0) for p in range(2)]
    xa = xa_type({tids[0]: 1_000, tids[1]: 4_000})
    committer = Committer(options, store=store, xa=xa, checkpoint=FakeCheckpoint(), now_ms=lambda: 10_000)
    return committer, store, generation, tids, xa


def test_committer_records_branches_age_and_timeout_and_measures_its_timings():
    committer, store, generation, tids, xa = _two_branches(FakeXA)
    handles = [BranchHandle(t, 1, 0, 5 + i) for i, t in enumerate(tids)]
    given = EpochFigures(records=(("kafka", 11),), previous=EpochTimings(-1, 3, 4))
    record = committer.commit(0, generation, handles, figures=given)
    assert record.figures == EpochFigures(2, (("kafka", 11),), 0, 9_000, TIMEOUT_MS, EpochTimings(-1, 3, 4))
    assert store.figures(LINK, 5) == [(0, record.decided_at_ms, record.figures)]
    assert committer.last_timings is not None and committer.last_timings.epoch == 0
    assert committer.last_timings.decide_ms >= 0 and committer.last_timings.phase2_ms >= 0
    assert sorted(xa.ended) == tids


@dataclass
class ListingMissesXA(FakeXA):
    """ListTransactions during a coordinator move: the open branches are not listed, yet each one's
    own coordinator (DescribeTransactions) reports it open."""

    asked: list[str] = field(default_factory=list)

    def recover(self, prefix: str) -> list[OpenTransaction]:
        return []

    def open_among(self, handles) -> list[OpenTransaction]:
        self.asked += [h.transactional_id for h in handles]
        return [t for t in FakeXA.recover(self, "") if t.transactional_id in self.asked]


def test_committer_asks_each_branch_the_listing_missed_and_decides():
    committer, _, generation, tids, xa = _two_branches(ListingMissesXA)
    record = committer.commit(0, generation, [BranchHandle(t, 1, 0, 3) for t in tids])
    assert isinstance(xa, ListingMissesXA) and sorted(xa.asked) == tids  # not refused as "no longer open on the broker"
    assert record.epoch == 0 and sorted(xa.ended) == tids
    assert record.figures is not None and record.figures.oldest_branch_age_ms == 9_000


def test_status_document_names_owner_generation_and_the_epochs_figures():
    store = InMemoryArbitrationStore()
    generation = store.claim(LINK, "query-1").generation
    for epoch in range(3):
        figures = EpochFigures(epoch + 1, (("kafka", 10 * epoch),), epoch, 100 * epoch, TIMEOUT_MS,
                               None if epoch == 0 else EpochTimings(epoch - 1, epoch, 2 * epoch))
        store.decide(ArbitrationRecord(LINK, epoch, "g", (), decided_at_ms=1000 + epoch, confirmed_through=epoch - 1,
                                       figures=figures), generation)

    class Stub:  # what status_document reads of a committer
        link = LINK
        options = KafkaSinkOptions.parse({"kafka.bootstrap.servers": "x:9092", "link": LINK,
                                          "arbitrationTable": "/arb", "checkpointLocation": "-"})

        def __init__(self) -> None:
            self.store = store

        def in_doubt(self):
            return [(OpenTransaction("lastagent-orders-1-0-0", 1, 0, "Ongoing", 4_000, TIMEOUT_MS), "rollback", -1)]

        def hazards(self):
            return []

    store.size = lambda: (3, 1)  # type: ignore[attr-defined]
    doc = cli.status_document(Stub(), epochs=2, now_ms=10_000)
    assert (doc["version"], doc["owner"], doc["generation"]) == (1, "query-1", generation)
    assert (doc["latest_decided_epoch"], doc["latest_decided_at_ms"]) == (2, 1002)
    assert doc["in_doubt_count"] == 1 and doc["oldest_in_doubt_age_ms"] == 6_000
    assert [e["epoch"] for e in doc["epochs"]] == [2, 1]
    assert doc["epochs"][1] | {} == {"epoch": 1, "decided_at_ms": 1001, "branches": 2, "records": {"kafka": 10},
                                     "dead_letters": 1, "oldest_branch_age_ms": 100,
                                     "transaction_timeout_ms": TIMEOUT_MS, "branch_age_ratio": round(100 / TIMEOUT_MS, 4),
                                     "decide_ms": 2, "phase2_ms": 4}
    json.dumps(doc)  # the document is JSON as it stands


@pytest.mark.parametrize("epochs", ["-1", "many"])
def test_a_bad_epoch_count_is_a_usage_error_naming_the_option(epochs, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["status", "--link", LINK, "--arbitration-table", "/nonexistent-arb", "--bootstrap-servers",
                  "localhost:1", "--epochs", epochs])
    assert exit_.value.code == 2 and "--epochs" in capsys.readouterr().err


def test_run_figures_join_the_progress_with_the_epochs_figures():
    progress = [
        {"batchId": 0, "numInputRows": 20, "durationMs": {"addBatch": 900},
         "sources": [{"endOffset": {"t": {"0": 10, "1": 10}}, "latestOffset": {"t": {"0": 30, "1": 25}}}]},
        {"batchId": 1, "numInputRows": 0, "durationMs": {}, "sources": []},  # an idle trigger: no row
        {"batchId": 2, "numInputRows": 5, "durationMs": {"addBatch": 400},
         "sources": [{"endOffset": None, "latestOffset": None}]},
    ]
    epochs = [{"epoch": 2, "decide_ms": None, "phase2_ms": None}, {"epoch": 0, "decide_ms": 30, "phase2_ms": 12}]
    assert run_figures(progress, epochs) == [(0, 20, 20, 42, 900), (2, 5, None, None, 400)]
