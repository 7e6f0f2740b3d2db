"""lastagent installed as users install it: a wheel in a fresh virtualenv outside the repository.

Builds the wheel, installs it with its ``spark`` extra into a new virtualenv in a temporary
directory, and from another directory (no checkout on ``sys.path``, no ``.cache``) checks that
Spark discovers both formats without a registration call, that a batch read works, and that the
``lastagent`` command runs. About a minute with pip's cache warm; ``make test-wheel`` runs it alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.package

ROOT = Path(__file__).resolve().parents[2]

SMOKE = textwrap.dedent("""
    import os, sys
    from pyspark.sql import SparkSession
    assert not any("{root}" in p for p in sys.path), sys.path
    import lastagent
    assert lastagent.__file__.startswith(sys.prefix), lastagent.__file__
    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    rows = (spark.read.format("lastagent-kafka").option("kafka.bootstrap.servers", os.environ["BOOTSTRAP"])
            .option("subscribe", os.environ["TOPIC"]).load().selectExpr("CAST(value AS STRING) AS v").collect())
    print("rows", sorted(r.v for r in rows))
    spark.stop()
""")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_wheel_works_in_a_clean_virtualenv(tmp_path, kafka_bootstrap, new_topic):
    from confluent_kafka import Producer

    topic = new_topic()
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(3):
        producer.produce(topic, value=f"row-{i}".encode())
    assert producer.flush(30) == 0

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LASTAGENT_", "VIRTUAL_ENV"))}
    env.update(BOOTSTRAP=kafka_bootstrap, TOPIC=topic)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)], tmp_path, env)
    wheel = next(dist.glob("lastagent-*.whl"))
    users = tmp_path / "users-venv"
    venv.create(users, with_pip=True)
    python = str(users / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", f"{wheel}[spark]"], tmp_path, env)

    work = tmp_path / "elsewhere"
    work.mkdir()
    env["PYSPARK_PYTHON"] = python
    out = _run([python, "-c", SMOKE.format(root=ROOT)], work, env, timeout=300)
    assert "rows ['row-0', 'row-1', 'row-2']" in out, out
    help_text = _run([str(users / "bin" / "lastagent"), "status", "--help"], work, env)
    assert "--command-config" in help_text
    missing = subprocess.run([str(users / "bin" / "lastagent"), "status", "--link", "x", "--arbitration-table",
                              str(work / "none"), "--bootstrap-servers", kafka_bootstrap], cwd=work, env=env,
                             capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode == 2 and "no Delta table there" in missing.stderr, missing.stderr
    assert not (work / ".cache").exists()
