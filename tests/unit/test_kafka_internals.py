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
