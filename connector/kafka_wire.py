"""A small synchronous Kafka protocol client for the transaction coordinator's verbs.

Runs on the driver and in the ``lastagent`` command. It finishes a prepared branch (an open
Kafka transaction) from any process, given its handle, with the public ``EndTxn`` request sent
to the coordinator that ``FindCoordinator`` names. Messages are encoded and decoded by
kafka-python's protocol layer; this module only frames them on a socket and negotiates versions
with ``ApiVersions``.

Why not the producer: Kafka has no released client API to resume another process's
transaction (KIP-939's calls were pulled), and Flink's route writes private producer fields.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any

from kafka import errors as kafka_errors
from kafka.protocol.metadata.api_versions import ApiVersionsRequest, ApiVersionsResponse
from kafka.protocol.metadata.find_coordinator import FindCoordinatorRequest, FindCoordinatorResponse
from kafka.protocol.producer.transaction import EndTxnRequest, EndTxnResponse

from lastagent.errors import KafkaProtocolError

_TRANSACTION_COORDINATOR = 1  # FindCoordinator key_type for transactional ids


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


def _error_name(code: int) -> str:
    """Kafka's own name for an error code, e.g. ``INVALID_TXN_STATE``."""
    if code == 0:
        return "NONE"
    return str(getattr(kafka_errors.for_code(code), "message", f"ERROR_{code}"))


class _Connection:
    """One TCP connection to one broker, with the API versions it supports."""

    def __init__(self, host: str, port: int, timeout_s: float, client_id: str) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._client_id = client_id
        self._correlation = 0
        self.address = f"{host}:{port}"
        self.versions: dict[int, tuple[int, int]] = {}
        #: The cluster's finalized feature levels (KIP-584), e.g. ``transaction.version``.
        self.features: dict[str, int] = {}
        # ApiVersions v0..3: the broker answers with its ranges; v3 is the newest we all know.
        resp = self.send(ApiVersionsRequest(client_software_name="lastagent",
                                            client_software_version="0"),
                         ApiVersionsResponse, version=3)
        if resp.error_code != 0:
            raise KafkaProtocolError(f"ApiVersions to {self.address} failed: {_error_name(resp.error_code)}")
        for api in resp.api_keys:
            self.versions[api.api_key] = (api.min_version, api.max_version)
        for feature in getattr(resp, "finalized_features", None) or ():
            self.features[feature.name] = int(feature.max_version_level)

    def version_for(self, request_cls: Any) -> int:
        """The highest version both this library and the broker speak."""
        lo, hi = request_cls.valid_versions
        b_lo, b_hi = self.versions.get(request_cls.API_KEY, (-1, -1))
        v = min(hi, b_hi)
        if v < max(lo, b_lo):
            raise KafkaProtocolError(
                f"broker {self.address} supports {request_cls.__name__} versions {b_lo}..{b_hi}, "
                f"kafka-python {lo}..{hi}: no common version"
            )
        return v

    def send(self, request: Any, response_cls: Any, version: int | None = None) -> Any:
        version = self.version_for(type(request)) if version is None else version
        self._correlation += 1
        request.API_VERSION = version
        request.with_header(correlation_id=self._correlation, client_id=self._client_id)
        self._sock.sendall(request.encode(version=version, header=True, framed=True))
        size = struct.unpack(">i", self._recv_exact(4))[0]
        payload = self._recv_exact(size)
        resp = response_cls.decode(payload, version=version, header=True)
        if resp._header.correlation_id != self._correlation:  # noqa: SLF001 (kafka-python field)
            raise KafkaProtocolError(f"out-of-order response from {self.address}")
        return resp

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise KafkaProtocolError(f"connection to {self.address} closed mid-response")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self._sock.close()


class TransactionCoordinatorClient:
    """Sends transaction-coordinator requests for any transactional id. Driver side.

    Args:
        bootstrap_servers: ``host:port[,host:port...]``, as ``kafka.bootstrap.servers``.
        timeout_s: socket timeout for each request.
    """

    def __init__(self, bootstrap_servers: str, timeout_s: float = 30.0, client_id: str = "lastagent") -> None:
        self._bootstrap = [_split_host_port(s) for s in bootstrap_servers.split(",") if s.strip()]
        if not self._bootstrap:
            raise KafkaProtocolError("kafka.bootstrap.servers is empty; give host:port[,host:port]")
        self._timeout_s = timeout_s
        self._client_id = client_id
        self._conns: dict[tuple[str, int], _Connection] = {}

    def _conn(self, host: str, port: int) -> _Connection:
        key = (host, port)
        if key not in self._conns:
            self._conns[key] = _Connection(host, port, self._timeout_s, self._client_id)
        return self._conns[key]

    def _any_conn(self) -> _Connection:
        last: Exception | None = None
        for host, port in self._bootstrap:
            try:
                return self._conn(host, port)
            except OSError as exc:
                last = exc
        raise KafkaProtocolError(f"no bootstrap server answered ({self._bootstrap}): {last}")

    def find_coordinator(self, transactional_id: str) -> tuple[str, int]:
        """The (host, port) of the transaction coordinator that owns transactional_id."""
        conn = self._any_conn()
        version = conn.version_for(FindCoordinatorRequest)
        if version >= 4:
            resp = conn.send(FindCoordinatorRequest(key_type=_TRANSACTION_COORDINATOR,
                                                    coordinator_keys=[transactional_id]),
                             FindCoordinatorResponse, version)
            c = resp.coordinators[0]
            error, host, port = c.error_code, c.host, c.port
        else:
            resp = conn.send(FindCoordinatorRequest(key=transactional_id, key_type=_TRANSACTION_COORDINATOR),
                             FindCoordinatorResponse, version)
            error, host, port = resp.error_code, resp.host, resp.port
        if error != 0:
            raise KafkaProtocolError(
                f"FindCoordinator for transactional.id {transactional_id!r} failed: {_error_name(error)}",
                retriable=True,
            )
        return host, port

    def transaction_protocol(self) -> int:
        """The transaction protocol the cluster runs: 2 (KIP-890: every end bumps the producer
        epoch), else 1 (the epoch moves only when a producer is fenced or re-initialised).

        Raises:
            KafkaProtocolError: the broker cannot serve an outside coordinator: it lacks
                ListTransactions / DescribeTransactions (Kafka before 3.0) or EndTxn.
        """
        conn = self._any_conn()
        missing = [name for key, name in ((26, "EndTxn"), (65, "DescribeTransactions"), (66, "ListTransactions"))
                   if key not in conn.versions]
        if missing:
            raise KafkaProtocolError(
                f"broker {conn.address} does not support {', '.join(missing)}: lastagent finishes and recovers "
                "transactions from outside the producer and needs Apache Kafka 3.0 or newer")
        return 2 if conn.features.get("transaction.version", 0) >= 2 else 1

    def end_txn(self, transactional_id: str, producer_id: int, producer_epoch: int, commit: bool) -> EndTxnResult:
        """Commits (or aborts) the open transaction named by its handle.

        Returns the coordinator's answer without raising on Kafka errors, so the caller (the
        protocol core) decides what each answer means, e.g. that a retried end after
        transaction protocol v2 bumped the epoch is already done.
        """
        host, port = self.find_coordinator(transactional_id)
        conn = self._conn(host, port)
        req = EndTxnRequest(transactional_id=transactional_id, producer_id=producer_id,
                            producer_epoch=producer_epoch, committed=commit)
        resp = conn.send(req, EndTxnResponse)
        pid = getattr(resp, "producer_id", -1)
        epoch = getattr(resp, "producer_epoch", -1)
        return EndTxnResult(_error_name(resp.error_code), pid, epoch)

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def __enter__(self) -> "TransactionCoordinatorClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split_host_port(server: str) -> tuple[str, int]:
    host, _, port = server.strip().rpartition(":")
    if not host or not port.isdigit():
        raise KafkaProtocolError(f"bad bootstrap server {server!r}: expected host:port")
    return host.strip("[]"), int(port)
