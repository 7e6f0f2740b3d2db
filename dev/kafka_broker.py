"""A real single-node Apache Kafka broker (KRaft) for development, tests and the demo.

The broker's jars come from Maven Central through ``dev/kafka/pom.xml`` (cached under
``.cache/kafka/jars`` after the first time). The broker runs as a plain JVM process bound to
127.0.0.1, with settings fit for transactions. Standard library only, so it runs before the
project's own packages are installed.

Usage::

    python dev/kafka_broker.py up   [--port 39092] [--dir .cache/kafka/39092]
    python dev/kafka_broker.py down [--port 39092] [--dir ...]
    python dev/kafka_broker.py status

``up`` and ``down`` are idempotent.
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LASTAGENT_CACHE", ROOT / ".cache"))
JARS = CACHE / "kafka" / "jars"
POM = ROOT / "dev" / "kafka" / "pom.xml"
DEFAULT_PORT = int(os.environ.get("LASTAGENT_KAFKA_PORT", "39092"))
# Kafka aborts an open transaction after its timeout; the protocol needs room to finish a
# decided epoch long after a crash, so the ceiling is raised to one hour (issue #2).
TRANSACTION_MAX_TIMEOUT_MS = 3_600_000

SERVER_PROPERTIES = """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{controller_port}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={log_dir}
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
transaction.max.timeout.ms={txn_max}
# Expire timed-out transactions promptly, so expiry (a hazard the protocol must surface) is testable.
transaction.abort.timed.out.transaction.cleanup.interval.ms=1000
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.retention.check.interval.ms=1000
log.cleaner.backoff.ms=1000
log.initial.task.delay.ms=1000
delete.topic.enable=true
"""

LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log_file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
"""


class BrokerError(RuntimeError):
    """The broker could not be resolved, formatted or started."""


def resolve_jars() -> Path:
    """Resolves the broker's jars from Maven Central once; later calls use the cache."""
    marker = JARS / ".complete"
    if marker.exists():
        return JARS
    JARS.mkdir(parents=True, exist_ok=True)
    cmd = [
        "mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
        f"-DoutputDirectory={JARS}", "-DincludeScope=runtime",
    ]
    print("kafka: resolving broker jars from Maven Central ...", flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise BrokerError(f"mvn could not resolve the Kafka broker:\n{result.stdout}{result.stderr}")
    marker.write_text("ok\n")
    return JARS


def _java(main: str, *args: str, log4j: Path) -> list[str]:
    return [
        "java", "-Xms256m", "-Xmx1g", "-XX:+UseG1GC", "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={log4j}",
        "-cp", str(JARS / "*"), main, *args,
    ]


def answers(port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _read_pid(workdir: Path) -> int | None:
    pid_file = workdir / "broker.pid"
    if not pid_file.exists():
        return None
    try:
        pid = int(pid_file.read_text().strip())
    except ValueError:
        return None
    return pid if _pid_alive(pid) else None


def up(port: int = DEFAULT_PORT, workdir: Path | None = None, wait_s: float = 120.0) -> str:
    """Starts the broker unless it already runs; returns its bootstrap servers string."""
    workdir = Path(workdir or CACHE / "kafka" / str(port))
    bootstrap = f"127.0.0.1:{port}"
    if _read_pid(workdir) and answers(port):
        return bootstrap
    if answers(port):
        raise BrokerError(
            f"port {port} on 127.0.0.1 is taken by a process this script did not start; "
            "stop it or choose another port with LASTAGENT_KAFKA_PORT"
        )
    resolve_jars()
    workdir.mkdir(parents=True, exist_ok=True)
    log_dir = workdir / "data"
    props = workdir / "server.properties"
    log4j = workdir / "log4j2.properties"
    server_log = workdir / "server.log"
    props.write_text(SERVER_PROPERTIES.format(
        port=port, controller_port=port + 1, log_dir=log_dir, txn_max=TRANSACTION_MAX_TIMEOUT_MS,
    ))
    log4j.write_text(LOG4J2.format(log_file=server_log))
    if not (log_dir / "meta.properties").exists():
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        fmt = subprocess.run(
            _java("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props),
                  "--ignore-formatted", log4j=log4j),
            capture_output=True, text=True,
        )
        if fmt.returncode != 0:
            raise BrokerError(f"formatting the KRaft log dir failed:\n{fmt.stdout}{fmt.stderr}")
    with open(workdir / "stdout.log", "ab") as out:
        proc = subprocess.Popen(
            _java("kafka.Kafka", str(props), log4j=log4j),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives the caller (make kafka-up) until kafka-down
        )
    (workdir / "broker.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrokerError(
                f"the broker exited with code {proc.returncode}; see {server_log} and {workdir / 'stdout.log'}"
            )
        if answers(port) and server_log.exists() and "Kafka Server started" in server_log.read_text(
            errors="replace"
        ):
            return bootstrap
        time.sleep(0.3)
    down(port, workdir)
    raise BrokerError(f"the broker did not start within {wait_s:.0f}s; see {server_log}")


def down(port: int = DEFAULT_PORT, workdir: Path | None = None, wait_s: float = 30.0) -> None:
    """Stops the broker started in workdir, by its pid; does nothing if none runs."""
    workdir = Path(workdir or CACHE / "kafka" / str(port))
    pid = _read_pid(workdir)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    (workdir / "broker.pid").unlink(missing_ok=True)


def kill(port: int = DEFAULT_PORT, workdir: Path | None = None) -> None:
    """SIGKILLs the broker (for crash tests); its log dir stays for a restart."""
    workdir = Path(workdir or CACHE / "kafka" / str(port))
    pid = _read_pid(workdir)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
        while _pid_alive(pid):
            time.sleep(0.05)
    (workdir / "broker.pid").unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "resolve"])
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = args.dir or CACHE / "kafka" / str(args.port)
    try:
        if args.command == "resolve":
            print(f"kafka: jars in {resolve_jars()}")
        elif args.command == "up":
            print(f"kafka: broker answers at {up(args.port, workdir)} (pid {_read_pid(workdir)})")
        elif args.command == "down":
            down(args.port, workdir)
            print("kafka: broker stopped")
        else:
            pid = _read_pid(workdir)
            running = pid is not None and answers(args.port)
            print(f"kafka: {'running, pid ' + str(pid) if running else 'not running'} on 127.0.0.1:{args.port}")
            return 0 if running else 1
    except BrokerError as exc:
        print(f"kafka: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
