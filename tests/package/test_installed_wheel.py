"""lastagent installed as users install it: the portable wheel in a fresh virtualenv outside the repository, on
a machine with no compiler.

The ``manylinux_2_28`` wheel ``make setup`` built (the one ``make wheels`` ships) is installed with its ``spark``
extra into a new virtualenv in a temporary directory, with no ``cargo`` or ``rustc`` on PATH and none of the
repository's settings. From another directory (no checkout on ``sys.path``), with Spark's jars given as a
cluster gives them, it runs both links as real streaming queries against the test broker:

- Kafka -> ``lastagent-kafka`` source -> ``lastagent-delta`` (with a side topic, so the epoch also commits a
  Kafka transaction), read back by Spark's Delta reader;
- Kafka -> ``lastagent-kafka`` source -> ``lastagent-kafka`` sink, read back here by an independent
  ``read_committed`` consumer;

then runs the ``lastagent`` command. About a minute and a half with pip's cache warm; ``make test-wheel`` runs it
alone.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import venv
from pathlib import Path

import pytest
from conftest import ROOT, no_toolchain_env
from support import read_committed

pytestmark = pytest.mark.package

ROWS = 12

QUERIES = textwrap.dedent("""
    import os, sys
    assert not any({root!r} in p for p in sys.path), sys.path
    import lastagent, lastagent._native
    assert lastagent.__file__.startswith(sys.prefix) and lastagent._native.__file__.startswith(sys.prefix)
    from lastagent.spark_session import local_session

    spark = local_session("installed-wheel", jars_dir=os.environ["SPARK_JARS"])
    boot, here = os.environ["BOOTSTRAP"], os.getcwd()

    def source():
        return (spark.readStream.format("lastagent-kafka").option("kafka.bootstrap.servers", boot)
                .option("subscribe", os.environ["TOPIC"]).option("startingOffsets", "earliest")
                .option("maxOffsetsPerTrigger", "5").load())

    def run(query):
        query.awaitTermination(300)
        assert query.exception() is None, query.exception()
        assert not query.isActive, "still running after 300 s"
        return len(query.recentProgress)

    epochs = run(source().selectExpr("CAST(value AS STRING) AS v", "partition", "offset")
                 .writeStream.format("lastagent-delta").option("link", "wheel-to-delta")
                 .option("checkpointLocation", here + "/ckpt-delta").option("kafka.bootstrap.servers", boot)
                 .option("sideTopics", os.environ["SIDE_TOPIC"]).trigger(availableNow=True)
                 .start(here + "/table"))
    rows = spark.read.format("delta").load(here + "/table").collect()
    print("delta", epochs, sorted(r.v for r in rows))

    epochs = run(source().selectExpr("CAST(value AS STRING) AS value")
                 .writeStream.format("lastagent-kafka").option("kafka.bootstrap.servers", boot)
                 .option("topic", os.environ["OUT_TOPIC"]).option("link", "wheel-to-kafka")
                 .option("arbitrationTable", here + "/arb").option("checkpointLocation", here + "/ckpt-kafka")
                 .trigger(availableNow=True).start())
    print("kafka", epochs)
    spark.stop()
""")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_portable_wheel_runs_both_links_without_a_compiler(tmp_path, host_wheel, kafka_bootstrap, new_topic):
    from confluent_kafka import Producer

    topic, side, out = new_topic(), new_topic(), new_topic()
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(ROWS):
        producer.produce(topic, value=f"row-{i:02d}".encode())
    assert producer.flush(30) == 0
    expected = sorted(f"row-{i:02d}" for i in range(ROWS))

    env = no_toolchain_env()
    users = tmp_path / "users-venv"
    venv.create(users, with_pip=True)
    python = str(users / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", "--only-binary", "lastagent", f"{host_wheel}[spark]"], tmp_path, env)

    work = tmp_path / "elsewhere"
    work.mkdir()
    env.update(BOOTSTRAP=kafka_bootstrap, TOPIC=topic, SIDE_TOPIC=side, OUT_TOPIC=out,
               SPARK_JARS=str(ROOT / ".cache" / "spark" / "jars"))
    printed = _run([python, "-c", QUERIES.format(root=str(ROOT))], work, env, timeout=600)
    lines = dict(line.split(" ", 1) for line in printed.splitlines() if line.startswith(("delta ", "kafka ")))
    delta_epochs, delta_rows = lines["delta"].split(" ", 1)
    assert delta_rows == repr(expected), printed
    assert int(delta_epochs) >= ROWS // 5, printed  # maxOffsetsPerTrigger=5: several epochs, each decided
    assert int(lines["kafka"]) >= ROWS // 5, printed
    assert sorted(v.decode() for _, v in read_committed(kafka_bootstrap, out, ROWS)) == expected
    assert len(read_committed(kafka_bootstrap, side, ROWS)) == ROWS  # the side topic: one JSON row per record

    status = _run([str(users / "bin" / "lastagent"), "status", "--link", "wheel-to-kafka", "--arbitration-table",
                   str(work / "arb"), "--bootstrap-servers", kafka_bootstrap, "--json"], work, env, timeout=120)
    document = json.loads(status)
    assert document["in_doubt"] == [] and document["decided_epochs"] >= ROWS // 5, status
    missing = subprocess.run([str(users / "bin" / "lastagent"), "status", "--link", "x", "--arbitration-table",
                              str(work / "none"), "--bootstrap-servers", kafka_bootstrap], cwd=work, env=env,
                             capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode == 2 and "no Delta table there" in missing.stderr, missing.stderr
    assert not (work / ".cache").exists()
