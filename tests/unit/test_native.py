"""The compiled Kafka path's client-side checks (``lastagent._native``): no broker needed."""

from __future__ import annotations

import pytest

from lastagent._native import NativeKafkaError, RangeConsumer, SettingRefused, librdkafka_version
from lastagent.errors import OptionError
from lastagent.kafka_config import KafkaConfig
from lastagent.sources import kafka_source

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
