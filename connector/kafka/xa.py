"""Kafka as an XA resource: branches are Kafka transactions, finished from any process.

Two halves, after the XA verbs (start / end / prepare on the branch's own producer, commit /
rollback / recover by the transaction manager; Kafka keeps no heuristic outcome to forget):

* :class:`BranchWriter` runs on an executor, inside one Spark task attempt. It owns a
  librdkafka transactional producer (``lastagent._native``), writes records, and ``prepare()`` flushes them inside
  the still-open transaction and returns the branch's :class:`BranchHandle`. It never commits,
  aborts or closes that transaction on the way out: the transaction outlives the producer, the
  task, even a SIGKILL of the process, until the driver ends it or the broker's
  ``transaction.timeout.ms`` expires it.
* :class:`KafkaXAResource` runs on the driver (or in the ``lastagent`` command). It commits or
  rolls back a branch by its handle with ``EndTxn`` (see :mod:`lastagent.kafka.wire`), lists
  the open transactions of a link from the broker, and reads the broker's transaction limits.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lastagent import faults, redact
from lastagent.errors import BranchError, KafkaProtocolError, KafkaUnavailableError, RecordTooLarge, TransactionFailed
from lastagent.kafka.config import KafkaConfig, access_hint, as_librdkafka_strings
from lastagent.kafka.retry import RETRIABLE_NAMES, is_retriable
from lastagent.kafka.wire import TransactionCoordinatorClient

log = logging.getLogger("lastagent.kafka")

#: Kafka error names that say this handle's transaction is no longer the open one.
_GONE = frozenset({
    "INVALID_TXN_STATE", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH",
    "INVALID_PRODUCER_ID_MAPPING", "TRANSACTIONAL_ID_NOT_FOUND",
})


@dataclass(frozen=True)
class RefusedRecord:
    """A record the broker refused (or that failed in delivery), as errors may show it: no contents.

    Attributes:
        topic: the record's topic.
        partition: its partition, None when it never had one (e.g. the topic is unknown).
        index: its index among the records the branch was given (0-based; for the
            ``lastagent-kafka`` sink, the row's index within the task), None if unknown.
        key: ``key sha256:<12 hex digits>`` or ``null key`` (:func:`lastagent.redact.key_label`).
        size: key and value bytes.
        error: librdkafka's error name (``MSG_SIZE_TOO_LARGE``, ``TOPIC_AUTHORIZATION_FAILED``...).
        text: the broker's or client's reason.
    """

    topic: str
    partition: int | None
    index: int | None
    key: str
    size: int
    error: str
    text: str

    @classmethod
    def of(cls, report: Sequence[Any]) -> RefusedRecord:
        """From a delivery report of ``BranchProducer.reports()`` (key bytes are digested here, never kept)."""
        name, text, topic, partition, key, size, index = report
        return cls(str(topic), int(partition) if partition is not None and partition >= 0 else None,
                   int(index) if index is not None and index >= 0 else None, redact.key_label(key), int(size),
                   str(name), str(text))

    def position(self) -> str:
        """Where the record is: its index in the branch, topic and partition (no contents)."""
        at = f"topic {self.topic}" + (f" partition {self.partition}" if self.partition is not None else "")
        return f"{'record' if self.index is None else f'record #{self.index}'} of the branch ({at}, {self.key})"

    def describe(self) -> str:
        hint = access_hint(self.error)
        note = f"; {hint}" if hint else ""
        if self.error == "MSG_SIZE_TOO_LARGE":
            note = (f"; the record has {self.size} bytes, and it or the batch it was in is larger than the "
                    "topic's max.message.bytes or the broker's message.max.bytes")
        return f"{self.position()}: {self.text} ({self.error}{note})"


@dataclass(frozen=True)
class BranchHandle:
    """What any process needs to finish a prepared branch; the task's commit message.

    Carries no payload and no secrets: only ids, counts and partitions.

    Attributes:
        transactional_id: the branch's Kafka transactional.id (one per task partition and attempt of a run).
        producer_id: the producer id that holds the open transaction.
        producer_epoch: the producer epoch of the open transaction.
        records: how many records the branch wrote; 0 means read-only (nothing to finish).
        partitions: the topic partitions the transaction touched.
    """

    transactional_id: str
    producer_id: int
    producer_epoch: int
    records: int
    partitions: tuple[tuple[str, int], ...] = ()

    @property
    def read_only(self) -> bool:
        """XA's XA_RDONLY: the branch wrote nothing, so there is no transaction to end."""
        return self.records == 0

    def to_json(self) -> str:
        return json.dumps({
            "tid": self.transactional_id, "pid": self.producer_id, "epoch": self.producer_epoch,
            "records": self.records, "partitions": [list(tp) for tp in self.partitions],
        }, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BranchHandle:
        d = json.loads(text)
        return cls(d["tid"], int(d["pid"]), int(d["epoch"]), int(d["records"]),
                   tuple((str(t), int(p)) for t, p in d.get("partitions", [])))


class EndOutcome(enum.Enum):
    """How ending one branch turned out, as the protocol core needs to know it."""

    COMMITTED = "committed"  # this call, or an earlier one (a retry recognised as done)
    ROLLED_BACK = "rolled_back"
    NOTHING_TO_END = "nothing_to_end"  # read-only branch
    #: Asked to commit, but the broker ended the transaction otherwise (expired after its
    #: timeout, or fenced by a new producer of the same id). A hazard for a decided epoch.
    NOT_COMMITTED = "not_committed"
    #: Asked to roll back, but the transaction was committed (XA's heuristic commit).
    HEURISTIC_COMMIT = "heuristic_commit"


@dataclass(frozen=True)
class EndResult:
    """One branch end: the outcome and the broker's words for it."""

    handle: BranchHandle
    outcome: EndOutcome
    detail: str = ""


@dataclass(frozen=True)
class OpenTransaction:
    """An open transaction the broker reports for a link's id prefix (recovery input)."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    state: str
    started_ms: int
    timeout_ms: int
    partitions: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    def handle(self) -> BranchHandle:
        """The handle to finish it; records unknown, so counted as one (not read-only)."""
        return BranchHandle(self.transactional_id, self.producer_id, self.producer_epoch, 1, self.partitions)


def producer_config(client_config: KafkaConfig | Mapping[str, str], transactional_id: str,
                    timeout_ms: int) -> dict[str, Any]:
    """librdkafka settings for one branch's producer. Executor side.

    ``client_config`` holds the user's ``kafka.*`` options with the prefix removed.
    """
    config: dict[str, Any] = KafkaConfig.of(client_config).librdkafka()
    # librdkafka buffers up to 1 GB by default; a branch only needs enough to keep batches
    # flowing, and the Python worker must stay bounded whatever a partition's size.
    config.setdefault("queue.buffering.max.kbytes", 32_768)
    # And at most this many records waiting for the broker (librdkafka: 100,000). Each record is a
    # separate allocation that librdkafka walks again when the broker acknowledges it; 100,000 small
    # records outgrow the CPU caches, and a branch then spends twice the CPU per record
    # (bench/sink_phases.py: 1.04 µs of the producing process's CPU per 100-byte record at 100,000,
    # 0.50 µs at 20,000). 20,000 records in flight still carry 2,000,000 records/s per task at a
    # 10 ms round trip.
    config.setdefault("queue.buffering.max.messages", 20_000)
    # A keyed record goes where Spark's kafka sink (the Java producer) puts it: murmur2 of the key.
    # librdkafka's own default (consistent_random, a CRC32) would send a key to another partition,
    # so a query moved between the two formats, or a topic shared with Java producers, would split
    # a key's records over two partitions and lose their order. kafka.partitioner still wins.
    config.setdefault("partitioner", "murmur2_random")
    # A branch's producer is new per task: librdkafka drops the bootstrap connection once it has
    # the cluster's metadata and connects the broker it learned only after reconnect.backoff.ms
    # (100 ms by default, with jitter), which was most of a task's init_transactions (about 60 ms;
    # 10 ms here: about 18 ms, bench/task_phases.py). Later reconnects still back off exponentially
    # to reconnect.backoff.max.ms.
    config.setdefault("reconnect.backoff.ms", 10)
    config.update({
        "transactional.id": transactional_id,
        "transaction.timeout.ms": int(timeout_ms),
        "enable.idempotence": True,
    })
    return config


#: How long one slice of a flush waits before the failure reports are looked at again.
_FLUSH_SLICE_S = 0.1
#: How long a refused call waits for the delivery report that says why the transaction failed.
_CAUSE_WAIT_S = 10.0
#: How many refused records an error names.
_SHOWN_REFUSALS = 3


class BranchWriter:
    """One branch: a Kafka transaction written by one Spark task attempt. Executor side.

    The producer is the compiled ``lastagent._native.BranchProducer`` (librdkafka): Arrow
    columns go into its queue without a Python object per record (:meth:`send_columns`).

    Args:
        client_config: librdkafka settings (bootstrap.servers, security, tuning).
        transactional_id: the branch id (:func:`lastagent.core.xid.transactional_id`).
        timeout_ms: the transaction timeout; the broker expires the branch after it.
        init_timeout_s: how long ``init_transactions`` may take.

    Raises:
        BranchError: the producer could not start its transaction (names the login or ACL
            setting when that is the cause).
    """

    def __init__(self, client_config: KafkaConfig | Mapping[str, str], transactional_id: str, timeout_ms: int,
                 init_timeout_s: float = 60.0) -> None:
        from lastagent._native import BranchProducer, NativeKafkaError  # executor-only: the data path

        self.transactional_id = transactional_id
        self._client_config = KafkaConfig.of(client_config)
        self._records = 0
        self._ended: str | None = None  # why the writer refuses calls, once it ended the branch itself
        config = producer_config(client_config, transactional_id, timeout_ms)
        # Delivery reports for failures only: success is what flush() already tells us.
        config["delivery.report.only.error"] = True
        try:
            self._producer: Any = BranchProducer(as_librdkafka_strings(config),  # None once released
                                                 token_provider=self._client_config.token_provider())
        except NativeKafkaError as exc:
            raise BranchError(f"branch {transactional_id}: {exc}") from exc
        # init_transactions fences any older producer of this id and aborts its open
        # transaction: the id scheme guarantees no decided branch still holds this id.
        failed = self._producer.init_transactions(int(init_timeout_s * 1000))
        if failed is None:
            failed = self._producer.begin_transaction()
        if failed is not None:
            error = self._denied(*failed)
            self.release()
            raise error

    def _denied(self, name: str, text: str) -> BranchError:
        """A refused call's error, saying which ACL or login setting it needs, when that is the cause.

        librdkafka reports a refused login or TLS handshake only to its error callback, and keeps
        retrying: the call that waited on it then fails with a bare timeout.
        """
        self._producer.poll(0)  # serves the error events queued while the blocking call waited
        _, _, client_errors = self._producer.reports()
        for cause_name, cause_text in [(name, text), *reversed(client_errors)]:
            hint = access_hint(cause_name)
            if hint is not None:
                return BranchError(f"branch {self.transactional_id}: {cause_text}; {hint}")
        return BranchError(f"branch {self.transactional_id}: {text} ({name})")

    def _live(self) -> Any:
        """The producer; a branch already ended here (aborted after a failure, or released) refuses more."""
        if self._producer is None:
            raise BranchError(f"branch {self.transactional_id}: {self._ended or 'the producer is released'}")
        return self._producer

    def _flush(self, timeout_s: float) -> int:
        """Waits for the records to be delivered, up to ``timeout_s``, but stops as soon as one failed.

        librdkafka's flush waits for *every* record: after a refusal that can be until
        ``message.timeout.ms`` (by default the transaction timeout) for records that are no longer
        sent, since a failed transaction sends nothing more. So flush in short slices and look at
        the failure reports between them. Returns how many records are left.
        """
        producer = self._live()
        deadline = time.monotonic() + timeout_s
        while True:
            slice_ms = int(max(0.0, min(_FLUSH_SLICE_S, deadline - time.monotonic())) * 1000)
            left = int(producer.flush(slice_ms))
            if left == 0 or producer.has_failed() or time.monotonic() >= deadline:
                return left

    def _refusals(self) -> tuple[list[RefusedRecord], int, int]:
        """(the refused records to show, how many failed, how many were dropped with the transaction).

        A batch the broker refuses fails every record in it; for a size refusal the largest record
        is the likely cause, so it comes first even when it was not among the first reports.
        """
        failures, purged, _ = self._live().reports()
        count, largest = self._live().failed()
        shown = [RefusedRecord.of(f) for f in failures]
        if largest is not None:
            big = RefusedRecord.of(largest)
            if big.error == "MSG_SIZE_TOO_LARGE":
                shown = [big, *(r for r in shown if r != big)]
        return shown[:_SHOWN_REFUSALS], int(count), int(purged)

    def _fail(self, what: str, fallback: str = "") -> TransactionFailed:
        """The transaction failed: names the refused records (positions, never contents), aborts the branch.

        Aborting here, before the task ends, keeps the failed transaction from holding its
        partitions' last stable offset (every read_committed reader waits on it) until the broker
        expires it. After this the writer refuses further calls.
        """
        shown, count, dropped = self._refusals()
        causes = "; ".join(r.describe() for r in shown) or fallback
        more = count - len(shown)
        text = (f"branch {self.transactional_id}: {what}" + (f": {causes}" if causes else "")
                + (f"; {more} more record(s) failed with the same batch or cause" if more > 0 else "")
                + (f"; {dropped} more record(s) dropped with the failed transaction" if dropped else ""))
        try:
            self.abort_local()
            text += "; the branch was aborted"
            aborted = True
        except BranchError as exc:
            text += f"; aborting the branch also failed ({exc}): the broker ends it after its transaction timeout"
            aborted = False
        self._ended = f"ended after a failure ({what})"
        return TransactionFailed(text, shown, count, dropped, aborted)

    def _refused(self, name: str, text: str, topic: str, partition: int | None, index: int,
                 key: bytes | None) -> BranchError:
        """The error for a record the client refused at once; if the transaction had already failed, its cause."""
        if name == "_STATE":  # the transaction failed earlier; the cause is in the delivery reports
            self._flush(_CAUSE_WAIT_S)  # serves pending reports; returns at the first failure
            return self._fail("the transaction failed and was not usable any more", f"{text} ({name})")
        record = RefusedRecord(topic, partition if partition is not None and partition >= 0 else None, index,
                               redact.key_label(key), 0, name, text)
        error = RecordTooLarge if name == "MSG_SIZE_TOO_LARGE" else BranchError
        return error(f"branch {self.transactional_id}: {record.position()}: {text} ({name})")

    def send(self, topic: str, value: bytes | None, key: bytes | None = None,
             headers: Sequence[tuple[str, str | bytes | None]] | None = None, partition: int | None = None) -> None:
        """Adds one record to the branch; blocks briefly when the local queue is full.

        Raises:
            RecordTooLarge: the client refused the record at once; nothing was added, the branch stays usable.
            TransactionFailed: an earlier record was refused by the broker; the branch was aborted.
            BranchError: the client refused the record at once for another reason.
        """
        part = -1 if partition is None else partition  # -1: the configured partitioner decides
        hdrs = [(k, v.encode() if isinstance(v, str) else v) for k, v in headers] if headers else None
        failed = self._live().produce(topic, value, key, part, hdrs, self._records)
        if failed is not None:
            name, text = failed
            raise self._refused(name, text, topic, partition, self._records, key)
        self._records += 1

    def send_columns(self, topic: str, keys: Any, values: Any) -> None:
        """Adds one record per row of the Arrow columns (binary or string; ``keys`` may be None) to
        one topic, partitioned by the configured partitioner. Hot path: no Python object per record.

        Raises:
            as :meth:`send`, for the first row not added.
        """
        added, failed = self._live().produce_columns(topic, keys, values, self._records)
        index = self._records + added
        self._records += added
        if failed is not None:
            name, text = failed
            key = None if keys is None or added >= len(keys) else keys[added].as_py()
            raise self._refused(name, text, topic, None, index, key.encode() if isinstance(key, str) else key)

    @property
    def records(self) -> int:
        """How many records the branch took so far; the next record's index."""
        return self._records

    def prepare(self, flush_timeout_s: float = 300.0) -> BranchHandle:
        """Flushes every record into the still-open transaction and returns the branch handle.

        The flush stops at the first failed record: the transaction cannot commit any more, so
        waiting for the rest would only hold its partitions' last stable offset.

        Raises:
            TransactionFailed: the broker refused a record (names its position and the broker's
                reason, never its contents); the branch was aborted.
            BranchError: the flush timed out, or the open transaction could not be described; the
                branch was aborted.
        """
        left = self._flush(flush_timeout_s)
        if self._live().has_failed():
            raise self._fail("delivery failed")
        if left:
            raise self._fail(f"{left} records not flushed within {flush_timeout_s}s")
        if self._records == 0:
            return BranchHandle(self.transactional_id, -1, -1, 0, ())
        try:
            pid, epoch, partitions = describe_open(self._client_config, self.transactional_id)
        except BranchError as exc:
            raise self._fail(str(exc).removeprefix(f"branch {self.transactional_id}: ")) from None
        return BranchHandle(self.transactional_id, pid, epoch, self._records, partitions)

    def abort_local(self, timeout_s: float = 30.0) -> None:
        """Rolls back from the owning producer, before prepare (the task failed mid-write).

        librdkafka's abort drops the records still queued and waits only for those in flight, so
        it returns promptly even after a failure.
        """
        if self._producer is None:
            return  # released after prepare (the branch is the driver's to end now), or aborted already
        failed = self._producer.abort_transaction(int(timeout_s * 1000))
        self.release()
        if failed is not None:
            raise BranchError(f"branch {self.transactional_id}: abort failed: {failed[1]} ({failed[0]})")

    def release(self) -> None:
        """Destroys the producer (its threads and sockets) now, leaving a prepared transaction open.

        librdkafka's destroy sends no EndTxn, so the transaction stays with whoever holds the
        handle; tests/integration/test_kafka_xa.py pins that.
        """
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.release()


#: This Python worker's coordinator clients for :func:`describe_open`, by settings, kept for its next tasks (as
#: Spark's kafka sink keeps a producer per executor): a new kafka-python client per task was 7-9 ms of each task
#: (bench/task_phases.py). A client whose broker went away is replaced by its own retry (``call``).
_DESCRIBERS: dict[tuple[tuple[str, str], ...], TransactionCoordinatorClient] = {}


def _describer(config: KafkaConfig) -> TransactionCoordinatorClient:
    """This worker's coordinator client for these settings, made on first use. Executor."""
    key = tuple(sorted(dict(as_librdkafka_strings(config.librdkafka())).items()))
    client = _DESCRIBERS.get(key)
    if client is None:
        client = _DESCRIBERS[key] = TransactionCoordinatorClient(config)
    return client


def describe_open(client_config: KafkaConfig | Mapping[str, str],
                  transactional_id: str) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    """(producer id, producer epoch, partitions) of transactional_id's open transaction, from the broker. Executor.

    Retried through broker loss within ``kafka.default.api.timeout.ms`` (the coordinator may be
    moving while the task prepares).
    """
    try:
        desc = _describer(KafkaConfig.of(client_config)).call(
            f"describing the prepared transaction {transactional_id!r}",
            lambda admin: admin.describe_transactions([transactional_id])[transactional_id])
    except KafkaProtocolError as exc:
        raise BranchError(f"branch {transactional_id}: {exc}") from None
    if desc.state.value != "Ongoing":
        raise BranchError(f"branch {transactional_id}: expected an open transaction after flush, broker says {desc.state.value}")
    partitions = tuple(sorted((tp.topic, tp.partition) for tp in desc.topic_partitions))
    return desc.producer_id, desc.producer_epoch, partitions


def _ongoing(described: Mapping[str, Any]) -> list[OpenTransaction]:
    """The open (``Ongoing``) transactions of a DescribeTransactions answer, by id."""
    return [OpenTransaction(tid, desc.producer_id, desc.producer_epoch, desc.state.value,
                            desc.transaction_start_time_ms, desc.transaction_timeout_ms,
                            tuple(sorted((tp.topic, tp.partition) for tp in desc.topic_partitions)))
            for tid, desc in sorted(described.items()) if desc.state.value == "Ongoing"]


class XAResource(Protocol):
    """The XA resource port: what the committer needs from Kafka. Driver side."""

    def transaction_protocol(self) -> int:
        """The broker's transaction protocol (2: KIP-890, else 1); raises for a broker that cannot serve us."""
        ...

    def broker_max_timeout_ms(self) -> int:
        """The broker's ``transaction.max.timeout.ms``."""
        ...

    def missing_topics(self, topics: Iterable[str]) -> list[str]:
        """Topics that do not exist and will not be created on first write."""
        ...

    def commit(self, handle: BranchHandle) -> EndResult:
        """Ends one branch with commit; a branch already committed counts as done."""
        ...

    def rollback(self, handle: BranchHandle) -> EndResult:
        """Ends one branch with abort; a branch already rolled back counts as done."""
        ...

    def end_all(self, handles: Iterable[BranchHandle], commit: bool, parallelism: int = 8) -> list[EndResult]:
        """Ends many branches (phase 2), results in the order given."""
        ...

    def recover(self, transactional_id_prefix: str) -> list[OpenTransaction]:
        """Every open transaction whose id starts with the prefix, as the broker lists it."""
        ...

    def open_among(self, handles: Iterable[BranchHandle]) -> list[OpenTransaction]:
        """The handles' transactions still open, asked of each id's own coordinator (never a listing)."""
        ...

    def how_ended(self, handle: BranchHandle) -> str:
        """"committed", "aborted", "open" or "unknown", from the broker, without side effects."""
        ...

    def close(self) -> None:
        """Frees connections."""
        ...


class KafkaXAResource:
    """The transaction manager's view of Kafka for one link: the :class:`XAResource` port. Driver side.

    Every request to the brokers is retried through broker loss (a node restarting, the
    coordinator or a leader moving, the transaction log short of in-sync replicas) within
    ``kafka.default.api.timeout.ms``, on a new client bootstrapped from any live broker
    (:meth:`TransactionCoordinatorClient.call`); only then does a call fail, with
    :class:`~lastagent.errors.KafkaUnavailableError` naming the broker's condition.

    Args:
        client_config: kafka settings with the ``kafka.`` prefix removed (bootstrap.servers...).
    """

    def __init__(self, client_config: KafkaConfig | Mapping[str, str]) -> None:
        self._config = KafkaConfig.of(client_config)
        if not self._config.bootstrap_servers.strip():
            raise KafkaProtocolError("kafka.bootstrap.servers is required")
        # kafka-python clients (each its own I/O thread, thread-safe), renewed after a broker loss.
        self._wire = TransactionCoordinatorClient(self._config)
        self._protocol: int | None = None

    def transaction_protocol(self) -> int:
        """The cluster's transaction protocol (2 or 1), asked once; see :meth:`TransactionCoordinatorClient.transaction_protocol`."""
        if self._protocol is None:
            self._protocol = self._wire.transaction_protocol()
        return self._protocol

    def _ended_epoch(self, handle: BranchHandle) -> int:
        """The producer epoch the broker reports once *this* transaction has ended.

        Protocol 2 bumps the epoch at every end, so the end of this transaction shows as epoch + 1
        (and a later transaction of the id as more); protocol 1 leaves it as it was.
        """
        return handle.producer_epoch + (1 if self.transaction_protocol() >= 2 else 0)

    def broker_max_timeout_ms(self) -> int:
        """The broker's ``transaction.max.timeout.ms``; a branch timeout above it is refused."""
        return int(self._broker_config("transaction.max.timeout.ms"))

    def _broker_config(self, name: str) -> str:
        """A broker setting, from the broker the client is connected to (any live one: a cluster's
        brokers share the settings lastagent reads)."""
        from kafka.admin import ConfigResource, ConfigResourceType

        def ask(admin: Any) -> tuple[str, Any]:
            # Each broker listed in turn: the first one of the list may be the one that is down.
            failure: BaseException | None = None
            # Fenced brokers (away, or not yet caught up) last.
            for broker in sorted(admin.describe_cluster()["brokers"], key=lambda b: bool(b.get("is_fenced"))):
                broker_id = str(broker["broker_id"])
                try:
                    return broker_id, admin.describe_configs(
                        [ConfigResource(ConfigResourceType.BROKER, broker_id, configs=[name])], config_filter="all")
                except Exception as exc:  # the next broker is asked; the last failure is raised
                    if not is_retriable(exc):
                        raise
                    failure = exc
            raise failure or KafkaUnavailableError("the cluster listed no broker")

        broker_id, res = self._wire.call(f"reading the broker setting {name}", ask)
        entry = res.get("broker", {}).get(broker_id, {}).get(name)
        if entry is None:
            # The broker leaves out what the principal may not describe, rather than refusing.
            raise KafkaProtocolError(f"the broker did not report {name}: the principal needs DescribeConfigs on "
                                     "the Cluster (docs/security.md)")
        return str(entry["value"])

    def missing_topics(self, topics: Iterable[str]) -> list[str]:
        """The topics that do not exist and that the broker will not create on first write."""
        wanted = sorted(set(topics))
        if not wanted:
            return []
        missing = [t for t in wanted if t not in set(self._wire.call("listing the topics",
                                                                       lambda admin: admin.list_topics()))]
        if missing and self._broker_config("auto.create.topics.enable").lower() == "true":
            return []
        return missing

    # -- commit / rollback -------------------------------------------------------------------

    def commit(self, handle: BranchHandle) -> EndResult:
        """Commits a prepared branch; a branch already committed counts as done."""
        return self._end(handle, commit=True)

    def rollback(self, handle: BranchHandle) -> EndResult:
        """Rolls a prepared branch back; a branch already rolled back counts as done."""
        return self._end(handle, commit=False)

    def _end(self, handle: BranchHandle, commit: bool) -> EndResult:
        if handle.read_only:
            return EndResult(handle, EndOutcome.NOTHING_TO_END)
        verb = "commit" if commit else "rollback"
        what = (f"the {verb} of branch {handle.transactional_id} (producer id {handle.producer_id}, "
                f"epoch {handle.producer_epoch})")

        def end_txn(admin: Any) -> str:
            answer = self._wire.end_txn(handle.transactional_id, handle.producer_id, handle.producer_epoch, commit,
                                        admin=admin).error
            if answer in RETRIABLE_NAMES:  # markers still being written, the coordinator moving, too few replicas
                raise KafkaProtocolError(f"EndTxn answered {answer}", retriable=True)
            return answer

        error = self._wire.call(what, end_txn)
        if error == "NONE":
            return EndResult(handle, EndOutcome.COMMITTED if commit else EndOutcome.ROLLED_BACK)
        if error in _GONE:
            return self._explain_gone(handle, commit, error)
        raise KafkaProtocolError(f"{what} failed: {error}")

    def _describe(self, transactional_ids: Sequence[str], what: str) -> dict[str, Any]:
        """The broker's DescribeTransactions answer for the ids, retried through broker loss."""
        ids = list(transactional_ids)
        return self._wire.call(what, lambda admin: admin.describe_transactions(ids))

    def _explain_gone(self, handle: BranchHandle, commit: bool, error: str) -> EndResult:
        """The handle no longer names the open transaction: find out how it ended.

        Raises:
            KafkaUnavailableError: the broker could not say within the budget; nothing is concluded
                (the decided epoch stays to be completed by the next start).
        """
        try:
            desc = self._describe([handle.transactional_id], f"how branch {handle.transactional_id} ended")[
                handle.transactional_id]
            state, pid, epoch = desc.state.value, desc.producer_id, desc.producer_epoch
        except KafkaProtocolError as exc:
            if exc.error != "TRANSACTIONAL_ID_NOT_FOUND":
                raise
            # The broker forgot the id (transactional.id.expiration.ms): its last transaction is unknown.
            state, pid, epoch = "unknown (no such transactional id)", -1, -1
        detail = (f"EndTxn answered {error}; broker now reports {state} for producer id {pid} "
                  f"epoch {epoch} (branch had producer id {handle.producer_id} epoch {handle.producer_epoch})")
        ended = self._ended_as(handle, state, pid, epoch)
        if commit:
            if ended == "committed":
                return EndResult(handle, EndOutcome.COMMITTED, detail)
            return EndResult(handle, EndOutcome.NOT_COMMITTED, detail)
        if ended == "committed":
            return EndResult(handle, EndOutcome.HEURISTIC_COMMIT, detail)
        # Aborted, expired or fenced: for a rollback every one of those means "not committed".
        return EndResult(handle, EndOutcome.ROLLED_BACK, detail)

    def _ended_as(self, handle: BranchHandle, state: str, pid: int, epoch: int) -> str:
        """How the broker's answer for the id (state, producer id, producer epoch) says *this* transaction ended.

        The one reading of a describe answer, used by every caller. PrepareCommit counts as committed:
        the coordinator has written the commit decision to its log and finishes the markers on its own,
        even across a coordinator move; PrepareAbort likewise counts as aborted.

        Returns:
            "open" (this transaction is still open), "committed", "aborted", or "unknown" when the
            broker's last word on the id is not this transaction's end (the id moved on).
        """
        if pid == handle.producer_id and epoch == handle.producer_epoch and state == "Ongoing":
            return "open"
        if pid == handle.producer_id and epoch == self._ended_epoch(handle):
            if state in ("CompleteCommit", "PrepareCommit"):
                return "committed"
            if state in ("CompleteAbort", "PrepareAbort", "PrepareEpochFence"):
                return "aborted"
        return "unknown"

    def how_ended(self, handle: BranchHandle) -> str:
        """How a branch that is no longer open ended, from the broker's describe (no side effect).

        Returns:
            "committed" or "aborted" when the broker's last word on the id is this very
            transaction's end (same producer id; epoch + 1 under transaction protocol 2);
            "open" when it is still open; "unknown" when the id has moved on to a newer one.
        """
        desc = self._describe([handle.transactional_id], f"how branch {handle.transactional_id} ended")[
            handle.transactional_id]
        return self._ended_as(handle, desc.state.value, desc.producer_id, desc.producer_epoch)

    def end_all(self, handles: Iterable[BranchHandle], commit: bool, parallelism: int = 8) -> list[EndResult]:
        """Ends many branches in parallel (phase 2), results in the order given."""
        from concurrent.futures import ThreadPoolExecutor

        handles = list(handles)
        if not handles:
            return []
        # One branch first, so a crash test can stop between two branch commits.
        first = [self._end(handles[0], commit)]
        faults.point("between_branch_commits" if commit else "between_branch_rollbacks")
        handles = handles[1:]
        if len(handles) <= 1:
            return first + [self._end(h, commit) for h in handles]

        # Threads share this resource's kafka-python client, which pipelines their requests.
        with ThreadPoolExecutor(max_workers=min(parallelism, len(handles))) as pool:
            return first + list(pool.map(lambda h: self._end(h, commit), handles))

    # -- recover -------------------------------------------------------------------------------

    def recover(self, transactional_id_prefix: str) -> list[OpenTransaction]:
        """Every open transaction whose transactional.id starts with the prefix, from the broker.

        Only ``Ongoing`` transactions are in doubt: one in PrepareCommit / PrepareAbort is
        already decided by its coordinator, which completes it on its own.

        Every broker the cluster lists must answer (each coordinates a share of the transaction
        log): while one is away but still listed, the listing is retried until the cluster moves
        its share to the others or it comes back, within ``kafka.default.api.timeout.ms``; a
        partial listing is never taken for the whole.
        """
        self._require_describe(transactional_id_prefix)
        ids = self._listed(transactional_id_prefix, ["Ongoing"])
        if not ids:
            return []
        # An id that ended between list and describe is left out.
        return _ongoing(self._describe(ids, f"the open transactions of '{transactional_id_prefix}*'"))

    def open_among(self, handles: Iterable[BranchHandle]) -> list[OpenTransaction]:
        """The handles' transactions the broker holds open, each asked of its own coordinator. Driver side.

        ListTransactions can miss an open transaction while its coordinator moves (a rolling
        restart: the old leader of its transaction-log partition has unloaded it and the new one has
        not begun loading), and says nothing of it; DescribeTransactions goes to the id's
        coordinator and is retried until that one answers. An id the broker does not know is not open.
        """
        out = []
        # One id per request: only the ids a listing missed come here (rarely), and a batch answer that
        # one id is unknown names no one.
        for tid in sorted({h.transactional_id for h in handles if not h.read_only}):
            try:
                out += _ongoing(self._describe([tid], f"whether branch {tid} is still open"))
            except KafkaProtocolError as exc:
                if exc.error != "TRANSACTIONAL_ID_NOT_FOUND":
                    raise
        return out

    def transactional_ids(self, transactional_id_prefix: str) -> list[str]:
        """Every transactional id the broker holds with the prefix, in any state. Driver side.

        The broker keeps an id (and its producer state) until ``transactional.id.expiration.ms``
        after its last transaction: what a link costs the brokers (tests and ``bench/epoch_cost.py`` count them).
        """
        return self._listed(transactional_id_prefix)

    def _listed(self, prefix: str, states: Sequence[str] = ()) -> list[str]:
        """The transactional ids with the prefix that every broker lists (in the given states)."""
        listed = self._wire.call(f"listing the transactions of '{prefix}*' on every broker",
                                 lambda admin: admin.list_transactions(state_filters=list(states) or None))
        return sorted({t.transactional_id for rows in listed.values() for t in rows
                       if t.transactional_id.startswith(prefix)})

    def _require_describe(self, prefix: str) -> None:
        """Fails unless the principal may describe the prefix's transactional ids.

        ListTransactions leaves out the ids a principal may not describe instead of refusing, so
        without this check a missing ACL would read as "nothing open" and recovery would decide
        on a partial view. Describing an id under the prefix is refused exactly then.
        """
        try:
            # A new cluster creates its transaction log on the first FindCoordinator: retried.
            self._describe([f"{prefix}access-check"], f"listing the open transactions of '{prefix}*'")
        except KafkaProtocolError as exc:
            if exc.error != "TRANSACTIONAL_ID_NOT_FOUND":
                raise

    def close(self) -> None:
        self._wire.close()

    def __enter__(self) -> KafkaXAResource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
