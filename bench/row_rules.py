"""What a table's row rules cost a task: ``RowChecker.apply`` beside the parquet writing it precedes.

A ``lastagent-delta`` task casts each batch to the table's schema, applies the table's rules
(generated columns, CHAR/VARCHAR lengths, NOT NULL, CHECK constraints: ``lastagent.sinks.table_rows``)
and writes the rows to parquet (``FileWriter``). This times, in one process and one run, the
writing alone and the rules for three tables: NOT NULL only; a CHECK constraint and a generated
column; and those with a VARCHAR and a NOT NULL column too. BENCH_ROWS rows (default 1,000,000)
in batches of 10,000, best of BENCH_REPEAT (default 3); prints microseconds per row and each rule
set's cost as a share of the writing, as JSON.

Run with `make bench` (or `cd bench && python row_rules.py`); no broker or Spark needed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import pyarrow as pa

from lastagent.delta.features import Constraint, GeneratedColumn, TableRules
from lastagent.delta.files import FileWriter
from lastagent.sinks.table_rows import RowChecker

ROWS = int(os.environ.get("BENCH_ROWS", "1000000"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))
BATCH = 10_000

SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("amount", pa.int32()), pa.field("name", pa.string()),
                    pa.field("doubled", pa.int32())])
RULES = {
    "not null": TableRules(not_null=("id",)),
    "check + generated": TableRules(constraints=(Constraint("positive", "amount >= 0"),),
                                    generated=(GeneratedColumn("doubled", "amount * 2"),)),
    "check + generated + varchar + not null": TableRules(
        constraints=(Constraint("positive", "amount >= 0"),), generated=(GeneratedColumn("doubled", "amount * 2"),),
        not_null=("id",), lengths=(("name", 16),)),
}


def batches() -> list[pa.RecordBatch]:
    out = []
    for start in range(0, ROWS, BATCH):
        ids = pa.array(range(start, start + BATCH), pa.int64())
        out.append(pa.record_batch([ids, pa.array([i % 1000 for i in range(BATCH)], pa.int32()),
                                    pa.array([f"name-{i % 97}" for i in range(BATCH)]),
                                    pa.nulls(BATCH, pa.int32())], schema=SCHEMA))
    return out


def best(fn) -> float:  # a timed callable
    times = []
    for _ in range(REPEAT):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    data = batches()

    def write() -> None:
        with tempfile.TemporaryDirectory() as root:
            writer = FileWriter(root, "bench", 0, 0, 0, 0)
            for b in data:
                writer.write(b)
            writer.close()

    writing = best(write)
    result: dict[str, object] = {"rows": ROWS, "write_us_per_row": round(writing / ROWS * 1e6, 4)}
    for name, rules in RULES.items():
        checker = RowChecker(rules, SCHEMA, ("id", "amount", "name"), "UTC")

        def apply(checker: RowChecker = checker) -> None:
            for b in data:
                checker.apply(b)

        cost = best(apply)
        result[name] = {"us_per_row": round(cost / ROWS * 1e6, 4), "share_of_writing": round(cost / writing, 3)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
