"""The `make run` demo, on embedded defaults: a local Kafka broker and local Delta paths.

1. Kafka (committed and aborted transactions) → `lastagent-kafka` source → a Delta table,
   stopped midway and restarted from its checkpoint; proof read back by Spark's Delta reader.
2. That Delta table → `lastagent-kafka` exactly-once sink → a topic, the driver SIGKILLed
   after its second decision and restarted; proof read by an independent read_committed
   consumer: rows in, rows out, duplicates 0, in doubt 0.
3. Kafka with poison records → the example transformer → `lastagent-delta`, with a dead-letter topic
   and a side topic in the same epoch, the driver SIGKILLed after its second Delta commit and
   restarted; proof read by Spark's Delta reader and read_committed consumers.

The pipelines the demo kills and restarts are the examples in :mod:`lastagent.examples`, each run in
a driver process of its own; the demo kills that process group from outside, as a lost machine
would (no fault point in the connector is involved).

Run: ``make run`` (or ``python dev/demo.py``; not part of the installed package, since it kills processes).
Needs a broker: ``make kafka-up`` starts one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer

ROWS_PER_TXN = 1000


def produce(bootstrap: str, topic: str, txns: int, aborted: frozenset[int]) -> int:
    """Writes ``txns`` transactions of 1000 rows, aborting those in ``aborted``; returns rows committed."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"demo-{uuid.uuid4().hex[:8]}",
                         "linger.ms": 20})
    producer.init_transactions(60)
    rows = 0
    for t in range(txns):
        producer.begin_transaction()
        for i in range(ROWS_PER_TXN):
            value = f"{'aborted' if t in aborted else 'order'}-{t}-{i}".encode()
            producer.produce(topic, key=f"{t}-{i}".encode(), value=value, partition=i % 3)
        if t in aborted:
            # Flushed first: the aborted records land in the log, and the source must skip them.
            producer.flush(60)
            producer.abort_transaction(60)
        else:
            producer.commit_transaction(60)
            rows += ROWS_PER_TXN
    return rows


def source_act(bootstrap: str, workdir: str) -> tuple[bool, str]:
    """Act 1: Kafka (with aborted transactions) → lastagent-kafka source → Delta, stopped midway."""
    from kafka.admin import KafkaAdminClient, NewTopic

    from lastagent.spark_session import local_session

    topic = f"demo-orders-{uuid.uuid4().hex[:6]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="lastagent-demo")
    admin.create_topics([NewTopic(topic, 3, 1)])
    admin.close()
    rows_in = produce(bootstrap, topic, txns=23, aborted=frozenset({3, 9, 15}))
    print(f"demo 1/3: wrote {rows_in} committed rows (+ 3 aborted transactions) to topic {topic}")

    spark = local_session("lastagent-demo")
    spark.sparkContext.setLogLevel("ERROR")
    table, ckpt = os.path.join(workdir, "orders"), os.path.join(workdir, "checkpoint-source")

    def start(trigger: dict[str, Any]):
        df = (spark.readStream.format("lastagent-kafka")
              .option("kafka.bootstrap.servers", bootstrap)
              .option("subscribe", topic)
              .option("startingOffsets", "earliest")
              .option("maxOffsetsPerTrigger", "4000")
              .load()
              .selectExpr("CAST(key AS STRING) AS key", "CAST(value AS STRING) AS value",
                          "topic", "partition", "offset"))
        return (df.writeStream.format("delta").option("checkpointLocation", ckpt)
                .trigger(**trigger).start(table))

    # First run: process two micro-batches, then stop as a user would.
    query = start({"processingTime": "1 second"})
    while len([p for p in query.recentProgress if p["numInputRows"] > 0]) < 2:
        query.awaitTermination(0.5)
    query.stop()
    first = spark.read.format("delta").load(table).count()
    print(f"demo 1/3: stopped after {first} rows; restarting from the checkpoint")
    query = start({"availableNow": True})
    query.awaitTermination()

    out = spark.read.format("delta").load(table)
    rows_out = out.count()
    distinct = out.select("topic", "partition", "offset").distinct().count()
    aborted = out.filter("value LIKE 'aborted-%'").count()
    spark.stop()
    ok = _proof("1/3 Kafka -> lastagent-kafka source -> Delta (read back with Spark's Delta reader)", {
        "rows in (committed to Kafka)": rows_in, "rows out (Delta table)": rows_out,
        "duplicates": rows_out - distinct, "missing": rows_in - distinct, "aborted rows visible": aborted,
    }, rows_out == rows_in)
    return ok, table


def sink_act(bootstrap: str, workdir: str, table: str) -> bool:
    """Act 2: that Delta table → lastagent-kafka sink, the driver SIGKILLed midway and restarted."""
    from kafka.admin import KafkaAdminClient, NewTopic

    from lastagent.sinks.kafka_sink_options import KafkaSinkOptions
    from lastagent.sinks.link_ports import link_committer

    topic = f"demo-shipments-{uuid.uuid4().hex[:6]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="lastagent-demo")
    admin.create_topics([NewTopic(topic, 3, 1)])
    admin.close()
    args = [bootstrap, table, os.path.join(workdir, "checkpoint-sink"), os.path.join(workdir, "arbitration"),
            "demo-shipments", topic]
    print(f"demo 2/3: Delta -> lastagent-kafka -> topic {topic}; the driver is SIGKILLed after its 2nd decision")
    if not _killed_then_restarted("2/3", "sink-driver", args, _newest_decided(args[3], "demo-shipments")):
        return False
    from deltalake import DeltaTable

    rows_in = DeltaTable(table).to_pyarrow_table(columns=["value"]).num_rows
    values = _read_committed(bootstrap, topic, rows_in)
    distinct = len(set(values))
    options = KafkaSinkOptions.parse({"kafka.bootstrap.servers": bootstrap, "link": "demo-shipments",
                                      "arbitrationTable": args[3], "checkpointLocation": args[2]})
    with link_committer(options) as committer:
        in_doubt = len(committer.in_doubt())
        epochs = len(committer.store.records("demo-shipments"))
    return _proof("2/3 Delta -> lastagent-kafka sink, killed once and restarted (independent read_committed consumer)", {
        "rows in (Delta table)": rows_in, "rows out (Kafka, read_committed)": len(values),
        "duplicates": len(values) - distinct, "missing": rows_in - distinct, "in doubt": in_doubt,
        "epochs decided": epochs,
    }, len(values) == rows_in)


def delta_act(bootstrap: str, workdir: str) -> bool:
    """Act 3: Kafka → transformer → lastagent-delta (+ dead letters, side topic), killed midway."""
    from kafka.admin import KafkaAdminClient, NewTopic

    suffix = uuid.uuid4().hex[:6]
    topic, dlq, side = f"demo-payments-{suffix}", f"demo-dead-letters-{suffix}", f"demo-receipts-{suffix}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="lastagent-demo")
    admin.create_topics([NewTopic(topic, 3, 1), NewTopic(dlq, 1, 1), NewTopic(side, 3, 1)])
    admin.close()
    good = produce(bootstrap, topic, txns=12, aborted=frozenset())
    poison = [b"poison-1", b"\xff\xfe not an order", b"order-x-y"]
    producer = Producer({"bootstrap.servers": bootstrap})
    for i, value in enumerate(poison):
        producer.produce(topic, key=f"poison-{i}".encode(), value=value, partition=i % 3)
    producer.flush(30)
    print(f"demo 3/3: wrote {good} orders and {len(poison)} poison records to {topic}; "
          "Kafka -> lastagent-delta, SIGKILLed after its 2nd Delta commit")
    table = os.path.join(workdir, "payments")
    args = [bootstrap, topic, table, os.path.join(workdir, "checkpoint-delta"), "demo-payments", dlq, side, "4000"]
    if not _killed_then_restarted("3/3", "delta-driver", args, _newest_decided(table, "demo-payments")):
        return False
    from lastagent.spark_session import local_session

    spark = local_session("lastagent-demo")
    spark.sparkContext.setLogLevel("ERROR")
    out = spark.read.format("delta").load(table)
    rows_out = out.count()
    distinct = out.select("partition", "offset").distinct().count()
    spark.stop()
    dead = _read_committed(bootstrap, dlq, len(poison))
    receipts = _read_committed(bootstrap, side, good)
    return _proof("3/3 Kafka -> transformer -> lastagent-delta + dead letters + side topic, killed once and restarted", {
        "rows in (Kafka)": good + len(poison), "rows out (Delta, Spark's reader)": rows_out,
        "dead letters (read_committed)": len(dead), "receipts (side topic)": len(receipts),
        "duplicates": (rows_out - distinct) + (len(dead) - len(set(dead))) + (len(receipts) - len(set(receipts))),
        "missing": (good - distinct) + (len(poison) - len(set(dead))),
    }, rows_out == good and len(dead) == len(poison) and len(receipts) == good)


def _killed_then_restarted(act: str, pipeline: str, args: list[str], decided: Callable[[], int | None]) -> bool:
    """Runs an example pipeline in a driver process of its own and SIGKILLs that process group (driver, JVM,
    Python workers) from outside once ``decided()`` shows a second decided epoch, as a lost machine would;
    then restarts it. True if the restart ends well."""
    command = [sys.executable, "-m", "lastagent.examples", pipeline, *args]
    proc = subprocess.Popen(command, start_new_session=True, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        newest = decided()
        if newest is not None and newest >= 1:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    code = proc.wait(timeout=60)
    print(f"demo {act}: driver exited with {code} ({'SIGKILL' if code == -signal.SIGKILL else 'no kill'}); restarting")
    code = subprocess.run(command, start_new_session=True, stderr=subprocess.DEVNULL, check=False).returncode
    if code != 0:
        print(f"demo {act}: the restarted query failed with exit {code}")
    return code == 0


def _newest_decided(path: str, link: str) -> Callable[[], int | None]:
    """The link's newest decided epoch in a Delta table (the ``txn`` action), None while there is none."""
    def read() -> int | None:
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return DeltaTable(path).transaction_version(link)
        except TableNotFoundError:
            return None
    return read


def _read_committed(bootstrap: str, topic: str, expect: int, timeout_s: float = 60.0) -> list[bytes | None]:
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"demo-verify-{uuid.uuid4().hex[:6]}",
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                         "enable.auto.commit": False})
    consumer.subscribe([topic])
    values: list[bytes | None] = []
    deadline = time.monotonic() + timeout_s
    idle_since = time.monotonic()
    while time.monotonic() < deadline:
        batch = consumer.consume(1000, 0.5)
        values += [m.value() for m in batch if m.error() is None]
        idle_since = time.monotonic() if batch else idle_since
        if len(values) >= expect and time.monotonic() - idle_since > 2:
            break
    consumer.close()
    return values


def _proof(title: str, figures: dict[str, int], ok: bool) -> bool:
    ok = ok and all(v == 0 for k, v in figures.items() if k in ("duplicates", "missing", "aborted rows visible", "in doubt"))
    print(f"demo {title}")
    for name, value in figures.items():
        print(f"  {name + ':':<36}{value}")
    print(f"  {'result:':<36}{'OK' if ok else 'FAILED'}")
    return ok


def run(bootstrap: str, workdir: str) -> int:
    ok, table = source_act(bootstrap, workdir)
    ok = sink_act(bootstrap, workdir, table) and ok
    ok = delta_act(bootstrap, workdir) and ok
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="lastagent demo on a local broker")
    parser.add_argument("--bootstrap", default=os.environ.get(
        "LASTAGENT_KAFKA_BOOTSTRAP", f"127.0.0.1:{os.environ.get('LASTAGENT_KAFKA_PORT', '39092')}"))
    parser.add_argument("--workdir", default=None, help="where the Delta table and checkpoint go (default: a temp dir)")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="lastagent-demo-")
    try:
        return run(args.bootstrap, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    from lastagent.cli import exit_now

    exit_now(main())
