"""Benchmark: what pyspark 4.0's row-based stream writer costs a sink task per row, in one process.

pyspark 4.0 turns the Arrow batches Spark sends a Python stream writer into rows (its ``batch_to_rows``, run
here as pyspark's own ``ArrowTableToRowsConversion`` converters do it); lastagent's sinks turn them back into
Arrow (``lastagent.spark_api.rows_to_arrow``). On 4.1+ neither happens. Prints both costs per row for two
schemas, BENCH_ROWS rows (default 1,000,000). Run with any pyspark 4 (the conversion is the same code):

    python bench/rows_to_arrow_bench.py
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from collections.abc import Callable, Iterator

import pyarrow as pa
from pyspark.sql.conversion import ArrowTableToRowsConversion
from pyspark.sql.types import BinaryType, IntegerType, StringType, StructField, StructType, TimestampType, _create_row

from lastagent.spark_api import rows_to_arrow

ROWS = int(os.environ.get("BENCH_ROWS", "1000000"))
AT = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

CASES: list[tuple[str, StructType, Callable[[int], list[pa.Array]]]] = [
    ("key, value: binary (10 and 100 bytes)",
     StructType([StructField("key", BinaryType()), StructField("value", BinaryType())]),
     lambda n: [pa.array([b"k%07d" % i for i in range(n)]), pa.array([os.urandom(100) for _ in range(n)])]),
    ("v: string, partition: int, ts: timestamp",
     StructType([StructField("v", StringType()), StructField("partition", IntegerType()),
                 StructField("ts", TimestampType())]),
     lambda n: [pa.array([f"row-{i:07d}" for i in range(n)]), pa.array(range(n), pa.int32()),
                pa.array([AT] * n, pa.timestamp("us", tz="UTC"))]),
]


def as_rows(batches: list[pa.RecordBatch], schema: StructType) -> Iterator[object]:
    """What pyspark 4.0's write_into_data_source hands a stream writer: its batch_to_rows."""
    convert = [ArrowTableToRowsConversion._create_converter(f.dataType) for f in schema.fields]
    fields = schema.fieldNames()
    for b in batches:
        columns = [c.to_pylist() for c in b.columns]
        for r in range(b.num_rows):
            yield _create_row(fields=fields, values=[convert[c](columns[c][r]) for c in range(b.num_columns)])


def main() -> None:
    out = []
    for name, schema, make in CASES:
        arrays = make(ROWS)
        batches = [pa.RecordBatch.from_arrays([a.slice(o, 10_000) for a in arrays], names=schema.fieldNames())
                   for o in range(0, ROWS, 10_000)]
        start = time.perf_counter()
        assert sum(1 for _ in as_rows(batches, schema)) == ROWS
        spark_s = time.perf_counter() - start
        start = time.perf_counter()
        assert sum(b.num_rows for b in rows_to_arrow(as_rows(batches, schema), schema)) == ROWS
        ours_s = time.perf_counter() - start - spark_s
        out.append({"schema": name, "rows": ROWS, "pyspark_arrow_to_rows_us_per_row": round(spark_s / ROWS * 1e6, 2),
                    "lastagent_rows_to_arrow_us_per_row": round(ours_s / ROWS * 1e6, 2)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
