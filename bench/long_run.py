"""A link's age: does its millionth epoch cost what its first did? A `lastagent-kafka` -> `lastagent-kafka` link
(one input and one output partition, 5 records an epoch, `trigger(availableNow=True)` with maxOffsetsPerTrigger=5)
for BENCH_EPOCHS epochs in one run, then a restart; with BENCH_LINK=kafka-delta, a `lastagent-kafka` ->
`lastagent-delta` link the same way (its target table in the arbitration table's place); with
BENCH_LINK=delta-kafka, a Delta table (one commit of 5 rows per epoch, written with deltalake, read by Spark's Delta
source one file per micro-batch) -> `lastagent-kafka`; with BENCH_LINK=block, the epoch block.

Measured, from Spark's own progress events (a StreamingQueryListener on the driver): the median epoch time
(`batchDuration`) of the first and of the last BENCH_WINDOW epochs and their ratio; the time from `start()` to the
first epoch's end for a restart after BENCH_WINDOW epochs and for a restart at the end, and their ratio; and the
files on disk at the end (the arbitration table's log and data files, the query checkpoint's), which the tables'
retention bounds, not the epoch count. The arbitration table's retention is shortened after its creation, as a user
would with ALTER TABLE (`delta.logRetentionDuration` BENCH_LOG_RETENTION, `delta.deletedFileRetentionDuration` 0)
and the log's cutoff is not truncated to the day (LASTAGENT_DELTA_LOG_CUTOFF=minute), so the cleanups show within
the run. Every record is then read back by a read_committed consumer: exactly once.

Run with `make bench-long-run` (a broker up: `make kafka-up`; BENCH_EPOCHS=20000 takes about two hours here).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from common import BOOTSTRAP, new_topic
from confluent_kafka import Consumer, Producer
from kafka.admin import KafkaAdminClient

os.environ.setdefault("LASTAGENT_DELTA_LOG_CUTOFF", "minute")  # before Spark starts: its Python workers inherit it

from lastagent.spark_session import local_session

#: "kafka-kafka" (a `lastagent-kafka` sink and its arbitration table), "kafka-delta" (a `lastagent-delta` sink:
#: the target table is the arbitration store; its data files grow with the rows, its log must not), "delta-kafka"
#: (Spark's Delta source into a `lastagent-kafka` sink: `lastagent.examples.delta_to_kafka`) or "block" (the
#: examples' `lastagent.epoch` MERGE with an event per change: `lastagent.examples.merge_changes`).
LINK = os.environ.get("BENCH_LINK", "kafka-kafka")
EPOCHS = int(os.environ.get("BENCH_EPOCHS", "20000"))
WINDOW = int(os.environ.get("BENCH_WINDOW", "1000"))
PER_EPOCH = 5
LOG_RETENTION = os.environ.get("BENCH_LOG_RETENTION", "interval 10 minutes")


class Progress:
    """Each finished epoch of the query (Spark's progress events): (batch id, batchDuration ms, wall time)."""

    def __init__(self) -> None:
        self.epochs: list[tuple[int, int, float]] = []
        self.lock = threading.Lock()

    def listener(self):
        from pyspark.sql.streaming import StreamingQueryListener

        progress = self

        class Listener(StreamingQueryListener):
            def onQueryStarted(self, event):
                pass

            def onQueryProgress(self, event):
                p = event.progress
                if p.numInputRows:
                    with progress.lock:
                        progress.epochs.append((p.batchId, int(p.batchDuration), time.time()))

            def onQueryIdle(self, event):
                pass

            def onQueryTerminated(self, event):
                pass

        return Listener()


def _append(table: str, first: int, count: int) -> None:
    """The Delta source's records: one commit of PER_EPOCH rows per epoch (Spark reads one file per micro-batch)."""
    import pyarrow as pa
    from deltalake import write_deltalake

    for start in range(first, first + count, PER_EPOCH):
        ids = [str(i) for i in range(start, start + PER_EPOCH)]
        write_deltalake(table, pa.table({"key": ids, "value": ids}), mode="append")


def _produce(topic: str, first: int, count: int) -> None:
    p = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 20})
    for i in range(first, first + count):
        # The block's changes: 20 keys, each record a new amount of one (the other links copy it as it is).
        value = json.dumps({"id": i % 20, "amount": i}) if LINK == "block" else str(i)
        p.produce(topic, value=value.encode(), key=str(i).encode(), partition=0)
        if i % 10_000 == 0:
            p.poll(0)
    assert p.flush(120) == 0


def _read_committed(topic: str, expected: int) -> Counter:
    c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                  "isolation.level": "read_committed", "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic])
    seen: Counter = Counter()
    deadline = time.time() + 300
    while sum(seen.values()) < expected and time.time() < deadline:
        for m in c.consume(1000, 1.0):
            if not m.error():
                seen[m.value()] += 1
    c.close()
    return seen


def _files(path: Path) -> dict[str, int]:
    log = [p for p in (path / "_delta_log").iterdir() if p.is_file()] if (path / "_delta_log").exists() else []
    return {"log_files": len(log), "checkpoints": sum(".checkpoint" in p.name for p in log),
            "data_files": sum(1 for p in path.glob("*.parquet"))}


def main() -> int:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("bench-long-run")
    progress = Progress()
    spark.streams.addListener(progress.listener())
    source, target = new_topic(admin, 1), new_topic(admin, 1)
    link = f"bench-age-{uuid.uuid4().hex[:6]}"
    restart_epochs = 20
    total = WINDOW + EPOCHS + restart_epochs
    with tempfile.TemporaryDirectory() as work:
        arb, ckpt = Path(work, "arb"), Path(work, "ckpt")
        source_table = str(Path(work, "source"))

        def run(epochs: int) -> tuple[float, float]:
            """Produces ``epochs`` epochs' records, runs the query through them; (s to the first epoch, s in all)."""
            if LINK == "delta-kafka":
                _append(source_table, run.produced, epochs * PER_EPOCH)  # type: ignore[attr-defined]
            else:
                _produce(source, run.produced, epochs * PER_EPOCH)  # type: ignore[attr-defined]
            run.produced += epochs * PER_EPOCH  # type: ignore[attr-defined]
            before = len(progress.epochs)
            if LINK == "block":
                from lastagent.examples import merge_changes

                start = time.time()
                query = merge_changes(spark, BOOTSTRAP, source, target, str(arb), str(ckpt), link, str(PER_EPOCH))
                return _timed(query, before, epochs, start)
            if LINK == "delta-kafka":
                from lastagent.examples import delta_to_kafka

                start = time.time()
                query = delta_to_kafka(spark, BOOTSTRAP, source_table, str(ckpt), str(arb), link, target)
                return _timed(query, before, epochs, start)
            rows = (spark.readStream.format("lastagent-kafka").option("kafka.bootstrap.servers", BOOTSTRAP)
                    .option("subscribe", source).option("startingOffsets", "earliest")
                    .option("maxOffsetsPerTrigger", str(PER_EPOCH)).load())
            if LINK == "kafka-delta":
                q = (rows.selectExpr("CAST(key AS STRING) AS key", "value").writeStream.format("lastagent-delta")
                     .option("link", link).option("path", str(arb)))
            else:
                q = (rows.selectExpr("key", "value").writeStream.format("lastagent-kafka")
                     .option("kafka.bootstrap.servers", BOOTSTRAP).option("topic", target).option("link", link)
                     .option("arbitrationTable", str(arb)))
            q = q.option("checkpointLocation", str(ckpt)).trigger(availableNow=True)
            start = time.time()
            return _timed(q.start(), before, epochs, start)

        def _timed(query: Any, before: int, epochs: int, start: float) -> tuple[float, float]:
            query.awaitTermination()
            time.sleep(1)  # the last progress event reaches the listener
            with progress.lock:
                mine = progress.epochs[before:]
            assert len(mine) == epochs, f"{len(mine)} epochs ran, {epochs} expected"
            return mine[0][2] - start, time.time() - start

        run.produced = 0  # type: ignore[attr-defined]
        if LINK == "block":
            spark.sql(f"CREATE TABLE delta.`{arb}` (id BIGINT, amount BIGINT) USING delta")
        run(WINDOW)
        # As a user would shorten a table's retention (ALTER TABLE ... SET TBLPROPERTIES), once the link made it.
        spark.sql(f"ALTER TABLE delta.`{arb}` SET TBLPROPERTIES ('delta.logRetentionDuration' = '{LOG_RETENTION}', "
                  "'delta.deletedFileRetentionDuration' = 'interval 0 seconds')")
        early_restart, _ = run(EPOCHS)
        files = _files(arb)
        checkpoint_files = sum(1 for p in ckpt.rglob("*") if p.is_file())
        late_restart, _ = run(restart_epochs)
        durations = [d for _, d, _ in progress.epochs]
        first = statistics.median(durations[:WINDOW])
        last = statistics.median(durations[WINDOW + EPOCHS - WINDOW:WINDOW + EPOCHS])
        if LINK == "kafka-delta":
            seen = Counter(r.value for r in spark.read.format("delta").load(str(arb)).select("value").collect())
        elif LINK == "block":  # one event per change, and the table the last amount per key
            seen = Counter(json.loads(v)["amount"] for v in _read_committed(target, total * PER_EPOCH).elements())
            merged = {r.id: r.amount for r in spark.read.format("delta").load(str(arb)).collect()}
            if merged != {k: max(i for i in range(total * PER_EPOCH) if i % 20 == k) for k in range(20)}:
                seen = Counter()  # the MERGE table is wrong: not once
        else:
            seen = _read_committed(target, total * PER_EPOCH)
        once = len(seen) == total * PER_EPOCH and set(seen.values()) == {1}
    summary = {
        "link": {"kafka-kafka": "lastagent-kafka -> lastagent-kafka",
                 "kafka-delta": "lastagent-kafka -> lastagent-delta",
                 "delta-kafka": "Spark's Delta source -> lastagent-kafka",
                 "block": "lastagent-kafka -> foreachBatch with lastagent.epoch (MERGE, an event per change)"}[LINK],
        "epochs": len(durations), "records_per_epoch": PER_EPOCH,
        "first_window_median_ms": first, "last_window_median_ms": last, "window": WINDOW,
        "last_over_first": round(last / first, 3),
        "restart_to_first_epoch_s": {f"after {WINDOW} epochs": round(early_restart, 2),
                                     f"after {WINDOW + EPOCHS} epochs": round(late_restart, 2)},
        "restart_ratio": round(late_restart / early_restart, 3),
        ("target_table_at_end" if LINK in ("kafka-delta", "block") else "arbitration_table_at_end"): files,
        "query_checkpoint_files_at_end": checkpoint_files,
        "log_retention": LOG_RETENTION, "every_record_once": once, "records": sum(seen.values()),
    }
    json.dump(summary, sys.stdout, indent=2)
    print()
    spark.stop()
    return 0 if once else 1


if __name__ == "__main__":
    sys.exit(main())
