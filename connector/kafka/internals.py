"""The kafka-python internals lastagent depends on, in one place, checked before they are used. Driver side.

kafka-python has no public call that sends ``EndTxn`` for a transaction another process opened (only
a transactional producer ends its own). Phase 2 and recovery need exactly that, so they send the
request through the admin client's own machinery: ``KafkaAdminClient._find_coordinator_id`` (the
transaction coordinator of an id), ``._manager.send`` (a request to one node) and ``._manager.run``
(run a coroutine on the client's I/O thread); ``._net`` says whether that thread was started. Nothing
else in lastagent touches a private name of kafka-python.

:func:`missing` checks the classes for those names and the signatures used, without I/O. It runs when
the driver opens its first transaction-coordinator client, so a kafka-python that changed them stops
the query at start, naming what is missing, instead of failing the first phase 2 (after a decision).
``tests/unit/test_kafka_internals.py`` runs the same check, so an upgrade fails a unit test first.
"""

from __future__ import annotations

import inspect
from typing import Any

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


def io_thread_started(admin: Any) -> bool:
    """Whether kafka-python's admin client got as far as starting its I/O thread (to be closed)."""
    return getattr(admin, "_net", None) is not None
