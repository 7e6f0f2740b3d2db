"""Riding through broker loss (``lastagent.kafka.retry``): which failures are retried, and the time budget."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException
from kafka import errors as kerr

from lastagent.errors import KafkaProtocolError, KafkaUnavailableError, OptionError
from lastagent.kafka.config import KafkaConfig
from lastagent.kafka.retry import condition, is_retriable, retried

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("exc", [
    kerr.NodeNotReadyError(3), kerr.UnknownBrokerIdError(1), kerr.KafkaConnectionError("socket disconnected"),
    kerr.NotCoordinatorError(), kerr.CoordinatorLoadInProgressError(), kerr.CoordinatorNotAvailableError(),
    kerr.LeaderNotAvailableError(), kerr.NotEnoughReplicasError(), kerr.RequestTimedOutError(), kerr.KafkaTimeoutError(),
    ConnectionResetError(104, "Connection reset by peer"), KafkaProtocolError("EndTxn answered NOT_COORDINATOR", retriable=True),
    KafkaException(KafkaError(KafkaError._TRANSPORT)), KafkaException(KafkaError(KafkaError._ALL_BROKERS_DOWN)),
    KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION)), KafkaException(KafkaError(KafkaError.NOT_ENOUGH_REPLICAS)),
    KafkaException(KafkaError(KafkaError.OFFSET_NOT_AVAILABLE)),  # a new leader's high watermark (rolling restart)
], ids=lambda e: type(e).__name__ + (f"-{e.args[0].name()}" if isinstance(e, KafkaException) else ""))
def test_a_broker_away_or_a_coordinator_moving_is_retried(exc: BaseException) -> None:
    assert is_retriable(exc)


@pytest.mark.parametrize("exc", [
    kerr.TopicAuthorizationFailedError(), kerr.TransactionalIdAuthorizationFailedError(),
    kerr.SaslAuthenticationFailedError("bad password"), kerr.UnsupportedVersionError(),
    KafkaProtocolError("denied"), OptionError("kafka.bootstrap.servers", "empty"), ValueError("a bug"),
    KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)), KafkaException(KafkaError(KafkaError._INVALID_ARG)),
], ids=lambda e: type(e).__name__ + (f"-{e.args[0].name()}" if isinstance(e, KafkaException) else ""))
def test_what_a_retry_cannot_cure_is_not_retried(exc: BaseException) -> None:
    assert not is_retriable(exc)


class Clock:
    """A fake monotonic clock that sleeping advances."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_call_that_fails_while_a_broker_restarts_succeeds_once_it_is_back() -> None:
    clock, renewed = Clock(), []
    answers = iter([kerr.NodeNotReadyError(1), kerr.UnknownBrokerIdError(1), "listed"])

    def call() -> str:
        clock.now += 0.05  # each attempt takes a moment
        answer = next(answers)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    assert retried(call, "listing", 60_000, renew=renewed.append, clock=clock, sleep=clock.sleep) == "listed"
    assert [type(e).__name__ for e in renewed] == ["NodeNotReadyError", "UnknownBrokerIdError"]
    assert clock.slept == [0.1, 0.2]  # backing off


def test_the_budget_bounds_the_retries_and_the_error_names_the_broker_condition_first() -> None:
    clock, attempts = Clock(), []

    def call() -> None:
        attempts.append(clock.now)
        clock.now += 1.0
        raise kerr.NodeNotReadyError(3)

    with pytest.raises(KafkaUnavailableError) as err:
        retried(call, "listing the open transactions of 'lastagent-x-*'", 10_000, clock=clock, sleep=clock.sleep)
    message = str(err.value)
    assert message.startswith("NodeNotReadyError: 3 — ")
    assert "listing the open transactions of 'lastagent-x-*' within 10000 ms (kafka.default.api.timeout.ms" in message
    assert "\n" not in message and err.value.retriable
    assert attempts[-1] <= 10.0 < clock.now  # no attempt starts after the budget
    assert max(clock.slept) <= 2.0


def test_a_failure_that_retrying_cannot_help_is_raised_at_once_as_it_was() -> None:
    clock, renewed = Clock(), []
    denied = kerr.TransactionalIdAuthorizationFailedError()

    def call() -> None:
        raise denied

    with pytest.raises(kerr.TransactionalIdAuthorizationFailedError) as err:
        retried(call, "describing", 60_000, renew=renewed.append, clock=clock, sleep=clock.sleep)
    assert err.value is denied and renewed == [] and clock.slept == []


def test_condition_is_one_line() -> None:
    assert condition(kerr.KafkaConnectionError("socket\ndisconnected")) == "KafkaConnectionError: socket disconnected"
    assert condition(KafkaProtocolError("EndTxn answered NOT_COORDINATOR")) == "EndTxn answered NOT_COORDINATOR"


def test_the_java_clients_api_timeout_is_checked_and_kept_from_librdkafka() -> None:
    config = KafkaConfig.parse({"bootstrap.servers": "b:9092", "default.api.timeout.ms": "5000"})
    assert config.api_timeout_ms == 5000
    assert "default.api.timeout.ms" not in config.librdkafka()
    assert KafkaConfig.parse({"bootstrap.servers": "b:9092"}).api_timeout_ms == 60_000
    with pytest.raises(OptionError, match="kafka.default.api.timeout.ms"):
        KafkaConfig.parse({"bootstrap.servers": "b:9092", "default.api.timeout.ms": "soon"})


class _Metadata:
    """What confluent-kafka's ``list_topics`` returns, for the topics given: name -> (error, partition count)."""

    def __init__(self, topics: dict) -> None:
        self.topics = {name: type("T", (), {"error": error, "partitions": dict.fromkeys(range(count))})()
                       for name, (error, count) in topics.items()}


def test_a_topic_whose_leaders_are_moving_is_asked_again_not_read_as_vanished() -> None:
    # The source's reader with a stand-in admin: the first metadata answer has the topic with
    # LEADER_NOT_AVAILABLE (a broker away); read as absent, its partitions would look deleted.
    from lastagent.sources.kafka_offsets import OffsetReader
    from lastagent.sources.kafka_source_options import KafkaSourceOptions

    answers = iter([_Metadata({"orders": (KafkaError(KafkaError.LEADER_NOT_AVAILABLE), 0)}),
                    _Metadata({"orders": (None, 2), "__consumer_offsets": (None, 50)})])
    reader = object.__new__(OffsetReader)
    reader.options = KafkaSourceOptions.parse({"kafka.bootstrap.servers": "b:9092", "subscribe": "orders"})
    reader.timeout, reader._login_error = 1.0, None
    reader.admin = type("Admin", (), {"list_topics": lambda self, timeout: next(answers)})()
    assert reader.topics() == {"orders": 2}
