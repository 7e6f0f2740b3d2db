"""The kafka-python internals phase 2 sends EndTxn through are there, with the signatures used.

An upgrade of kafka-python that renames or reshapes them fails here, and at query start
(``kafka_internals.require``), never in a commit after a decision.
"""

from __future__ import annotations

import pytest

from lastagent.errors import LastAgentError
from lastagent.kafka import internals as kafka_internals

pytestmark = pytest.mark.unit


def test_the_installed_kafka_python_has_every_internal_phase_2_uses():
    assert kafka_internals.missing() == []
    kafka_internals.require()


def test_a_kafka_python_without_them_is_refused_naming_what_is_missing(monkeypatch):
    from kafka.admin import KafkaAdminClient
    from kafka.net.manager import KafkaConnectionManager

    monkeypatch.delattr(KafkaAdminClient, "_find_coordinator_id")

    def send(self, request):  # node_id gone
        raise AssertionError("not called")

    monkeypatch.setattr(KafkaConnectionManager, "send", send)
    monkeypatch.setattr(kafka_internals, "_checked", False)
    assert kafka_internals.missing() == ["KafkaAdminClient._find_coordinator_id(key, key_type=...) as a coroutine",
                                         "KafkaConnectionManager.send(request, node_id=...)"]
    with pytest.raises(LastAgentError, match=r"lacks what lastagent uses to end transactions .*kafka-python==3\.0\.12"):
        kafka_internals.require()


@pytest.mark.parametrize("release, expected", [
    ((2, 8), "does not support DescribeTransactions, ListTransactions"),  # before 3.0: refused, naming the release
    ((3, 9), 1), ((4, 3), 1)])  # no transaction.version feature given below: protocol 1
def test_the_transaction_protocol_is_read_from_the_brokers_api_versions(monkeypatch, release, expected):
    """Without I/O: the API versions a broker of each release answers (kafka-python's table of them), plus a key
    newer than any release kafka-python knows, which is ignored."""
    from kafka.protocol.broker_version_data import BROKER_API_VERSIONS

    from lastagent.errors import KafkaProtocolError
    from lastagent.kafka.wire import TransactionCoordinatorClient

    versions = {**BROKER_API_VERSIONS[release], 93: (0, 0)}
    client = TransactionCoordinatorClient({"bootstrap.servers": "b:9092"})
    monkeypatch.setattr(client, "call", lambda what, request: (versions, {}))
    if isinstance(expected, int):
        assert client.transaction_protocol() == expected
        return
    with pytest.raises(KafkaProtocolError) as refused:
        client.transaction_protocol()
    assert str(refused.value) == (f"the broker at b:9092 (Kafka 2.8 or similar) {expected}: lastagent finishes and "
                                  "recovers transactions from outside the producer and needs Apache Kafka 3.0 or newer")


def test_transaction_version_2_means_protocol_2(monkeypatch):
    from kafka.protocol.broker_version_data import BROKER_API_VERSIONS

    from lastagent.kafka.wire import TransactionCoordinatorClient

    client = TransactionCoordinatorClient({"bootstrap.servers": "b:9092"})
    versions = dict(BROKER_API_VERSIONS[(4, 3)])
    monkeypatch.setattr(client, "call", lambda what, request: (versions, {"transaction.version": (0, 2)}))
    assert client.transaction_protocol() == 2
