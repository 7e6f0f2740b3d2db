"""The secured test broker is really secured: SCRAM over TLS works, and everything else is refused.

Each refusal is checked for its cause (authorization, authentication, TLS), not just for a failure,
and every wait is bounded: a misconfigured client must fail fast, not hang.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

pytestmark = pytest.mark.integration

WAIT_S = 10.0


def _refused(config: dict, because: Callable[[KafkaError], bool]) -> list[KafkaError]:
    """Connects with librdkafka, which must report an error that ``because`` accepts within WAIT_S and
    get no metadata; returns the errors it reported (error_cb)."""
    errors: list[KafkaError] = []
    producer = Producer({**config, "error_cb": errors.append, "logger": logging.getLogger("librdkafka")})
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not any(because(e) for e in errors):
        producer.poll(0.1)
    assert any(because(e) for e in errors), errors
    with pytest.raises(KafkaException):  # and no metadata either
        producer.list_topics(timeout=1)
    return errors


def _kafka_python_refused(config: dict, caplog: pytest.LogCaptureFixture, *causes: str) -> None:
    """Connects with kafka-python, which must give up within 2 s, having logged one of ``causes``."""
    from kafka.admin import KafkaAdminClient
    from kafka.errors import KafkaTimeoutError

    caplog.set_level(logging.WARNING, logger="kafka")
    started = time.monotonic()
    with pytest.raises(KafkaTimeoutError):
        KafkaAdminClient(**config, bootstrap_timeout_ms=2000)
    assert time.monotonic() - started < WAIT_S
    failures = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Bootstrap connection to")]
    # The attempt the bootstrap deadline cuts short times out; every other one shows a cause.
    assert any(any(c in f for c in causes) for f in failures), failures
    assert all(any(c in f for c in causes) or "time" in f.lower() for f in failures), failures


def test_admin_creates_a_topic_over_scram_and_tls(secured_kafka, secured_admin, new_secured_topic):
    topic = new_secured_topic(partitions=2)
    assert topic in secured_admin.list_topics()
    assert secured_kafka.bootstrap.startswith("127.0.0.1:")


def test_alice_with_acls_commits_a_transaction_and_reads_it_committed(secured_kafka, new_secured_topic, grant):
    topic = new_secured_topic()
    txn_prefix = f"tx-{uuid.uuid4().hex[:8]}-"
    group = f"g-{uuid.uuid4().hex[:8]}"
    grant("alice", "TOPIC", topic, ["WRITE", "DESCRIBE", "READ"])
    grant("alice", "TRANSACTIONAL_ID", txn_prefix, ["WRITE", "DESCRIBE"], pattern="PREFIXED")
    grant("alice", "GROUP", group, "READ")
    alice = secured_kafka.librdkafka_config("alice", "alice-secret")

    producer = Producer({**alice, "transactional.id": f"{txn_prefix}1"})
    producer.init_transactions(WAIT_S)
    producer.begin_transaction()
    producer.produce(topic, b"committed", b"k")
    producer.commit_transaction(WAIT_S)
    producer.begin_transaction()
    producer.produce(topic, b"aborted", b"k")
    producer.abort_transaction(WAIT_S)
    producer.begin_transaction()
    producer.produce(topic, b"committed-2", b"k")
    producer.commit_transaction(WAIT_S)

    consumer = Consumer({**alice, "group.id": group, "isolation.level": "read_committed",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    try:
        consumer.subscribe([topic])
        values: list[bytes] = []
        deadline = time.monotonic() + WAIT_S
        while len(values) < 2 and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            values.append(msg.value())
        assert values == [b"committed", b"committed-2"]
        consumer.commit(asynchronous=False)  # needs READ on the group
    finally:
        consumer.close()


def test_bob_without_acls_is_refused_not_left_hanging(secured_kafka, new_secured_topic, grant):
    topic = new_secured_topic()
    bob = secured_kafka.librdkafka_config("bob", "bob-secret")

    reports: list[KafkaError | None] = []
    producer = Producer({**bob, "message.timeout.ms": 5000})
    producer.produce(topic, b"x", on_delivery=lambda err, _msg: reports.append(err))
    assert producer.flush(WAIT_S) == 0
    assert [e.code() if e else None for e in reports] == [KafkaError.TOPIC_AUTHORIZATION_FAILED]

    transactional = Producer({**bob, "transactional.id": f"tx-bob-{uuid.uuid4().hex[:8]}"})
    with pytest.raises(KafkaException) as refused:
        transactional.init_transactions(WAIT_S)
    assert refused.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED

    # READ on the topic is not enough to consume in a group: the group needs its own ACL.
    grant("bob", "TOPIC", topic, "READ")
    consumer = Consumer({**bob, "group.id": f"g-bob-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest"})
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + WAIT_S
        error = None
        while error is None and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            error = msg.error() if msg is not None else None
        assert error is not None and error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED
    finally:
        consumer.close()


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_a_wrong_password_fails_authentication(secured_kafka, mechanism, caplog):
    config = {**secured_kafka.librdkafka_config("alice", "not-her-password"), "sasl.mechanisms": mechanism}
    _refused(config, lambda e: e.code() == KafkaError._AUTHENTICATION and "Authentication failed" in e.str())

    config = {**secured_kafka.kafka_python_config("alice", "not-her-password"), "sasl_mechanism": mechanism}
    # kafka-python sometimes sees the broker close the connection before it reads the error
    # response (it checks for EOF first), so "socket disconnected" is the same refusal.
    _kafka_python_refused(config, caplog, "SaslAuthenticationFailedError", "socket disconnected")


def test_plain_with_the_right_password_works(secured_kafka):
    errors = []
    producer = Producer({**secured_kafka.librdkafka_config("alice"), "sasl.mechanisms": "PLAIN", "error_cb": errors.append})
    metadata = producer.list_topics(timeout=WAIT_S)  # raises unless authenticated
    assert [b.port for b in metadata.brokers.values()] == [int(secured_kafka.bootstrap.rsplit(":", 1)[1])]
    assert errors == []


def test_a_client_trusting_another_ca_fails_the_tls_handshake(secured_kafka, caplog):
    untrusting = {**secured_kafka.librdkafka_config("admin"), "ssl.ca.location": str(secured_kafka.pki["other_ca"])}
    # librdkafka reports it as _SSL or, when it sees the failure while reading, as _TRANSPORT.
    _refused(untrusting, lambda e: e.code() in (KafkaError._SSL, KafkaError._TRANSPORT) and "certificate verify failed" in e.str())

    config = {**secured_kafka.admin_config, "ssl_cafile": str(secured_kafka.pki["other_ca"])}
    _kafka_python_refused(config, caplog, "CERTIFICATE_VERIFY_FAILED")


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL", "SASL_PLAINTEXT"])
def test_a_client_skipping_tls_or_sasl_gets_no_data(secured_kafka, protocol):
    config = {"bootstrap.servers": secured_kafka.bootstrap, "security.protocol": protocol,
              "logger": logging.getLogger("librdkafka")}
    if "SSL" in protocol:
        config["ssl.ca.location"] = str(secured_kafka.pki["ca"])
    if "SASL" in protocol:
        config.update({"sasl.mechanisms": "SCRAM-SHA-512", "sasl.username": "admin", "sasl.password": "admin-secret"})
    producer = Producer({**config, "message.timeout.ms": 2000})
    with pytest.raises(KafkaException):
        producer.list_topics(timeout=2)
    reports: list[KafkaError | None] = []
    producer.produce("anything", b"x", on_delivery=lambda err, _msg: reports.append(err))
    assert producer.flush(WAIT_S) == 0
    assert len(reports) == 1 and reports[0] is not None


def _metadata_request_v0(correlation_id: int) -> bytes:
    client_id = b"plain-probe"
    body = struct.pack(">hhih", 3, 0, correlation_id, len(client_id)) + client_id + struct.pack(">i", 0)
    return struct.pack(">i", len(body)) + body


@pytest.mark.parametrize("listener, offset", [("client SASL_SSL", 0), ("controller", 1), ("inter-broker", 2)])
def test_no_listener_answers_an_unauthenticated_metadata_request(secured_kafka, listener, offset):
    """A raw Kafka request, sent before any TLS or SASL, gets no Kafka response on any of the three ports."""
    port = int(secured_kafka.bootstrap.rsplit(":", 1)[1]) + offset
    correlation_id = 0x5EC0
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(_metadata_request_v0(correlation_id))
        while chunk := sock.recv(4096):  # the broker closes the connection; a timeout fails the test
            received += chunk
    assert received[4:8] != struct.pack(">i", correlation_id), f"{listener} answered: {received[:64]!r}"
    if offset == 0:
        assert received == b"" or received[0] == 0x15  # nothing, or a TLS alert record
