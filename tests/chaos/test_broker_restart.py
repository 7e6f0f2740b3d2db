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

from lastagent.arbitration import InMemoryArbitrationStore
from lastagent.committer import Committer
from lastagent.errors import KafkaProtocolError
from lastagent.kafka_xa import BranchWriter
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions

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
        except Exception:  # noqa: BLE001 — retried until the deadline
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def test_prepared_branches_survive_a_broker_kill(own_broker, tmp_path):
    port, workdir, bootstrap = own_broker
    topic = f"restart-{uuid.uuid4().hex[:6]}"
    KafkaAdminClient(bootstrap_servers=bootstrap).create_topics([NewTopic(topic, 2, 1)])
    options = KafkaSinkOptions.parse({"kafka.bootstrap.servers": bootstrap, "link": "restart",
                                      "arbitrationTable": str(tmp_path / "arb"), "checkpointLocation": "-"})
    handles = []
    for branch in range(3):
        w = BranchWriter(options.client_config, options.transactional_id(1, branch, 0), options.transaction_timeout_ms)
        for i in range(20):
            w.send(topic, f"{branch}-{i}".encode(), partition=i % 2)
        handles.append(w.prepare())

    kafka_broker.kill(port, workdir)  # mid-epoch: prepared, not decided
    store = InMemoryArbitrationStore()
    store.claim("restart", "q")
    with Committer(options, store=store) as committer:
        committer.xa._end_deadline_s = 5  # noqa: SLF001 — fail fast while the broker is down
        with pytest.raises(KafkaProtocolError):
            committer.commit(0, 1, handles)  # decided (the store is up) but phase 2 cannot reach Kafka
    assert store.get("restart", 0) is not None

    kafka_broker.up(port, workdir)
    _wait_for_broker(bootstrap)
    with Committer(options, store=store) as committer:
        committer.start(owner="q")  # recovery commits the decided epoch's open branches
        assert committer.in_doubt() == []
    values = sorted(v for _, v in read_committed(bootstrap, topic, 60))
    assert values == sorted(f"{b}-{i}".encode() for b in range(3) for i in range(20))
