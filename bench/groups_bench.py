"""Benchmark: duplicate elimination by reliable groups (``lastagent.reliable_groups``) vs Spark's
``dropDuplicatesWithinWatermark``, on the same stream in the same run: rows per second and state size.

The stream: BENCH_GROUP_ROWS messages (default 2,000,000) of BENCH_GROUPS groups (default 10,000),
each message a (GroupId, SequenceNumber, ExpiryTime, event time, 100-byte value) row, the groups'
messages interleaved, BENCH_DUP_SHARE (default 1 %) re-sent a little later (within a minute of event
time). Written once as parquet files of BENCH_ROWS_PER_FILE rows; both queries read them as a stream
(``maxFilesPerTrigger`` files per micro-batch), both keep their state in RocksDB, both write to
Spark's ``noop`` sink, so the figure is the operator's cost.

* reliable groups: ``reliable_groups(df, columns={...})``: state per group (intervals of sequence
  numbers), kept whatever the time between a message and its copy.
* ``withWatermark("event_time", BENCH_WATERMARK).dropDuplicatesWithinWatermark(["GroupId",
  "SequenceNumber"])``: one state entry per message until the watermark passes it. The event times
  span BENCH_SPAN (default 1 hour) over the stream; the watermark delay (default 10 minutes) is more
  than any re-send's delay, so both find every duplicate.

Checked: each query outputs exactly the distinct messages. State size: the state operator's
``numRowsTotal`` and RocksDB's ``rocksdbSstFileSize`` (bytes of the state store's files) after the last
batch, as Spark's query progress reports them. A warm-up of each on the first file, then
BENCH_GROUP_RUNS (default 3) timed runs of each, the two alternating, each on a new checkpoint; the
figures are the medians (every run's rows/s is listed too). Run with ``make bench`` (or
``python bench/groups_bench.py``). Prints JSON.

``python bench/groups_bench.py --curve``: the state of both by group size instead. For each size in
BENCH_CURVE_SIZES (default 1,8,64,1000 messages per group), a stream of BENCH_CURVE_ROWS distinct
messages (default 128,000; the groups = rows / size) with the same 1 % of copies, read in two
micro-batches, once by each query. Each message's ExpiryTime is a day after its event time, and the
watermark's delay (BENCH_CURVE_WATERMARK, default 1 day) is longer than the stream's event-time span,
as when copies may come within a day: ``dropDuplicatesWithinWatermark`` then keeps every message, as
reliable groups keep every group until it ends. BENCH_CURVE_KINDS (default plain,group_expiry): plain
messages, then the same with a GroupExpiryTime on each (not plain: the rules parse each message, and
the group keeps its parameter). Its state is its SST bytes after the last batch, per message and as the ratio
theirs / ours. A shorter delay keeps only the messages within it (a share f of them: theirs
shrinks by about f; ours does not change).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lastagent.groups.step import ROCKSDB
from lastagent.spark_session import local_session

ROWS = int(os.environ.get("BENCH_GROUP_ROWS", "2000000"))
GROUPS = int(os.environ.get("BENCH_GROUPS", "10000"))
DUP_SHARE = float(os.environ.get("BENCH_DUP_SHARE", "0.01"))
ROWS_PER_FILE = int(os.environ.get("BENCH_ROWS_PER_FILE", "250000"))
FILES_PER_TRIGGER = int(os.environ.get("BENCH_FILES_PER_TRIGGER", "2"))
RUNS = int(os.environ.get("BENCH_GROUP_RUNS", "3"))
SPAN_MS = 3_600_000
DAY_MS = 86_400_000  # --curve: each message's ExpiryTime, after its event time
WATERMARK = "10 minutes"
T0 = 1_800_000_000_000  # event times from here; ExpiryTime far after the run (ms since the epoch)


def write_stream(root: Path, total: int = ROWS, groups: int = GROUPS, rows_per_file: int = ROWS_PER_FILE,
                 expiry_after: int | None = None, group_expiry: bool = False) -> tuple[int, int]:
    """The stream as parquet files: ``total`` messages (rounded down to whole groups) of ``groups`` groups;
    returns (rows written, distinct messages).

    ``expiry_after``: each message's ExpiryTime is this long (ms) after its first send's event time (a copy
    keeps its original's); None: one ExpiryTime far after the run for all. ``group_expiry``: a
    GroupExpiryTime column too, a group's own (after every ExpiryTime of the stream), on each message."""
    rng = random.Random(2026)
    per_group = total // groups
    distinct = per_group * groups
    dups = int(distinct * DUP_SHARE)
    # Message i of the stream is number i // groups of group i % groups: the groups interleave.
    order = list(range(distinct))
    resend_at = sorted(rng.sample(range(distinct), dups))
    value = rng.randbytes(100)
    root.mkdir(parents=True)
    rows = []
    j = 0
    for i in order:
        rows.append(i)
        while j < len(resend_at) and resend_at[j] + 50 == i:  # a copy 50 messages (~1 s of event time) later
            rows.append(resend_at[j])
            j += 1
    n = len(rows)
    first: dict[int, int] = {}
    if expiry_after is not None:
        for p, i in enumerate(rows):
            first.setdefault(i, p)
    for f, start in enumerate(range(0, n, rows_per_file)):
        chunk = rows[start:start + rows_per_file]
        positions = range(start, start + len(chunk))
        expiries = [T0 + 10 * SPAN_MS] * len(chunk) if expiry_after is None else \
            [T0 + first[i] * SPAN_MS // n + expiry_after for i in chunk]
        columns = {
            "GroupId": pa.array([f"g{i % groups}" for i in chunk]),
            "SequenceNumber": pa.array([i // groups for i in chunk], pa.int64()),
            "ExpiryTime": pa.array(expiries, pa.int64()),
            "event_time": pa.array([(T0 + p * SPAN_MS // n) * 1000 for p in positions], pa.timestamp("us", tz="UTC")),
            "value": pa.array([value] * len(chunk), pa.binary()),
        }
        if group_expiry:  # after every ExpiryTime of the stream, a second apart from group to group
            last = T0 + SPAN_MS + (expiry_after or 10 * SPAN_MS)
            columns["GroupExpiryTime"] = pa.array([last + 1000 * (i % groups) for i in chunk], pa.int64())
        table = pa.table(columns)
        pq.write_table(table, root / f"part-{f:05d}.parquet")
    return n, distinct


def run(spark, name: str, src: Path, ckpt: Path, build, files_per_trigger: int = FILES_PER_TRIGGER) -> dict:
    stream = spark.readStream.schema(spark.read.parquet(str(src)).schema) \
        .option("maxFilesPerTrigger", files_per_trigger).parquet(str(src))
    from pyspark.sql import functions as F

    counted = build(stream).observe(f"{name}_rows", F.count("*").alias("n"))
    start = time.perf_counter()
    query = counted.writeStream.format("noop").option("checkpointLocation", str(ckpt)) \
        .trigger(availableNow=True).start()
    query.awaitTermination()
    elapsed = time.perf_counter() - start
    reports = [json.loads(p.json) for p in query.recentProgress]
    out_rows = sum(int(r.get("observedMetrics", {}).get(f"{name}_rows", {}).get("n", 0)) for r in reports)
    in_rows = sum(r.get("numInputRows", 0) for r in reports)
    last = [r for r in reports if r.get("stateOperators")][-1]["stateOperators"][0]
    return {"seconds": round(elapsed, 1), "input_rows": in_rows, "output_rows": out_rows,
            "rows_per_s": round(in_rows / elapsed), "state_rows": last.get("numRowsTotal"),
            "state_sst_bytes": int(last.get("customMetrics", {}).get("rocksdbSstFileSize", 0)),
            "state_memory_bytes": last.get("memoryUsedBytes"), "batches": len(reports)}


def steps(watermark: str, group_expiry: bool = False) -> dict:
    """The two queries' steps, by name; ``group_expiry``: the stream has a GroupExpiryTime column."""
    from lastagent import reliable_groups

    fields = {"GroupId": "GroupId", "SequenceNumber": "SequenceNumber", "ExpiryTime": "ExpiryTime",
              **({"GroupExpiryTime": "GroupExpiryTime"} if group_expiry else {})}
    return {
        "reliable_groups": lambda df: reliable_groups(df.drop("event_time"), columns=fields,
                                                      headers_column=None, ordered=False),
        "dropDuplicatesWithinWatermark": lambda df: df.withWatermark("event_time", watermark)
        .dropDuplicatesWithinWatermark(["GroupId", "SequenceNumber"]),
    }


def curve() -> int:
    """State of both by group size (``--curve``, module docstring). Prints JSON."""
    total = int(os.environ.get("BENCH_CURVE_ROWS", "128000"))
    sizes = [int(x) for x in os.environ.get("BENCH_CURVE_SIZES", "1,8,64,1000").split(",")]
    watermark = os.environ.get("BENCH_CURVE_WATERMARK", "1 day")
    kinds = os.environ.get("BENCH_CURVE_KINDS", "plain,group_expiry").split(",")
    work = Path(tempfile.mkdtemp(prefix="lastagent-groups-curve-"))
    try:
        spark = local_session("lastagent-groups-bench", extra_conf={"spark.sql.streaming.stateStore.providerClass": ROCKSDB})
        spark.sparkContext.setLogLevel("ERROR")
        points = []
        for kind, size in [(k, z) for k in kinds for z in sizes]:
            src = work / f"stream-{kind}-{size}"
            # Two files read one per micro-batch: two commits of the state store, as in a running query.
            n, distinct = write_stream(src, total, max(1, total // size), rows_per_file=-(-total * 101 // 100 // 2),
                                       expiry_after=DAY_MS, group_expiry=kind == "group_expiry")
            point: dict = {"kind": kind, "messages_per_group": size, "groups": max(1, total // size), "rows": n,
                           "distinct": distinct}
            for name, build in steps(watermark, kind == "group_expiry").items():
                r = run(spark, name, src, work / f"ckpt-{name}-{kind}-{size}", build, files_per_trigger=1)
                if r["output_rows"] != distinct:
                    print(f"{name}, {size} per group: {r['output_rows']} rows out, {distinct} distinct messages in",
                          file=sys.stderr)
                    return 1
                point[name] = {"state_sst_bytes": r["state_sst_bytes"], "state_rows": r["state_rows"],
                               "sst_bytes_per_message": round(r["state_sst_bytes"] / distinct, 2),
                               "batches": r["batches"], "rows_per_s": r["rows_per_s"]}
            ours, theirs = point["reliable_groups"], point["dropDuplicatesWithinWatermark"]
            point["state_sst_bytes_ratio_theirs_over_ours"] = round(
                theirs["state_sst_bytes"] / max(1, ours["state_sst_bytes"]), 2)
            points.append(point)
            print(json.dumps(point), file=sys.stderr)  # progress, one line per size
        print(json.dumps({"rows": total, "duplicate_share": DUP_SHARE, "watermark": watermark,
                          "expiry_after_ms": DAY_MS, "curve": points},
                         indent=2))
        spark.stop()
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="lastagent-groups-bench-"))
    try:
        n, distinct = write_stream(work / "stream")
        warm = work / "warm"
        warm.mkdir()
        for f in sorted((work / "stream").iterdir())[:1]:
            shutil.copy(f, warm / f.name)
        spark = local_session("lastagent-groups-bench", extra_conf={"spark.sql.streaming.stateStore.providerClass": ROCKSDB})
        spark.sparkContext.setLogLevel("ERROR")
        by_name = steps(WATERMARK)
        for name, build in by_name.items():
            run(spark, name, warm, work / f"ckpt-warm-{name}", build)
        runs: dict[str, list[dict]] = {name: [] for name in by_name}
        for k in range(RUNS):  # alternating, so a slow minute of the machine falls on both
            for name, build in by_name.items():
                r = run(spark, name, work / "stream", work / f"ckpt-{name}-{k}", build)
                if r["output_rows"] != distinct:
                    print(f"{name}: {r['output_rows']} rows out, {distinct} distinct messages in", file=sys.stderr)
                    return 1
                runs[name].append(r)
        results = {}
        for name, rs in runs.items():
            middle = sorted(rs, key=lambda r: r["rows_per_s"])[len(rs) // 2]
            results[name] = {**middle, "rows_per_s": round(statistics.median(r["rows_per_s"] for r in rs)),
                             "runs_rows_per_s": [r["rows_per_s"] for r in rs]}
        ours, theirs = results["reliable_groups"], results["dropDuplicatesWithinWatermark"]
        summary = {
            "rows": n, "distinct": distinct, "groups": GROUPS, "duplicate_share": DUP_SHARE,
            "rows_per_file": ROWS_PER_FILE, "files_per_trigger": FILES_PER_TRIGGER, "watermark": WATERMARK,
            "timed_runs": RUNS,
            "results": results,
            "throughput_ratio": round(ours["rows_per_s"] / theirs["rows_per_s"], 3),
            "state_sst_bytes_ratio_theirs_over_ours": round(theirs["state_sst_bytes"] / max(1, ours["state_sst_bytes"]), 1),
            "state_rows_ratio_theirs_over_ours": round(theirs["state_rows"] / max(1, ours["state_rows"]), 1),
        }
        print(json.dumps(summary, indent=2))
        spark.stop()
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(curve() if sys.argv[1:] == ["--curve"] else main())
