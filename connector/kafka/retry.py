"""Kafka calls that ride through a broker going away, within the user's time budget. Driver and executor.

A broker stops for a rolling restart, is killed, or loses its leaderships, every week of a
production cluster's life; the Java client retries metadata, coordinator and connection errors
within ``default.api.timeout.ms`` and the query never notices. :func:`retried` gives our Kafka
calls (kafka-python on the driver, confluent-kafka's admin in the source) the same rule: a
retriable failure is tried again, after a back-off and with a fresh view of the cluster (the
caller's ``renew``: a new client, which bootstraps from any live broker), until the budget is
spent. Only a failure that retrying cannot help, or an exhausted budget, reaches the query, as
:class:`KafkaUnavailableError` whose message starts with the broker's condition.

Pure apart from the clock and the sleep it is given; unit-tested without a broker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from lastagent.errors import KafkaProtocolError, KafkaUnavailableError

log = logging.getLogger("lastagent.kafka")

T = TypeVar("T")

#: The budget's option, as the Java client names it (default: kafka_config.DEFAULT_API_TIMEOUT_MS).
API_TIMEOUT_OPTION = "kafka.default.api.timeout.ms"

#: Kafka's error names (both clients use them) that a retry may cure: the coordinator or a leader
#: moving or loading, a broker away, too few in-sync replicas for the moment.
RETRIABLE_NAMES = frozenset({
    "NOT_COORDINATOR", "COORDINATOR_LOAD_IN_PROGRESS", "COORDINATOR_NOT_AVAILABLE", "LEADER_NOT_AVAILABLE",
    "NOT_LEADER_OR_FOLLOWER", "NOT_LEADER_FOR_PARTITION", "NOT_ENOUGH_REPLICAS", "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
    "REQUEST_TIMED_OUT", "NETWORK_EXCEPTION", "BROKER_NOT_AVAILABLE", "UNKNOWN_LEADER_EPOCH", "FENCED_LEADER_EPOCH",
    "NOT_CONTROLLER", "KAFKA_STORAGE_ERROR", "REPLICA_NOT_AVAILABLE", "CONCURRENT_TRANSACTIONS",
    # A new partition leader answers ListOffsets so until its high watermark caught up (KIP-207; seen in a
    # rolling restart); a group's offsets while a transactional commit to them is pending.
    "OFFSET_NOT_AVAILABLE", "UNSTABLE_OFFSET_COMMIT",
    # librdkafka's local names for the same conditions
    "_TRANSPORT", "_ALL_BROKERS_DOWN", "_TIMED_OUT", "_WAIT_COORD", "_LEADER_NOT_AVAILABLE", "_NODE_UPDATE",
    "_DESTROY_BROKER",
})
#: kafka-python's client-side exceptions that mean "that broker is not there right now": a node
#: being reconnected, a broker id the client's metadata no longer has (it left the cluster or
#: restarted), a metadata answer without brokers.
RETRIABLE_CLIENT_ERRORS = frozenset({
    "NodeNotReadyError", "UnknownBrokerIdError", "KafkaConnectionError", "KafkaTimeoutError", "MetadataEmptyBrokerList",
    "NoBrokersAvailable", "StaleMetadata", "Cancelled", "CorrelationIdError", "TooManyInFlightRequests",
})


def error_name(exc: BaseException) -> str:
    """Kafka's name for a failure (``NOT_COORDINATOR``), else the exception's class name."""
    # kafka-python: broker errors carry the name in ``message``; confluent-kafka: KafkaException(KafkaError).
    inner = exc.args[0] if exc.args and hasattr(exc.args[0], "name") and callable(exc.args[0].name) else None
    if inner is not None:
        return str(inner.name())
    name = getattr(exc, "message", None)
    return name if isinstance(name, str) and name.isupper() else type(exc).__name__


def is_retriable(exc: BaseException) -> bool:
    """Whether the same call may succeed once the cluster settles (see the module doc)."""
    if isinstance(exc, KafkaProtocolError):
        return exc.retriable
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    name = error_name(exc)
    if name in RETRIABLE_NAMES or type(exc).__name__ in RETRIABLE_CLIENT_ERRORS:
        return True
    inner = exc.args[0] if exc.args and hasattr(exc.args[0], "retriable") and callable(exc.args[0].retriable) else None
    if inner is not None:
        return bool(inner.retriable())
    return bool(getattr(exc, "retriable", False)) and not _denied(name)


def _denied(name: str) -> bool:
    return name.endswith("AUTHORIZATION_FAILED") or "AUTHENTICATION" in name or name == "SASL_AUTHENTICATION_FAILED"


def condition(exc: BaseException) -> str:
    """The broker condition an error shows, in one line: ``NodeNotReadyError: 3``."""
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    if isinstance(exc, KafkaProtocolError):
        return text
    return text if text.startswith(name) else f"{name}: {text}" if text else name


def retried(call: Callable[[], T], what: str, budget_ms: int, *, renew: Callable[[BaseException], None] | None = None,
            option: str = API_TIMEOUT_OPTION, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep, first_delay_s: float = 0.1, max_delay_s: float = 2.0) -> T:
    """``call()``, tried again on retriable failures until ``budget_ms`` has passed.

    Args:
        call: the Kafka call; it raises on failure.
        what: what is being asked, for the error ("listing the open transactions of 'lastagent-x-*'").
        budget_ms: the time budget (the user's ``kafka.default.api.timeout.ms``).
        renew: called with the failure before each retry: drop cached coordinators, take a new client.
        option: the option that sets the budget, named in the error.

    Raises:
        KafkaUnavailableError: the budget is spent and the last failure was retriable.
        Exception: the first failure that retrying cannot help, as the call raised it.
    """
    deadline = clock() + budget_ms / 1000
    delay = first_delay_s
    attempts = 0
    while True:
        attempts += 1
        try:
            return call()
        except Exception as exc:  # classified; what cannot be retried is raised as it was
            if not is_retriable(exc):
                raise
            left = deadline - clock()
            if left <= 0:
                raise KafkaUnavailableError(
                    f"{condition(exc)} — Kafka did not answer {what} within {budget_ms} ms ({option}; "
                    f"{attempts} attempt(s)); the brokers may be down, restarting or moving leaders") from None
            log.info("kafka: %s failed (%s); retrying, %.1f s of %s left", what, condition(exc), left, option)
            if renew is not None:
                renew(exc)
            sleep(min(delay, max(left, 0.0)))
            delay = min(delay * 2, max_delay_s)
