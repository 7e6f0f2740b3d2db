"""The compiled Kafka path's client-side checks (``lastagent._native``): no broker needed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from lastagent._native import NativeKafkaError, RangeConsumer, SettingRefused, librdkafka_version
from lastagent.errors import OptionError
from lastagent.kafka.config import KafkaConfig
from lastagent.sources import kafka_offsets, kafka_source

pytestmark = pytest.mark.unit


def test_built_with_the_pinned_librdkafka() -> None:
    # native/Cargo.toml pins rdkafka-sys =4.10.0, which builds librdkafka 2.12.1 from source.
    assert librdkafka_version() == "2.12.1"


def test_a_setting_librdkafka_does_not_know_is_refused_by_name() -> None:
    with pytest.raises(SettingRefused, match="no.such.setting") as refused:
        RangeConsumer([("bootstrap.servers", "127.0.0.1:1"), ("no.such.setting", "1")])
    assert refused.value.args[0] == "no.such.setting"


def test_the_build_has_tls_and_scram() -> None:
    # Secured brokers (SASL_SSL with SCRAM) need librdkafka built with OpenSSL: creating such a
    # client fails at once on a build without it, before any connection is tried.
    consumer = RangeConsumer([("bootstrap.servers", "127.0.0.1:1"), ("group.id", "g"),
                              ("security.protocol", "SASL_SSL"), ("sasl.mechanism", "SCRAM-SHA-512"),
                              ("sasl.username", "u"), ("sasl.password", "p")])
    consumer.close()


def test_source_reports_a_refused_setting_naming_the_option() -> None:
    config = KafkaConfig.of({"bootstrap.servers": "127.0.0.1:1", "no.such.setting": "1"})
    with pytest.raises(OptionError, match="option 'kafka.no.such.setting': rejected by the Kafka client"):
        kafka_source._checkout(config, "lastagent-test")


@pytest.mark.parametrize("check", ["at query start", "in a task"])
def test_a_java_client_value_librdkafka_refuses_is_named(check: str) -> None:
    # librdkafka refuses this value when the client is created, in a message, not as a setting apart.
    java = "org.apache.kafka.clients.consumer.RangeAssignor"
    config = KafkaConfig.of({"bootstrap.servers": "127.0.0.1:1", "partition.assignment.strategy": java})
    with pytest.raises(OptionError, match=f"option 'kafka.partition.assignment.strategy': .*{java}"):
        if check == "at query start":
            kafka_offsets._checked_config(dict(config.librdkafka()))
        else:
            kafka_source._checkout(config, "lastagent-test")


def test_a_closed_consumer_refuses_calls() -> None:
    consumer = RangeConsumer([("bootstrap.servers", "127.0.0.1:1"), ("group.id", "g")])
    consumer.close()
    with pytest.raises(NativeKafkaError, match="closed"):
        consumer.assign("t", 0, 0)


def test_the_branch_producer_names_a_refused_setting() -> None:
    from lastagent._native import BranchProducer

    with pytest.raises(NativeKafkaError, match="no.such.setting"):
        BranchProducer([("bootstrap.servers", "127.0.0.1:1"), ("no.such.setting", "1")])


def test_produce_columns_takes_binary_or_string_columns_only() -> None:
    import pyarrow as pa

    from lastagent._native import BranchProducer

    producer = BranchProducer([("bootstrap.servers", "127.0.0.1:1")])
    try:
        with pytest.raises(NativeKafkaError, match="value: an Arrow Int64 column; binary or string expected"):
            producer.produce_columns("t", None, pa.array([1, 2]), 0)
        with pytest.raises(NativeKafkaError, match="1 keys for 2 values"):
            producer.produce_columns("t", pa.array([b"k"]), pa.array([b"a", b"b"]), 0)
        # Queued locally (no broker needed): string and binary columns, nulls as null keys/values.
        added, failed = producer.produce_columns("t", pa.array(["k", None]), pa.array([b"v", None]), 0)
        assert (added, failed) == (2, None)
    finally:
        producer.release()


# SASL/OAUTHBEARER through a Python token provider (native/src/oauth.rs). Nothing listens on
# 127.0.0.1:1: librdkafka asks for a token when the client is created, before any connection.
_OAUTH = [("bootstrap.servers", "127.0.0.1:1"), ("security.protocol", "SASL_PLAINTEXT"),
          ("sasl.mechanism", "OAUTHBEARER")]
_CONSUMER = [*_OAUTH, ("group.id", "g")]
_PRODUCER = [*_OAUTH, ("transactional.id", "lastagent-test")]
_OAUTH_FAILED = "Failed to acquire SASL OAUTHBEARER token: "


class _Provider:
    """A token provider that records its calls (they come on librdkafka's background thread)."""

    def __init__(self, answer: Callable[[], Any]) -> None:
        self.answer = answer
        self.called = threading.Event()
        self.threads: list[int] = []

    def __call__(self) -> Any:
        self.threads.append(threading.get_ident())
        self.called.set()
        return self.answer()


def _token() -> tuple[str, int, str, dict[str, str]]:
    return "header.payload.signature", int(time.time() * 1000) + 60_000, "lastagent", {"traceId": "abc"}


def _refused_no_token_today() -> Any:
    raise RuntimeError("no token today")


def _client_errors(producer: Any, wanted: str) -> list[tuple[str, str]]:
    """The producer's client errors once one contains `wanted`, serving its error callback for up to 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        producer.poll(100)
        errors = producer.reports()[2]
        if any(wanted in text for _, text in errors):
            return errors
    return producer.reports()[2]


@pytest.mark.parametrize("kind", ["consumer", "producer"])
def test_a_token_provider_is_called_without_a_poll(kind: str) -> None:
    # librdkafka asks on its background thread: no poll, as during init_transactions.
    from lastagent._native import BranchProducer

    provider = _Provider(_token)
    client = RangeConsumer(_CONSUMER, token_provider=provider) if kind == "consumer" else BranchProducer(_PRODUCER, token_provider=provider)
    try:
        assert provider.called.wait(10), "the token provider was never called"
        assert threading.get_ident() not in provider.threads
        if kind == "producer":  # librdkafka took the token: no refusal to report
            client.poll(100)
            assert not [e for e in client.reports()[2] if e[0] == "_AUTHENTICATION"]
    finally:
        if kind == "consumer":
            client.close()
        else:
            client.release()


def test_a_provider_that_raises_fails_the_token_with_its_exception() -> None:
    from lastagent._native import BranchProducer

    provider = _Provider(_refused_no_token_today)
    producer = BranchProducer(_PRODUCER, token_provider=provider)
    try:
        assert provider.called.wait(10)
        errors = _client_errors(producer, _OAUTH_FAILED)
    finally:
        producer.release()
    assert ("_AUTHENTICATION", _OAUTH_FAILED + "the token provider raised RuntimeError: no token today") in errors

    # The consumer has no error callback: librdkafka logs the reason; the client stays usable.
    provider = _Provider(_refused_no_token_today)
    consumer = RangeConsumer(_CONSUMER, token_provider=provider)
    try:
        assert provider.called.wait(10)
        consumer.assign("t", 0, 0)
        assert consumer.next_batch(10, 10, 100, False)[2] == "wait"
    finally:
        consumer.close()


def test_a_provider_that_returns_the_wrong_shape_fails_the_token() -> None:
    from lastagent._native import BranchProducer

    provider = _Provider(lambda: "header.payload.signature")
    producer = BranchProducer(_PRODUCER, token_provider=provider)
    try:
        assert provider.called.wait(10)
        errors = _client_errors(producer, _OAUTH_FAILED)
    finally:
        producer.release()
    assert ("_AUTHENTICATION", _OAUTH_FAILED + "the token provider returned a str, not (token: str, expiry_ms: int, "
            "principal: str, extensions: dict[str, str])") in errors
    assert not any("header.payload" in text for _, text in errors)

    provider = _Provider(lambda: ("header.payload.signature", 1, "lastagent", None))
    consumer = RangeConsumer(_CONSUMER, token_provider=provider)
    assert provider.called.wait(10)
    consumer.close()


def test_a_refused_token_is_never_quoted() -> None:
    # librdkafka's own refusal of a token with a control character quotes the token: checked first.
    from lastagent._native import BranchProducer

    def token_with_a_control_character() -> tuple[str, int, str, dict[str, str]]:
        return "secret\x01token", int(time.time() * 1000) + 60_000, "lastagent", {}

    producer = BranchProducer(_PRODUCER, token_provider=_Provider(token_with_a_control_character))
    try:
        errors = _client_errors(producer, _OAUTH_FAILED)
    finally:
        producer.release()
    failures = [text for name, text in errors if name == "_AUTHENTICATION"]
    assert failures and "characters SASL/OAUTHBEARER does not allow" in failures[0]
    assert not any("secret" in text for _, text in errors)

    # An expired token: librdkafka's reason (times only) is passed on.
    producer = BranchProducer(_PRODUCER, token_provider=_Provider(lambda: ("secret", 1000, "lastagent", {})))
    try:
        errors = _client_errors(producer, _OAUTH_FAILED)
    finally:
        producer.release()
    assert any("Must supply an unexpired token" in text for _, text in errors)
    assert not any("secret" in text for _, text in errors)


def test_a_token_provider_needs_oauthbearer_and_a_callable() -> None:
    from lastagent._native import BranchProducer

    no_sasl = [("bootstrap.servers", "127.0.0.1:1")]
    with pytest.raises(NativeKafkaError, match="token_provider needs .* sasl.mechanism OAUTHBEARER"):
        RangeConsumer([*no_sasl, ("group.id", "g")], token_provider=_token)
    with pytest.raises(NativeKafkaError, match="token_provider needs .* sasl.mechanism OAUTHBEARER"):
        BranchProducer(no_sasl, token_provider=_token)
    # librdkafka's own unsecured-JWT maker and a provider exclude each other.
    with pytest.raises(NativeKafkaError, match="mutually exclusive"):
        BranchProducer([*_OAUTH, ("enable.sasl.oauthbearer.unsecure.jwt", "true")], token_provider=_token)
    with pytest.raises(TypeError, match="token_provider must be callable, not str"):
        RangeConsumer(_CONSUMER, token_provider="header.payload.signature")


def test_oauthbearer_without_a_provider_is_as_before() -> None:
    from lastagent._native import BranchProducer

    consumer = RangeConsumer(_CONSUMER)
    consumer.close()
    producer = BranchProducer(_PRODUCER, token_provider=None)
    try:
        producer.poll(100)
        assert not [e for e in producer.reports()[2] if e[0] == "_AUTHENTICATION"]
    finally:
        producer.release()
    # librdkafka's own unsecured-JWT maker still answers (here: refuses its empty config).
    producer = BranchProducer([*_OAUTH, ("enable.sasl.oauthbearer.unsecure.jwt", "true")])
    try:
        errors = _client_errors(producer, _OAUTH_FAILED)
    finally:
        producer.release()
    assert any("sasl.oauthbearer.config" in text for _, text in errors)


def test_a_consumer_without_a_group_id_is_an_error_not_a_crash() -> None:
    # librdkafka gives a consumer without group.id no consumer queue; closing it used to dereference null.
    with pytest.raises(NativeKafkaError, match=r"group\.id"):
        RangeConsumer([("bootstrap.servers", "127.0.0.1:1")])
