"""Every Spark 4 minor users run: the portable wheel in a fresh virtualenv per minor, with that minor's newest pyspark
and nothing else of Spark's, outside the repository, with no compiler on PATH (tests/package's environment).

On each minor (``make test-spark-versions``; .ci/run on all but 4.3.0, whose failure is in docs/install.md), against
the test broker:

1. both links (Kafka -> ``lastagent-kafka`` -> ``lastagent-delta`` with a side topic, and Kafka -> ``lastagent-kafka``
   -> ``lastagent-kafka``) run with ``maxOffsetsPerTrigger``; the driver is SIGKILLed once each link has
   decided a few epochs, then restarted from the same checkpoints until every record is read. Checked by
   independent readers: ``deltalake`` for the table, a ``read_committed`` consumer for the topics: every record
   exactly once; no batch above the cap, before or after the kill;
2. admission control: ``Trigger.AvailableNow`` ends after the data present at start (in capped batches on 4.2+,
   where Spark passes a read limit; one batch before, where Spark asks a Python source once per run), and
   ``minOffsetsPerTrigger`` holds new records back until ``maxTriggerDelay`` has passed;
3. Spark Connect: a Connect server of that Spark (its own ``spark-submit``, the virtualenv's Python) and a Connect
   client in the virtualenv run the source into both sinks; read back as in 1;
4. ``lastagent.epoch`` in foreachBatch with that minor's Delta (``delta-spark_<minor>_2.13`` from Maven Central;
   4.0 to 4.2: no Delta release builds for 4.3 yet): every record once as an event (read_committed) and once in
   the table an SQL MERGE wrote, each MERGE carrying its record.

A few minutes per minor with pip's cache warm (the first run downloads each pyspark, about 430 MB).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest
from support import no_toolchain_env, portable_wheel, read_committed

from lastagent.worker_env import runner_keys

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connect"))

pytestmark = pytest.mark.spark_versions

HERE = Path(__file__).resolve().parent
#: The newest patch of each Spark 4 minor (lastagent.spark_versions.TESTED_MINORS), as docs/install.md lists them.
SPARKS = ["4.0.5", "4.1.4", "4.2.1", "4.3.0"]
#: LASTAGENT_SPARK_VERSIONS="4.0.5 4.1.4" runs those only (make test-spark-versions SPARK_VERSIONS=...; .ci/run).
_ONLY = os.environ.get("LASTAGENT_SPARK_VERSIONS", "").split()
if unknown := set(_ONLY) - set(SPARKS):
    raise ValueError(f"LASTAGENT_SPARK_VERSIONS: {sorted(unknown)} not among {SPARKS}")
ROWS, CAP, LATE = 600, 50, 5
#: Delta for the lastagent.epoch phase: one release builds for every Spark 4 minor (delta-spark_<minor>_2.13), the
#: one dev/spark/pom.xml resolves for the development pyspark.
DELTA_VERSION = "4.4.0"
#: The minors Delta 4.4.0 builds for (Maven Central has no delta-spark_4.3_2.13: Spark 4.3 has no Delta yet).
DELTA_MINORS = ("4.0", "4.1", "4.2")


def _user_python(tmp_path: Path, pyspark: str, env: dict[str, str]) -> str:
    """A fresh virtualenv with the wheel and ``pyspark[connect]`` (the Connect client's extras too); its python."""
    wheel = portable_wheel()
    if wheel is None:
        pytest.fail("no portable wheel in dist/: make setup builds it")
    users = tmp_path / f"pyspark-{pyspark}"
    venv.create(users, with_pip=True)
    python = str(users / "bin" / "python")
    done = subprocess.run([python, "-m", "pip", "install", "-q", "--only-binary", "lastagent", str(wheel),
                           f"pyspark[connect]=={pyspark}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return python


def _cause(log: str) -> str:
    """The log's first Java or Python exception with what follows it, else its last 4,000 characters."""
    for marker in ("Caused by:", "Exception", "Error"):
        at = log.find(marker)
        if at >= 0:
            return log[max(0, at - 1000):at + 8000]
    return log[-4000:]


def _produce(bootstrap: str, topic: str, values: list[str]) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap})
    for v in values:
        producer.produce(topic, key=v.encode(), value=v.encode())
    assert producer.flush(30) == 0


class Driver:
    """links.py in the user's virtualenv, as its own process group (the JVM is its child)."""

    def __init__(self, python: str, phase: str, work: Path, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        # stderr to a file: Spark's log would fill a pipe nobody reads until the end, and a failure needs all of it.
        self.stderr = work / f"{phase}.stderr"
        with self.stderr.open("w") as err:
            self.proc = subprocess.Popen([python, str(HERE / "links.py"), phase, str(work)], cwd=work, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         start_new_session=True)

    def read_until(self, done, timeout_s: float = 300) -> None:
        """Reads stdout lines until ``done(lines)`` or the process ends; fails with its stderr on a timeout."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while not done(self.lines):
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            assert time.monotonic() < deadline, f"no end after {timeout_s} s:\n" + "\n".join(self.lines[-20:])

    def finish(self, timeout_s: float = 300) -> None:
        self.read_until(lambda _: False, timeout_s)
        rc = self.proc.wait(timeout_s)
        assert rc == 0, f"exit {rc} (all of its stderr: {self.stderr}):\n" + "\n".join(self.lines[-20:]) + "\n" + \
            _cause(self.stderr.read_text())

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)

    def progress(self, query: str) -> list[dict]:
        return [json.loads(line.split(" ", 2)[2]) for line in self.lines if line.startswith(f"progress {query} ")]

    def admission(self) -> dict[str, dict]:
        return {d["case"]: d for d in (json.loads(line.split(" ", 1)[1]) for line in self.lines
                                      if line.startswith("admission "))}


@pytest.mark.timeout(1800)  # a cold pip cache downloads and builds a 430 MB pyspark first
@pytest.mark.parametrize("pyspark", [v for v in SPARKS if not _ONLY or v in _ONLY])
def test_every_format_on_this_spark_every_record_once_across_a_driver_kill(tmp_path, pyspark, kafka_bootstrap,
                                                                            new_topic):
    env = no_toolchain_env()
    python = _user_python(tmp_path, pyspark, env)
    topic, side, out, late = new_topic(3), new_topic(), new_topic(), new_topic(2)
    expected = [f"row-{i:04d}" for i in range(ROWS)]
    _produce(kafka_bootstrap, topic, expected)
    _produce(kafka_bootstrap, late, expected)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env.update(BOOTSTRAP=kafka_bootstrap, TOPIC=topic, SIDE_TOPIC=side, OUT_TOPIC=out, LATE_TOPIC=late,
               ROWS=str(ROWS), CAP=str(CAP))

    # 1. Both links, the driver SIGKILLed once each has decided three epochs with records.
    first = Driver(python, "links", work, env)
    first.read_until(lambda lines: all(
        len([line for line in lines if line.startswith(f"progress {q} ") and '"rows": 0' not in line]) >= 3
        for q in ("delta", "kafka")))
    assert first.lines and first.lines[0] == f"pyspark {pyspark}", first.lines[:3]
    first.kill()
    before = {q: first.progress(q) for q in ("delta", "kafka")}
    assert all(sum(p["rows"] for p in before[q]) < ROWS for q in before), before  # killed mid-run
    second = Driver(python, "resume", work, env)
    second.finish()
    after = {q: second.progress(q) for q in ("delta", "kafka")}
    # lastagent.register filled in what Spark's source runner adds at a query's first start, so the two queries
    # starting at once changed nothing the tasks carry (Spark's race: lastagent.worker_env).
    envmaps = next(json.loads(line.split(" ", 1)[1]) for line in second.lines if line.startswith("envmaps "))
    assert envmaps["unchanged"] and envmaps["filled"], envmaps
    assert all(set(runner_keys(pyspark)) <= set(m) for m in envmaps["filled"]), envmaps
    for q in ("delta", "kafka"):
        assert max(p["rows"] for p in before[q] + after[q]) <= CAP, (q, before[q], after[q])  # every batch capped
        assert after[q][-1]["readTo"] == ROWS, after[q]

    from deltalake import DeltaTable

    table = DeltaTable(str(work / "table")).to_pyarrow_table().to_pylist()
    assert sorted(r["v"] for r in table) == expected  # every record once in the table
    assert len({(r["partition"], r["offset"]) for r in table}) == ROWS
    assert sorted(v.decode() for _, v in read_committed(kafka_bootstrap, out, ROWS)) == expected
    assert len(read_committed(kafka_bootstrap, side, ROWS)) == ROWS  # the side topic: one row per record

    # 2. Admission control on this Spark.
    third = Driver(python, "admission", work, env)
    third.read_until(lambda lines: "produce-late" in lines)
    _produce(kafka_bootstrap, late, [f"late-{i}" for i in range(LATE)])
    assert third.proc.stdin is not None
    third.proc.stdin.write("go\n")
    third.proc.stdin.flush()
    third.finish()
    cases = third.admission()
    assert sum(cases["available-now"]["batches"]) == ROWS, cases
    capped = cases["available-now-capped"]["batches"]
    if tuple(int(x) for x in pyspark.split(".")[:2]) >= (4, 2):
        assert sum(capped) == ROWS and max(capped) <= CAP and len(capped) >= ROWS // CAP, cases
    else:  # Spark asks a Python source once per AvailableNow run: one batch, capped
        assert len(capped) == 1 and 0 < capped[0] <= CAP, cases
    assert cases["min-first"]["rows"] == ROWS, cases  # a query's first trigger is never held back
    assert cases["min-late"]["rows"] == ROWS + LATE, cases
    # held back until maxTriggerDelay (10 s) passed since the first batch; unheld they arrive within a trigger or two
    assert cases["min-late"]["waited_s"] >= 4 and cases["min-late"]["since_first_s"] >= 7, cases

    # 3. Spark Connect: this Spark's server, the formats found in its Python, a client in the same virtualenv.
    from connect_server import ConnectServer, free_port

    spark_submit = next((tmp_path / f"pyspark-{pyspark}").glob("lib/python*/site-packages/pyspark/bin/spark-submit"))
    server = ConnectServer(free_port(), tmp_path / "connect-server", python=python, spark_submit=spark_submit,
                           delta=False)
    connect_out = new_topic()
    server.start()
    try:
        fourth = Driver(python, "connect", work, {**env, "CONNECT_URL": server.url, "CONNECT_OUT_TOPIC": connect_out})
        fourth.read_until(lambda lines: "done" in lines, timeout_s=400)
        try:
            fourth.finish()
        except AssertionError as e:
            raise AssertionError(f"{e}\n{server.tail()}") from None
    finally:
        server.stop()
    assert sorted(v.decode() for _, v in read_committed(kafka_bootstrap, connect_out, ROWS)) == expected
    connected = DeltaTable(str(work / "table-connect")).to_pyarrow_table().column("v").to_pylist()
    assert sorted(connected) == expected

    # 4. lastagent.epoch with this minor's Delta (Spark's own Delta writer is its last agent).
    minor = ".".join(pyspark.split(".")[:2])
    if minor not in DELTA_MINORS:
        return  # no Delta release builds for this minor yet: nothing to be the block's last agent
    import spark_jars

    pyspark_jars = next((tmp_path / f"pyspark-{pyspark}").glob("lib/python*/site-packages/pyspark/jars"))
    delta_jars = spark_jars.resolve_delta_for(pyspark_jars, minor, DELTA_VERSION)
    epoch_out = new_topic()
    fifth = Driver(python, "epoch", work, {**env, "EPOCH_TOPIC": epoch_out,
                                           "DELTA_JARS": ",".join(str(j) for j in delta_jars)})
    fifth.finish(timeout_s=600)
    ran = next(json.loads(line.split(" ", 1)[1]) for line in fifth.lines if line.startswith("epoch "))
    assert ran["batches"] >= 1, ran
    merged = DeltaTable(ran["table"]).to_pyarrow_table().to_pylist()
    assert sorted(r["v"] for r in merged) == expected and {r["n"] for r in merged} == {1}, merged[:5]
    assert sorted(v.decode() for _, v in read_committed(kafka_bootstrap, epoch_out, ROWS)) == expected
    records = [c for c in DeltaTable(ran["table"]).history() if c.get("operation") == "MERGE"]
    assert len(records) == ran["batches"] and all('"branches"' in c.get("userMetadata", "") for c in records)

