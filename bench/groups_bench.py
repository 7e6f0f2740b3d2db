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
WATERMARK = "10 minutes"
T0 = 1_800_000_000_000  # event times from here; ExpiryTime far after the run (ms since the epoch)


def write_stream(root: Path) -> tuple[int, int]:
    """The stream as parquet files; returns (rows written, distinct messages)."""
    rng = random.Random(2026)
    per_group = ROWS // GROUPS
    distinct = per_group * GROUPS
    dups = int(distinct * DUP_SHARE)
    # Message i of the stream is number i // GROUPS of group i % GROUPS: the groups interleave.
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
    for f, start in enumerate(range(0, n, ROWS_PER_FILE)):
        chunk = rows[start:start + ROWS_PER_FILE]
        positions = range(start, start + len(chunk))
        table = pa.table({
            "GroupId": pa.array([f"g{i % GROUPS}" for i in chunk]),
            "SequenceNumber": pa.array([i // GROUPS for i in chunk], pa.int64()),
            "ExpiryTime": pa.array([T0 + 10 * SPAN_MS] * len(chunk), pa.int64()),
            "event_time": pa.array([(T0 + p * SPAN_MS // n) * 1000 for p in positions], pa.timestamp("us", tz="UTC")),
            "value": pa.array([value] * len(chunk), pa.binary()),
        })
        pq.write_table(table, root / f"part-{f:05d}.parquet")
    return n, distinct


def run(spark, name: str, src: Path, ckpt: Path, build) -> dict:
    stream = spark.readStream.schema(spark.read.parquet(str(src)).schema) \
        .option("maxFilesPerTrigger", FILES_PER_TRIGGER).parquet(str(src))
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


def main() -> int:
    from lastagent import reliable_groups

    work = Path(tempfile.mkdtemp(prefix="lastagent-groups-bench-"))
    try:
        n, distinct = write_stream(work / "stream")
        warm = work / "warm"
        warm.mkdir()
        for f in sorted((work / "stream").iterdir())[:1]:
            shutil.copy(f, warm / f.name)
        spark = local_session("lastagent-groups-bench", extra_conf={"spark.sql.streaming.stateStore.providerClass": ROCKSDB})
        spark.sparkContext.setLogLevel("ERROR")
        steps = {
            "reliable_groups": lambda df: reliable_groups(df.drop("event_time"), columns={
                "GroupId": "GroupId", "SequenceNumber": "SequenceNumber", "ExpiryTime": "ExpiryTime"},
                headers_column=None, ordered=False),
            "dropDuplicatesWithinWatermark": lambda df: df.withWatermark("event_time", WATERMARK)
            .dropDuplicatesWithinWatermark(["GroupId", "SequenceNumber"]),
        }
        for name, build in steps.items():
            run(spark, name, warm, work / f"ckpt-warm-{name}", build)
        runs: dict[str, list[dict]] = {name: [] for name in steps}
        for k in range(RUNS):  # alternating, so a slow minute of the machine falls on both
            for name, build in steps.items():
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
    sys.exit(main())
