"""The branch writer: one Kafka transaction written by one Spark task attempt and left prepared. Executor side.

:class:`BranchWriter` owns a librdkafka transactional producer (``lastagent._native``), writes records, and
``prepare()`` flushes them inside the still-open transaction and returns the branch's :class:`BranchHandle`. It
never commits, aborts or closes that transaction on the way out: the transaction outlives the producer, the task,
even a SIGKILL of the process, until the driver ends it by its handle (:mod:`lastagent.kafka.xa`) or the broker's
``transaction.timeout.ms`` expires it. The only other request a task makes is the describe of its own open
transaction (:func:`describe_open`), for the handle's producer id and epoch.

This module does not import the driver's transaction client (:class:`lastagent.kafka.xa.KafkaXAResource`:
``EndTxn``, listing, the broker's limits); the handle it returns is :class:`lastagent.core.branch_handle.BranchHandle`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lastagent import redact
from lastagent.core.branch_handle import BranchHandle
from lastagent.errors import BranchError, KafkaProtocolError, RecordTooLarge, TransactionFailed
from lastagent.kafka.config import KafkaConfig, access_hint, as_librdkafka_strings
from lastagent.kafka.wire import TransactionCoordinatorClient

log = logging.getLogger("lastagent.kafka")

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
    from lastagent.kafka import internals as kafka_internals

    try:
        desc = _describer(KafkaConfig.of(client_config)).call(
            f"describing the prepared transaction {transactional_id!r}",
            lambda admin: kafka_internals.describe_transactions(admin, [transactional_id])[transactional_id])
    except KafkaProtocolError as exc:
        raise BranchError(f"branch {transactional_id}: {exc}") from None
    if desc.state != "Ongoing":
        raise BranchError(f"branch {transactional_id}: expected an open transaction after flush, broker says {desc.state}")
    return desc.producer_id, desc.producer_epoch, tuple(sorted(desc.topic_partitions))
