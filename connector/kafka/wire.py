"""The transaction coordinator's verbs, sent through kafka-python's own client. Driver side.

Runs on the driver and in the ``lastagent`` command. It finishes a prepared branch (an open
Kafka transaction) from any process, given its handle, with the public ``EndTxn`` request sent
to the coordinator that ``FindCoordinator`` names. Connections, version negotiation, TLS and
SASL are kafka-python's (``KafkaAdminClient`` and its connection manager), configured from the
user's ``kafka.*`` settings by :class:`lastagent.kafka.config.KafkaConfig`, so these requests
authenticate exactly like every other client the connector opens.

Why not the producer: Kafka has no released client API to resume another process's
transaction (KIP-939's calls were pulled), and Flink's route writes private producer fields.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kafka import errors as kafka_errors
from kafka.admin import KafkaAdminClient
from kafka.protocol.producer.transaction import EndTxnRequest

from lastagent.errors import KafkaProtocolError
from lastagent.kafka import internals as kafka_internals
from lastagent.kafka import oauth as kafka_oauth
from lastagent.kafka.config import LOGIN_HINT, KafkaConfig, access_hint
from lastagent.kafka.retry import error_name, is_retriable, retried

T = TypeVar("T")

#: The Kafka API keys an outside transaction coordinator client needs, by name.
_NEEDED_APIS = ((26, "EndTxn"), (65, "DescribeTransactions"), (66, "ListTransactions"))

@dataclass(frozen=True)
class EndTxnResult:
    """The coordinator's answer to one ``EndTxn``.

    Attributes:
        error: the Kafka error name, ``"NONE"`` on success.
        producer_id: the producer id after the end (transaction protocol v2 may bump it).
        producer_epoch: the producer epoch after the end (v2 bumps it at every end).
    """

    error: str
    producer_id: int
    producer_epoch: int

    @property
    def ok(self) -> bool:
        return self.error == "NONE"


def kafka_version(api_versions: Mapping[int, tuple[int, int]]) -> str:
    """What the broker's API versions say of its Kafka release, for an error message ("Kafka 2.8 or similar")."""
    from kafka.protocol.broker_version_data import infer_broker_version_from_api_versions

    try:
        inferred = infer_broker_version_from_api_versions(dict(api_versions))
    except Exception:  # an inference is only a hint: the message goes on without it
        return "Kafka of an unknown release"
    return "Kafka " + ".".join(str(p) for p in inferred) + " or similar"


def _error_name(code: int) -> str:
    """Kafka's own name for an error code, e.g. ``INVALID_TXN_STATE``."""
    if code == 0:
        return "NONE"
    return str(getattr(kafka_errors.for_code(code), "message", f"ERROR_{code}"))


def explain(exc: BaseException, what: str) -> KafkaProtocolError:
    """A :class:`KafkaProtocolError` for a kafka-python failure of ``what``, naming the missing ACL
    or the setting to check; never the settings' values."""
    name = error_name(exc)
    hint = access_hint(name)
    if hint is not None:
        return KafkaProtocolError(f"{what}: {type(exc).__name__}: {hint}", error=name)
    # The broker's condition first: the one line a user sees says what the cluster did.
    return KafkaProtocolError(f"{type(exc).__name__}: {exc}" + (f" ({what})" if what else ""),
                              retriable=is_retriable(exc), error=name)


class _LoginFailures(logging.Filter):
    """Keeps the connection failures kafka-python reports while it bootstraps (it only logs them,
    then retries until its timeout), so the error can say what went wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[BaseException] = []
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        for arg in record.args if isinstance(record.args, tuple) else ():
            if isinstance(arg, kafka_errors.SaslAuthenticationFailedError):
                self.refused.append(arg)
            elif isinstance(arg, kafka_errors.KafkaConnectionError):
                # The broker closes the connection after refusing a login; kafka-python at times
                # sees the close before it reads the refusal.
                self.dropped += 1
        return True


class _Admin(KafkaAdminClient):
    """kafka-python's admin client that stops its I/O thread if it cannot bootstrap and says why."""

    def __init__(self, config: KafkaConfig, timeout_ms: int) -> None:
        self._closed = True  # close() before bootstrap succeeded must not find a missing attribute
        failures = _LoginFailures()
        logger = logging.getLogger("kafka.net.manager")
        kafka_oauth.check_login(config.security.oauth)
        logger.addFilter(failures)
        try:
            super().__init__(**config.kafka_python(timeout_ms))
        except kafka_errors.KafkaError as exc:
            auth = failures.refused[-1] if failures.refused else None
            if kafka_internals.io_thread_started(self):
                self._closed = False
                self.close()
            if auth is not None:
                raise explain(auth, f"connecting to {config.bootstrap_servers}") from None
            detail, retriable = _unreachable(config, timeout_ms, exc, failures.dropped)
            raise KafkaProtocolError(detail, retriable=retriable) from None
        finally:
            logger.removeFilter(failures)


def admin_client(config: KafkaConfig | Mapping[str, str], timeout_ms: int | None = None) -> Any:
    """A connected kafka-python ``KafkaAdminClient`` for ``config``. Driver side.

    Raises:
        KafkaProtocolError: no broker answered within ``timeout_ms`` (default: ``request.timeout.ms``,
            else 30 s), TLS failed, or SASL authentication failed; the message says which.
    """
    config = KafkaConfig.of(config)
    if not config.bootstrap_servers.strip():
        raise KafkaProtocolError("kafka.bootstrap.servers is empty; give host:port[,host:port]")
    return _Admin(config, timeout_ms or int(config.get("request.timeout.ms", "30000")))


def _unreachable(config: KafkaConfig, timeout_ms: int, exc: BaseException, dropped: int = 0) -> tuple[str, bool]:
    """Why no bootstrap server could be used: unreachable, TLS refused, the connection closed during
    the login, or no answer in time; and whether waiting may help (not for TLS or a login refused)."""
    reasons = []
    settled = False  # a cause that no retry cures
    for server in config.bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        if not host or not port.isdigit():
            return f"bad bootstrap server {server.strip()!r} in kafka.bootstrap.servers: expected host:port", False
        host = host.strip("[]")
        try:
            with socket.create_connection((host, int(port)), timeout=min(timeout_ms / 1000, 10)) as sock:
                if config.security.tls:
                    with config.ssl_context().wrap_socket(sock, server_hostname=host):
                        pass
        except ssl.SSLError as tls:
            settled = True
            reasons.append(f"{host}:{port}: TLS handshake failed ({tls.reason or tls}); check "
                           "kafka.ssl.truststore.location (or kafka.ssl.ca.location), "
                           "kafka.ssl.endpoint.identification.algorithm and kafka.security.protocol")
        except OSError as err:
            reasons.append(f"{host}:{port}: {err.strerror or err}")
    if reasons:
        detail = "; ".join(reasons)
    elif dropped and config.security.sasl:
        settled = True
        detail = (f"the connection{' and TLS handshake' if config.security.tls else ''} succeed, but the broker "
                  f"closed the connection during the login {dropped} time(s): it refused the login, or its listener "
                  f"expects another mechanism; {LOGIN_HINT}")
    else:
        detail = f"{type(exc).__name__}: {exc}"
    return (f"no Kafka broker could be used at {config.bootstrap_servers} within {timeout_ms} ms "
            f"(kafka.bootstrap.servers, kafka.security.protocol {config.security.protocol}): {detail}"), not settled


class TransactionCoordinatorClient:
    """Sends transaction-coordinator and admin requests for any transactional id. Driver (and executor) side.

    Every request goes through :meth:`call`: retried within ``kafka.default.api.timeout.ms`` on
    retriable failures, each retry on a new kafka-python client, which bootstraps from any live
    broker of ``bootstrap.servers`` and so forgets brokers that left, coordinators that moved and
    connections in back-off. Threads may share one instance (phase 2 ends branches in parallel).

    Args:
        config: the user's ``kafka.*`` settings (prefix removed), checked or not.
        timeout_ms: bound of the first connection and of each request.
    """

    def __init__(self, config: KafkaConfig | Mapping[str, str], timeout_ms: int | None = None) -> None:
        kafka_internals.require()  # at start, not at the first phase 2
        self._config = KafkaConfig.of(config)
        self._timeout_ms = timeout_ms
        self._admin: Any = None
        #: Clients a failure retired: another thread may still wait on one, so they close with this one.
        self._retired: list[Any] = []
        self._lock = threading.Lock()
        self.budget_ms = self._config.api_timeout_ms

    @property
    def admin(self) -> Any:
        """The kafka-python admin client, connected on first use."""
        with self._lock:
            if self._admin is None:
                self._admin = admin_client(self._config, self._timeout_ms)
            return self._admin

    def call(self, what: str, request: Callable[[Any], T], budget_ms: int | None = None) -> T:
        """``request(admin)``, retried through broker loss (:func:`lastagent.kafka.retry.retried`).

        Raises:
            KafkaUnavailableError: still failing after the budget, naming the broker condition.
            KafkaProtocolError: a failure retrying cannot help (denied, unsupported, an unknown id);
                its ``error`` is Kafka's name for it.
        """
        used: list[Any] = []

        def attempt() -> T:
            used.append(self.admin)
            try:
                return request(used[-1])
            except kafka_errors.KafkaError as exc:
                # Named, never bare; what was asked is added once: here if this ends the call, else
                # by the retry's own error when the budget runs out.
                raise explain(exc, "" if is_retriable(exc) else what) from None

        def renew(exc: BaseException) -> None:
            if used:
                self._retire(used[-1])

        return retried(attempt, what, self.budget_ms if budget_ms is None else budget_ms, renew=renew)

    def _retire(self, admin: Any) -> None:
        """The next request takes a new client, unless another thread already replaced this one."""
        with self._lock:
            if self._admin is admin:
                self._admin = None
                self._retired.append(admin)

    def transaction_protocol(self) -> int:
        """The transaction protocol the cluster runs: 2 (KIP-890: every end bumps the producer
        epoch), else 1 (the epoch moves only when a producer is fenced or re-initialised).

        Raises:
            KafkaProtocolError: the broker cannot serve an outside coordinator: it lacks
                ListTransactions / DescribeTransactions (Kafka before 3.0) or EndTxn.
        """
        versions, features = self.call("asking a broker's API versions and features", kafka_internals.api_versions)
        missing = [name for key, name in _NEEDED_APIS if key not in versions]
        if missing:
            raise KafkaProtocolError(
                f"the broker at {self._config.bootstrap_servers} ({kafka_version(versions)}) does not support "
                f"{', '.join(missing)}: lastagent finishes and recovers transactions from outside the producer and "
                "needs Apache Kafka 3.0 or newer")
        return 2 if features.get("transaction.version", (0, 0))[1] >= 2 else 1

    def end_txn(self, transactional_id: str, producer_id: int, producer_epoch: int, commit: bool,
                admin: Any = None) -> EndTxnResult:
        """Commits (or aborts) the open transaction named by its handle.

        Returns the coordinator's answer without raising on Kafka errors, so the caller (the
        protocol core) decides what each answer means, e.g. that a retried end after
        transaction protocol v2 bumped the epoch is already done.

        Raises:
            KafkaProtocolError: the request could not be sent or answered (retriable when a retry
                may help), or the coordinator could not be found.
        """
        admin = admin or self.admin
        request = EndTxnRequest(transactional_id=transactional_id, producer_id=producer_id,
                                producer_epoch=producer_epoch, committed=commit)
        # A retry after NOT_COORDINATOR and friends finds the coordinator anew: :meth:`call` gives it
        # a new client, with no cached coordinator.
        try:
            resp = kafka_internals.send_to_transaction_coordinator(admin, transactional_id, request)
        except kafka_errors.KafkaError as exc:
            raise explain(exc, f"EndTxn for transactional.id {transactional_id!r}") from None
        return EndTxnResult(_error_name(resp.error_code), getattr(resp, "producer_id", -1),
                            getattr(resp, "producer_epoch", -1))

    def close(self) -> None:
        with self._lock:
            clients, self._admin, self._retired = [self._admin, *self._retired], None, []
        for admin in clients:
            if admin is not None:
                admin.close()

    def __enter__(self) -> TransactionCoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
