"""Every Kafka broker users run: 3.9 (transaction protocol 1) to the newest 4.x (protocol 2, KIP-890).

On each version, 3.9.1, 4.0.1, 4.2.1, 4.3.1 and 4.4.0 (``make test-kafka-versions``; KAFKA_VERSIONS="3.9.1 4.4.0"
runs those only; .ci/run runs part 1 on the oldest and the newest), a single KRaft
broker of that release, its jars resolved from Maven Central by ``dev/kafka_broker.py --kafka-version``:

1. every link and the epoch block as four queries of one application (``python -m lastagent.examples
   every-link-driver``): Delta -> ``lastagent-kafka``, Kafka -> ``lastagent-kafka``, Kafka -> ``lastagent-delta``
   with dead letters and a side topic, and a ``lastagent.epoch`` MERGE with one event per change. The driver is
   SIGKILLed right after a decision (decided, branches open, not in Spark's commit log), then restarted to the
   end. Every record once in every output (a read_committed consumer, Spark's Delta reader), the MERGE table the
   last change per key, no transaction of any link left open;
2. the producer-epoch limit: the transactional ids of a Kafka -> Kafka link's first two runs are driven to a few
   bumps below 32,767 before the query starts (InitProducerId, as a producer's restarts would); the first run is
   SIGKILLed after a decision before its id reaches the limit, the second runs past it (the coordinator gives the
   id a new producer id) and is SIGKILLed after a decision there, then a third run goes to the end: every record
   once, nothing open, ``lastagent status`` clean, and the second run's id has a new producer id.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import kafka_broker  # dev/, on sys.path by tests/conftest.py
import pytest
import support
from support import produce_changes, read_committed

from lastagent.core import xid
from lastagent.kafka.xa import KafkaXAResource

pytestmark = pytest.mark.kafka_versions

#: The oldest 3.x users still run (protocol 1), 4.0 (the first without ZooKeeper), 4.2, 4.3 and the newest release.
VERSIONS = ["3.9.1", "4.0.1", "4.2.1", "4.3.1", "4.4.0"]
_ONLY = os.environ.get("LASTAGENT_KAFKA_VERSIONS", "").split()
ROWS, POISON, PER_TRIGGER = 200, {41, 152}, "50"
KEYS, CHANGES = 20, 200
#: Kafka's producer epoch is a 16-bit signed number: at this value the coordinator gives the id a new producer id.
EPOCH_LIMIT = 32_767


@pytest.fixture(scope="module", params=_ONLY or VERSIONS)
def broker(request, tmp_path_factory) -> tuple[str, str]:
    """(version, bootstrap) of a broker of that Kafka release, started for this module and stopped after it."""
    version = request.param
    port = support.free_ports(2)
    workdir = tmp_path_factory.mktemp(f"kafka-{version}")
    bootstrap = kafka_broker.up(port, workdir, version=version)
    try:
        yield version, bootstrap
    finally:
        kafka_broker.down(port, workdir)


def _topic(bootstrap: str, partitions: int = 2, prefix: str = "t") -> str:
    from kafka.admin import KafkaAdminClient, NewTopic

    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        admin.close()
    return name


def _once(counts: Counter, expected, what: str) -> None:
    expected = list(expected)
    assert sorted(counts) == expected, f"{what}: lost {sorted(set(expected) - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"{what}: twice {[k for k, c in counts.items() if c > 1][:10]}"


def test_every_link_and_the_block_killed_and_restarted(broker, spark, tmp_path):
    from confluent_kafka import Producer

    version, bootstrap = broker
    source = str(tmp_path / "source")
    for f in range(2):
        (spark.range(f * 100, (f + 1) * 100, numPartitions=1)
         .selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
         .write.format("delta").mode("append").save(source))
    orders = _topic(bootstrap)
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(ROWS):
        producer.produce(orders, key=str(i).encode(),
                         value=(f"poison-{i}" if i in POISON else f"order-1-{i}").encode(), partition=i % 2)
    assert producer.flush(30) == 0
    changes, events = _topic(bootstrap), _topic(bootstrap, prefix="events")
    produce_changes(bootstrap, changes, CHANGES, KEYS)
    sink_topic, copy_topic, dead, side = _topic(bootstrap), _topic(bootstrap), _topic(bootstrap, 1), _topic(bootstrap)
    link, base = f"v{version.replace('.', '')}-{uuid.uuid4().hex[:6]}", tmp_path / "links"
    spark.sql(f"CREATE TABLE delta.`{base / 'merged'}` (id BIGINT, amount BIGINT) USING delta")
    args = [bootstrap, str(base), link, source, orders, sink_topic, copy_topic, dead, side, changes, events,
            PER_TRIGGER]

    state = tmp_path / "killed"
    code = support.run_driver("every-link-driver", args, "after_arbitration:3", state)
    assert code == -signal.SIGKILL, f"Kafka {version}: the driver was not killed after a decision (exit {code}); " \
                                    f"see {state}.log"
    assert support.run_driver("every-link-driver", args, None, tmp_path / "restart") == 0, \
        f"Kafka {version}: the restart failed; see {tmp_path / 'restart.log'}"

    _once(Counter(int(v) for _, v in read_committed(bootstrap, sink_topic, 200)), range(200), "Delta -> Kafka")
    _once(Counter(int(k) for k, _ in read_committed(bootstrap, copy_topic, ROWS)), range(ROWS), "Kafka -> Kafka")
    good = [i for i in range(ROWS) if i not in POISON]
    _once(Counter(int(r.key) for r in spark.read.format("delta").load(str(base / "orders")).select("key").collect()),
          good, "Kafka -> Delta")
    _once(Counter(int(json.loads(v)["key"]) for _, v in read_committed(bootstrap, side, len(good))), good, "side")
    _once(Counter(int(k) for k, _ in read_committed(bootstrap, dead, len(POISON))), sorted(POISON), "dead letters")
    merged = {r.id: r.amount for r in spark.read.format("delta").load(str(base / "merged")).collect()}
    assert merged == {k: max(i for i in range(CHANGES) if i % KEYS == k) for k in range(KEYS)}, "the MERGE table"
    _once(Counter(json.loads(v)["amount"] for _, v in read_committed(bootstrap, events, CHANGES)), range(CHANGES),
          "the block's events")
    with KafkaXAResource({"bootstrap.servers": bootstrap}) as xa:
        for name in ("sink", "copy", "delta", "merge"):
            assert xa.recover(xid.id_prefix(f"{link}-{name}")) == [], f"open transactions of {link}-{name}"


def _init_producer_id(admin, tid: str, producer_id: int, epoch: int) -> tuple[int, int]:
    from kafka.protocol.producer.transaction import InitProducerIdRequest

    from lastagent.kafka import internals

    r = internals.send_to_transaction_coordinator(admin, tid, InitProducerIdRequest(
        transactional_id=tid, transaction_timeout_ms=60_000, producer_id=producer_id, producer_epoch=epoch))
    if r.error_code:
        from kafka import errors as kafka_errors

        raise kafka_errors.for_code(r.error_code)(f"InitProducerId for {tid}")
    return r.producer_id, r.producer_epoch


def _drive(bootstrap: str, tid: str, to_epoch: int) -> int:
    """Bumps ``tid``'s producer epoch to ``to_epoch`` with InitProducerId (each call fences the last); its producer id."""
    from kafka import errors as kafka_errors
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        # A new broker makes its transaction log at the first FindCoordinator: retried while it comes up (bounded).
        deadline = time.monotonic() + 60
        while True:
            try:
                pid, epoch = _init_producer_id(admin, tid, -1, -1)
                break
            except kafka_errors.KafkaError as exc:
                if not exc.retriable or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        for _ in range(to_epoch):  # every call moves the epoch up by one, so this many are enough
            if epoch >= to_epoch:
                return pid
            pid, epoch = _init_producer_id(admin, tid, pid, epoch)
        assert epoch >= to_epoch, f"{tid}: producer epoch {epoch} after {to_epoch} InitProducerId calls"
        return pid
    finally:
        admin.close()


def test_a_transactional_id_past_the_producer_epoch_limit(broker, tmp_path):
    """Two runs' transactional ids (generations 1 and 2, task 0) driven to 6 bumps below the limit, in parallel;
    the first run is SIGKILLed after its second decision, before its id crossed the limit (the restart ends that
    branch across nothing); the second crosses it and is SIGKILLed after its 12th decision, its open branches
    under the new producer id, so its restart ends those; a third run to the end. Every record once, nothing open,
    `lastagent status` clean, and the second run's id has a new producer id."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from confluent_kafka import Producer

    version, bootstrap = broker
    source, out = _topic(bootstrap, 1), _topic(bootstrap, 1)
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(150):
        producer.produce(source, key=str(i).encode(), value=str(i).encode())
    assert producer.flush(30) == 0
    link = f"epochs-{uuid.uuid4().hex[:6]}"
    ids = [xid.transactional_id(link, generation, 0, 0) for generation in (1, 2)]  # the first two runs' task 0
    with ThreadPoolExecutor(2) as pool:
        driven = list(pool.map(lambda tid: _drive(bootstrap, tid, EPOCH_LIMIT - 6), ids))
    # Epochs of 5 records: each costs the id one or two producer-epoch bumps, so the limit falls among the first few.
    args = [bootstrap, source, str(tmp_path / "ckpt"), str(tmp_path / "arb"), link, out, "5"]
    for run, point in enumerate(("after_arbitration:1", "after_arbitration:14")):
        state = tmp_path / f"killed-{run}"
        code = support.run_driver("kafka-driver", args, point, state)
        assert code == -signal.SIGKILL, f"Kafka {version}: run {run + 1} not killed (exit {code}); see {state}.log"
        assert Path(f"{state}.fired").read_text() == "after_arbitration"
    assert support.run_driver("kafka-driver", args, None, tmp_path / "restart") == 0, \
        f"Kafka {version}: the restart failed; see {tmp_path / 'restart.log'}"
    _once(Counter(int(k) for k, _ in read_committed(bootstrap, out, 150)), range(150), "past the epoch limit")
    with KafkaXAResource({"bootstrap.servers": bootstrap}) as xa:
        assert xa.recover(xid.id_prefix(link)) == []
    status = subprocess.run([sys.executable, "-m", "lastagent.cli", "status", "--link", link, "--arbitration-table",
                             str(tmp_path / "arb"), "--bootstrap-servers", bootstrap, "--json"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert status.returncode == 0 and json.loads(status.stdout)["in_doubt"] == [], status.stdout + status.stderr
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        now = {tid: d.producer_id for tid, d in admin.describe_transactions(ids).items()}  # asks, bumps nothing
    finally:
        admin.close()
    assert now[ids[1]] != driven[1], f"Kafka {version}: {ids[1]} kept producer id {driven[1]}: the second run " \
                                     "never crossed the epoch limit"
