"""The Delta arbitration store: idempotent, race-safe decisions that Spark reads back."""

from __future__ import annotations

import pytest
from support import race

from lastagent.core.arbitration import (
    ArbitrationError,
    ArbitrationRecord,
    InMemoryArbitrationStore,
    LinkMismatchError,
    StaleOwnerError,
)
from lastagent.delta.arbitration_table import DeltaArbitrationStore

pytestmark = pytest.mark.integration


def _rec(epoch: int, branch: str, link: str = "orders", confirmed: int = -1) -> ArbitrationRecord:
    return ArbitrationRecord(link, epoch, f"gxid-{link}-{epoch}", (branch,), confirmed_through=confirmed)


@pytest.fixture(params=["delta", "memory"])
def store(request, tmp_path):
    store = DeltaArbitrationStore(str(tmp_path / "arb")) if request.param == "delta" else InMemoryArbitrationStore()
    store.claim("orders", "q")
    return store


def test_decide_once_then_follow(store):
    first = store.decide(_rec(0, "a"), 1)
    assert first.won
    again = store.decide(_rec(0, "b"), 1)
    assert not again.won and again.record.branches == ("a",)
    assert store.get("orders", 0).branches == ("a",)
    assert store.get("orders", 1) is None
    assert store.latest_epoch("orders") == 0


def test_cleanup_keeps_unconfirmed_and_retained(store):
    for epoch in range(6):
        store.decide(_rec(epoch, f"b{epoch}", confirmed=epoch - 1), 1)
    # confirmed through 4, keep 2 more: epochs 0..2 go.
    assert store.cleanup("orders", retain_epochs=2) == 3
    assert [r.epoch for r in store.records("orders")] == [3, 4, 5]
    # A cleaned-up epoch stays decided: re-deciding it is refused loudly, never re-recorded.
    with pytest.raises(ArbitrationError, match="epoch 1 is decided"):
        store.decide(_rec(1, "late"), 1)


def test_link_name_is_remembered(tmp_path):
    store = DeltaArbitrationStore(str(tmp_path / "arb"))
    store.claim("orders", "q")
    store.decide(_rec(0, "a", link="orders"), 1)
    store.check_link("orders")
    with pytest.raises(LinkMismatchError, match="option 'link'.*orders"):
        store.check_link("orders-v2")


def test_spark_reads_the_arbitration_table(spark, tmp_path):
    store = DeltaArbitrationStore(str(tmp_path / "arb"))
    store.claim("orders", "q")
    for epoch in range(3):
        store.decide(_rec(epoch, f'{{"tid":"orders-0-{epoch}"}}', confirmed=epoch - 1), 1)
    rows = spark.read.format("delta").load(store.path).orderBy("epoch").collect()
    assert [(r.link, r.epoch, r.gxid) for r in rows] == [("orders", e, f"gxid-orders-{e}") for e in range(3)]
    assert rows[2].confirmed_through == 1
    history = spark.sql(f"DESCRIBE HISTORY delta.`{store.path}`").collect()
    assert len(history) == 5  # the empty table, the owner's claim, then one commit per decision


SCHEMA = '{"type":"struct","fields":[{"name":"id","type":"long","nullable":true,"metadata":{}}]}'


def _target(base: str, storage=None, **kw):
    from lastagent.delta.target_table import TargetTableStore

    return TargetTableStore(f"{base}/target", fallback_schema_json=kw.pop("schema", SCHEMA), storage=storage, **kw)


@pytest.fixture(params=["delta", "memory", "target", "delta-s3", "target-s3"])
def any_store(request, tmp_path):
    """Every implementation of the store port: arbitration table, memory, lastagent-delta target table; the
    Delta ones on a local disk and on an S3-compatible server (s3a:// paths), where the decision's
    put-if-absent is the server's conditional write."""
    kind, _, place = request.param.partition("-")
    if kind == "memory":
        return InMemoryArbitrationStore()
    base, storage = str(tmp_path), None
    if place == "s3":
        s3 = request.getfixturevalue("s3")
        base, storage = f"s3a://{s3.bucket()}/tables", s3.config()
    return _target(base, storage) if kind == "target" else DeltaArbitrationStore(f"{base}/arb", storage)


def test_racing_deciders_exactly_one_wins_on_every_store(any_store):
    """The loser follows the winner: both see one record."""
    generation = any_store.claim("orders", "q").generation
    for epoch in range(3):
        results = race(lambda name, epoch=epoch: any_store.decide(_rec(epoch, name), generation), ["x", "y"])
        assert sorted(d.won for d in results.values()) == [False, True]
        assert results["x"].record.branches == results["y"].record.branches
        assert any_store.get("orders", epoch).branches == results["x"].record.branches


def test_one_owner_per_link_and_a_superseded_run_decides_nothing(any_store):
    from lastagent.errors import LinkOwnedError, StaleOwnerError

    first = any_store.claim("orders", "query-a")
    with pytest.raises(LinkOwnedError, match="link 'orders' is owned by query query-a.*this query \\(query-b\\)"):
        any_store.claim("orders", "query-b")
    again = any_store.claim("orders", "query-a")  # the owner restarted while its old run still runs
    assert again.generation == first.generation + 1 and any_store.ownership("orders") == again
    with pytest.raises(StaleOwnerError, match=f"generation {first.generation}\\) was superseded"):
        any_store.decide(_rec(0, "old-run"), first.generation)
    assert any_store.get("orders", 0) is None and any_store.latest_epoch("orders") is None
    assert any_store.decide(_rec(0, "new-run"), again.generation).won
    fenced = any_store.claim("orders", "", takeover=True)  # `lastagent recover` fences the running owner
    assert fenced == type(fenced)("query-a", again.generation + 1)
    with pytest.raises(StaleOwnerError):
        any_store.decide(_rec(1, "fenced"), again.generation)


@pytest.mark.parametrize("kind", ["delta", "target", "delta-s3", "target-s3"])
def test_a_store_sees_what_another_store_committed_since_its_last_look(kind, tmp_path, request):
    """A store opens its table once and then reads only newer log entries: every call must still see
    the newest version, or a decision could be taken on a stale view."""
    from lastagent.errors import StaleOwnerError

    kind, _, place = kind.partition("-")
    base, storage = str(tmp_path), None
    if place == "s3":
        s3 = request.getfixturevalue("s3")
        base, storage = f"s3a://{s3.bucket()}/tables", s3.config()

    def make():
        return _target(base, storage) if kind == "target" else DeltaArbitrationStore(f"{base}/arb", storage)

    mine, other = make(), make()
    old = mine.claim("orders", "q")
    assert mine.latest_epoch("orders") is None  # mine has looked at the table
    new = other.claim("orders", "q")
    assert other.decide(_rec(0, "other"), new.generation).won
    assert mine.latest_epoch("orders") == 0 and mine.get("orders", 0).branches == ("other",)
    assert mine.ownership("orders") == new
    with pytest.raises(StaleOwnerError):
        mine.decide(_rec(1, "mine"), old.generation)
    assert not mine.decide(_rec(0, "mine"), new.generation).won  # follows the other's decision
    assert mine.decide(_rec(1, "mine"), new.generation).won
    assert other.get("orders", 1).branches == ("mine",)


def test_claim_racing_a_decision_leaves_no_decision_of_the_old_generation(tmp_path):
    """A claim and a decision that read the same snapshot: Delta lets one commit; a decision that
    lands must be of the generation that stood when it committed."""
    from lastagent.errors import StaleOwnerError

    store = DeltaArbitrationStore(str(tmp_path / "arb"))
    for epoch in range(4):
        old = store.claim("orders", "q")
        outcome = race(lambda what, epoch=epoch, old=old: store.decide(_rec(epoch, f"b{epoch}"), old.generation)
                       if what == "decide" else store.claim("orders", "q"), ["decide", "claim"])
        assert not isinstance(outcome["claim"], Exception), outcome
        from deltalake import DeltaTable

        history = DeltaTable(store.path).history()
        claimed_at = max(c["version"] for c in history if c.get("operation") == "SET TBLPROPERTIES")
        decided_at = [c["version"] for c in history if c.get("lastagent.epoch") == str(epoch)]
        if isinstance(outcome["decide"], StaleOwnerError):
            assert decided_at == [] and store.get("orders", epoch) is None
        else:
            assert outcome["decide"].won and decided_at and decided_at[0] < claimed_at, history[:3]


@pytest.mark.parametrize("place", ["local", "s3"])
def test_first_runs_racing_to_create_the_target_table_make_one_decision(place, tmp_path, request):
    """Two deciders of a first run, a transformer's table that does not exist yet: each decision
    would create the table. Exactly one creates it with its epoch; the other follows."""
    from pyarrow import fs

    from lastagent.delta.target_table import StagedEpoch
    from lastagent.storage import location

    base, storage = str(tmp_path), None
    if place == "s3":
        s3 = request.getfixturevalue("s3")
        base, storage = f"s3a://{s3.bucket()}/q", s3.config()
    checkpoint = f"{base}/ckpt"
    where = location(checkpoint, "checkpointLocation")
    filesystem = (storage.filesystem(where) if storage else fs.LocalFileSystem())
    filesystem.create_dir(where.path)
    with filesystem.open_output_stream(f"{where.path}/metadata") as f:
        f.write(b'{"id":"query-a"}\n')
    for round_ in range(5):
        stores = {n: _target(f"{base}/{round_}", storage, schema=None, checkpoint_location=checkpoint) for n in "xy"}
        # Before the table exists, a run's claim goes to the checkpoint; two deciders of that run race.
        for store in stores.values():
            assert store.claim("orders", "query-a", run="run-1").generation == 1
        results = race(lambda n, stores=stores: stores[n].decide(_rec(0, n), 1, StagedEpoch((), SCHEMA, ())), ["x", "y"])
        assert not any(isinstance(d, Exception) for d in results.values()), results
        assert sorted(d.won for d in results.values()) == [False, True], results
        winner = next(n for n, d in results.items() if d.won)
        assert results["x"].record.branches == results["y"].record.branches == (winner,)
        from deltalake import DeltaTable

        table = stores["x"]._where
        history = DeltaTable(table.uri, storage_options=(storage.delta_options(table) if storage else None)).history()
        decided = [c for c in history if c.get("lastagent.epoch") == "0"]
        assert len(decided) == 1, history


def test_two_first_runs_before_the_table_exists_do_not_share_a_generation(tmp_path):
    """A transformer's first run restarted while its old driver still runs, before any table exists:
    the runs claim in the checkpoint, get generations (and transactional ids) of their own, the old
    run can decide nothing, and the table the new run creates carries its ownership on."""
    from lastagent.delta.target_table import StagedEpoch

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "metadata").write_text('{"id":"query-a"}\n')
    store = _target(str(tmp_path), schema=None, checkpoint_location=str(checkpoint))
    old = store.claim("orders", "query-a", run="run-old")
    new = store.claim("orders", "query-a", run="run-new")
    assert (old.generation, new.generation) == (1, 2)
    assert store.table() is None and store.ownership("orders") == new
    with pytest.raises(StaleOwnerError):
        store.decide(_rec(0, "old"), old.generation, StagedEpoch((), SCHEMA, ()))
    with pytest.raises(StaleOwnerError):
        store.claim("orders", "query-a", run="run-old")  # the zombie cannot take the link back
    assert store.decide(_rec(0, "new"), new.generation, StagedEpoch((), SCHEMA, ())).won
    assert store.table() is not None and store.ownership("orders") == new  # recorded in the new table
    assert store.claim("orders", "query-a", run="run-3").generation == 3  # generations go on


def test_decisions_leave_a_checkpoint_where_sparks_writer_would(tmp_path, spark):
    """Where the table does not set delta.checkpointInterval, Spark's writer checkpoints every 10 versions (delta-rs:
    every 100); the decisions do as Spark does. A table that sets the interval gets its checkpoints by it, at the
    versions Spark's writer would choose (Delta Kernel's checkpoints)."""
    from pathlib import Path

    from deltalake import DeltaTable

    def checkpoints(path: str) -> list[int]:
        return sorted(int(p.name.split(".")[0]) for p in Path(path, "_delta_log").glob("*.checkpoint.parquet"))

    store = _target(str(tmp_path))
    generation = store.claim("orders", "q").generation
    for epoch in range(25):
        assert store.decide(_rec(epoch, "b"), generation).won
    latest = DeltaTable(store.path).version()
    assert latest >= 20 and checkpoints(store.path) == [v for v in range(1, latest + 1) if v % 10 == 0]
    # Spark's reader starts from the newest checkpoint (version 20): it reads the table through it.
    assert spark.sql(f"DESCRIBE DETAIL delta.`{store.path}`").collect()[0].format == "delta"
    assert spark.read.format("delta").load(store.path).count() == 0

    other = _target(str(tmp_path / "five"))
    generation = other.claim("orders", "q").generation
    assert other.decide(_rec(0, "b"), generation).won
    DeltaTable(other.path).alter.set_table_properties({"delta.checkpointInterval": "5"})
    for epoch in range(1, 12):
        assert other.decide(_rec(epoch, "b"), generation).won
    latest = DeltaTable(other.path).version()
    assert checkpoints(other.path) == [v for v in range(1, latest + 1) if v % 5 == 0]

    # After a checkpoint the log's expired entries go, as Spark's writer removes them: with a retention of a day,
    # every commit made to look three days old before the next one, the commits below the checkpoint at 10.
    brief = _target(str(tmp_path / "brief"))
    generation = brief.claim("orders", "q").generation
    assert brief.decide(_rec(0, "b"), generation).won
    DeltaTable(brief.path).alter.set_table_properties({"delta.logRetentionDuration": "interval 1 day"})
    for epoch in range(1, 12):
        _age(Path(brief.path, "_delta_log"), days=3)
        assert brief.decide(_rec(epoch, "b"), generation).won
    latest = DeltaTable(brief.path).version()
    logs = sorted(int(p.name.split(".")[0]) for p in Path(brief.path, "_delta_log").glob("*.json"))
    assert checkpoints(brief.path) == [10] and logs == list(range(10, latest + 1)), logs
    assert spark.read.format("delta").load(brief.path).count() == 0 and brief.latest_epoch("orders") == 11


def _age(directory, days: float) -> None:
    """Makes every file in ``directory`` look ``days`` old (the cleanups go by the files' times)."""
    import os
    import time

    then = time.time() - days * 24 * 3600
    for path in directory.iterdir():
        if path.is_file():
            os.utime(path, (then, then))


def test_the_arbitration_tables_files_stay_bounded_by_its_retention_not_by_its_age(tmp_path, spark, monkeypatch):
    """A link's arbitration table, 120 decisions with the cleanup the committer makes (keep 5): checkpoints every
    10 versions, the log cut below the newest checkpoint once its commits are past delta.logRetentionDuration, and
    the rows' files the cleanups removed deleted once past delta.deletedFileRetentionDuration (here 0: at once, when
    written over 10 minutes ago). Every file is made to look three days old before each decision, as on a link
    that has run that long; the cutoff is not truncated to the day, so each checkpoint cleans. Spark reads the
    table's rows and the link's txn version at the end, and every kept decision is still read back."""
    from pathlib import Path

    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    monkeypatch.setenv("LASTAGENT_DELTA_LOG_CUTOFF", "none")
    store = DeltaArbitrationStore(str(tmp_path / "arb"))
    generation = store.claim("orders", "q").generation
    DeltaTable(store.path).alter.set_table_properties({"delta.logRetentionDuration": "interval 1 day",
                                                      "delta.deletedFileRetentionDuration": "interval 0 seconds"})
    root, log_dir = Path(store.path), Path(store.path, "_delta_log")
    for epoch in range(120):
        _age(root, days=3)
        _age(log_dir, days=3)
        assert store.decide(_rec(epoch, "b", confirmed=epoch - 1), generation).won
        if epoch % 10 == 9:
            store.cleanup("orders", retain_epochs=5)
    latest = DeltaTable(store.path).version()
    json_versions = sorted(int(p.name[:20]) for p in log_dir.glob("*.json"))
    kept_checkpoints = sorted(int(p.name[:20]) for p in log_dir.glob("*.checkpoint*.parquet"))
    assert latest > 130 and len(kept_checkpoints) == 1 and json_versions == list(range(kept_checkpoints[0], latest + 1))
    assert len(json_versions) <= 10
    referenced = {Path(u).name for u in DeltaTable(store.path).file_uris()}
    on_disk = {p.name for p in root.glob("*.parquet")}
    # The cleanup's tombstones of the last 10 versions may still hold a file or two; never the 120 decisions' files.
    assert referenced <= on_disk and len(on_disk - referenced) <= 12, sorted(on_disk - referenced)
    rows = spark.read.format("delta").load(store.path)
    assert sorted(r.epoch for r in rows.collect()) == [r.epoch for r in store.records("orders")]
    assert store.latest_epoch("orders") == 119 and store.get("orders", 119).branches == ("b",)
    assert {r.epoch for r in store.records("orders")} >= set(range(114, 120))
    checkpoint = pq.read_table(log_dir / next(log_dir.glob("*.checkpoint*.parquet")).name)
    assert "txn" in checkpoint.column_names  # the link's txn version lives on in the checkpoint


def test_a_reader_whose_cached_version_was_cleaned_up_reads_the_newest_version(tmp_path):
    """Each read brings the process's last snapshot of the table forward. The log's cleanup may delete every commit
    after that snapshot's version (another process decided meanwhile, with checkpoints and a brief retention): the
    read then starts from the newest checkpoint instead of failing the decision that asked, and the history it
    gives stops at the oldest commit the log keeps. (The table is reached by a second path, a symbolic link, so its
    cached snapshot is not the one this process's own decisions move.)"""
    from pathlib import Path

    from deltalake import DeltaTable

    from lastagent.delta.snapshot import read_snapshot
    from lastagent.storage import StorageConfig, location

    store = DeltaArbitrationStore(str(tmp_path / "arb"))
    generation = store.claim("orders", "q").generation
    assert store.decide(_rec(0, "b"), generation).won
    (tmp_path / "alias").symlink_to(tmp_path / "arb")
    alias = location(str(tmp_path / "alias"), "arbitrationTable")
    stale = read_snapshot(alias, StorageConfig())
    assert stale is not None and stale.version == 2
    DeltaTable(store.path).alter.set_table_properties({"delta.logRetentionDuration": "interval 1 day"})
    for epoch in range(1, 25):
        _age(Path(store.path, "_delta_log"), days=3)
        assert store.decide(_rec(epoch, "b"), generation).won
    logs = sorted(int(p.name.split(".")[0]) for p in Path(store.path, "_delta_log").glob("*.json"))
    assert logs[0] > stale.version + 1, logs  # the commits after the cached version are gone
    fresh = read_snapshot(alias, StorageConfig())
    assert fresh is not None and fresh.version == DeltaTable(store.path).version() == logs[-1]
    assert fresh.app_version("orders") == 24
    assert [c["version"] for c in fresh.commits()] == logs[::-1]


@pytest.mark.parametrize("kind", ["partitioned", "deletion vectors", "shallow clone"])
def test_reading_the_rows_of_a_table_lastagent_did_not_make_is_refused_by_name(kind, tmp_path, spark):
    """``Snapshot.rows`` reads lastagent's own tables with pyarrow, which know no partition values, deletion vectors
    or files outside the table's directory. A table Spark made with one of them (put where an arbitration table
    would be) is refused with its reason, never read as other rows than Spark reads."""
    from lastagent.delta.snapshot import read_snapshot
    from lastagent.storage import StorageConfig, location

    table = str(tmp_path / "table")
    if kind == "partitioned":
        spark.sql(f"CREATE TABLE delta.`{table}` (a INT, b STRING) USING delta PARTITIONED BY (b)")
        spark.sql(f"INSERT INTO delta.`{table}` VALUES (1, 'x'), (2, 'y')")
        reason, rows = "is partitioned", 2
    elif kind == "deletion vectors":
        spark.sql(f"CREATE TABLE delta.`{table}` (a INT, b STRING) USING delta "
                  "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
        spark.sql(f"INSERT INTO delta.`{table}` SELECT id, 'x' FROM range(100)")
        spark.sql(f"DELETE FROM delta.`{table}` WHERE a = 7")
        reason, rows = "has rows deleted by deletion vectors", 99
    else:  # a shallow clone's files are its source's: absolute paths outside its directory
        source = str(tmp_path / "source")
        spark.sql(f"CREATE TABLE delta.`{source}` (a INT, b STRING) USING delta")
        spark.sql(f"INSERT INTO delta.`{source}` VALUES (1, 'x')")
        spark.sql(f"CREATE TABLE delta.`{table}` SHALLOW CLONE delta.`{source}`")
        reason, rows = "names a file outside its directory", 1
    snapshot = read_snapshot(location(table, "arbitrationTable"), StorageConfig())
    assert snapshot is not None
    with pytest.raises(ArbitrationError, match=reason):
        snapshot.rows()
    assert spark.read.format("delta").load(table).count() == rows  # Spark reads it: the table is well made
