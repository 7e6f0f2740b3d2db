"""The rules that keep lastagent's Delta tables as Spark's writer keeps its own (lastagent.delta.upkeep), without I/O."""

from __future__ import annotations

import pytest

from lastagent.delta.upkeep import (
    DELETED_FILE_RETENTION_MS,
    LOG_RETENTION_MS,
    LogFile,
    Retention,
    cutoff,
    expired_log_files,
    interval_ms,
    unreferenced_files,
)
from lastagent.errors import ArbitrationError

pytestmark = pytest.mark.unit

DAY = 24 * 3600 * 1000


def _log(versions: range, checkpoints: set[int], time_of=lambda v: 1000 * v, crc: bool = True) -> list[LogFile]:
    files = [LogFile(f"{v:020}.json", time_of(v), 10) for v in versions]
    files += [LogFile(f"{v:020}.checkpoint.parquet", time_of(v), 10) for v in checkpoints]
    files += [LogFile(f"{v:020}.crc", time_of(v), 10) for v in versions if crc]
    return files


@pytest.mark.parametrize("text, ms", [("interval 30 days", 30 * DAY), ("7 days", 7 * DAY), ("interval 1 hour", 3600_000),
                                      ("interval 0 seconds", 0), ("INTERVAL 2 days 3 hours", 2 * DAY + 3 * 3600_000),
                                      ("interval 1 week", 7 * DAY), ("interval 500 milliseconds", 500)])
def test_intervals_read_as_delta_reads_them(text, ms):
    assert interval_ms(text, "delta.logRetentionDuration") == ms


@pytest.mark.parametrize("text", ["30", "interval 1 month", "forever", "interval x days", ""])
def test_an_interval_delta_would_refuse_is_refused_naming_the_property(text):
    with pytest.raises(ArbitrationError, match="delta.deletedFileRetentionDuration"):
        interval_ms(text, "delta.deletedFileRetentionDuration")


def test_retention_takes_sparks_defaults_where_the_table_sets_none():
    assert Retention.of({}) == Retention(10, True, LOG_RETENTION_MS, DELETED_FILE_RETENTION_MS)
    assert Retention.of({"delta.checkpointInterval": "5", "delta.enableExpiredLogCleanup": "FALSE",
                         "delta.logRetentionDuration": "interval 1 day",
                         "delta.deletedFileRetentionDuration": "interval 2 hours"}) == Retention(5, False, DAY, 7200_000)


def test_the_cutoff_is_truncated_to_midnight_utc_as_spark_truncates_it():
    now = 100 * DAY + 5 * 3600_000
    assert cutoff(now, 30 * DAY) == 70 * DAY
    assert cutoff(now, 0) == 100 * DAY  # nothing written today is past a retention of 0 at day granularity
    assert cutoff(now, 0, 1) == now


def test_the_log_is_cleaned_up_to_the_newest_checkpoint_whose_previous_commit_expired():
    files = _log(range(0, 35), {10, 20, 30})
    # Commits 0..24 are past the cutoff: the boundary is checkpoint 20 (19 expired), not 30 (29 is not).
    doomed = expired_log_files(files, cutoff_ms=24_500, newest_checkpoint=30)
    assert sorted({int(n[:20]) for n in doomed}) == list(range(0, 20))
    assert f"{10:020}.checkpoint.parquet" in doomed and f"{20:020}.checkpoint.parquet" not in doomed
    # Everything expired: the newest checkpoint bounds it, and it and every commit after it stay.
    doomed = expired_log_files(files, cutoff_ms=10**9, newest_checkpoint=30)
    assert sorted({int(n[:20]) for n in doomed}) == list(range(0, 30))
    # Only the newest checkpoint that _last_checkpoint names counts (a later one may still be written).
    assert sorted({int(n[:20]) for n in expired_log_files(files, 10**9, 20)}) == list(range(0, 20))


def test_nothing_goes_without_a_checkpoint_past_it_or_before_the_cutoff():
    assert expired_log_files(_log(range(0, 30), set()), 10**9, 29) == []
    assert expired_log_files(_log(range(0, 30), {10, 20}), cutoff_ms=9_000 - 1, newest_checkpoint=20) == []
    # An empty (torn) checkpoint file is no checkpoint.
    torn = [f._replace(size=0) if ".checkpoint" in f.name else f for f in _log(range(0, 30), {20})]
    assert expired_log_files(torn, 10**9, 20) == []


def test_times_that_go_back_are_raised_past_the_previous_commit_as_spark_does():
    """Commit 9's file is older than commit 8's: its time is 8's plus 1 ms, so with the cutoff between the two,
    the segment before checkpoint 10 is not expired (Spark keeps a time-travel anchor)."""
    times = {v: 1000 * v for v in range(0, 15)}
    times[9] = 500
    files = _log(range(0, 15), {10}, time_of=times.__getitem__, crc=False)
    assert expired_log_files(files, cutoff_ms=8_000, newest_checkpoint=10) == []
    assert len(expired_log_files(files, cutoff_ms=8_001, newest_checkpoint=10)) == 10


def test_a_multi_part_checkpoint_counts_once_every_part_is_there():
    files = _log(range(0, 15), set())
    files.append(LogFile(f"{10:020}.checkpoint.0000000001.0000000002.parquet", 10_000, 5))
    assert expired_log_files(files, 10**9, 10) == []
    files.append(LogFile(f"{10:020}.checkpoint.0000000002.0000000002.parquet", 10_000, 5))
    assert sorted({int(n[:20]) for n in expired_log_files(files, 10**9, 10)}) == list(range(0, 10))


def test_other_files_in_the_log_are_left_alone_and_compactions_below_the_boundary_go():
    files = [*_log(range(0, 15), {10}), LogFile("_last_checkpoint", 0, 10), LogFile(".00000.json.tmp", 0, 1),
             LogFile(f"{2:020}.{5:020}.compacted.json", 0, 3), LogFile(f"{8:020}.{12:020}.compacted.json", 0, 3)]
    doomed = expired_log_files(files, 10**9, 10)
    assert "_last_checkpoint" not in doomed and ".00000.json.tmp" not in doomed
    assert f"{2:020}.{5:020}.compacted.json" in doomed and f"{8:020}.{12:020}.compacted.json" not in doomed


def test_vacuum_deletes_what_no_version_within_retention_references_and_nothing_younger():
    files = [LogFile("kept.parquet", 0, 1), LogFile("removed-long-ago.parquet", 0, 1),
             LogFile("removed-lately.parquet", 0, 1), LogFile("never-committed.parquet", 0, 1),
             LogFile("just-written.parquet", 5_000, 1), LogFile("_delta_log", 0, 1), LogFile(".hidden.crc", 0, 1)]
    doomed = unreferenced_files(files, {"kept.parquet"}, {"removed-long-ago.parquet": 100,
                                                          "removed-lately.parquet": 3_000},
                                removed_before_ms=2_000, written_before_ms=4_000)
    assert doomed == ["never-committed.parquet", "removed-long-ago.parquet"]


def test_a_property_spark_would_refuse_leaves_the_table_unkept_and_the_commit_standing(caplog):
    """The upkeep runs after a commit: a bad property is logged, never raised into the decision that committed."""
    from lastagent.delta.upkeep import TableUpkeep

    upkeep = TableUpkeep(filesystem=lambda: None, root="/nowhere", uri="file:///nowhere", storage={}, what="table t")
    for bad in ({"delta.checkpointInterval": "often"}, {"delta.logRetentionDuration": "interval 1 month"}):
        upkeep.after_commit(10, "id", bad)
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert "delta.logRetentionDuration" in caplog.records[1].getMessage()
