"""Benchmark: Kafka → the exactly-once `lastagent-delta` sink vs Spark's built-in `kafka`
source → built-in Delta sink, on the same topic in the same run; and the data files each sink
leaves behind.

* `lastagent-kafka` source → `lastagent-delta` sink, trigger availableNow;
* Spark's built-in `kafka` source → built-in `delta` sink, trigger availableNow;
both with the same select (key as string, value, topic, partition, offset) and the same
maxOffsetsPerTrigger, so both run several epochs (one Delta commit each). One warm-up run of
each, then BENCH_REPEAT alternating runs; medians. Every run is checked: the table read back
with `spark.read.format("delta")` holds exactly the topic's rows.

Files: per sink, the number of data files in the output table and their median / min / max size
(from the add actions, via `deltalake.DeltaTable`), the number of epochs (Delta commits that add
files) and the most files one epoch added — for the full-size run and for a small-trigger run
(BENCH_SMALL_PER_TRIGGER=1000 over BENCH_SMALL_ROWS=20,000 rows), to show there is no flood of
tiny files beyond one file per task (Kafka partition) per epoch.

Run with `make bench` (or `python bench/delta_bench.py`). Sizes via env: BENCH_ROWS (default
2,000,000 rows of 100-byte values over 2 partitions), BENCH_PER_TRIGGER (maxOffsetsPerTrigger,
default 200,000), BENCH_REPEAT (default 3). Prints a JSON summary.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow as pa
from common import BOOTSTRAP, fill_topic
from deltalake import DeltaTable
from kafka.admin import KafkaAdminClient

from lastagent.spark_session import local_session

ROWS = int(os.environ.get("BENCH_ROWS", "2000000"))
PER_TRIGGER = int(os.environ.get("BENCH_PER_TRIGGER", "200000"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))
SMALL_ROWS = int(os.environ.get("BENCH_SMALL_ROWS", "20000"))
SMALL_PER_TRIGGER = int(os.environ.get("BENCH_SMALL_PER_TRIGGER", "1000"))
PARTITIONS = 2
VALUE_BYTES = 100
WORK = tempfile.mkdtemp(prefix="lastagent-bench-delta-")

#: sink name in the summary → (source format, sink format)
SINKS = {"delta-builtin": ("kafka", "delta"), "lastagent-delta": ("lastagent-kafka", "lastagent-delta"),
         "lastagent-delta-new-table": ("lastagent-kafka", "lastagent-delta")}
#: lastagent-delta-new-table writes a table made first as Delta makes new ones (deletion vectors, row tracking,
#: in-commit timestamps, clustering), whose commits go through Delta Kernel; lastagent-delta's table is the one the
#: sink creates (delta-rs).
NEW_TABLE = ("CREATE TABLE delta.`{t}` (key STRING, value BINARY, topic STRING, partition INT, offset BIGINT) USING delta "
             "CLUSTER BY (offset) TBLPROPERTIES ('delta.enableDeletionVectors'='true', 'delta.enableRowTracking'='true', "
             "'delta.enableInCommitTimestamps'='true')")


#: sink → seconds per phase of Spark's micro-batch (durationMs of the progress reports), summed
#: over the epochs of the last timed run: where each pipeline spends its time.
PHASES: dict[str, dict[str, float]] = {}


def spark_write(spark, sink: str, topic: str, rows: int, per_trigger: int) -> tuple[float, str]:
    """One availableNow run of ``sink`` over the whole topic: (rows/s, table path). Checks the rows."""
    source_fmt, sink_fmt = SINKS[sink]
    run = os.path.join(WORK, f"{sink}-{uuid.uuid4().hex[:8]}")
    table, ckpt = os.path.join(run, "table"), os.path.join(run, "ckpt")
    df = (spark.readStream.format(source_fmt).option("kafka.bootstrap.servers", BOOTSTRAP)
          .option("subscribe", topic).option("startingOffsets", "earliest")
          .option("maxOffsetsPerTrigger", str(per_trigger)).load()
          .selectExpr("CAST(key AS STRING) AS key", "value", "topic", "partition", "offset"))
    writer = (df.writeStream.format(sink_fmt).option("checkpointLocation", ckpt)
              .trigger(availableNow=True))
    if sink_fmt == "lastagent-delta":
        writer = writer.option("link", f"bench-{uuid.uuid4().hex[:8]}")
    if sink == "lastagent-delta-new-table":
        spark.sql(NEW_TABLE.format(t=table))
    start = time.perf_counter()
    query = writer.start(table)
    query.awaitTermination()
    elapsed = time.perf_counter() - start
    if query.exception() is not None:
        raise SystemExit(f"{sink} failed: {query.exception()}")
    phases: dict[str, float] = {}
    for progress in query.recentProgress:
        for phase, ms in progress["durationMs"].items():
            phases[phase] = phases.get(phase, 0.0) + ms / 1000
    PHASES[sink] = {k: round(v, 2) for k, v in sorted(phases.items())}
    written = spark.read.format("delta").load(table).count()
    if written != rows:
        raise SystemExit(f"{sink}: table {table} holds {written} rows, expected {rows}")
    return rows / elapsed, table


def file_stats(table: str) -> dict[str, int]:
    """Data files of a Delta table: count, median/min/max bytes, epochs, most files added by one commit."""
    adds = pa.table(DeltaTable(table).get_add_actions(flatten=True))
    sizes = sorted(adds.column("size_bytes").to_pylist())
    # Files added per commit (one commit per epoch for both sinks), from the commit JSONs.
    per_commit = []
    for log in sorted(Path(table, "_delta_log").glob("*.json")):
        n = sum(1 for line in log.read_text().splitlines() if line.strip() and "add" in json.loads(line))
        if n:
            per_commit.append(n)
    return {
        "files": len(sizes),
        "median_bytes": round(statistics.median(sizes)) if sizes else 0,
        "min_bytes": sizes[0] if sizes else 0,
        "max_bytes": sizes[-1] if sizes else 0,
        "epochs": len(per_commit),
        "max_files_per_epoch": max(per_commit, default=0),
    }


def files_section(spark, topic: str, rows: int, per_trigger: int,
                  tables: dict[str, str] | None = None) -> dict[str, object]:
    """File stats of both sinks for one (rows, per_trigger); runs each sink unless tables are given."""
    out: dict[str, object] = {"rows": rows, "per_trigger": per_trigger, "tasks_per_epoch": PARTITIONS}
    for sink in SINKS:
        table = tables[sink] if tables else spark_write(spark, sink, topic, rows, per_trigger)[1]
        stats = file_stats(table)
        stats["at_most_one_file_per_task_per_epoch"] = stats["max_files_per_epoch"] <= PARTITIONS
        out[sink] = stats
    return out


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("lastagent-bench")
    spark.sparkContext.setLogLevel("ERROR")
    try:
        topic = fill_topic(admin, PARTITIONS, ROWS, VALUE_BYTES)
        # Warm-up: JIT, Python workers, consumers, Delta's code paths.
        for sink in SINKS:
            spark_write(spark, sink, topic, ROWS, PER_TRIGGER)
        results: dict[str, list[float]] = {sink: [] for sink in SINKS}
        last: dict[str, str] = {}
        for _ in range(REPEAT):
            for sink in SINKS:
                rate, table = spark_write(spark, sink, topic, ROWS, PER_TRIGGER)
                results[sink].append(rate)
                last[sink] = table
        med = {k: statistics.median(v) for k, v in results.items()}
        phases = {k: dict(v) for k, v in PHASES.items()}
        files = {"full": files_section(spark, topic, ROWS, PER_TRIGGER, tables=last)}
        small = fill_topic(admin, PARTITIONS, SMALL_ROWS, VALUE_BYTES)
        files["small_trigger"] = files_section(spark, small, SMALL_ROWS, SMALL_PER_TRIGGER)
        summary = {
            "rows": ROWS, "value_bytes": VALUE_BYTES, "partitions": PARTITIONS, "repeat": REPEAT,
            "per_trigger": PER_TRIGGER,
            "rows_per_s_median": {k: round(v) for k, v in med.items()},
            "ratio_vs_builtin": round(med["lastagent-delta"] / med["delta-builtin"], 2),
            "new_table_vs_sink_created": round(med["lastagent-delta-new-table"] / med["lastagent-delta"], 2),
            "seconds_per_phase_last_run": phases,
            "files": files,
        }
        print(json.dumps(summary, indent=2))
    finally:
        spark.stop()
        shutil.rmtree(WORK, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
