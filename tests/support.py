"""Helpers shared by the integration and chaos tests (not fixtures)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer


def read_committed(bootstrap: str, topic: str, expect: int, timeout_s: float = 30.0,
                   quiet_s: float = 2.0, config: dict[str, Any] | None = None) -> list[tuple[bytes | None, bytes | None]]:
    """(key, value) of every record an independent read_committed consumer sees in topic.

    Reads until ``expect`` records arrived, then ``quiet_s`` longer to catch duplicates; gives
    up after ``timeout_s`` and returns what it has (the caller's assertion shows the gap).
    ``config`` adds librdkafka settings (a secured broker's).
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"verify-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                         "enable.auto.commit": False, **(config or {})})
    consumer.subscribe([topic])
    rows: list[tuple[bytes | None, bytes | None]] = []
    deadline = time.monotonic() + timeout_s
    quiet_until: float | None = None
    try:
        while time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.2):
                if msg.error() is None:
                    rows.append((msg.key(), msg.value()))
            if len(rows) >= expect:
                quiet_until = quiet_until or time.monotonic() + quiet_s
                if time.monotonic() > quiet_until:
                    break
    finally:
        consumer.close()
    return rows


#: Spark settings users have that differ from our test session's defaults.
DAEMON_OFF = {"spark.python.use.daemon": "false"}
#: The driver sessions crash tests run in: name -> extra Spark settings.
SESSIONS: dict[str, dict[str, str] | None] = {"daemon-on": None, "daemon-off": DAEMON_OFF}
#: Set by ``make test-chaos-full``: every crash point in every session (the default run spreads the
#: points over the sessions, to stay within the test budget).
FULL = os.environ.get("LASTAGENT_CHAOS_FULL") == "1"


def produce_changes(bootstrap: str, topic: str, changes: int, keys: int) -> None:
    """Change records to a 2-partition topic: change i sets key ``i % keys`` to amount i (JSON ``{"id", "amount"}``),
    so the last change per key is the oracle of a MERGE."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(changes):
        producer.produce(topic, key=str(i % keys).encode(), value=json.dumps({"id": i % keys, "amount": i}).encode(),
                         partition=i % 2)
    assert producer.flush(30) == 0


def sessions_for(points: list[str]) -> list[tuple[str, str]]:
    """(point, session) pairs: each point in every session when FULL, else in alternating sessions."""
    names = sorted(SESSIONS)
    if FULL:
        return [(p, n) for p in points for n in names]
    return [(p, names[i % len(names)]) for i, p in enumerate(points)]


def sessions(default: str) -> list[str]:
    """Every session when FULL, else ``default`` only."""
    return sorted(SESSIONS) if FULL else [default]


def race(fn: Callable[[str], Any], names: Sequence[str]) -> dict[str, Any]:
    """Runs ``fn(name)`` for every name in threads released together; {name: result or exception}."""
    barrier = threading.Barrier(len(names))
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        barrier.wait()
        try:
            results[name] = fn(name)
        except Exception as exc:  # handed to the test, which asserts on it
            results[name] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def start_driver(mode: str, args: list[str], crash_at: str | None, state: Path, master: str = "local[2]",
                 conf: dict[str, str] | None = None, kafka_config: Path | None = None,
                 storage_config: Path | None = None) -> subprocess.Popen:
    """Starts ``python -m lastagent.examples <mode> <args>`` as a driver process; returns it, running.

    With ``crash_at`` (``point`` or ``point:n``) the driver SIGKILLs its own process group (driver,
    JVM, Python workers) at that protocol point; ``state`` counts how often points were reached
    and ``<state>.fired`` names the point that fired. The driver leads a new session so the kill
    takes exactly its processes; its stderr goes to ``<state>.log``. ``conf`` adds Spark settings;
    ``kafka_config`` is a properties file of Kafka client settings (a secured broker's);
    ``storage_config`` one of storage settings (an object store's), given to the sinks as ``storage.*``.
    """
    env = dict(os.environ, LASTAGENT_SPARK_MASTER=master,
               LASTAGENT_SPARK_CONF=";".join(f"{k}={v}" for k, v in (conf or {}).items()))
    env.pop("LASTAGENT_CRASH_AT", None)
    for variable, path in (("LASTAGENT_KAFKA_CONFIG", kafka_config), ("LASTAGENT_STORAGE_CONFIG", storage_config)):
        env.pop(variable, None)
        if path is not None:
            env[variable] = str(path)
    if crash_at:
        env["LASTAGENT_CRASH_AT"] = crash_at
        env["LASTAGENT_CRASH_STATE"] = str(state)
    # The crash hook (tests/crashhook) is on PYTHONPATH of the driver, its JVM and Spark's workers.
    hook = str(Path(__file__).resolve().parent / "crashhook")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (hook, env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([sys.executable, "-m", "lastagent.examples", mode, *args], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(state.with_suffix(".log"), "ab"))


def run_driver(mode: str, args: list[str], crash_at: str | None, state: Path, timeout: float = 300,
               **kw: Any) -> int:
    """:func:`start_driver`, waited for; returns its exit code (the process group is killed at ``timeout``)."""
    proc = start_driver(mode, args, crash_at, state, **kw)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def orders_topic(admin: Any, bootstrap: str, rows: int, poison: set[int]) -> str:
    """A new topic of ``rows`` records over 2 partitions: ``order-1-<i>``, and ``poison-<i>`` for ``i`` in
    ``poison`` (records the example transformer rejects); key ``<i>``."""
    from confluent_kafka import Producer
    from kafka.admin import NewTopic

    topic = f"orders-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, 2, 1)])
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(rows):
        value = f"poison-{i}" if i in poison else f"order-1-{i}"
        producer.produce(topic, key=str(i).encode(), value=value.encode(), partition=i % 2)
    assert producer.flush(30) == 0
    return topic


# --- a replicated Kafka cluster (tests/kafka_cluster) ---------------------------------------------


def free_ports(count: int) -> int:
    """A port p with p .. p+count-1 all free on 127.0.0.1."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65000:
            continue
        try:
            for offset in range(count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base


def cluster_admin(bootstrap: str) -> Any:
    from kafka.admin import KafkaAdminClient

    return KafkaAdminClient(bootstrap_servers=bootstrap, client_id="lastagent-cluster-tests", request_timeout_ms=10_000)


def replicated_topic(cluster: Any, partitions: int = 1, prefix: str = "t") -> str:
    """A new topic with a replica on every node of the cluster; its name."""
    from kafka.admin import NewTopic
    from kafka.errors import NodeNotReadyError, UnknownBrokerIdError

    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    deadline = time.monotonic() + 60
    while True:
        admin = cluster_admin(cluster.bootstrap)
        try:
            admin.create_topics([NewTopic(name, partitions, len(cluster.nodes))])
            return name
        except (UnknownBrokerIdError, NodeNotReadyError):
            # A new cluster names its controller before every node is in the metadata it gives out.
            if time.monotonic() > deadline:
                raise
        finally:
            admin.close()
        time.sleep(0.5)


def in_sync(cluster: Any, timeout_s: float = 240.0) -> None:
    """Waits until every node runs, the cluster lists every broker and every partition (the internal
    topics' too) has all its replicas in sync: what an operator waits for between two restarts."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            admin = cluster_admin(cluster.bootstrap)
            try:
                brokers = {b["broker_id"] for b in admin.describe_cluster()["brokers"] if not b.get("is_fenced")}
                lagging = [f"{t['name']}-{p['partition_index']} isr {sorted(p['isr_nodes'])}"
                           for t in admin.describe_topics() for p in t["partitions"]
                           if sorted(p["isr_nodes"]) != sorted(p["replica_nodes"])]
            finally:
                admin.close()
            if brokers == set(cluster.nodes) and not lagging:
                return
            last = f"brokers {sorted(brokers)}, out of sync: {lagging[:5]}"
        except Exception as exc:  # a node may still be starting; asked again until the deadline
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(1)
    raise AssertionError(f"the cluster did not get back in sync within {timeout_s:.0f}s: {last}")


def link_acls(link: str, *, read: tuple[str, ...] = (), write: tuple[str, ...] = ()) -> list[tuple]:
    """The ACLs docs/security.md lists for a link: (resource type, name, operations, pattern)."""
    return ([("TOPIC", t, ["READ", "DESCRIBE"], "LITERAL") for t in read]
            + [("GROUP", "lastagent-source-", ["READ"], "PREFIXED") for _ in read[:1]]
            + [("TOPIC", t, ["WRITE", "DESCRIBE"], "LITERAL") for t in write]
            + [("TRANSACTIONAL_ID", f"lastagent-{link}-", ["WRITE", "DESCRIBE"], "PREFIXED"),
               ("CLUSTER", "kafka-cluster", ["DESCRIBE_CONFIGS"], "LITERAL")])


def grant_all(grant: Callable[..., None], acls: list[tuple], principal: str = "alice") -> None:
    """Grants each of ``acls`` (from :func:`link_acls`) to ``principal`` on the secured broker."""
    for rtype, name, ops, pattern in acls:
        grant(principal, rtype, name, ops, pattern=pattern)


# Where a cluster node's Python and Java are; rustup's ~/.cargo/bin is not among them.
NO_TOOLCHAIN_PATH = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"])


def no_toolchain_env() -> dict[str, str]:
    """This process's environment without Python, virtualenv, lastagent, cargo or rustup settings, nor the tests'
    JVM options (``SPARK_SUBMIT_OPTS``), and a PATH on which neither ``cargo`` nor ``rustc`` is found (asserted, so
    that the check cannot pass by accident)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "LASTAGENT_", "VIRTUAL_ENV", "CARGO", "RUSTUP", "PYSPARK_", "SPARK_SUBMIT_"))}
    env["PATH"] = NO_TOOLCHAIN_PATH
    for tool in ("cargo", "rustc"):
        assert shutil.which(tool, path=NO_TOOLCHAIN_PATH) is None, f"{tool} is on {NO_TOOLCHAIN_PATH}: not a clean check"
    return env


def portable_wheel(arch: str | None = None) -> Path | None:
    """``dist/``'s ``manylinux_2_28`` wheel for ``arch`` (this machine's by default), or None."""
    arch = arch or platform.machine()
    wheels = sorted((Path(__file__).resolve().parents[1] / "dist").glob(f"lastagent-*-cp310-abi3-manylinux_2_28_{arch}.whl"))
    return wheels[-1] if wheels else None
