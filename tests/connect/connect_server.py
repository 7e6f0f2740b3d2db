"""A real Spark Connect server in a process (group) of its own, and Connect client processes, for the Connect tier.

Started with pyspark's own ``bin/spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``
(the spark-connect jar ships in ``pyspark/jars``), master ``local[2]``, gRPC bound to 127.0.0.1 on a
given port, with the jars ``make setup`` resolved (delta-spark, spark-sql-kafka) and the Delta
extension and catalog: the settings of :func:`lastagent.spark_session.local_session`. Its Python
workers run this interpreter (the venv that has lastagent installed). Clients run ``connect_client.py``
in processes of their own (see conftest.py for why). stdlib and pyspark only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyspark

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).resolve().parent / "connect_client.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def session_members(sid: int) -> list[int]:
    """Pids of the processes in session ``sid`` (Linux /proc). pyspark's Python daemons move to process
    groups of their own (``os.setpgid(0, 0)``) but stay in the server's session."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after "pid (comm)": state ppid pgrp session
            pids.append(int(stat.parent.name))
    return pids


class ConnectServer:
    """One Spark Connect server on ``127.0.0.1:port``; ``workdir`` holds its log, warehouse and cwd."""

    def __init__(self, port: int, workdir: Path, jars_dir: Path | None = None, python: str | None = None,
                 spark_submit: Path | None = None, delta: bool = True) -> None:
        """``python`` and ``spark_submit``: another environment's (tests/spark_versions' virtualenvs), else this
        one's; ``delta``: with delta-spark's jars, extension and catalog (``make setup``'s jars)."""
        self.port = port
        self.workdir = workdir
        self.log = workdir / "connect-server.log"
        self.jars_dir = jars_dir or Path(os.environ.get("LASTAGENT_SPARK_JARS", "") or ROOT / ".cache" / "spark" / "jars")
        self.python = python or sys.executable
        self.spark_submit = spark_submit or Path(pyspark.__file__).resolve().parent / "bin" / "spark-submit"
        self.delta = delta
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        jars = sorted(str(p) for p in self.jars_dir.glob("*.jar")) if self.delta else []
        if self.delta and not jars:
            raise FileNotFoundError(f"no jars in {self.jars_dir}: run `make setup` or set LASTAGENT_SPARK_JARS")
        conf = {
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.connect.grpc.port.maxRetries": "0",  # the restart must come back on the same port, or fail
            "spark.sql.shuffle.partitions": "2",
            # Delta rebuilds a snapshot's state in 50 tasks by default: ~30 s of a loaded 2-core machine.
            "spark.databricks.delta.snapshotPartitions": "2",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.sql.streaming.forceDeleteTempCheckpointLocation": "true",
            "spark.python.worker.reuse": "true",
            "spark.sql.warehouse.dir": str(self.workdir / "warehouse"),
            "spark.driver.extraJavaOptions": f"-Dderby.system.home={self.workdir / 'derby'} "
                                             f"-Dlog4j2.configurationFile=file:{self.log4j()}",
        }
        if self.delta:
            conf["spark.sql.extensions"] = "io.delta.sql.DeltaSparkSessionExtension"
            conf["spark.sql.catalog.spark_catalog"] = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
        cmd = [str(self.spark_submit), "--master", "local[2]", "--class", SERVER_CLASS,
               "--name", "lastagent-connect-tests"] + (["--jars", ",".join(jars)] if jars else [])
        for key, value in conf.items():
            cmd += ["--conf", f"{key}={value}"]
        return [*cmd, "spark-internal"]

    def log4j(self) -> Path:
        """Warnings and errors only (INFO from every component costs CPU this machine lacks), plus the
        server's own start line and the streaming queries' errors."""
        path = self.workdir / "log4j2.properties"
        path.write_text("\n".join([
            "rootLogger.level = warn",
            "rootLogger.appenderRef.stdout.ref = console",
            "appender.console.type = Console",
            "appender.console.name = console",
            "appender.console.target = SYSTEM_ERR",
            "appender.console.layout.type = PatternLayout",
            "appender.console.layout.pattern = %d{HH:mm:ss.SSS} %p %c{1}: %m%n%ex",
            "logger.server.name = org.apache.spark.sql.connect.service.SparkConnectServer",
            "logger.server.level = info",
            "logger.stream.name = org.apache.spark.sql.execution.streaming",
            "logger.stream.level = info",
            "",
        ]))
        return path

    def start(self, timeout_s: float = 150.0) -> None:
        """Starts the server and waits (bounded) until its gRPC port answers."""
        if _answers(self.port):
            raise RuntimeError(f"port {self.port} already answers before the Connect server started")
        env = dict(os.environ, PYSPARK_PYTHON=self.python, PYSPARK_DRIVER_PYTHON=self.python,
                   SPARK_LOCAL_IP="127.0.0.1")
        for key in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", "SPARK_HOME", "SPARK_CONF_DIR"):
            env.pop(key, None)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"\n===== start #{self.starts} on port {self.port} =====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), cwd=self.workdir, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not _answers(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Connect server exited with {self.proc.returncode} before answering\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the Connect server did not answer on port {self.port} within {timeout_s:.0f} s\n{self.tail()}")
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILLs the server's process group and every other process of its session (the Python
        daemons and workers), and reaps it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        members = session_members(proc.pid)
        kill_group(proc)
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _answers(self.port) and time.monotonic() < deadline:
            time.sleep(0.2)

    def restart(self, timeout_s: float = 150.0) -> None:
        """kill -9 and start again on the same port (the recovery test's crash)."""
        self.kill()
        self.start(timeout_s)

    def stop(self) -> None:
        """Ends the server at the end of the session: SIGTERM to its group, SIGKILL after a grace period."""
        proc = self.proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def tail(self, chars: int = 6000) -> str:
        """The end of the server's log, for assertion messages."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return f"(no server log at {self.log})"
        return f"--- Connect server log ({self.log}), last {chars} chars ---\n{text[-chars:]}"


# --- client processes ------------------------------------------------------------------------------


@dataclass
class ClientRun:
    """One client subprocess: its exit code, its ``RESULT`` (or {}), its output and the server's log tail."""

    code: int | None
    result: dict[str, Any]
    output: str
    server: ConnectServer

    def explain(self) -> str:
        return f"client exit {self.code}\n--- client output (last 6000 chars) ---\n{self.output[-6000:]}\n{self.server.tail()}"


def client_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", "SPARK_API_MODE"):
        env.pop(key, None)
    return env


def start_client(server: ConnectServer, scenario: str, args: dict[str, Any], log: Path) -> subprocess.Popen[bytes]:
    """Starts ``connect_client.py scenario`` against the server, output into ``log``, in a new session."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, str(CLIENT), scenario, json.dumps({"url": server.url, **args})],
                                env=client_env(), cwd=log.parent, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def finish_client(proc: subprocess.Popen[bytes], server: ConnectServer, log: Path, timeout_s: float) -> ClientRun:
    """Waits (bounded) for a client; a client over time is SIGKILLed and reported with code None."""
    try:
        code: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        code = None
    output = log.read_text(errors="replace")
    result: dict[str, Any] = {}
    for line in output.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    return ClientRun(code, result, output, server)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILLs a client's process group (it leads its own session) and reaps it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
