"""The driver's Kafka calls answer while a node is away, on a client that knew it.

Each call's client connects while every node runs (its metadata lists them all), then a node goes
away. Before the calls were retried on a new client, the broker settings were read from the first
broker of the cluster's list (node 1), recovery listed transactions on every broker its metadata
named, and phase 2's ``EndTxn`` went to a coordinator that had died: each failed at once
(``UnknownBrokerIdError``, ``NodeNotReadyError``, a reset connection).
"""

from __future__ import annotations

import uuid

import pytest
from support import in_sync, read_committed

from lastagent import faults
from lastagent.core.arbitration import InMemoryArbitrationStore
from lastagent.core.kafka_port import EndOutcome
from lastagent.kafka.branch import BranchWriter
from lastagent.kafka.xa import KafkaXAResource
from lastagent.sinks.kafka_sink_options import KafkaSinkOptions
from lastagent.sinks.link_ports import link_committer

pytestmark = pytest.mark.kafka_cluster


def _branch(bootstrap: str, topic: str, tid: str, records: int = 10):
    writer = BranchWriter({"bootstrap.servers": bootstrap}, tid, 600_000)
    for i in range(records):
        writer.send(topic, f"{tid}-{i}".encode(), partition=i % 2)
    return writer.prepare()


def test_settings_topics_recovery_and_phase_2_answer_while_node_1_is_away(kafka_cluster, cluster_topic):
    bootstrap, topic = kafka_cluster.bootstrap, cluster_topic(2)
    prefix = f"lastagent-away-{uuid.uuid4().hex[:6]}-"
    handle = _branch(bootstrap, topic, f"{prefix}1-0-0")
    with KafkaXAResource({"bootstrap.servers": bootstrap}) as xa:
        assert xa.transaction_protocol() >= 1  # connected, every node in its metadata
        kafka_cluster.stop(1)
        try:
            assert xa.broker_max_timeout_ms() == 3_600_000
            assert xa.missing_topics([topic]) == []
            assert [t.transactional_id for t in xa.recover(prefix)] == [handle.transactional_id]
            assert xa.commit(handle).outcome is EndOutcome.COMMITTED
            assert xa.recover(prefix) == []
        finally:
            kafka_cluster.start(1)
            in_sync(kafka_cluster)
    assert len(read_committed(bootstrap, topic, handle.records, 60)) == handle.records


def test_phase_2_rides_through_the_coordinator_killed_after_the_decision(kafka_cluster, cluster_topic, tmp_path):
    """The node coordinating the branches dies right after the last agent's decision: phase 2 waits for
    the coordinator to move (the broker is fenced after its session timeout) and commits every branch."""
    from kafka.admin import KafkaAdminClient

    bootstrap, topic = kafka_cluster.bootstrap, cluster_topic(2)
    link = f"coord-{uuid.uuid4().hex[:6]}"
    options = KafkaSinkOptions.parse({"kafka.bootstrap.servers": bootstrap, "link": link,
                                      "arbitrationTable": str(tmp_path / "arb"), "checkpointLocation": "-"})
    store = InMemoryArbitrationStore()
    generation = store.claim(link, "q").generation
    handles = [_branch(bootstrap, topic, options.transactional_id(generation, task, 0)) for task in range(3)]
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        coordinator = admin.describe_transactions([handles[0].transactional_id])[handles[0].transactional_id].coordinator_id
    finally:
        admin.close()
    killed = []

    def kill_the_coordinator(name: str) -> None:
        if name == "after_arbitration" and not killed:
            kafka_cluster.kill(coordinator)
            killed.append(coordinator)

    faults.install(kill_the_coordinator)
    try:
        with link_committer(options, store=store) as committer:
            committer.commit(0, generation, handles)  # decided, then phase 2 through the failover
            assert killed == [coordinator]
            assert committer.in_doubt() == []
    finally:
        faults.install(None)
        kafka_cluster.start(coordinator)
        in_sync(kafka_cluster)
    assert len(read_committed(bootstrap, topic, 30, 60)) == 30
