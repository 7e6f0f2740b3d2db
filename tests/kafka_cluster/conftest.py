"""A replicated Kafka cluster on 127.0.0.1 (``dev/kafka_broker.py``'s :class:`Cluster`): three KRaft
nodes, each broker and controller, replication factor 3 everywhere, ``min.insync.replicas=2``.

One cluster per session, on six free ports in a row; the tests stop, kill and restart its nodes and
leave every node running and in sync when they end (:func:`in_sync`).
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Iterator

import kafka_broker
import pytest
from support import cluster_admin, in_sync


def _free_ports(count: int) -> int:
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


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kafka_broker.Cluster]:
    cluster = kafka_broker.Cluster(_free_ports(2 * kafka_broker.CLUSTER_NODES), tmp_path_factory.mktemp("kafka-cluster"))
    cluster.up()
    try:
        in_sync(cluster)
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def cluster_topic(kafka_cluster: kafka_broker.Cluster) -> Callable[..., str]:
    """Creates a topic with a replica on every node: ``cluster_topic(partitions=1)``."""
    from kafka.admin import NewTopic

    def make(partitions: int = 1, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        admin = cluster_admin(kafka_cluster.bootstrap)
        try:
            admin.create_topics([NewTopic(name, partitions, len(kafka_cluster.nodes))])
        finally:
            admin.close()
        return name

    return make
