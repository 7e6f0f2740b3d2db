"""The broker is SIGKILLed and restarted mid-epoch: prepared branches survive it, the decision
completes after it, and every record arrives once."""

from __future__ import annotations

import time
import uuid

import kafka_broker
import pytest
from conftest import _free_port_pair
from kafka.admin import KafkaAdminClient, NewTopic
from support import read_committed

from lastagent import faults
from lastagent.core.arbitration import InMemoryArbitrationStore
from lastagent.errors import KafkaUnavailableError
from lastagent.kafka.branch import BranchWriter
from lastagent.kafka.xa import KafkaXAResource
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions
from lastagent.sinks.link_ports import link_committer

pytestmark = pytest.mark.chaos


@pytest.fixture
def own_broker(tmp_path):
    port = _free_port_pair()
    workdir = tmp_path / "kafka"
    bootstrap = kafka_broker.up(port, workdir)
    yield port, workdir, bootstrap
    kafka_broker.down(port, workdir)


def _wait_for_broker(bootstrap: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            KafkaAdminClient(bootstrap_servers=bootstrap).list_topics()
            return
        except Exception:  # retried until the deadline
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _prepare(options: KafkaSinkOptions, topic: str, generation: int) -> list:
    handles = []
    for branch in range(3):
        w = BranchWriter(options.client_config, options.transactional_id(generation, branch, 0),
                         options.transaction_timeout_ms)
        for i in range(20):
            w.send(topic, f"{branch}-{i}".encode(), partition=i % 2)
        handles.append(w.prepare())
    return handles


@pytest.fixture
def link(own_broker, tmp_path):
    port, workdir, bootstrap = own_broker
    topic = f"restart-{uuid.uuid4().hex[:6]}"
    KafkaAdminClient(bootstrap_servers=bootstrap).create_topics([NewTopic(topic, 2, 1)])
    # Calls give up after 5 s of retrying (the Java client's default.api.timeout.ms, 60 s by default):
    # the broker stays down for the tests' failing steps.
    options = KafkaSinkOptions.parse({"kafka.bootstrap.servers": bootstrap, "link": "restart",
                                      "arbitrationTable": str(tmp_path / "arb"), "checkpointLocation": "-",
                                      "kafka.default.api.timeout.ms": "5000"})
    store = InMemoryArbitrationStore()
    store.claim("restart", "q")
    return options, store, topic


def _expected() -> list[bytes]:
    return sorted(f"{b}-{i}".encode() for b in range(3) for i in range(20))


def test_prepared_branches_survive_a_broker_kill_between_decision_and_phase_2(own_broker, link):
    port, workdir, bootstrap = own_broker
    options, store, topic = link
    handles = _prepare(options, topic, 1)

    def kill_after_the_decision(name: str) -> None:
        if name == "after_arbitration":
            kafka_broker.kill(port, workdir)

    faults.install(kill_after_the_decision)
    try:
        with link_committer(options, store=store) as committer, pytest.raises(KafkaUnavailableError):
            committer.commit(0, 1, handles)  # decided, but phase 2 cannot reach Kafka
    finally:
        faults.install(None)
    assert store.get("restart", 0) is not None

    kafka_broker.up(port, workdir)
    _wait_for_broker(bootstrap)
    with link_committer(options, store=store) as committer:
        committer.start(owner="q")  # recovery commits the decided epoch's open branches
        assert committer.in_doubt() == []
    assert sorted(v for _, v in read_committed(bootstrap, topic, 60)) == _expected()


def test_a_broker_down_before_the_decision_decides_nothing_and_the_replay_writes_once(own_broker, link):
    """Whether the branches still exist cannot be known with the broker away: nothing is decided, the
    prepared branches survive the kill, the replay's commit rolls them back, and the replayed epoch writes once."""
    port, workdir, bootstrap = own_broker
    options, store, topic = link
    handles = _prepare(options, topic, 1)
    kafka_broker.kill(port, workdir)  # mid-epoch: prepared, not decided
    with link_committer(options, store=store) as committer, pytest.raises(KafkaUnavailableError):
        committer.commit(0, 1, handles)
    assert store.get("restart", 0) is None

    kafka_broker.up(port, workdir)
    _wait_for_broker(bootstrap)
    with KafkaXAResource(options.client_config) as xa:
        assert sorted(t.transactional_id for t in xa.recover(options.id_prefix)) == sorted(
            h.transactional_id for h in handles)  # they survived the kill, still open
    with link_committer(options, store=store) as committer:
        assert committer.start(owner="q")[1] == -1  # nothing decided; an earlier run's branches stay for now
        ownership = store.claim("restart", "q", run="run-2")  # the replay's first task claims the link
        committer.commit(0, ownership.generation, _prepare(options, topic, ownership.generation))  # Spark's replay
        assert committer.in_doubt() == []  # presumed abort: the first run's branches were rolled back
    assert sorted(v for _, v in read_committed(bootstrap, topic, 60)) == _expected()
