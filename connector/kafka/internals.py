"""The kafka-python internals lastagent depends on, in one place, checked before they are used. Driver side.

kafka-python has no public call that sends ``EndTxn`` for a transaction another process opened (only
a transactional producer ends its own). Phase 2 and recovery need exactly that, so they send the
request through the admin client's own machinery: ``KafkaAdminClient._find_coordinator_id`` (the
transaction coordinator of an id), ``._manager.send`` (a request to one node) and ``._manager.run``
(run a coroutine on the client's I/O thread); ``._net`` says whether that thread was started. The broker's
API versions and features are read the same way, with kafka-python's public ``ApiVersionsRequest``
(:func:`api_versions`), and the transactions are listed and described with its public
``ListTransactionsRequest`` / ``DescribeTransactionsRequest`` (:func:`list_transactions`,
:func:`describe_transactions`, at the coordinator ``_find_coordinator_id`` names, on every broker of
``._manager.cluster``), so that an API key or a transaction state newer than kafka-python is never an
error: kafka-python's own helpers map both to closed enums. Nothing else in lastagent touches a private
name of kafka-python.

:func:`missing` checks the classes for those names and the signatures used, without I/O. It runs when
the driver opens its first transaction-coordinator client, so a kafka-python that changed them stops
the query at start, naming what is missing, instead of failing the first phase 2 (after a decision).
``tests/unit/test_kafka_internals.py`` runs the same check, so an upgrade fails a unit test first.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

from lastagent.errors import LastAgentError

#: The kafka-python release these internals were read from (pyproject.toml pins it).
READ_FROM = "3.0.12"


def missing() -> list[str]:
    """What of the internals below this kafka-python lacks; empty when all are there."""
    from kafka.admin import KafkaAdminClient
    from kafka.net.manager import KafkaConnectionManager
    from kafka.protocol.metadata import CoordinatorType

    problems = []
    find = getattr(KafkaAdminClient, "_find_coordinator_id", None)
    if find is None or not inspect.iscoroutinefunction(find) or "key_type" not in inspect.signature(find).parameters:
        problems.append("KafkaAdminClient._find_coordinator_id(key, key_type=...) as a coroutine")
    if not hasattr(CoordinatorType, "TRANSACTION"):
        problems.append("CoordinatorType.TRANSACTION")
    send = getattr(KafkaConnectionManager, "send", None)
    if send is None or "node_id" not in inspect.signature(send).parameters:
        problems.append("KafkaConnectionManager.send(request, node_id=...)")
    if not callable(getattr(KafkaConnectionManager, "run", None)):
        problems.append("KafkaConnectionManager.run(coroutine)")
    try:
        manager_init = inspect.getsource(KafkaConnectionManager.__init__)
    except (OSError, TypeError):  # installed without sources: the attribute cannot be read ahead
        manager_init = "self.cluster ="
    if "self.cluster =" not in manager_init:
        problems.append("KafkaConnectionManager.cluster (set in __init__; its brokers() list ListTransactions goes to)")
    try:
        init = inspect.getsource(KafkaAdminClient.__init__)
    except (OSError, TypeError):  # installed without sources: the attributes cannot be read ahead
        init = "self._manager = self._net ="
    for attribute in ("self._manager =", "self._net ="):
        if attribute not in init:
            problems.append(f"KafkaAdminClient.{attribute.split('.')[1].split()[0]} (set in __init__)")
    return problems


_checked = False


def require() -> None:
    """Raises unless this kafka-python has the internals below (checked once per process).

    Raises:
        LastAgentError: naming what is missing and the kafka-python release lastagent needs.
    """
    global _checked
    if _checked:
        return
    problems = missing()
    if problems:
        import kafka

        raise LastAgentError(f"kafka-python {kafka.__version__} lacks what lastagent uses to end transactions "
                             f"(EndTxn): {'; '.join(problems)}; install kafka-python=={READ_FROM}, the version "
                             "lastagent pins")
    _checked = True


def send_to_transaction_coordinator(admin: Any, transactional_id: str, request: Any) -> Any:
    """Sends ``request`` to the transaction coordinator of ``transactional_id`` and waits for the answer.

    Raises:
        kafka.errors.KafkaError: the coordinator could not be found, or the request failed.
    """
    from kafka.protocol.metadata import CoordinatorType

    async def call() -> Any:
        node = await admin._find_coordinator_id(transactional_id, key_type=CoordinatorType.TRANSACTION)
        return await admin._manager.send(request, node_id=node)

    return admin._manager.run(call)


def api_versions(admin: Any) -> tuple[dict[int, tuple[int, int]], dict[str, tuple[int, int]]]:
    """One ``ApiVersions`` request to any broker: (API key -> (min, max) version, finalized feature -> (min, max)
    level), keys as the integers the broker sends. A key no client knows yet (every Kafka release adds some) is
    an integer like the others, never an error: kafka-python's own ``api_versions()`` maps the keys to a closed
    enum and fails on a newer broker (Kafka 4.4's key 93).

    Raises:
        kafka.errors.KafkaError: the request failed or the broker answered with an error.
    """
    from kafka import errors as kafka_errors
    from kafka.protocol.metadata import ApiVersionsRequest

    request = ApiVersionsRequest(client_software_name="lastagent", client_software_version=READ_FROM, min_version=3)

    async def call() -> Any:
        return await admin._manager.send(request)

    response = admin._manager.run(call)
    if response.error_code:
        raise kafka_errors.for_code(response.error_code)(f"ApiVersions failed: {response}")
    keys = {int(k.api_key): (int(k.min_version), int(k.max_version)) for k in response.api_keys or []}
    features = {str(f.name): (int(f.min_version_level), int(f.max_version_level))
                for f in response.finalized_features or []}
    return keys, features


class Described(NamedTuple):
    """One transactional id as its coordinator describes it; ``state`` is the broker's own word (``Ongoing``,
    ``CompleteCommit``, ...), kept as a string so that a state a newer broker adds is never an error."""

    state: str
    producer_id: int
    producer_epoch: int
    transaction_start_time_ms: int
    transaction_timeout_ms: int
    topic_partitions: tuple[tuple[str, int], ...]


def describe_transactions(admin: Any, transactional_ids: list[str]) -> dict[str, Described]:
    """``DescribeTransactions`` for each id, at the id's own coordinator (FindCoordinator). Id -> description.

    Raises:
        kafka.errors.KafkaError: a request failed, or the coordinator answered an id with an error
            (``TRANSACTIONAL_ID_NOT_FOUND`` for an id it does not know).
    """
    from kafka import errors as kafka_errors
    from kafka.protocol.admin.transactions import DescribeTransactionsRequest
    from kafka.protocol.metadata import CoordinatorType

    async def call() -> dict[str, Described]:
        by_coordinator: dict[int, list[str]] = {}
        for tid in transactional_ids:
            node = await admin._find_coordinator_id(tid, key_type=CoordinatorType.TRANSACTION)
            by_coordinator.setdefault(node, []).append(tid)
        out: dict[str, Described] = {}
        for node, ids in by_coordinator.items():
            response = await admin._manager.send(DescribeTransactionsRequest(transactional_ids=ids), node_id=node)
            for t in response.transaction_states:
                if t.error_code:
                    raise kafka_errors.for_code(t.error_code)(f"DescribeTransactions for {t.transactional_id!r}")
                out[str(t.transactional_id)] = Described(
                    str(t.transaction_state), int(t.producer_id), int(t.producer_epoch),
                    int(t.transaction_start_time_ms), int(t.transaction_timeout_ms),
                    tuple(sorted((str(topic.topic), int(p)) for topic in t.topics for p in topic.partitions)))
        return out

    return admin._manager.run(call)


def list_transactions(admin: Any, states: list[str]) -> list[tuple[str, str]]:
    """``ListTransactions`` on every broker (each holds a slice of the transaction log), in the given states (all
    when empty): (transactional id, state) pairs, states as the broker's own words.

    Raises:
        kafka.errors.KafkaError: a request failed or a broker answered with an error.
    """
    from kafka import errors as kafka_errors
    from kafka.protocol.admin.transactions import ListTransactionsRequest

    async def call() -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for broker in admin._manager.cluster.brokers():
            request = ListTransactionsRequest(state_filters=list(states), producer_id_filters=[], min_version=0)
            response = await admin._manager.send(request, node_id=broker.node_id)
            if response.error_code:
                raise kafka_errors.for_code(response.error_code)(f"ListTransactions on broker {broker.node_id}")
            out += [(str(t.transactional_id), str(t.transaction_state)) for t in response.transaction_states]
        return out

    return admin._manager.run(call)


def io_thread_started(admin: Any) -> bool:
    """Whether kafka-python's admin client got as far as starting its I/O thread (to be closed)."""
    return getattr(admin, "_net", None) is not None
