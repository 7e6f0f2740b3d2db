"""The ``lastagent-kafka`` streaming source on Spark 4's Python Data Source API.

* :class:`KafkaStreamReader` runs on the driver (in Spark's long-lived Python source
  process): it resolves starting offsets, plans each micro-batch under admission control
  (``maxOffsetsPerTrigger``, ``minOffsetsPerTrigger``, ``maxTriggerDelay``: Spark's on 4.2+,
  the reader's own before), detects data loss, and commits processed offsets to
  ``kafka.group.id`` when one is set.
* :func:`read_range` runs on executors, one Spark task per offset range: it reads the range
  with a reused librdkafka consumer of ``lastagent._native``, straight into pyarrow record batches of at most
  ``maxRecordsPerArrowBatch`` rows, so a task's memory is bounded whatever the partition's size.

Under ``read_committed`` (the default) the batch's end is the partition's last stable
offset, so a batch never waits on an open transaction; records of aborted transactions are
skipped by the client, and the offsets they and the transaction markers occupy are gaps
that end a range without counting as loss.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from lastagent.errors import DataLossError, KafkaProtocolError, OptionError
from lastagent.kafka.config import KafkaConfig, access_hint, as_librdkafka_strings, setting_in
from lastagent.sources.kafka_offsets import (
    TP,
    OffsetRange,
    OffsetReader,
    check_loss,
    from_json,
    hold_back,
    plan_ranges,
    rate_limit,
    to_json,
)
from lastagent.sources.kafka_source_options import EARLIEST, LATEST, KafkaSourceOptions
from lastagent.spark_api import ADMISSION_CONTROL, ReadAllAvailable, ReadLimit, ReadMaxRows, ReadMinRows, SupportsTriggerAvailableNow

log = logging.getLogger("lastagent.source")

HEADERS_TYPE = ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())]))


def kafka_schema(include_headers: bool) -> StructType:
    """The row schema of Spark's built-in kafka source."""
    fields = [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
    ]
    if include_headers:
        fields.append(StructField("headers", HEADERS_TYPE))
    return StructType(fields)


@dataclass(frozen=True)
class KafkaInputPartition(InputPartition):
    """One Spark task's work (pickled to the executor): an offset range and the client settings."""

    range: OffsetRange
    options: KafkaSourceOptions


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans micro-batches over Kafka offsets. Driver side.

    One reader serves every Spark 4 minor. pyspark 4.2+ sees ``latestOffset(start, limit)`` and treats
    it as a source with admission control; 4.0 and 4.1 call ``latestOffset()`` with neither, and the
    reader supplies both: the start is the end of the newest batch Spark planned (Spark passes a
    restarted query's last end through ``partitions(end, end)`` before it asks) or, before any, a new
    query's initial offsets (Spark asks for the end of its first batch before its start); the limit is
    the options'. Both give the same batches; only ``Trigger.AvailableNow`` differs before 4.2, where
    Spark asks for the end once per run (:mod:`lastagent.spark_api`).

    Args:
        options: the checked options (parsed once, at query start).
    """

    def __init__(self, options: KafkaSourceOptions) -> None:
        self.options = options
        self._offsets: OffsetReader | None = OffsetReader(options)
        self._available_now: dict[TP, int] | None = None
        self._latest: dict[TP, int] = {}
        self._group_committed: dict[TP, int] = {}
        self._initial: dict | None = None
        self._planned: dict[TP, int] | None = None
        self._last_batch_ms = 0
        self._said_capped = False
        self._known = set(self.offsets.partitions(must_exist=True))
        self.offsets.require_group_access()

    @property
    def offsets(self) -> OffsetReader:
        """The driver's admin client (created again if this reader was unpickled)."""
        if self._offsets is None:
            self._offsets = OffsetReader(self.options)
        return self._offsets

    def __getstate__(self) -> dict[str, Any]:
        # Spark pickles the reader with read(): the admin client stays on the driver.
        return dict(self.__dict__, _offsets=None)

    # -- start ----------------------------------------------------------------------------

    def initialOffset(self) -> dict:  # Spark's API
        """Resolves startingOffsets / startingTimestamp / startingOffsetsByTimestamp (new query only).

        Resolved once: before 4.2 the reader plans a new query's first batch from it before Spark asks.
        """
        if self._initial is None:
            self._initial = to_json(starting_offsets(self.offsets, self.options, sorted(self._known)))
        return self._initial

    # -- each trigger -----------------------------------------------------------------------

    def getDefaultReadLimit(self) -> ReadLimit:  # Spark's API (4.2+)
        """``maxOffsetsPerTrigger`` (or else ``minOffsetsPerTrigger``) as Spark's admission control sees it.

        Spark has no composite limit for Python sources: :meth:`latestOffset` takes both bounds from
        the options whatever limit Spark passes back, unless it is :class:`ReadAllAvailable`.
        """
        o = self.options
        if o.max_offsets_per_trigger:
            return ReadMaxRows(o.max_offsets_per_trigger)
        if o.min_offsets_per_trigger:
            return ReadMinRows(o.min_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:  # Spark's API (4.2+)
        """Trigger.AvailableNow: fixes the end at the offsets available now."""
        tps = self.offsets.partitions()
        self._available_now = self.offsets.latest(tps)

    def latestOffset(self, start: dict | None = None, limit: ReadLimit | None = None) -> dict:  # Spark's API
        """The end of the next batch: latest (stable) offsets, new partitions from earliest, under admission control.

        Args:
            start: the batch's start (pyspark 4.2+); None before 4.2, when the reader knows it itself.
            limit: Spark's read limit (4.2+); None before 4.2, when the options' limits apply.
        """
        if start is None:  # before 4.2: the end of the batch Spark last planned, or a new query's start
            start = to_json(self._planned) if self._planned is not None else self.initialOffset()
        begin = from_json(start)
        # Spark asks for the next batch's end only once the previous batch is done (and calls
        # commit() only when a next batch starts): report the finished position to the group now.
        self._commit_group(begin)
        tps = self.offsets.partitions()
        new = [tp for tp in tps if tp not in begin]
        if new:
            log.info("new partitions %s: reading them from earliest", ", ".join(f"{t}-{p}" for t, p in new))
            begin.update(self.offsets.earliest(new))
        earliest = self.offsets.earliest([tp for tp in begin if tp in set(tps)])
        begin = check_loss(begin, earliest, self.options.fail_on_data_loss)
        latest = self._available_now if self._available_now is not None else self.offsets.latest(tps)
        latest = {tp: max(off, begin.get(tp, off)) for tp, off in latest.items() if tp in begin}
        self._latest = latest
        cap, minimum = self._limits(limit)
        now_ms = int(time.time() * 1000)
        if minimum and hold_back(begin, latest, minimum, self.options.max_trigger_delay_ms, self._last_batch_ms, now_ms):
            # No batch this trigger: the end Spark already has (its start) leaves it nothing new to run.
            return start
        self._last_batch_ms = now_ms
        if cap:
            capped = rate_limit(begin, latest, cap)
            if not ADMISSION_CONTROL and capped != latest and not self._said_capped:
                self._said_capped = True
                log.warning("maxOffsetsPerTrigger=%d holds this batch to %d of %d new offsets; before Spark 4.2 "
                            "a Trigger.AvailableNow run asks a Python source once, so such a run ends after this "
                            "one batch (a processing-time trigger runs the rest in later batches)", cap,
                            sum(capped[tp] - begin.get(tp, 0) for tp in capped),
                            sum(latest[tp] - begin.get(tp, 0) for tp in latest))
            latest = capped
        return to_json({**begin, **latest})

    def _limits(self, limit: ReadLimit | None) -> tuple[int | None, int | None]:
        """(maxOffsetsPerTrigger, minOffsetsPerTrigger) for this trigger: none under Spark's
        :class:`ReadAllAvailable`; no minimum under Trigger.AvailableNow, which must end."""
        if isinstance(limit, ReadAllAvailable):
            return None, None
        cap = limit.max_rows if isinstance(limit, ReadMaxRows) else self.options.max_offsets_per_trigger
        minimum = None if self._available_now is not None else self.options.min_offsets_per_trigger
        return cap, minimum

    def reportLatestOffset(self) -> dict | None:  # Spark's API (4.2+)
        return to_json(self._latest) if self._latest else None

    def partitions(self, start: dict, end: dict) -> list[KafkaInputPartition]:
        """One task per offset range (split further under minPartitions)."""
        begin, until = from_json(start), from_json(end)
        self._planned = dict(until)  # before 4.2, the start of the next batch (latestOffset)
        new = [tp for tp in until if tp not in begin]
        if new:
            # A partition first seen in this batch is read from its earliest offset (as Spark's
            # kafka source does); found only now, so records already gone are data loss.
            earliest = self.offsets.earliest(new)
            begin.update(check_loss({tp: 0 for tp in new}, earliest, self.options.fail_on_data_loss))
        ranges = plan_ranges(begin, until, self.options.min_partitions)
        return [KafkaInputPartition(r, self.options) for r in ranges]

    def read(self, partition: KafkaInputPartition) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        """Executor: the records of one offset range as Arrow record batches."""
        return read_range(partition.range, partition.options)

    def commit(self, end: dict) -> None:
        """Spark is done with offsets up to ``end``: reports them to ``kafka.group.id``, if set."""
        self._commit_group(from_json(end))

    def _commit_group(self, offsets: dict[TP, int]) -> None:
        """Commits processed offsets to the group, for lag tools only: correctness never reads them."""
        if not self.options.group_id or not offsets or offsets == self._group_committed:
            return
        try:
            self.offsets.commit_group(offsets)
            self._group_committed = dict(offsets)
        except KafkaProtocolError as e:
            # Offsets live in Spark's checkpoint; a failed group commit only delays lag reports.
            log.warning("could not commit offsets to group %s (progress is safe in the checkpoint): %s",
                        self.options.group_id, e)


class FailedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Stands in for a reader whose start-up checks failed; raises that error at Spark's first call.

    Driver side. pyspark 4.2's source runner calls ``reader.stop()`` in a ``finally`` even when
    the reader's constructor raised, so an error raised there reaches the user as an
    ``UnboundLocalError``; raised from the first method call instead, it arrives whole.
    """

    def __init__(self, error: Exception) -> None:
        self.error = error

    def _raise(self, *_: Any) -> Any:
        raise self.error

    initialOffset = latestOffset = getDefaultReadLimit = prepareForTriggerAvailableNow = _raise  # type: ignore[assignment]
    reportLatestOffset = partitions = read = commit = _raise  # type: ignore[assignment]

    def stop(self) -> None:
        return None


def starting_offsets(offsets: OffsetReader, o: KafkaSourceOptions, tps: list[TP]) -> dict[TP, int]:
    """Resolves startingOffsets / startingTimestamp / startingOffsetsByTimestamp for ``tps``. Driver side."""
    if o.starting_timestamp is not None or o.starting_by_timestamp is not None:
        return _by_timestamp(offsets, o, tps, "starting")
    if o.starting == "earliest":
        return offsets.earliest(tps)
    if o.starting == "latest":
        return offsets.latest(tps)
    if o.starting == "group":
        committed = offsets.group_offsets(tps)
        missing = [tp for tp in tps if tp not in committed]
        if missing:
            log.info("group %s has no offset for %s; starting them at earliest", o.group_id,
                     ", ".join(f"{t}-{p}" for t, p in missing))
        return {**offsets.earliest(missing), **committed}
    assert isinstance(o.starting, dict)
    given = {(t, p): off for t, parts in o.starting.items() for p, off in parts.items()}
    unknown = sorted(set(given) - set(tps))
    if unknown:
        raise OptionError("startingOffsets", f"names {', '.join(f'{t}-{p}' for t, p in unknown)}, which the "
                                             f"{o.strategy()} option does not cover (partitions: "
                                             f"{', '.join(f'{t}-{p}' for t, p in tps)})")
    missing = [tp for tp in tps if tp not in given]
    if missing:
        raise OptionError("startingOffsets", f"gives no offset for {', '.join(f'{t}-{p}' for t, p in missing)}; "
                                             "give every partition an offset, -2 (earliest) or -1 (latest)")
    earliest = offsets.earliest([tp for tp, v in given.items() if v == EARLIEST])
    latest = offsets.latest([tp for tp, v in given.items() if v == LATEST])
    return {tp: earliest.get(tp, latest.get(tp, v)) for tp, v in given.items()}


def ending_offsets(offsets: OffsetReader, o: KafkaSourceOptions, tps: list[TP]) -> dict[TP, int]:
    """Resolves endingOffsets / endingTimestamp / endingOffsetsByTimestamp of a batch read. Driver side.

    Never beyond the latest (under read_committed, last stable) offset: an explicit offset past
    it is an error naming endingOffsets rather than a task that waits for records that are not there.
    """
    latest = offsets.latest(tps)
    if o.ending_timestamp is not None or o.ending_by_timestamp is not None:
        found = _by_timestamp(offsets, o, tps, "ending")
        return {tp: min(found[tp], latest[tp]) for tp in tps}
    if o.ending == "latest":
        return latest
    assert isinstance(o.ending, dict)
    given = {(t, p): off for t, parts in o.ending.items() for p, off in parts.items()}
    missing = [tp for tp in tps if tp not in given]
    if missing:
        raise OptionError("endingOffsets", f"gives no offset for {', '.join(f'{t}-{p}' for t, p in missing)}; "
                                           "give every partition an offset or -1 (latest)")
    beyond = [tp for tp in tps if given[tp] > latest[tp]]
    if beyond:
        raise OptionError("endingOffsets", "is beyond the latest offset in " + ", ".join(
            f"{t}-{p} ({given[(t, p)]} > {latest[(t, p)]})" for t, p in beyond) + "; give at most the latest "
            "offset or -1 (latest)")
    return {tp: latest[tp] if given[tp] == LATEST else given[tp] for tp in tps}


def _by_timestamp(offsets: OffsetReader, o: KafkaSourceOptions, tps: list[TP], end: str) -> dict[TP, int]:
    """Offsets of ``tps`` from the ``end`` ("starting" or "ending") timestamp options. Driver side."""
    by_partition = o.starting_by_timestamp if end == "starting" else o.ending_by_timestamp
    if by_partition is not None:
        name = f"{end}OffsetsByTimestamp"
        stamps = {(t, p): ts for t, parts in by_partition.items() for p, ts in parts.items()}
        missing = [tp for tp in tps if tp not in stamps]
        if missing:
            raise OptionError(name, f"gives no timestamp for {', '.join(f'{t}-{p}' for t, p in missing)}")
    else:
        name = f"{end}Timestamp"
        one = o.starting_timestamp if end == "starting" else o.ending_timestamp
        assert one is not None, f"{name} is set when no {end}OffsetsByTimestamp is"
        stamps = {tp: one for tp in tps}
    found = offsets.by_timestamp(stamps)
    none = [tp for tp, off in found.items() if off < 0]
    # No record at or after an ending timestamp: that partition ends at latest, as in Spark.
    if none and end == "starting" and o.timestamp_strategy == "error":
        raise OptionError(name, f"no record at or after the given timestamp in "
                                f"{', '.join(f'{t}-{p}' for t, p in sorted(none))}; set "
                                "startingOffsetsByTimestampStrategy=latest to start those at the end")
    latest = offsets.latest(none)
    return {tp: (latest[tp] if off < 0 else off) for tp, off in found.items()}


class KafkaBatchReader(DataSourceReader):
    """``spark.read.format("lastagent-kafka")``: one bounded read of the offsets between the
    starting and ending options. Planned on the driver, read by the executors' reused consumers.

    Args:
        options: the checked options (parsed with ``batch=True``).
    """

    def __init__(self, options: KafkaSourceOptions) -> None:
        self.options = options

    def partitions(self) -> list[KafkaInputPartition]:
        """Driver: resolves both ends now and cuts the offset ranges into Spark partitions."""
        reader = OffsetReader(self.options)
        tps = reader.partitions(must_exist=True)
        reader.require_group_access()
        begin = starting_offsets(reader, self.options, tps)
        end = ending_offsets(reader, self.options, tps)
        begin = check_loss(begin, reader.earliest(tps), self.options.fail_on_data_loss)
        behind = sorted(tp for tp in tps if tp in begin and end[tp] < begin[tp])
        if behind:
            raise OptionError("endingOffsets", "ends before the start in "
                                               f"{', '.join(f'{t}-{p} ({begin[(t, p)]} > {end[(t, p)]})' for t, p in behind)}")
        ranges = plan_ranges(begin, end, self.options.min_partitions)
        log.info("batch read of %d offset range(s), %d records at most", len(ranges), sum(r.size for r in ranges))
        return [KafkaInputPartition(r, self.options) for r in ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Executor: the records of one offset range as Arrow record batches."""
        if not isinstance(partition, KafkaInputPartition):
            # Nothing to read: pyspark plans one InputPartition(None) in place of an empty list.
            return iter(())
        return read_range(partition.range, partition.options)


# -- executor side ------------------------------------------------------------------------

#: Idle consumers of this Python worker, keyed by their settings, reused by its next tasks. A read
#: checks one out for its whole life and checks it back in when it ends, so a read that ends late
#: (a generator Spark dropped and the garbage collector finalises during a later task) can only
#: touch its own consumer, never the one a later read is using.
_IDLE: dict[tuple[tuple[str, str], ...], list[Any]] = {}


def _checkout(client: KafkaConfig, group_id_prefix: str = "lastagent-source") -> tuple[tuple[tuple[str, str], ...], Any]:
    """(key, consumer) for these settings: an idle one of this worker, or a new one. Executor.

    The consumer is the compiled ``lastagent._native.RangeConsumer`` (librdkafka into Arrow).

    Raises:
        OptionError: librdkafka refused a ``kafka.*`` setting (named).
        KafkaProtocolError: librdkafka could not create the client.
    """
    from lastagent._native import NativeKafkaError, RangeConsumer, SettingRefused

    config = dict(as_librdkafka_strings(client.librdkafka()))
    key = tuple(sorted(config.items())) + (("groupIdPrefix", group_id_prefix),)
    idle = _IDLE.get(key)
    if idle:
        return key, idle.pop()
    settings = consumer_settings(config, group_id_prefix)
    try:
        return key, RangeConsumer(list(settings.items()), token_provider=client.token_provider())
    except SettingRefused as e:
        raise OptionError(f"kafka.{e.args[0]}", f"rejected by the Kafka client: {e.args[1]}") from None
    except NativeKafkaError as e:
        option = setting_in(str(e), settings)
        if option != "kafka.*":  # a value the client refuses, checked at start too
            raise OptionError(option, f"the Kafka client could not start with it: {e}") from None
        raise KafkaProtocolError(f"the source's Kafka consumer: {e}") from e


def consumer_settings(config: dict[str, str], group_id_prefix: str) -> dict[str, str]:
    """librdkafka settings of a task's consumer: the user's ``kafka.*`` settings over lastagent's
    defaults, and the few a range read depends on, which no setting overrides. No I/O; executor.
    """
    return {
        # Bounded prefetch: the client's queue, not the partition's size, sets memory use.
        "queued.max.messages.kbytes": "16384",
        "fetch.max.bytes": str(16 * 1024 * 1024),
        # A reused consumer's next range waits for the previous range's last fetch, a long poll at
        # the end of the log held by the broker for up to this long (librdkafka's default: 500 ms).
        # A range never waits for records beyond the last stable offset, so the long poll buys nothing.
        "fetch.wait.max.ms": "50",
        # Once the queue holds its limit (16 MB or queued.min.messages), librdkafka stops fetching
        # for fetch.queue.backoff.ms, 1 s by default: a task that drains the queue while Spark takes
        # its batches then sits idle for the rest of that second. Measured: a 1,000,000-record range
        # spent 2.1-3.9 s in the client's batch calls in a Spark task, against 0.3 s outside Spark.
        "fetch.queue.backoff.ms": "10",
        **config,
        "group.id": config.get("group.id") or f"{group_id_prefix}-{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": "false",
        "enable.auto.offset.store": "false",
        "enable.partition.eof": "true",
        # Out-of-range is data loss; failOnDataLoss decides, never a silent reset.
        "auto.offset.reset": "error",
    }


def _checkin(key: tuple[tuple[str, str], ...], consumer: Any) -> None:
    """Returns a consumer for the worker's next task; one idle consumer per settings is kept. Executor."""
    consumer.unassign()
    idle = _IDLE.setdefault(key, [])
    if idle:
        consumer.close()  # a late-ending read's extra consumer: the worker keeps one
    else:
        idle.append(consumer)


def read_range(r: OffsetRange, options: KafkaSourceOptions) -> Iterator[pa.RecordBatch]:
    """Reads offsets [r.start, r.until) of one partition. Runs on an executor.

    The records go from librdkafka into Arrow arrays without a Python object per record
    (``lastagent._native``); each batch holds at most ``maxRecordsPerArrowBatch`` rows. The
    range ends at the first record, or end-of-partition event, at or beyond ``until``: under
    read_committed the last offsets of a range may be transaction markers or aborted records
    that the client never returns.

    Raises:
        DataLossError: records of the range are gone and ``failOnDataLoss`` is true.
        KafkaProtocolError: no progress within ``kafkaConsumer.pollTimeoutMs``, or a client error.
    """
    from lastagent.sources.kafka_columns import arrow_schema

    schema = arrow_schema(options.include_headers)
    key, consumer = _checkout(options.client_config, options.group_id_prefix)
    consumer.assign(r.topic, r.partition, r.start)
    position = r.start
    patience = options.poll_timeout_ms / 1000
    deadline = time.monotonic() + patience
    wait_ms = int(min(1.0, patience) * 1000)
    try:
        while position < r.until:
            native, after, status, error = consumer.next_batch(r.until, options.batch_rows, wait_ms,
                                                               options.include_headers)
            if native is not None:
                batch = pa.record_batch(native)
                if batch.schema != schema:  # a build of lastagent._native that does not match this code
                    raise KafkaProtocolError(f"lastagent._native gave batches of schema {batch.schema}, not {schema}; "
                                             "reinstall lastagent")
                yield batch
            if after >= 0:
                position = max(position, after)
                deadline = time.monotonic() + patience
            if status == "done":
                position = r.until
            elif status == "reset":
                position = _lost(consumer, r, position, options)
            elif status == "error":
                name, text = error
                hint = access_hint(name)
                raise KafkaProtocolError(f"{r.topic}-{r.partition} at offset {position}: {text}"
                                         + (f"; {hint}" if hint else ""), retriable=False)
            elif status == "wait" and time.monotonic() > deadline:
                raise KafkaProtocolError(
                    f"{r.topic}-{r.partition}: no record at offset {position} within kafkaConsumer.pollTimeoutMs="
                    f"{options.poll_timeout_ms} (range [{r.start}, {r.until})); is the broker reachable?",
                    retriable=True)
    finally:
        _checkin(key, consumer)


def _lost(consumer: Any, r: OffsetRange, position: int, options: KafkaSourceOptions) -> int:
    """Offset ``position`` is out of range mid-read: fail, or skip to the earliest offset left."""
    from lastagent._native import NativeKafkaError

    try:
        low, _high = consumer.watermarks(r.topic, r.partition, options.api_timeout_ms)
    except NativeKafkaError as e:
        raise KafkaProtocolError(f"{r.topic}-{r.partition}: records at offset {position} are out of range, and "
                                 f"asking the broker for the partition's earliest offset failed: {e}",
                                 retriable=True) from e
    msg = (f"records of {r.topic}-{r.partition} at offsets [{position}, {min(low, r.until)}) are gone "
           f"(retention or truncation) before this query read them")
    if options.fail_on_data_loss or low <= position:
        raise DataLossError(msg + ". Set failOnDataLoss=false to skip lost records and continue.")
    log.warning("%s; skipping them (failOnDataLoss=false)", msg)
    if low >= r.until:
        return r.until
    consumer.assign(r.topic, r.partition, low)
    return low
