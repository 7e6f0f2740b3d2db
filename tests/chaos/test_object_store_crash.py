"""Both sinks with every path on an S3-compatible server (s3proxy, ``s3a://``), drivers SIGKILLed and restarted.

Tables, the arbitration table, the dead-letter table, the task files and Spark's checkpoints are all
``s3a://`` paths on the session's server; Spark reaches them through Hadoop's s3a filesystem, lastagent
through pyarrow and delta-rs with the ``storage.*`` options. The drivers are killed right after the
decision (the Delta commit: the target table's, or the arbitration table's) and between the branch
commits of the recovery, then run to the end. Every row once: in the table, read back by Spark's
Delta reader over s3a; in the topics, by an independent read_committed consumer. No transaction of
the link is left open, no data file is left that no decision references, and the storage secret is
nowhere in what the runs wrote (objects, topics, driver logs).
"""

from __future__ import annotations

import json
import signal
import uuid
from collections import Counter
from pathlib import Path

import pytest
import s3_server
import support
from support import read_committed

from lastagent.delta.files import parse_file_name
from lastagent.kafka.xa import KafkaXAResource
from lastagent.storage import location

pytestmark = [pytest.mark.chaos, pytest.mark.objectstore]

ROWS, POISON, PER_TRIGGER = 300, {41, 207}, "100"
SECRET = s3_server.SECRET_KEY.encode()


def _killed_then_finished(mode: str, args: list[str], points: list[str], state: Path, s3, tmp_path: Path) -> None:
    conf = s3.spark_conf()
    storage = s3.properties(tmp_path / "storage.properties")
    for point in points:
        state.write_text("0")
        code = support.run_driver(mode, args, point, state, conf=conf, storage_config=storage)
        assert code == -signal.SIGKILL, f"the driver was not killed at {point} (exit {code}); see {state}.log"
        assert Path(str(state) + ".fired").read_text() == point.split(":")[0]
    assert support.run_driver(mode, args, None, state, conf=conf, storage_config=storage) == 0, \
        f"the last restart failed; see {state}.log"


def _objects(s3, bucket: str, prefix: str) -> set[str]:
    """Names of the data files under ``prefix`` that this sink wrote, as the server stores them."""
    root = s3.data / bucket / prefix
    return {p.name for p in root.rglob("*.parquet") if parse_file_name(p.name)}


def assert_no_secret(s3, topics: list[str], bootstrap: str, logs: list[Path]) -> None:
    for path in [*s3.data.rglob("*"), *logs]:
        if path.is_file():
            assert SECRET not in path.read_bytes(), f"the storage secret is in {path}"
    for topic in topics:
        for key, value in read_committed(bootstrap, topic, 1, timeout_s=10, quiet_s=1):
            assert SECRET not in (key or b"") + (value or b""), f"the storage secret is in topic {topic}"


def test_kafka_to_delta_on_s3_killed_after_the_commit_and_in_recovery(spark, s3, kafka_admin, kafka_bootstrap,
                                                                       new_topic, tmp_path):
    from deltalake import DeltaTable

    orders, side = support.orders_topic(kafka_admin, kafka_bootstrap, ROWS, POISON), new_topic(partitions=2)
    bucket = s3.bucket()
    base = f"s3a://{bucket}/link"
    table, dead = f"{base}/orders", f"{base}/dead-letters"
    link = f"s3-d-{uuid.uuid4().hex[:8]}"
    # A table as Delta makes new ones (row tracking, in-commit timestamps, clustering): its claims and epochs are
    # committed through Delta Kernel on the object store; the dead-letter table, which the sink creates, by delta-rs.
    spark.sql(f"CREATE TABLE delta.`{table}` (key STRING, value BINARY, topic STRING, partition INT, offset BIGINT, "
              "amount BIGINT) USING delta CLUSTER BY (amount) TBLPROPERTIES ('delta.enableRowTracking'='true', "
              "'delta.enableInCommitTimestamps'='true', 'delta.enableDeletionVectors'='true')")
    args = [kafka_bootstrap, orders, table, f"{base}/ckpt", link, "", side, PER_TRIGGER, dead]
    state = tmp_path / "crash"
    _killed_then_finished("delta-driver", args, ["after_arbitration:1", "between_branch_commits:1"], state, s3,
                          tmp_path)

    good = [i for i in range(ROWS) if i not in POISON]
    rows = spark.read.format("delta").load(table).select("key", "topic", "_metadata.row_id").collect()
    assert len({r.row_id for r in rows}) == len(rows)
    counts = Counter(int(r.key) for r in rows)
    assert sorted(counts) == good, f"lost rows: {sorted(set(good) - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"duplicates: {[k for k, c in counts.items() if c > 1][:10]}"
    dead_rows = spark.read.format("delta").load(dead).select("key", "reason").collect()
    assert Counter(r.key for r in dead_rows) == Counter(str(i).encode() for i in POISON), "dead letters not once"
    follow = Counter(json.loads(v)["key"] for _, v in read_committed(kafka_bootstrap, side, len(good)))
    assert sorted(int(k) for k in follow) == good and max(follow.values()) == 1, "side topic not exactly once"
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []
    options = s3.config().delta_options(location(table, "path"))
    for path, prefix in ((table, "link/orders"), (dead, "link/dead-letters")):
        referenced = {Path(u).name for u in DeltaTable(path, storage_options=options).file_uris()}
        assert _objects(s3, bucket, prefix) == referenced, f"files no decision references in {path}"
    assert_no_secret(s3, [side, orders], kafka_bootstrap, [state.with_suffix(".log")])


@pytest.mark.skipif(not support.FULL, reason="make test-chaos-full: in make test, the lastagent-delta test above "
                                              "kills at the decision on S3, and the arbitration table's races run "
                                              "on S3 in tests/integration/test_arbitration_delta.py")
def test_delta_to_kafka_on_s3_killed_after_the_decision_and_restarted(spark, s3, kafka_bootstrap, new_topic,
                                                                      tmp_path):
    bucket = s3.bucket()
    base = f"s3a://{bucket}/link"
    source = f"{base}/source"
    files, per_file = 3, 50
    for f in range(files):
        (spark.range(f * per_file, (f + 1) * per_file, numPartitions=1)
         .selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
         .write.format("delta").mode("append").save(source))
    topic = new_topic(partitions=2)
    link = f"s3-k-{uuid.uuid4().hex[:8]}"
    arbitration = f"{base}/arbitration"
    args = [kafka_bootstrap, source, f"{base}/ckpt", arbitration, link, topic]
    state = tmp_path / "crash"
    _killed_then_finished("sink-driver", args, ["after_arbitration:2"], state, s3, tmp_path)

    rows = read_committed(kafka_bootstrap, topic, files * per_file)
    counts = Counter(v for _, v in rows)
    assert sorted(counts) == sorted(str(i).encode() for i in range(files * per_file)), "lost rows"
    assert max(counts.values()) == 1, f"duplicates: {[k for k, c in counts.items() if c > 1][:10]}"
    with KafkaXAResource({"bootstrap.servers": kafka_bootstrap}) as xa:
        assert xa.recover(f"lastagent-{link}-") == []
    decided = spark.read.format("delta").load(arbitration).where(f"link = '{link}'").select("epoch").collect()
    assert sorted(r.epoch for r in decided) == list(range(files)), "one decision per epoch, read by Spark over s3a"
    assert_no_secret(s3, [topic], kafka_bootstrap, [state.with_suffix(".log")])
