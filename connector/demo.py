"""The `make run` demo, on embedded defaults: a local Kafka broker and local Delta paths.

Kafka → `lastagent-kafka` source → a Delta table, stopped midway and restarted from its
checkpoint, ending with a printed proof read back by Spark's own Delta reader:
rows in (committed to Kafka), rows out, duplicates 0, aborted rows 0.

Run: ``python -m lastagent.demo`` (driver). Needs a broker: ``make kafka-up`` starts one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import uuid

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
            producer.abort_transaction(60)
        else:
            producer.commit_transaction(60)
            rows += ROWS_PER_TXN
    return rows


def run(bootstrap: str, workdir: str) -> int:
    from kafka.admin import KafkaAdminClient, NewTopic

    from lastagent.spark_session import local_session

    topic = f"demo-orders-{uuid.uuid4().hex[:6]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="lastagent-demo")
    admin.create_topics([NewTopic(topic, 3, 1)])
    admin.close()
    rows_in = produce(bootstrap, topic, txns=23, aborted=frozenset({3, 9, 15}))
    print(f"demo: wrote {rows_in} committed rows (+ 3 aborted transactions) to topic {topic}")

    spark = local_session("lastagent-demo")
    spark.sparkContext.setLogLevel("ERROR")
    table, ckpt = os.path.join(workdir, "orders"), os.path.join(workdir, "checkpoint")

    def start(trigger: dict[str, bool | str]):  # noqa: ANN202
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

    # First run: process two micro-batches, then stop as a user would (or a crash would).
    query = start({"processingTime": "1 second"})
    while len([p for p in query.recentProgress if p["numInputRows"] > 0]) < 2:
        query.awaitTermination(0.5)
    query.stop()
    first = spark.read.format("delta").load(table).count()
    print(f"demo: stopped after {first} rows; restarting from the checkpoint")
    # Second run: restart from the checkpoint and drain what is there.
    query = start({"availableNow": True})
    query.awaitTermination()

    out = spark.read.format("delta").load(table)
    rows_out = out.count()
    distinct = out.select("topic", "partition", "offset").distinct().count()
    aborted = out.filter("value LIKE 'aborted-%'").count()
    duplicates = rows_out - distinct
    missing = rows_in - distinct
    print("demo: proof (read back with Spark's Delta reader)")
    print(f"  rows in (committed to Kafka): {rows_in}")
    print(f"  rows out (Delta table):       {rows_out}")
    print(f"  duplicates:                   {duplicates}")
    print(f"  missing:                      {missing}")
    print(f"  aborted rows visible:         {aborted}")
    spark.stop()
    ok = duplicates == 0 and missing == 0 and aborted == 0 and rows_out == rows_in
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
    sys.exit(main())
