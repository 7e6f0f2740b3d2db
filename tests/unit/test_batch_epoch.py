"""The foreachBatch epoch's pure rules, case by case (the model check covers their interplay)."""

from __future__ import annotations

import pytest

from lastagent.core import batch_epoch as be
from lastagent.core.branch_handle import BranchHandle
from lastagent.core.protocol import Branch
from lastagent.errors import ArbitrationError

pytestmark = pytest.mark.unit

B1 = Branch("lastagent-orders-g2-0-0", 12, 0)


def test_the_current_generation_comes_from_the_txn_versions_alone():
    assert be.current_generation("orders", {}) == 0
    assert be.current_generation("orders", {be.app_id("orders", 0): be.FENCED}) == 1  # claimed, nothing decided
    assert be.current_generation("orders", {be.app_id("orders", 0): be.FENCED, be.app_id("orders", 1): 7}) == 1
    assert be.current_generation("orders", {be.app_id("orders", 1): be.FENCED, be.app_id("orders", 2): 9,
                                            be.app_id("orders-2", 5): 3, "someone-else": 4}) == 2


def test_app_ids_of_other_links_are_not_the_links():
    assert be.generation_of("orders", be.app_id("orders", 3)) == 3
    assert be.generation_of("orders", be.app_id("orders-eu", 3)) is None
    assert be.generation_of("a.b", "lastagent/aXb/g1") is None


def test_a_claim_fences_the_current_generation_and_knows_whether_it_won():
    commit, mine = be.claim("orders", "run-2", "n2", {be.app_id("orders", 0): be.FENCED, be.app_id("orders", 1): 4})
    assert (commit.app, commit.version) == (be.app_id("orders", 1), be.FENCED) and mine.fenced == 1
    other = be.Claim("orders", 1, "run-3", "n3")
    assert be.claim_won(mine, [None, "free text", commit.metadata])
    assert not be.claim_won(mine, [other.to_metadata()])


def test_records_round_trip_and_other_writers_metadata_is_not_one():
    record = be.BatchRecord("orders", 7, 2, (B1,))
    assert be.record_in(record.to_metadata(), "orders") == record
    assert be.record_in(record.to_metadata(), "orders-eu") is None
    assert be.record_in('{"job": "nightly"}', "orders") is None and be.record_in("nightly compaction", "orders") is None
    assert be.record_in(be.Claim("orders", 1, "r", "n").to_metadata(), "orders") is None
    with pytest.raises(ArbitrationError, match="names the link but is no record"):
        be.record_in('{"lastagent": {"link": "orders", "epoch": 7}}', "orders")


def test_entering_an_epoch():
    txns = {be.app_id("orders", 1): be.FENCED, be.app_id("orders", 2): 6}
    assert be.enter("orders", 7, 2, txns, None) == be.Fresh(be.app_id("orders", 2), 7)
    decided = be.BatchRecord("orders", 7, 1, (B1,))
    assert be.enter("orders", 7, 2, txns, decided) == be.Replay(be.app_id("orders", 1), 7, decided)
    assert isinstance(be.enter("orders", 7, 1, txns, None), be.Superseded)
    with pytest.raises(ArbitrationError, match="holds no record of the epoch"):
        be.enter("orders", 6, 2, txns, None)


def test_kafka_writes_after_the_delta_write_are_refused_by_name():
    fresh = be.Fresh(be.app_id("orders", 2), 7)
    assert be.may_write_kafka("orders", fresh, None) is None
    said = be.may_write_kafka("orders", fresh, be.BatchRecord("orders", 7, 2, ()))
    assert said is not None and "before the Delta write" in said


def test_leaving_an_epoch():
    fresh = be.Fresh(be.app_id("orders", 2), 7)
    stray = Branch("lastagent-orders-g2-0-1", 13, 0)
    decide = be.leave("orders", fresh, 2, [B1], [B1, stray], None, body_failed=False)
    assert isinstance(decide, be.DecideByEmptyCommit) and be.record_in(decide.metadata, "orders").branches == (B1,)
    recorded = be.BatchRecord("orders", 7, 2, (B1,))
    assert be.leave("orders", fresh, 2, [B1], [B1, stray], recorded, False) == be.Finish((B1,), (stray,))
    assert be.leave("orders", fresh, 2, [B1], [stray], None, body_failed=True) == be.Finish((), (B1, stray))
    assert be.leave("orders", fresh, 2, [], [stray], None, body_failed=False) == be.Finish((), (stray,))  # nothing
    fenced = be.leave("orders", fresh, 2, [B1], [], None, body_failed=False, decided_here=True)
    assert fenced.roll_back == (B1,) and "fenced" in fenced.fail


def test_a_data_change_without_the_blocks_record_is_a_stray_write():
    record = be.BatchRecord("orders", 7, 2, (B1,)).to_metadata()
    claim = be.Claim("orders", 2, "run-3", "n").to_metadata()
    other_link = be.BatchRecord("payments", 3, 1, ()).to_metadata()
    commits = [be.Commit(10, "MERGE", record), be.Commit(11, "WRITE", claim), be.Commit(12, "OPTIMIZE", None),
               be.Commit(13, "STREAMING UPDATE", other_link), be.Commit(14, "VACUUM END", '{"job": "nightly"}')]
    assert be.stray_writes(commits) == []
    unseen = [be.Commit(15, "MERGE", None), be.Commit(16, "WRITE", "nightly load"), be.Commit(17, "DELETE", "{}"),
              be.Commit(18, "SOME FUTURE OPERATION", None)]  # an operation the list does not know counts as data
    assert be.stray_writes(commits + unseen) == unseen
    undecided = be.stray_reason("orders", 7, "/t/orders", unseen[:1], None)
    assert "version 15 (MERGE)" in undecided and "rolled back" in undecided and "batch.sparkSession" in undecided
    assert "RESTORE TABLE delta.`/t/orders` TO VERSION AS OF 14" in undecided
    decided = be.stray_reason("orders", 7, "/t/orders", unseen[:1], 10)
    assert "decided by version 10" in decided and "exactly one Delta write" in decided


def test_a_stray_write_decides_nothing_and_a_standing_record_is_still_finished():
    fresh = be.Fresh(be.app_id("orders", 2), 7)
    other = Branch("lastagent-orders-g2-0-1", 13, 0)
    why = "link 'orders' epoch 7: ... version 15 (MERGE)"
    # No record: the block must not decide with its empty append; everything is rolled back and the batch fails.
    assert be.leave("orders", fresh, 2, [B1], [B1, other], None, False, stray=why) == \
        be.Finish((), (B1, other), why, stray=True)
    # A record stands (the one write decided, a second one strayed): its branches are committed all the same.
    recorded = be.BatchRecord("orders", 7, 2, (B1,))
    assert be.leave("orders", fresh, 2, [B1], [B1, other], recorded, False, stray=why) == \
        be.Finish((B1,), (other,), why, stray=True)


def test_the_block_refuses_what_it_does_not_implement_by_name():
    from types import SimpleNamespace

    import lastagent
    from lastagent.errors import OptionError

    batch = SimpleNamespace(sparkSession=SimpleNamespace(sparkContext=None))  # options are checked before Spark
    with pytest.raises(OptionError, match="option 'table'.*ftp"):
        lastagent.epoch(batch, 0, link="orders", table="ftp://host/orders", **{"kafka.bootstrap.servers": "h:9092"})
    with pytest.raises(OptionError, match="option 'storage.aws_conditional_put'"):
        lastagent.epoch(batch, 0, link="orders", table="s3a://b/orders",
                        **{"kafka.bootstrap.servers": "h:1", "storage.aws_conditional_put": "none"})
    with pytest.raises(OptionError, match="option 'topic'.*kafka.\\* client settings and storage.\\* settings"):
        lastagent.epoch(batch, 0, link="orders", table="/data/orders", topic="x", **{"kafka.bootstrap.servers": "h:1"})
    with pytest.raises(OptionError, match="option 'kafka.bootstrap.servers'"):
        lastagent.epoch(batch, 0, link="orders", table="/data/orders")
    with pytest.raises(OptionError, match="option 'kafka.transaction.timeout.ms'.*positive number"):
        lastagent.epoch(batch, 0, link="orders", table="/data/orders",
                        **{"kafka.bootstrap.servers": "h:1", "kafka.transaction.timeout.ms": "15min"})


class _Table:
    """A table as the batch store reads it (:class:`lastagent.delta.snapshot.Snapshot`): ``txn`` versions and the
    commits, newest first."""

    def __init__(self, txns: dict[str, int], metadata: list[str | None]) -> None:
        self.txns, self.metadata = txns, metadata

    def app_versions(self, apps: list[str]) -> list[int | None]:
        return [self.txns.get(a) for a in apps]

    def app_version(self, app: str) -> int | None:
        return self.txns.get(app)

    def commits(self, limit: int | None = None) -> list[dict]:
        rows = [{"userMetadata": m, "timestamp": 1000 + i} for i, m in enumerate(reversed(self.metadata))][::-1]
        return rows if limit is None else rows[:limit]


def _store(table: _Table):
    from lastagent.delta.batch_table import BatchEpochTable

    store = BatchEpochTable("/data/orders")
    store.table = lambda: table  # type: ignore[method-assign]
    return store


def test_the_batch_store_reads_records_generations_and_runs_from_the_table():
    from lastagent.delta.batch_table import is_batch_link
    from lastagent.errors import LastAgentError

    claim0, claim1 = be.Claim("orders", 0, "run-a", "n1"), be.Claim("orders", 1, "run-b", "n2")
    r0, r1 = be.BatchRecord("orders", 0, 1, (B1,)), be.BatchRecord("orders", 1, 2, ())
    newest_first = [r1.to_metadata(), claim1.to_metadata(), r0.to_metadata(), "someone's note", claim0.to_metadata()]
    table = _Table({be.app_id("orders", 0): be.FENCED, be.app_id("orders", 1): be.FENCED,
                    be.app_id("orders", 2): 1}, newest_first)
    store = _store(table)
    records = store.records("orders")
    assert [(r.epoch, r.confirmed_through) for r in records] == [(0, 0), (1, 0)]  # all but the newest confirmed
    assert [BranchHandle.from_json(b).transactional_id for b in records[0].branches] == [B1.transactional_id]
    assert store.latest_epoch("orders") == 1 and store.get("orders", 0) == records[0]
    owner = store.ownership("orders")
    assert owner is not None and (owner.generation, owner.run) == (2, "run-b")
    assert is_batch_link(table, "orders") and not is_batch_link(table, "other") and not is_batch_link(None, "orders")
    assert store.records("other") == [] and store.ownership("other") is None
    with pytest.raises(LastAgentError, match="Stop the query and start it again"):
        store.claim("orders", "", takeover=True)
