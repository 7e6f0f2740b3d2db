"""A link's age: does its millionth epoch cost what its first did, and how does Spark's own pipeline age beside it?

A `lastagent-kafka` -> `lastagent-kafka` link (one input and one output partition, 5 records an epoch,
`trigger(availableNow=True)` with maxOffsetsPerTrigger=5) for BENCH_EPOCHS epochs, with restarts after the first
BENCH_FIRST_RESTART epochs and at the end; with BENCH_LINK=kafka-delta, a `lastagent-kafka` -> `lastagent-delta`
link the same way (its target table in the arbitration table's place); with BENCH_LINK=delta-kafka, a Delta table
(one commit of 5 rows per epoch, written with deltalake, read by Spark's Delta source one file per micro-batch) ->
`lastagent-kafka`; with BENCH_LINK=block, the epoch block (the examples' MERGE of 20 keys with an event per change).

The peer, in the same run and first (BENCH_PEER=0 leaves it out): the same pipeline in Spark's own formats, at
least once: `kafka` -> `kafka`, `kafka` -> `delta`, `delta` -> `kafka`, and a plain `foreachBatch` that MERGEs and
writes the events with `kafka`, over BENCH_PEER_EPOCHS (2,000: nothing of it grows but what Spark bounds). It runs
first so that the JVM's warm-up falls in its first window, not in lastagent's (it would flatter lastagent's ratio).

Measured, from Spark's own progress events (a StreamingQueryListener on the driver): the median epoch time
(`batchDuration`) of the first and of the last BENCH_WINDOW epochs (Spark's own: at most half its epochs) and their
ratio; the time from `start()` to the first epoch's end, the median of BENCH_RESTARTS (3) restarts after
BENCH_FIRST_RESTART epochs and of as many at the end, and their ratio; the resident memory of the driver, its JVM
and its Python workers after the first run and after the long one (a run resumed in between has a younger
process); and the files on disk at the end (the table's log and data files, the query checkpoint's), which the
tables' retention bounds, not the epoch count.
Each table's retention is shortened after its creation, as a user would with ALTER TABLE
(`delta.logRetentionDuration` BENCH_LOG_RETENTION, `delta.deletedFileRetentionDuration` 0) and the log's cutoff of
lastagent's own tables is not truncated to the day (LASTAGENT_DELTA_LOG_CUTOFF=minute), so the cleanups show within
the run. Every record is then read back (a read_committed consumer, Spark's Delta reader): once.

Run with `make bench-long-run` (BENCH_LINK=kafka-delta and so on for the others; it brings a broker up): 20,000
epochs of the Kafka -> Kafka link, 5,000 of each other kind, unless BENCH_EPOCHS says otherwise. A run longer than a
sitting: with BENCH_WORKDIR (the make target sets .cache/long-run-<link>) its state is kept there, BENCH_SECONDS=N
stops the query after N seconds, and the same command goes on where it stopped (a restart, as a user's query has;
the restarts measured are the run's own). Delete the directory to start again.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import BOOTSTRAP, new_topic
from confluent_kafka import Consumer, Producer, TopicPartition
from kafka.admin import KafkaAdminClient

os.environ.setdefault("LASTAGENT_DELTA_LOG_CUTOFF", "minute")  # before Spark starts: its Python workers inherit it

from lastagent.spark_session import local_session

#: "kafka-kafka" (a `lastagent-kafka` sink and its arbitration table), "kafka-delta" (a `lastagent-delta` sink:
#: the target table is the arbitration store; its data files grow with the rows, its log must not), "delta-kafka"
#: (Spark's Delta source into a `lastagent-kafka` sink: `lastagent.examples.delta_to_kafka`) or "block" (the
#: examples' `lastagent.epoch` MERGE with an event per change: `lastagent.examples.merge_changes`).
LINK = os.environ.get("BENCH_LINK", "kafka-kafka")
EPOCHS = int(os.environ.get("BENCH_EPOCHS", "20000" if LINK == "kafka-kafka" else "5000"))  # issue 53's lengths
WINDOW = int(os.environ.get("BENCH_WINDOW", "1000"))
FIRST_RESTART = int(os.environ.get("BENCH_FIRST_RESTART", "100"))
PEER = os.environ.get("BENCH_PEER", "1") != "0"
PER_EPOCH = 5
RESTART_EPOCHS = 20
#: Restarts measured at each age (their median counts): one start is one sample of a time that varies by seconds.
RESTARTS = int(os.environ.get("BENCH_RESTARTS", "3"))
LOG_RETENTION = os.environ.get("BENCH_LOG_RETENTION", "interval 10 minutes")
#: Spark's own pipeline over fewer epochs by default: its two windows, apart (nothing of it grows but what Spark bounds).
PEER_EPOCHS = int(os.environ.get("BENCH_PEER_EPOCHS", str(min(EPOCHS, 2000))))
#: A run kept in BENCH_WORKDIR is resumed by the same command; BENCH_SECONDS stops it (query.stop) after so long.
WORKDIR = os.environ.get("BENCH_WORKDIR")
SECONDS = float(os.environ.get("BENCH_SECONDS", "0"))
DESCRIPTION = {
    "kafka-kafka": ("lastagent-kafka -> lastagent-kafka", "Spark's kafka -> kafka (at least once)"),
    "kafka-delta": ("lastagent-kafka -> lastagent-delta", "Spark's kafka -> delta"),
    "delta-kafka": ("Spark's Delta source -> lastagent-kafka", "Spark's Delta source -> kafka (at least once)"),
    "block": ("lastagent-kafka -> foreachBatch with lastagent.epoch (MERGE, an event per change)",
              "Spark's kafka -> plain foreachBatch (MERGE, events written with kafka: at least once)"),
}


class Progress:
    """Each finished epoch of the query (Spark's progress events): (batch id, batchDuration ms, wall time)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.file: Path | None = None

    def record_to(self, file: Path | None) -> None:
        """Appends each epoch from now on to ``file`` (a JSON line: batch id, batchDuration ms, wall time)."""
        with self.lock:
            self.file = file

    def listener(self):
        from pyspark.sql.streaming import StreamingQueryListener

        progress = self

        class Listener(StreamingQueryListener):
            def onQueryStarted(self, event):
                pass

            def onQueryProgress(self, event):
                p = event.progress
                with progress.lock:
                    if p.numInputRows and progress.file is not None:
                        with progress.file.open("a") as f:
                            f.write(json.dumps([p.batchId, int(p.batchDuration), time.time()]) + "\n")

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


def _pipeline(spark: Any, peer: bool, work: Path, source: str, target: str, link: str) -> Callable[[], Any]:
    """What one start of the query is: a function that starts it (availableNow) and returns the started query."""
    table, ckpt, source_table = str(work / "table"), str(work / "ckpt"), str(work / "source")
    if not peer:
        from lastagent import examples

        if LINK == "block":
            return lambda: examples.merge_changes(spark, BOOTSTRAP, source, target, table, ckpt, link, str(PER_EPOCH))
        if LINK == "delta-kafka":
            return lambda: examples.delta_to_kafka(spark, BOOTSTRAP, source_table, ckpt, table, link, target)

    def kafka() -> Any:
        return (spark.readStream.format("kafka" if peer else "lastagent-kafka")
                .option("kafka.bootstrap.servers", BOOTSTRAP).option("subscribe", source)
                .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", str(PER_EPOCH)).load())

    def to_kafka(rows: Any) -> Any:
        if peer:
            return rows.writeStream.format("kafka").option("kafka.bootstrap.servers", BOOTSTRAP).option("topic", target)
        return (rows.writeStream.format("lastagent-kafka").option("kafka.bootstrap.servers", BOOTSTRAP)
                .option("topic", target).option("link", link).option("arbitrationTable", table))

    def start() -> Any:
        if LINK == "block":  # the peer of merge_changes: the same MERGE and events, without lastagent.epoch
            from delta.tables import DeltaTable

            def apply(batch: Any, epoch_id: int) -> None:
                (batch.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(id, amount)) AS value").write
                 .format("kafka").option("kafka.bootstrap.servers", BOOTSTRAP).option("topic", target).save())
                latest = batch.groupBy("id").agg({"amount": "max"}).withColumnRenamed("max(amount)", "amount")
                (DeltaTable.forPath(batch.sparkSession, table).alias("t").merge(latest.alias("s"), "t.id = s.id")
                 .whenMatchedUpdate(set={"amount": "s.amount"})
                 .whenNotMatchedInsert(values={"id": "s.id", "amount": "s.amount"}).execute())

            changes = kafka().selectExpr(
                "CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
                "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount")
            w = changes.writeStream.foreachBatch(apply)
        elif LINK == "delta-kafka":
            w = to_kafka(spark.readStream.format("delta").option("maxFilesPerTrigger", "1").load(source_table)
                         .selectExpr("key", "value"))
        elif LINK == "kafka-delta":
            rows = kafka().selectExpr("CAST(key AS STRING) AS key", "value").writeStream
            w = (rows.format("delta").option("path", table) if peer
                 else rows.format("lastagent-delta").option("link", link).option("path", table))
        else:
            w = to_kafka(kafka().selectExpr("key", "value"))
        return w.option("checkpointLocation", ckpt).trigger(availableNow=True).start()

    return start


def _memory() -> dict[str, int]:
    """Resident memory (MB) of this driver's Python, its JVM and its Python workers (its descendants only: other
    Spark processes on the machine are not counted), as the long run ages."""
    parent, rss, cmd = {}, {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text().splitlines()
            cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status if ":" in line)
        parent[int(d.name)] = int(fields["PPid"])
        rss[int(d.name)] = int(fields.get("VmRSS", "0 kB").split()[0]) // 1024

    def mine(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    ours = [p for p in parent if mine(p)]
    return {"driver_python_mb": rss.get(os.getpid(), 0),
            "jvm_mb": sum(rss[p] for p in ours if "SparkSubmit" in cmd[p]),
            "python_workers_mb": sum(rss[p] for p in ours if "pyspark" in cmd[p] and "SparkSubmit" not in cmd[p])}


class Paused(Exception):
    """BENCH_SECONDS ran out: the query was stopped; the same command with the same BENCH_WORKDIR goes on."""


def _source_records(work: Path, source: str) -> int:
    """How many records the source holds: they are added in whole epochs, so a killed run never loses count."""
    if LINK == "delta-kafka":
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return (DeltaTable(str(work / "source")).version() + 1) * PER_EPOCH  # one commit per epoch
        except TableNotFoundError:
            return 0
    c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": "bench-long-run"})
    try:
        return c.get_watermark_offsets(TopicPartition(source, 0), timeout=30)[1]
    finally:
        c.close()


def measure(spark: Any, admin: KafkaAdminClient, progress: Progress, work: Path, peer: bool,
            epochs: int, deadline: float | None) -> dict[str, Any]:
    """Driver: one pipeline (lastagent's, or Spark's own with ``peer``) through its epochs and restarts; its figures.

    Its state is kept in ``work`` (topics, link, the steps done, every epoch's time): when ``deadline`` passes the
    query is stopped and :class:`Paused` raised, and a later call with the same ``work`` goes on from there.
    """
    work.mkdir(parents=True, exist_ok=True)
    state_file, epochs_file = work / "state.json", work / "epochs.jsonl"
    if not state_file.exists():
        state_file.write_text(json.dumps({"source": new_topic(admin, 1), "target": new_topic(admin, 1),
                                          "link": f"bench-age-{uuid.uuid4().hex[:6]}", "done": 0, "starts": {}}))
    state = json.loads(state_file.read_text())
    if "result" in state:
        return state["result"]
    table, ckpt = work / "table", work / "ckpt"
    start_query = _pipeline(spark, peer, work, state["source"], state["target"], state["link"])
    # The steps: the first run, RESTARTS - 1 restarts of one epoch, the retention shortened, the long run (its start
    # is the last of the early restarts), the files counted, RESTARTS restarts at the end (the last of them runs
    # RESTART_EPOCHS), the read-back. Each run adds its epochs' records first.
    plan: list[tuple[str, int]] = (
        [("run", FIRST_RESTART + i) for i in range(RESTARTS)] + [("alter", 0), ("run", epochs), ("files", 0)]
        + [("run", epochs + i) for i in range(1, RESTARTS)] + [("run", epochs + RESTART_EPOCHS), ("verify", 0)])
    runs = [step for step, (kind, _) in enumerate(plan) if kind == "run"]

    def save() -> None:
        state_file.write_text(json.dumps(state))

    def recorded() -> list[list[float]]:
        return [json.loads(line) for line in epochs_file.read_text().splitlines()] if epochs_file.exists() else []

    if LINK == "block" and not table.exists():  # the MERGE's table, as its owner made it
        spark.sql(f"CREATE TABLE delta.`{table}` (id BIGINT, amount BIGINT) USING delta")
    progress.record_to(epochs_file)
    for step in range(state["done"], len(plan)):
        kind, through = plan[step]
        if kind == "run":
            have = _source_records(work, state["source"]) // PER_EPOCH
            if LINK == "delta-kafka":
                _append(str(work / "source"), have * PER_EPOCH, (through - have) * PER_EPOCH)
            else:
                _produce(state["source"], have * PER_EPOCH, (through - have) * PER_EPOCH)
            # The start whose time to the first epoch counts: the step's first, or the next when it was paused before
            # its first epoch (a pause's gap is not a restart's time).
            if str(step) not in state["starts"] or state["starts"][str(step)][1] == len(recorded()):
                state["starts"][str(step)] = [time.time(), len(recorded())]
                save()
            query = start_query()
            ended = True  # awaitTermination() without a timeout returns None, not True
            if deadline:
                ended = query.awaitTermination(max(deadline - time.time(), 1))
            else:
                query.awaitTermination()
            if not ended:
                query.stop()
                state["pauses"] = state.get("pauses", 0) + 1
                save()
                time.sleep(1)  # the last progress event reaches the listener
                raise Paused(f"paused in step {step} ({through} epochs wanted, {len(recorded())} recorded)")
            if query.exception() is not None:
                raise RuntimeError(f"the query failed: {query.exception()}")
            time.sleep(1)
        elif kind == "alter":
            state["memory_early"] = _memory()
            if table.exists():  # as a user would shorten a table's retention (ALTER TABLE ... SET TBLPROPERTIES)
                spark.sql(f"ALTER TABLE delta.`{table}` SET TBLPROPERTIES ('delta.logRetentionDuration' = "
                          f"'{LOG_RETENTION}', 'delta.deletedFileRetentionDuration' = 'interval 0 seconds')")
        elif kind == "files":
            state["memory_late"] = _memory()
            state["files"] = _files(table) if table.exists() else None
            state["checkpoint_files"] = sum(1 for p in ckpt.rglob("*") if p.is_file())
        elif kind == "verify":
            total = (epochs + RESTART_EPOCHS) * PER_EPOCH
            if LINK == "kafka-delta":
                seen = Counter(r.value for r in spark.read.format("delta").load(str(table)).select("value").collect())
            elif LINK == "block":  # one event per change, and the table the last amount per key
                seen = Counter(json.loads(v)["amount"] for v in _read_committed(state["target"], total).elements())
                merged = {r.id: r.amount for r in spark.read.format("delta").load(str(table)).collect()}
                if merged != {k: max(i for i in range(total) if i % 20 == k) for k in range(20)}:
                    seen = Counter()  # the MERGE table is wrong: not once
            else:
                seen = _read_committed(state["target"], total)
            state["once"] = len(seen) == total and set(seen.values()) == {1}
            state["records"] = sum(seen.values())
        state["done"] = step + 1
        save()
    progress.record_to(None)
    times = recorded()
    durations = [ms for _, ms, _ in times]

    def restart(step: int) -> float:
        began, before = state["starts"][str(step)]
        return round(times[before][2] - began, 2)

    early, late = [restart(step) for step in runs[1:RESTARTS + 1]], [restart(step) for step in runs[RESTARTS + 1:]]
    window = min(WINDOW, epochs // 2)  # Spark's own, over fewer epochs: two windows apart
    first, last = statistics.median(durations[:window]), statistics.median(durations[epochs - window:epochs])
    state["result"] = {
        "pipeline": DESCRIPTION[LINK][1 if peer else 0],
        "epochs": len(durations), "window": window, "first_window_median_ms": first, "last_window_median_ms": last,
        "last_over_first": round(last / first, 3),
        "restart_to_first_epoch_s": {f"after {FIRST_RESTART} epochs": statistics.median(early),
                                     f"after {epochs} epochs": statistics.median(late)},
        "restarts_s": {"early": early, "late": late},
        "restart_ratio": round(statistics.median(late) / statistics.median(early), 3),
        "table_at_end": state["files"], "query_checkpoint_files_at_end": state["checkpoint_files"],
        "memory_mb": {f"after {FIRST_RESTART} epochs": state["memory_early"],
                      f"after {epochs} epochs": state["memory_late"]},
        "paused_and_resumed": state.get("pauses", 0),
        "every_record_once": state["once"], "records": state["records"],
    }
    save()
    return state["result"]


def main() -> int:
    assert RESTARTS >= 1 and EPOCHS >= FIRST_RESTART + RESTARTS + WINDOW, \
        "BENCH_EPOCHS must hold the first run, its restarts and a window after them"
    assert PEER_EPOCHS >= 2 * FIRST_RESTART, "BENCH_PEER_EPOCHS must hold the first restart twice"
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    spark = local_session("bench-long-run")
    progress = Progress()
    spark.streams.addListener(progress.listener())
    deadline = time.time() + SECONDS if SECONDS else None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(WORKDIR or tmp).resolve()  # Spark reads delta.`path` as a path only when it is absolute
        try:
            spark_own = measure(spark, admin, progress, work / "spark", True, PEER_EPOCHS, deadline) if PEER else None
            ours = measure(spark, admin, progress, work / "lastagent", False, EPOCHS, deadline)
        except Paused as paused:
            print(f"long_run: {paused}; run the same command (BENCH_WORKDIR={work}) to go on", file=sys.stderr)
            spark.stop()
            return 3
    summary: dict[str, Any] = {
        "link": LINK, "records_per_epoch": PER_EPOCH, "log_retention": LOG_RETENTION,
        "lastagent": ours, "spark": spark_own,
    }
    if spark_own:
        summary["lastagent_over_spark"] = {
            "first_window": round(ours["first_window_median_ms"] / spark_own["first_window_median_ms"], 3),
            "last_window": round(ours["last_window_median_ms"] / spark_own["last_window_median_ms"], 3),
        }
    json.dump(summary, sys.stdout, indent=2)
    print()
    spark.stop()
    return 0 if ours["every_record_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
