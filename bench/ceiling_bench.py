"""Benchmark: the ceiling of any Python data source and sink on this Spark, beside the built-in `kafka`
format and lastagent, in the same run.

Issue 13 asks for a source at 1.5 x Spark's built-in `kafka` source and a sink at 0.8 x a raw producer.
Part of every Python data source's time is Spark's: starting the driver's Python processes, moving
Arrow batches between the Python workers and the JVM, turning them into rows. This measures that
part alone, with two formats that do no Kafka work:

* `ceiling-source`: a Python streaming source whose tasks yield ready Arrow batches of Kafka's row
  schema (key, value of 100 random bytes, topic, partition, offset, timestamp, timestampType),
  built once per worker; same rows, partitions and batch size as the topic the others read;
* `ceiling-sink`: a Python streaming Arrow sink whose tasks only count the rows they get.

The ceiling source reads into `noop` like source_bench.py; the ceiling sink takes the Delta table of
sink_bench.py. Both also report the rate inside Spark's micro-batch (source: triggerExecution; sink:
addBatch), without query start and the Delta source's planning. No Python data source can be faster
than the ceiling, since it does strictly less.

Run with `cd bench && ../.venv/bin/python ceiling_bench.py` (in `make bench`). Sizes via env:
BENCH_ROWS (source, default 2,000,000 over 2 partitions), BENCH_SINK_ROWS (default 1,000,000),
BENCH_REPEAT (default 3). Prints a JSON summary.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

from common import BOOTSTRAP, fill_topic, new_topic
from kafka.admin import KafkaAdminClient
from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, DataSourceStreamReader, InputPartition, WriterCommitMessage
from sink_bench import raw_producer, source_table, spark_write
from source_bench import raw_consumer, spark_read

from lastagent.sources.kafka_source import kafka_schema
from lastagent.spark_session import local_session

ROWS = int(os.environ.get("BENCH_ROWS", "2000000"))
SINK_ROWS = int(os.environ.get("BENCH_SINK_ROWS", "1000000"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))
PARTITIONS = 2
BATCH_ROWS = 10_000  # the lastagent source's default maxRecordsPerArrowBatch


class _Range(InputPartition):
    def __init__(self, partition: int, rows: int) -> None:
        self.partition, self.rows = partition, rows


class CeilingReader(DataSourceStreamReader):
    """Offsets 0..rows per partition, all in the first micro-batch (availableNow reads them at once)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def initialOffset(self) -> dict:  # Spark's API
        return {"rows": 0}

    def latestOffset(self) -> dict:  # Spark's API
        return {"rows": self.rows}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        n = end["rows"] - start["rows"]
        return [_Range(p, n // PARTITIONS) for p in range(PARTITIONS)]

    def read(self, partition: _Range) -> Iterator[Any]:  # type: ignore[override]
        batch = _ready_batch(partition.partition)
        whole, rest = divmod(partition.rows, BATCH_ROWS)
        for _ in range(whole):
            yield batch
        if rest:
            yield batch.slice(0, rest)

    def commit(self, end: dict) -> None:
        pass


_BATCH: dict[int, Any] = {}


def _ready_batch(partition: int) -> Any:
    """One Arrow batch of Kafka's row schema, built once per worker process (not timed per row)."""
    import numpy as np
    import pyarrow as pa

    from lastagent.sources.kafka_columns import arrow_schema

    if partition not in _BATCH:
        rng = np.random.default_rng(partition)
        values = pa.Array.from_buffers(pa.binary(), BATCH_ROWS, [
            None, pa.py_buffer(np.arange(0, (BATCH_ROWS + 1) * 100, 100, dtype=np.int32).tobytes()),
            pa.py_buffer(rng.bytes(BATCH_ROWS * 100))])
        keys = pa.array([str(i).encode() for i in range(BATCH_ROWS)], pa.binary())
        _BATCH[partition] = pa.record_batch({
            "key": keys, "value": values, "topic": pa.array(["ceiling"] * BATCH_ROWS),
            "partition": pa.array([partition] * BATCH_ROWS, pa.int32()),
            "offset": pa.array(range(BATCH_ROWS), pa.int64()),
            "timestamp": pa.array([1_700_000_000_000_000] * BATCH_ROWS, pa.timestamp("us", tz="UTC")),
            "timestampType": pa.array([0] * BATCH_ROWS, pa.int32()),
        }, schema=arrow_schema(False))
    return _BATCH[partition]


class _Count(WriterCommitMessage):
    def __init__(self, rows: int) -> None:
        self.rows = rows


class CeilingWriter(DataSourceStreamArrowWriter):
    def write(self, iterator: Iterator[Any]) -> _Count:
        return _Count(sum(batch.num_rows for batch in iterator))

    def commit(self, messages: list, batchId: int) -> None:  # Spark's API
        pass

    def abort(self, messages: list, batchId: int) -> None:  # Spark's API
        pass


class CeilingSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "ceiling-source"

    def schema(self):  # Spark's API
        return kafka_schema(False)

    def streamReader(self, schema):  # Spark's API
        return CeilingReader(int(self.options["rows"]))


class CeilingSink(DataSource):
    @classmethod
    def name(cls) -> str:
        return "ceiling-sink"

    def streamWriter(self, schema, overwrite):  # Spark's API
        return CeilingWriter()


def ceiling_read(spark, rows: int, trigger_rates: list[float]) -> float:
    start = time.perf_counter()
    query = (spark.readStream.format("ceiling-source").option("rows", str(rows)).load().writeStream.format("noop")
             .option("checkpointLocation", f"/tmp/lastagent-bench/ckpt-{uuid.uuid4().hex}")
             .trigger(availableNow=True).start())
    query.awaitTermination()
    elapsed = time.perf_counter() - start
    read = sum(int(p["numInputRows"]) for p in query.recentProgress)
    if read != rows:
        raise SystemExit(f"ceiling-source read {read} rows, expected {rows}")
    trigger_rates.append(rows / (sum(int(p["durationMs"]["triggerExecution"]) for p in query.recentProgress) / 1000))
    return rows / elapsed


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("lastagent-bench")
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(CeilingSource)
    spark.dataSource.register(CeilingSink)
    topic = fill_topic(admin, PARTITIONS, ROWS, 100)
    table = source_table(spark, SINK_ROWS, 100, PARTITIONS)
    readers = ("kafka", "lastagent-kafka", "ceiling-source")
    writers = ("kafka", "lastagent-kafka", "ceiling-sink")
    reads: dict[str, list[float]] = {k: [] for k in (*readers, "raw-consumer")}
    inside: dict[str, list[float]] = {k: [] for k in readers}
    writes: dict[str, list[float]] = {k: [] for k in (*writers, "raw-producer")}
    writing: dict[str, list[float]] = {k: [] for k in writers}
    for timed in (False,) + (True,) * REPEAT:  # one warm-up round
        for fmt in readers:
            rates: list[float] = []
            rate = (ceiling_read(spark, ROWS, rates) if fmt == "ceiling-source"
                    else spark_read(spark, fmt, topic, ROWS, trigger_rates=rates))
            if timed:
                reads[fmt].append(rate)
                inside[fmt].extend(rates)
        for fmt in writers:
            rates = []
            rate = spark_write(spark, fmt, table, new_topic(admin, PARTITIONS), SINK_ROWS, rates)
            if timed:
                writes[fmt].append(rate)
                writing[fmt].extend(rates)
        if timed:
            reads["raw-consumer"].append(raw_consumer(topic, PARTITIONS, ROWS))
            writes["raw-producer"].append(raw_producer(new_topic(admin, PARTITIONS), SINK_ROWS, 100))
    med = {k: round(statistics.median(v)) for k, v in reads.items()}
    med_inside = {k: round(statistics.median(v)) for k, v in inside.items()}
    med_w = {k: round(statistics.median(v)) for k, v in writes.items()}
    med_writing = {k: round(statistics.median(v)) for k, v in writing.items()}
    summary = {
        "rows": ROWS, "sink_rows": SINK_ROWS, "repeat": REPEAT,
        "source_rows_per_s_median": med,
        "source_inside_micro_batch_rows_per_s_median": med_inside,
        "ceiling_source_vs_builtin": round(med["ceiling-source"] / med["kafka"], 2),
        "ceiling_source_vs_builtin_inside": round(med_inside["ceiling-source"] / med_inside["kafka"], 2),
        "lastagent_source_vs_ceiling": round(med["lastagent-kafka"] / med["ceiling-source"], 2),
        "sink_rows_per_s_median": med_w,
        "ceiling_sink_vs_raw_producer": round(med_w["ceiling-sink"] / med_w["raw-producer"], 2),
        "ceiling_sink_vs_builtin": round(med_w["ceiling-sink"] / med_w["kafka"], 2),
        "lastagent_sink_vs_ceiling": round(med_w["lastagent-kafka"] / med_w["ceiling-sink"], 2),
        "sink_add_batch_rows_per_s_median": med_writing,
        "ceiling_sink_add_batch_vs_raw_producer": round(med_writing["ceiling-sink"] / med_w["raw-producer"], 2),
    }
    print(json.dumps(summary, indent=2))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
