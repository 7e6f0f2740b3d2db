"""A Spark standalone cluster on 127.0.0.1: a master and two workers, from pyspark's own launch classes.

The driver is a separate process (``support.run_driver`` with ``master=cluster.url``), so driver,
executors and Python workers live in different process trees, as on a real cluster. Each worker
leads a process group of its own (its JVM, its executor JVMs) and has ``LASTAGENT_MACHINE_PGID``
set to it, so the crash hook can take a whole worker "machine" down from inside a task
(``LASTAGENT_CRASH_SCOPE=machine``). Dead workers are started again before the next test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyspark
import pytest

SPARK_HOME = Path(pyspark.__file__).resolve().parent
CRASH_HOOK = Path(__file__).resolve().parent.parent / "crashhook"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Cluster:
    """A running master and its workers; ``url`` is the ``spark://`` master URL."""

    WORKERS = 2

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.ui_port = _free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.master: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = [None] * self.WORKERS
        self._env = dict(os.environ, SPARK_HOME=str(SPARK_HOME), SPARK_LOCAL_IP="127.0.0.1",
                         PYSPARK_PYTHON=sys.executable,
                         # A lost worker is noticed from its closed connection; this bounds the rest.
                         SPARK_MASTER_OPTS="-Dspark.worker.timeout=15")
        # Tasks' Python workers load the crash hook; it does nothing unless a driver asks for a fault
        # through spark.executorEnv.LASTAGENT_CRASH_AT.
        self._env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CRASH_HOOK), os.environ.get("PYTHONPATH", "")) if p)
        for key in ("LASTAGENT_CRASH_AT", "LASTAGENT_CRASH_STATE", "LASTAGENT_CRASH_PGID"):
            self._env.pop(key, None)

    def _launch(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 — the JVM writes to it after this returns
        # A shell that leads a new session and execs the JVM: its pid is the group's id, which the
        # worker's children (executor JVMs, Python daemons' parents) inherit as LASTAGENT_MACHINE_PGID.
        cmd = ['exec "$0" "$@"', str(SPARK_HOME / "bin" / "spark-class"), *args]
        return subprocess.Popen(["sh", "-c", f'LASTAGENT_MACHINE_PGID=$$; export LASTAGENT_MACHINE_PGID; {cmd[0]}', *cmd[1:]],
                                env=self._env, cwd=self.workdir, start_new_session=True,
                                stdout=log, stderr=subprocess.STDOUT)

    def start(self) -> None:
        self.master = self._launch("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                              "--port", str(self.port), "--webui-port", str(self.ui_port)])
        self._wait(lambda: _answers(self.port), "the master to listen", "master")
        self.ensure_workers()

    def ensure_workers(self) -> None:
        """Starts any worker that is not running and waits until the master lists it as ALIVE."""
        for i, proc in enumerate(self.workers):
            if proc is None or proc.poll() is not None:
                work = self.workdir / f"worker-{i}"
                work.mkdir(exist_ok=True)
                self.workers[i] = self._launch(f"worker-{i}", [
                    "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "1",
                    "--memory", "2g", "--webui-port", str(_free_port()), "--work-dir", str(work), self.url])
        self._wait(lambda: self.alive_workers() >= self.WORKERS, f"{self.WORKERS} workers to register", "master")

    def alive_workers(self) -> int:
        """Workers the master counts as ALIVE (its web UI's JSON); 0 while the UI cannot say."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as answer:
                return sum(w.get("state") == "ALIVE" for w in json.load(answer).get("workers", []))
        except (OSError, ValueError):
            # ValueError: Jetty answers with an HTML page while the master is still attaching its
            # handlers (seen in CI: the request came between "Start Jetty" and "Bound MasterWebUI").
            return 0

    def lost_workers(self) -> list[int]:
        """Indexes of the workers whose process has died."""
        return [i for i, p in enumerate(self.workers) if p is not None and p.poll() is not None]

    def _wait(self, ready, what: str, log: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                tail = (self.workdir / f"{log}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; {log}.log ends:\n{tail}")
            time.sleep(0.25)

    def stop(self) -> None:
        for proc in [*self.workers, self.master]:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A standalone cluster for this session, stopped (by pid) at the end."""
    cluster = Cluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(spark_cluster: Cluster) -> Cluster:
    """The session's cluster with every worker running (a test may have taken one down)."""
    spark_cluster.ensure_workers()
    return spark_cluster
