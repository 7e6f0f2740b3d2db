"""The commit path under real timing: a task slower than kafka.transaction.timeout.ms, on a real broker and Spark.

Both sinks: ``lastagent-kafka`` (the branches are the output) and ``lastagent-delta`` with a side
topic (the branches ride beside the table's commit).

Skewed tasks are ordinary. While one task of an epoch runs long, the broker aborts the epoch's
other, already prepared branches once their transaction timeout passes. The driver must then not
decide the epoch (a decision would record as committed records that are gone): it rolls the
epoch's branches back and stops the query, naming the timeout; a restart replays the epoch and
every row arrives once.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest
from support import read_committed

from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.integration

ROWS = 200
#: Short, so the test is quick; a normal epoch here (200 rows) still ends well inside its 6 s budget
#: (the timeout less the decision margin, a quarter of it).
TIMEOUT_MS = 8_000
#: Longer than the timeout plus the broker's expiry sweep (1 s in dev/kafka_broker.py).
SLOW_S = 12.0


def _slow_partition(marker: str, seconds: float):
    """A column function that holds task partition 1 for ``seconds`` on its first row while ``marker`` exists.

    Nested, so that cloudpickle ships it by value to the Python workers.
    """
    from pyspark.sql.functions import udf

    def slow(value: str, _held: list = []) -> str:  # noqa: B006 — one list per task: the UDF is unpickled per task
        import os
        import time

        from pyspark import TaskContext

        ctx = TaskContext.get()
        if not _held and ctx is not None and ctx.partitionId() == 1 and os.path.exists(marker):
            time.sleep(seconds)
        _held.append(True)
        return value

    return udf(slow, "string")


def _run(spark, fmt: str, source: str, tmp: Path, bootstrap: str, topic: str, link: str, marker: Path):
    """The link: ``lastagent-kafka`` into ``topic``, or ``lastagent-delta`` into a table with ``topic`` as side topic."""
    from pyspark.sql.functions import col

    slow = _slow_partition(str(marker), SLOW_S)
    df = (spark.readStream.format("delta").load(source).repartition(2)
          .select(slow(col("id").cast("string")).alias("key"), col("id").cast("string").alias("value")))
    writer = (df.writeStream.format(fmt).option("kafka.bootstrap.servers", bootstrap).option("link", link)
              .option("kafka.transaction.timeout.ms", str(TIMEOUT_MS))
              .option("checkpointLocation", str(tmp / "ckpt")).trigger(availableNow=True))
    if fmt == "lastagent-kafka":
        writer = writer.option("topic", topic).option("arbitrationTable", str(tmp / "arb"))
    else:
        writer = writer.option("sideTopics", topic).option("path", str(tmp / "table"))
    return writer.start()


def _decisions(spark, fmt: str, tmp: Path) -> list[int]:
    """The link's decided epochs: arbitration rows, or the target table's lastagent commits."""
    import json

    if fmt == "lastagent-kafka":
        arb = tmp / "arb"
        if not (arb / "_delta_log").exists():
            return []
        return sorted(r.epoch for r in spark.read.format("delta").load(str(arb)).collect())
    table = tmp / "table"
    if not (table / "_delta_log").exists():
        return []
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").collect()
    return sorted(json.loads(h.userMetadata)["lastagent"]["epoch"] for h in history if h.userMetadata)


@pytest.mark.parametrize("fmt", ["lastagent-kafka", "lastagent-delta"])
def test_a_task_slower_than_the_timeout_leaves_its_epoch_undecided_and_the_restart_writes_it_once(
        spark, tmp_path, kafka_bootstrap, new_topic, fmt):
    source = str(tmp_path / "source")
    spark.range(0, ROWS, numPartitions=2).write.format("delta").save(source)
    topic = new_topic(partitions=2)
    link = f"slow-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "slow"
    marker.touch()

    q = _run(spark, fmt, source, tmp_path, kafka_bootstrap, topic, link, marker)
    with pytest.raises(Exception) as failed:
        q.awaitTermination(timeout=300)
    text = str(failed.value)
    assert f"link '{link}' epoch 0 was not decided" in text, text[-3000:]
    assert f"kafka.transaction.timeout.ms (now {TIMEOUT_MS} ms)" in text and "no longer open on the broker" in text
    # Nothing was decided, nothing committed, nothing left open holding the partitions' stable offset.
    assert read_committed(kafka_bootstrap, topic, 1, timeout_s=5, quiet_s=0) == []
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []
    assert _decisions(spark, fmt, tmp_path) == []
    if fmt == "lastagent-delta":  # the epoch's staged data files went with it
        assert not list((tmp_path / "table").rglob("*.parquet"))

    marker.unlink()  # the skew passes: the restarted query replays epoch 0 on its own
    q = _run(spark, fmt, source, tmp_path, kafka_bootstrap, topic, link, marker)
    q.awaitTermination(timeout=300)
    assert q.exception() is None
    expected = Counter(str(i) for i in range(ROWS))
    rows = read_committed(kafka_bootstrap, topic, ROWS)
    if fmt == "lastagent-kafka":
        assert Counter(v.decode() for _, v in rows) == expected
    else:  # side-topic records are the rows as JSON; the table has each row once
        import json

        assert Counter(json.loads(v)["value"] for _, v in rows) == expected
        table = spark.read.format("delta").load(str(tmp_path / "table"))
        assert Counter(r.value for r in table.select("value").collect()) == expected
    assert _decisions(spark, fmt, tmp_path) == [0]
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []
