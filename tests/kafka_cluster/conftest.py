"""A replicated Kafka cluster on 127.0.0.1 (``dev/kafka_broker.py``'s :class:`Cluster`): three KRaft
nodes, each broker and controller, replication factor 3 everywhere, ``min.insync.replicas=2``.

One cluster per session, on six free ports in a row; the tests stop, kill and restart its nodes. Each
test starts on the whole cluster, running and in sync (:func:`whole_cluster`), even when the test before
failed half-way through a fault and left a node down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import kafka_broker
import pytest
from support import free_ports, in_sync, replicated_topic


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kafka_broker.Cluster]:
    cluster = kafka_broker.Cluster(free_ports(2 * kafka_broker.CLUSTER_NODES), tmp_path_factory.mktemp("kafka-cluster"))
    cluster.up()
    try:
        in_sync(cluster)
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(autouse=True)
def whole_cluster(kafka_cluster: kafka_broker.Cluster) -> None:
    """Starts any node a failed test left down, and waits until every partition is in sync."""
    kafka_cluster.up()
    in_sync(kafka_cluster)


@pytest.fixture
def cluster_topic(kafka_cluster: kafka_broker.Cluster) -> Callable[..., str]:
    """Creates a topic with a replica on every node: ``cluster_topic(partitions=1)``."""

    def make(partitions: int = 1, prefix: str = "t") -> str:
        return replicated_topic(kafka_cluster, partitions, prefix)

    return make
