"""Offsets, ranges and the broker's view of them for the ``lastagent-kafka`` source.

Two parts:

* pure functions (no I/O) that plan a micro-batch: admission control under
  ``maxOffsetsPerTrigger`` and the split of offset ranges into Spark partitions
  (``minPartitions``), as Spark's own kafka source does them;
* :class:`OffsetReader`, the driver's Kafka admin client: partitions of the subscription,
  earliest/latest offsets (latest is the last *stable* offset under read_committed, so a
  batch never ends inside an open transaction), offsets by timestamp, and the group's
  committed offsets.

Offsets travel through Spark's checkpoint as ``{"topic": {"0": 42}}``, the JSON shape of
Spark's built-in kafka source.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lastagent.errors import DataLossError, KafkaProtocolError, OptionError
from lastagent.kafka.config import access_hint, as_librdkafka_strings, setting_in
from lastagent.kafka.oauth import check_login
from lastagent.kafka.retry import is_retriable, retried
from lastagent.sources.kafka_source_options import KafkaSourceOptions

log = logging.getLogger("lastagent.source")

TP = tuple[str, int]


def to_json(offsets: Mapping[TP, int]) -> dict[str, dict[str, int]]:
    """{(topic, partition): offset} → Spark checkpoint form, sorted so equal offsets print equal."""
    out: dict[str, dict[str, int]] = {}
    for (topic, part), off in sorted(offsets.items()):
        out.setdefault(topic, {})[str(part)] = int(off)
    return out


def from_json(offsets: Mapping[str, Mapping[str, int]]) -> dict[TP, int]:
    """Spark checkpoint form → {(topic, partition): offset}."""
    return {(topic, int(p)): int(o) for topic, parts in offsets.items() for p, o in parts.items()}


def rate_limit(start: Mapping[TP, int], latest: Mapping[TP, int], max_rows: int) -> dict[TP, int]:
    """End offsets for one batch under ``maxOffsetsPerTrigger``, shared in proportion to backlog.

    Spark's rule: each partition gets ``max_rows * size / total`` offsets, rounded down, but
    at least one when its share is below one, never beyond its latest offset.
    Pure: no I/O, runs on the driver.
    """
    sizes = {tp: max(0, latest[tp] - start.get(tp, latest[tp])) for tp in latest}
    total = sum(sizes.values())
    if total <= max_rows:
        return dict(latest)
    out = {}
    for tp, end in latest.items():
        begin = start.get(tp, end)
        share = max_rows * (sizes[tp] / total)
        step = math.ceil(share) if share < 1 else math.floor(share)
        out[tp] = min(begin + step, end)
    return out


def hold_back(start: Mapping[TP, int], latest: Mapping[TP, int], min_rows: int, max_delay_ms: int,
              last_batch_ms: int, now_ms: int) -> bool:
    """True when the next batch should wait under ``minOffsetsPerTrigger`` / ``maxTriggerDelay``.

    Spark's kafka source's rule: never once ``max_delay_ms`` has passed since the last batch let
    through (``last_batch_ms``; 0 before the first, so a query's first trigger always runs); else
    while fewer than ``min_rows`` offsets are new over all partitions (a partition new to
    ``start`` counts from offset 0). Pure: no I/O, runs on the driver.
    """
    if now_ms - last_batch_ms >= max_delay_ms:
        return False
    return sum(max(0, off - start.get(tp, 0)) for tp, off in latest.items()) < min_rows


@dataclass(frozen=True)
class OffsetRange:
    """One Spark partition's work: offsets [start, until) of one topic-partition."""

    topic: str
    partition: int
    start: int
    until: int

    @property
    def size(self) -> int:
        return self.until - self.start


def plan_ranges(start: Mapping[TP, int], end: Mapping[TP, int], min_partitions: int | None) -> list[OffsetRange]:
    """The non-empty ranges of a batch, split so there are at least ``min_partitions`` of them.

    As Spark's ``KafkaOffsetRangeCalculator``: when there are fewer non-empty ranges than
    ``minPartitions``, each range is cut into pieces in proportion to its size.
    Pure: no I/O, runs on the driver.
    """
    ranges = [OffsetRange(t, p, start[(t, p)], end[(t, p)]) for (t, p) in sorted(end)
              if (t, p) in start and end[(t, p)] > start[(t, p)]]
    if not min_partitions or len(ranges) >= min_partitions:
        return ranges
    total = sum(r.size for r in ranges)
    out: list[OffsetRange] = []
    for r in ranges:
        pieces = max(1, min(r.size, round(r.size / total * min_partitions)))
        for i in range(pieces):
            lo = r.start + r.size * i // pieces
            hi = r.start + r.size * (i + 1) // pieces
            out.append(OffsetRange(r.topic, r.partition, lo, hi))
    return out


def check_loss(start: Mapping[TP, int], earliest: Mapping[TP, int], fail: bool) -> dict[TP, int]:
    """Start offsets moved past records that are gone; raises or logs when any are.

    A start below the partition's earliest offset means retention (or a truncation) removed
    records this query had not read; a partition in ``start`` that no longer exists was
    deleted with its topic. Pure apart from logging.

    Raises:
        DataLossError: when ``fail`` (``failOnDataLoss=true``), naming topic, partition and offsets.
    """
    out = {}
    for tp, off in start.items():
        if tp not in earliest:
            msg = (f"partition {tp[0]}-{tp[1]} is gone (topic or partition deleted) with records from offset "
                   f"{off} not yet read")
        elif off < earliest[tp]:
            msg = (f"records of {tp[0]}-{tp[1]} at offsets [{off}, {earliest[tp]}) are gone (retention or "
                   f"truncation) before this query read them")
        else:
            out[tp] = off
            continue
        if fail:
            raise DataLossError(msg + ". Set failOnDataLoss=false to skip lost records and continue.")
        log.warning("%s; skipping them (failOnDataLoss=false)", msg)
        if tp in earliest:
            out[tp] = earliest[tp]
    return out


def _kafka_error(e: Exception) -> str:
    """librdkafka's text for a failure, with what to grant or check when it is about access."""
    err: Any = e.args[0] if e.args else None
    if not hasattr(err, "str"):
        return str(e)
    hint = access_hint(err.name())
    return f"{err.str()}; {hint}" if hint else str(err.str())


class OffsetReader:
    """The driver's view of the broker for the source: metadata and offsets. Driver side.

    Every call is bounded by ``kafka.default.api.timeout.ms``; an unreachable broker is an
    error naming ``kafka.bootstrap.servers``, never a hang.
    """

    def __init__(self, options: KafkaSourceOptions) -> None:
        from confluent_kafka.admin import AdminClient

        self.options = options
        self.timeout = options.api_timeout_ms / 1000
        # Each request gets a third of the budget, as the Java clients' request.timeout.ms (30 s) is a share of
        # default.api.timeout.ms (60 s): a request sent while its broker died or a leader moved can wait out its
        # whole timeout, and the retry, to the leader found since, answers.
        self.attempt_timeout = max(self.timeout / 3, 1.0)
        config = _checked_config(options.client_config.librdkafka())
        self._login_error: Any = None
        settings: dict[str, Any] = {k: v for k, v in config.items() if k not in _CONSUMER_ONLY}
        settings["error_cb"] = self._on_client_error
        check_login(options.client_config.security.oauth)
        settings.update(options.client_config.oauth_cb())
        self._settings = settings
        self.admin = AdminClient(settings)

    def _renew_admin(self) -> None:
        """A new admin client, with metadata read afresh. librdkafka's admin requests go to the leader its
        metadata cache names, with that cache's leader epoch; after a broker restart it kept sending
        ListOffsets with a fenced epoch (``FENCED_LEADER_EPOCH``, "Leader epoch is older than broker epoch")
        for the whole 60 s budget (CI, the Kafka-cluster tier's rolling restart), so a retry starts clean."""
        from confluent_kafka.admin import AdminClient

        self.admin = AdminClient(self._settings)

    def _on_client_error(self, err: Any) -> None:
        # librdkafka reports a refused login or TLS handshake only here; the call waiting on the
        # broker then fails with a bare timeout.
        if access_hint(err.name()) is not None:
            self._login_error = err

    def _wait(self, submit: Callable[[], dict], what: str) -> dict:
        """Submits an admin request (``submit()`` returns its futures) and waits for every answer.

        Retried through broker loss (a leader or the group coordinator moving, a broker restarting)
        within ``kafka.default.api.timeout.ms`` (:func:`lastagent.kafka.retry.retried`).
        """
        from confluent_kafka import KafkaException

        def once() -> dict:
            out = {}
            for key, fut in submit().items():
                try:
                    out[key] = fut.result(timeout=self.attempt_timeout + 5)
                except KafkaException as e:
                    retriable = is_retriable(e)
                    if retriable:
                        self._renew_admin()  # the retry asks with fresh metadata (a leader, its epoch)
                    raise KafkaProtocolError(f"{_kafka_error(e)} ({what}, {key})", retriable=retriable) from e
            return out

        return retried(once, what, self.options.api_timeout_ms)

    def topics(self) -> dict[str, int]:
        """Topic → partition count of every topic the broker reports (internal ones excluded)."""
        return retried(self._topics, "reading the topics' metadata", self.options.api_timeout_ms)

    def _topics(self) -> dict[str, int]:
        from confluent_kafka import KafkaException

        try:
            md = self.admin.list_topics(timeout=self.timeout)
        except KafkaException as e:
            self.admin.poll(0)  # serves the error events queued while list_topics waited
            if self._login_error is not None:
                raise KafkaProtocolError(f"connecting to {self.options.bootstrap_servers}: {self._login_error.str()}; "
                                         f"{access_hint(self._login_error.name())}") from None
            raise OptionError("kafka.bootstrap.servers",
                              f"no Kafka broker answered at {self.options.bootstrap_servers} within "
                              f"{self.options.api_timeout_ms} ms (kafka.default.api.timeout.ms): {_kafka_error(e)}; "
                              "check host:port and that the broker is running") from None
        # A topic whose metadata the cluster cannot give for the moment (its leaders moving) is not
        # a topic that vanished: ask again rather than read it as deleted partitions.
        unsettled = [f"{name}: {t.error.str()} ({t.error.name()})" for name, t in md.topics.items()
                     if t.error is not None and is_retriable(KafkaException(t.error))]
        if unsettled:
            raise KafkaProtocolError("; ".join(unsettled) + " (reading the topics' metadata)", retriable=True)
        return {name: len(t.partitions) for name, t in md.topics.items()
                if t.error is None and not name.startswith("__")}

    def partitions(self, must_exist: bool = False) -> list[TP]:
        """The topic-partitions the subscription covers now (new partitions and topics included).

        Args:
            must_exist: at query start: a named topic or partition that does not exist is an
                error naming the option (later, a vanished one is data loss, decided elsewhere).
        """
        topics = self.topics()
        o = self.options
        if o.subscribe:
            missing = [t for t in o.subscribe if t not in topics]
            if missing and must_exist:
                raise OptionError("subscribe", f"topic(s) {', '.join(missing)} do not exist on "
                                               f"{o.bootstrap_servers}; create them first or fix the name")
            return [(t, p) for t in o.subscribe if t in topics for p in range(topics[t])]
        if o.pattern is not None:
            rx = re.compile(o.pattern)
            return [(t, p) for t in sorted(topics) if rx.fullmatch(t) for p in range(topics[t])]
        assert o.assign is not None
        out = []
        for t, parts in sorted(o.assign.items()):
            for p in parts:
                if p < topics.get(t, 0):
                    out.append((t, p))
                elif must_exist:
                    raise OptionError("assign", f"{t}-{p} does not exist on {o.bootstrap_servers} "
                                                f"(topic {t!r} has {topics.get(t, 0)} partition(s))")
        return out

    def _list_offsets(self, specs: Mapping[TP, Any]) -> dict[TP, int]:
        from confluent_kafka import IsolationLevel, TopicPartition

        if not specs:
            return {}
        level = IsolationLevel.READ_COMMITTED if self.options.read_committed else IsolationLevel.READ_UNCOMMITTED
        request = {TopicPartition(t, p): s for (t, p), s in specs.items()}
        done = self._wait(lambda: self.admin.list_offsets(request, isolation_level=level, request_timeout=self.attempt_timeout),
                          "listing offsets")
        return {(tp.topic, tp.partition): info.offset for tp, info in done.items()}

    def earliest(self, tps: Iterable[TP]) -> dict[TP, int]:
        from confluent_kafka.admin import OffsetSpec

        return self._list_offsets({tp: OffsetSpec.earliest() for tp in tps})

    def latest(self, tps: Iterable[TP]) -> dict[TP, int]:
        """The end offsets; under read_committed the last stable offset (never inside an open transaction)."""
        from confluent_kafka.admin import OffsetSpec

        return self._list_offsets({tp: OffsetSpec.latest() for tp in tps})

    def by_timestamp(self, stamps: Mapping[TP, int]) -> dict[TP, int]:
        """First offset whose timestamp is >= the given one, per partition; -1 where there is none."""
        from confluent_kafka.admin import OffsetSpec

        return self._list_offsets({tp: OffsetSpec.for_timestamp(ts) for tp, ts in stamps.items()})

    def require_group_access(self) -> None:
        """Fails at query start when the principal may not use the consumer group the tasks' consumers
        name (``kafka.group.id``, else one prefixed by ``groupIdPrefix``).

        The tasks' clients learn of a refused group from the group coordinator while they fetch, so a
        short range could finish before the refusal arrives and another would fail: asking here makes
        the outcome the same every time. Driver side.

        Raises:
            KafkaProtocolError: the broker refused; names the ACL needed.
        """
        import uuid

        group = self.options.group_id or f"{self.options.group_id_prefix}-{uuid.uuid4().hex[:12]}"

        def describe(admin: Any) -> None:
            from kafka import errors as kafka_errors

            # DescribeGroups needs what the tasks' consumers need first (Describe on the group). kafka-python
            # gives a group's error as text ("[Error 14] CoordinatorLoadInProgressError: ..."): raised as its
            # class, so a settling coordinator is asked again and a refusal names the ACL.
            error = admin.describe_groups([group]).get(group, {}).get("error")
            if error:
                exc_type = getattr(kafka_errors, error.split("] ", 1)[-1].split(":", 1)[0], kafka_errors.KafkaError)
                if exc_type is not kafka_errors.GroupIdNotFoundError:  # a group not made yet (Kafka 4's answer)
                    raise exc_type(error.split(": ", 1)[-1])

        self._group_call(describe, f"check the consumer group failed for {group}")

    def _group_call(self, call: Callable[[Any], Any], what: str) -> Any:
        """Runs ``call(admin)`` on a kafka-python admin client, retried through a settling or moving
        group coordinator within ``kafka.default.api.timeout.ms``. Driver side.

        Every request to a group coordinator goes through kafka-python, never librdkafka's admin client:
        on a coordinator that is not ready (a new cluster's, a moved one) librdkafka 2.16 and before
        kills the process, on an OffsetFetch answer with a NULL dereference on its rdk:main thread
        (librdkafka#5040, "segfault at 58") and on a DescribeGroups lookup with the assertion
        ``eonce->refcnt > 0`` in ``rd_kafka_enq_once_del_source_return``; Spark then sees its source runner
        die (``EOFException`` in ``PythonStreamingSourceRunner.init``).
        """
        from kafka.errors import KafkaError as PyKafkaError

        from lastagent.kafka.wire import admin_client, explain

        def once() -> Any:
            admin = admin_client(self.options.client_config, self.options.api_timeout_ms)
            try:
                return call(admin)
            except PyKafkaError as exc:  # named (and retried when a retry may help), never bare
                raise explain(exc, "" if is_retriable(exc) else what) from None
            finally:
                admin.close()

        return retried(once, what, self.options.api_timeout_ms)

    def _group(self) -> str:
        group = self.options.group_id
        if group is None:
            raise OptionError("kafka.group.id", "is needed for group offsets; set it")
        return group

    def group_offsets(self, tps: Iterable[TP]) -> dict[TP, int]:
        """Offsets committed for ``kafka.group.id``; partitions without one are absent."""
        from kafka import TopicPartition as KafkaTopicPartition

        group = self._group()
        wanted = [KafkaTopicPartition(t, p) for t, p in tps]
        result = self._group_call(lambda admin: admin.list_group_offsets({group: wanted})[group],
                                  f"fetching the offsets of group {group}")
        return {(tp.topic, tp.partition): meta.offset for tp, meta in result.items() if meta.offset >= 0}

    def commit_group(self, offsets: Mapping[TP, int]) -> None:
        """Commits offsets to ``kafka.group.id`` (for lag tools; correctness never reads them)."""
        from kafka import TopicPartition as KafkaTopicPartition
        from kafka.structs import OffsetAndMetadata

        group = self._group()
        request = {KafkaTopicPartition(t, p): OffsetAndMetadata(o, "", None) for (t, p), o in offsets.items()}
        failed = self._group_call(lambda admin: admin.alter_group_offsets(group, request),
                                  f"committing the offsets of group {group}")
        refused = sorted(f"{tp.topic}-{tp.partition}: {err.__name__}" for tp, err in failed.items()
                         if err.errno != 0)
        if refused:
            raise KafkaProtocolError(f"committing the offsets of group {group}: {', '.join(refused)}")


#: librdkafka consumer settings an admin client would only warn about; kept for executors.
_CONSUMER_ONLY = {"group.id", "isolation.level", "fetch.min.bytes", "fetch.max.bytes", "fetch.wait.max.ms",
                  "max.partition.fetch.bytes", "queued.max.messages.kbytes", "queued.min.messages",
                  "fetch.message.max.bytes", "enable.partition.eof", "check.crcs", "client.rack",
                  "session.timeout.ms", "heartbeat.interval.ms", "max.poll.interval.ms", "auto.commit.interval.ms",
                  "partition.assignment.strategy", "group.instance.id", "fetch.queue.backoff.ms",
                  "fetch.error.backoff.ms", "enable.auto.offset.store"}


def _checked_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Validates kafka.* settings against the librdkafka the tasks use (``lastagent._native``):
    one it refuses is an error naming it, at query start. Driver side."""
    from lastagent._native import NativeKafkaError, RangeConsumer, SettingRefused

    probe = dict(config, **{"group.id": config.get("group.id", "lastagent-probe")})
    try:
        RangeConsumer(as_librdkafka_strings(probe)).close()
    except SettingRefused as e:
        raise OptionError(f"kafka.{e.args[0]}", f"rejected by the Kafka client: {e.args[1]}. Give librdkafka "
                                                "consumer settings (https://github.com/confluentinc/librdkafka/"
                                                "blob/master/CONFIGURATION.md)") from None
    except NativeKafkaError as e:
        raise OptionError(setting_in(str(e), config), f"the Kafka client could not start with it: {e}") from None
    return dict(config)
