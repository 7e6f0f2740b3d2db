"""Options of the ``lastagent-kafka`` source, parsed once at query start. Driver side.

The names, defaults and meaning follow Spark's built-in ``kafka`` source, so switching is a
change of format name: ``kafka.bootstrap.servers`` and any ``kafka.*`` consumer setting pass
through to the client; exactly one of ``subscribe``, ``subscribePattern``, ``assign``;
``startingOffsets``, ``startingTimestamp``, ``startingOffsetsByTimestamp``,
``maxOffsetsPerTrigger``, ``minOffsetsPerTrigger``, ``maxTriggerDelay``, ``minPartitions``,
``failOnDataLoss``, ``includeHeaders``; for batch reads (``spark.read``) also ``endingOffsets``,
``endingTimestamp``, ``endingOffsetsByTimestamp``.
Every error names the option and what would be right.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lastagent.errors import OptionError
from lastagent.kafka.config import KafkaConfig
from lastagent.options import Option, OptionTable, parse_duration

#: Consumer settings the source owns, as in Spark's kafka source: a user value would break
#: offset tracking (Spark's checkpoint holds the offsets) or the row schema.
_RESERVED = {
    "kafka.auto.offset.reset": "set 'startingOffsets' instead (earliest, latest, group or per-partition JSON)",
    "kafka.enable.auto.commit": "offsets live in Spark's checkpoint; set 'kafka.group.id' to have them "
                                "committed to a group after each batch",
    "kafka.key.deserializer": "keys are read as bytes; cast the 'key' column in the query",
    "kafka.value.deserializer": "values are read as bytes; cast the 'value' column in the query",
    "kafka.interceptor.classes": "not supported by the Python client",
}

#: The source's options. Parsing reads them through this table and docs/options.md is generated
#: from it (``python -m lastagent.options_doc``).
SOURCE_OPTIONS = OptionTable([
    Option("kafka.bootstrap.servers", "string", None, "Kafka bootstrap servers, host:port[,host:port]."),
    Option("subscribe", "list", "", "Comma-separated topics to read. Exactly one of subscribe, subscribePattern, assign."),
    Option("subscribePattern", "string", "", "Java-style regular expression; every topic whose whole name matches is "
                                             "read, including topics created later."),
    Option("assign", "json", "", "JSON of the topic-partitions to read, e.g. {\"t\":[0,1]}."),
    Option("startingOffsets", "string", "latest",
           "Where a new query starts: earliest, latest, group (the offsets committed for kafka.group.id; partitions "
           "without one start at earliest) or JSON {\"t\":{\"0\":23,\"1\":-2}} (-2 earliest, -1 latest). Ignored on "
           "restart: the checkpoint's offsets win. Batch reads default to earliest and refuse latest."),
    Option("startingTimestamp", "integer", "", "Start every partition at the first offset whose timestamp is >= this "
                                               "(milliseconds since the epoch). Wins over startingOffsets.", minimum=0),
    Option("startingOffsetsByTimestamp", "json", "", "JSON {\"t\":{\"0\":1700000000000}}: a start timestamp per "
                                                     "partition. Wins over startingOffsets."),
    Option("startingOffsetsByTimestampStrategy", "choice", "error",
           "When no offset has a timestamp >= the given one: error (fail the query) or latest.",
           choices=("error", "latest")),
    Option("maxOffsetsPerTrigger", "integer", "", "Upper bound on offsets per micro-batch, shared across partitions in "
                                                  "proportion to their backlog (Spark's admission control). Before "
                                                  "Spark 4.2, Trigger.AvailableNow asks a Python source once per run, "
                                                  "so that run reads one batch of at most this many.", minimum=1),
    Option("minOffsetsPerTrigger", "integer", "", "Lower bound on offsets per micro-batch: a trigger with fewer new "
                                                  "offsets (summed over partitions) runs no batch, until "
                                                  "maxTriggerDelay has passed since the last batch. Ignored under "
                                                  "Trigger.AvailableNow on Spark 4.2+, which must end.", minimum=1),
    Option("maxTriggerDelay", "string", "15m", "With minOffsetsPerTrigger: the longest a batch is held back for too "
                                               "few offsets, as Spark's time strings: 15m, 30s, 500ms, 1h."),
    Option("minPartitions", "integer", "", "Split large offset ranges so a batch has at least this many Spark "
                                           "partitions.", minimum=1),
    Option("failOnDataLoss", "boolean", "true", "Fail the query when offsets it should read are gone (retention, "
                                                "deleted partition or topic); false logs a warning and skips them."),
    Option("endingOffsets", "string", "latest",
           "Batch reads only: where the read ends (exclusive): latest or JSON {\"t\":{\"0\":23,\"1\":-1}} "
           "(-1 latest). Under read_committed, latest is the last stable offset."),
    Option("endingTimestamp", "integer", "", "Batch reads only: end every partition at the first offset whose "
                                             "timestamp is >= this (milliseconds since the epoch), or at latest where "
                                             "there is none. Wins over endingOffsets.", minimum=0),
    Option("endingOffsetsByTimestamp", "json", "", "Batch reads only: JSON {\"t\":{\"0\":1700000000000}}, an end "
                                                   "timestamp per partition. Wins over endingOffsets."),
    Option("includeHeaders", "boolean", "false", "Add the 'headers' column: array<struct<key:string, value:binary>>."),
    Option("kafkaConsumer.pollTimeoutMs", "integer", "120000", "How long a task waits for records it knows exist "
                                                               "before failing.", minimum=1),
    Option("kafka.default.api.timeout.ms", "integer", "60000", "How long one of the driver's metadata and offset "
                                                               "requests keeps retrying through broker loss (a leader "
                                                               "or the group coordinator moving, a node restarting), "
                                                               "each attempt given a third of it; an unreachable "
                                                               "cluster fails the query after this.",
           minimum=1),
    Option("kafka.isolation.level", "choice", "read_committed",
           "read_committed skips records of aborted transactions and never reads past an open one; read_uncommitted "
           "reads all.", choices=("read_committed", "read_uncommitted")),
    Option("maxRecordsPerArrowBatch", "integer", "10000", "Rows per Arrow record batch handed to Spark (bounds a "
                                                          "task's memory).", minimum=1),
    Option("groupIdPrefix", "string", "lastagent-source", "Prefix of the consumer group id each executor consumer "
                                                          "gets when kafka.group.id is not set (the group is never "
                                                          "joined; a secured cluster still checks Read on it)."),
], exempt=("path",), others="kafka.* consumer settings", blank_integer_is_unset=True)


def _json(opts: Mapping[str, str], name: str, example: str) -> Any:
    raw = opts[name.lower()]
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise OptionError(name, f"is not valid JSON ({e.msg} at position {e.pos}); expected e.g. {example}") from None


def _partition_map(value: Any, name: str, example: str) -> dict[str, dict[int, int]]:
    """{"topic": {"0": 12}} → {"topic": {0: 12}}, checked."""
    if not isinstance(value, dict) or not value:
        raise OptionError(name, f"must be a non-empty JSON object of topics, e.g. {example}")
    out: dict[str, dict[int, int]] = {}
    for topic, parts in value.items():
        if not isinstance(parts, dict) or not parts:
            raise OptionError(name, f"topic {topic!r} must map partition numbers to values, e.g. {example}")
        out[topic] = {}
        for p, v in parts.items():
            if not str(p).lstrip("-").isdigit() or int(p) < 0 or isinstance(v, bool) or not isinstance(v, int):
                raise OptionError(name, f"topic {topic!r}: {p!r}: {v!r} is not partition: integer, e.g. {example}")
            out[topic][int(p)] = v
    return out


_ENDING = ("endingOffsets", "endingTimestamp", "endingOffsetsByTimestamp")
EARLIEST, LATEST = -2, -1


def _ending(opts: Mapping[str, str], batch: bool) -> tuple[str | dict[str, dict[int, int]], int | None,
                                                            dict[str, dict[int, int]] | None]:
    """(endingOffsets, endingTimestamp, endingOffsetsByTimestamp) of a batch read, checked."""
    given = [name for name in _ENDING if str(opts.get(name.lower(), "")).strip()]
    if given and not batch:
        raise OptionError(given[0], "is for batch reads (spark.read) only; a streaming query reads until it is "
                                    "stopped (use trigger(availableNow=True) to stop at the offsets available now)")
    ending_text = SOURCE_OPTIONS.raw(opts, "endingOffsets").strip()
    ending: str | dict[str, dict[int, int]] = ending_text
    if ending_text.lower() == "latest":
        ending = "latest"
    else:
        example = '{"topicA":{"0":23,"1":-1}}'
        if not ending_text.startswith("{"):
            raise OptionError("endingOffsets", f"{ending_text!r} is not valid; give latest or JSON such as {example}")
        ending = _partition_map(_json(opts, "endingOffsets", example), "endingOffsets", example)
        if any(v < LATEST for parts in ending.values() for v in parts.values()):
            raise OptionError("endingOffsets", "offsets must be >= 0, or -1 (latest); earliest (-2) would read "
                                               "nothing")
    by_ts = None
    if str(opts.get("endingoffsetsbytimestamp", "")).strip():
        example = '{"topicA":{"0":1700000000000}}'
        by_ts = _partition_map(_json(opts, "endingOffsetsByTimestamp", example), "endingOffsetsByTimestamp", example)
    return ending, SOURCE_OPTIONS.integer(opts, "endingTimestamp"), by_ts


@dataclass(frozen=True)
class KafkaSourceOptions:
    """The source's checked options (picklable; its client settings travel to executors).

    Attributes:
        client_config: librdkafka settings (the ``kafka.*`` options without the prefix).
        subscribe: topics of ``subscribe``, or empty.
        pattern: the compiled-checked ``subscribePattern`` text, or None.
        assign: topic → partitions of ``assign``, or None.
        starting: "earliest", "latest", "group", or topic → partition → offset (-2/-1).
        starting_timestamp: one timestamp for every partition, or None.
        starting_by_timestamp: topic → partition → timestamp, or None.
        batch: parsed for a batch read (``spark.read``), which may set the ending options.
        ending: batch reads: "latest", or topic → partition → offset (-1 latest).
        ending_timestamp: batch reads: one end timestamp for every partition, or None.
        ending_by_timestamp: batch reads: topic → partition → end timestamp, or None.
        max_offsets_per_trigger, min_offsets_per_trigger: admission control's bounds per batch, or None.
        max_trigger_delay_ms: the longest a batch waits for ``min_offsets_per_trigger`` offsets.
    """

    client_config: KafkaConfig
    subscribe: tuple[str, ...] = ()
    pattern: str | None = None
    assign: dict[str, tuple[int, ...]] | None = None
    starting: str | dict[str, dict[int, int]] = "latest"
    starting_timestamp: int | None = None
    starting_by_timestamp: dict[str, dict[int, int]] | None = None
    timestamp_strategy: str = "error"
    batch: bool = False
    ending: str | dict[str, dict[int, int]] = "latest"
    ending_timestamp: int | None = None
    ending_by_timestamp: dict[str, dict[int, int]] | None = None
    max_offsets_per_trigger: int | None = None
    min_offsets_per_trigger: int | None = None
    max_trigger_delay_ms: int = 15 * 60_000
    min_partitions: int | None = None
    fail_on_data_loss: bool = True
    include_headers: bool = False
    poll_timeout_ms: int = 120_000
    api_timeout_ms: int = 60_000
    batch_rows: int = 10_000
    group_id_prefix: str = "lastagent-source"
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def bootstrap_servers(self) -> str:
        return self.client_config["bootstrap.servers"]

    @property
    def group_id(self) -> str | None:
        return self.client_config.get("group.id") or None

    @property
    def read_committed(self) -> bool:
        return self.client_config.get("isolation.level", "read_committed") == "read_committed"

    def strategy(self) -> str:
        """The subscription option in use, for messages: ``subscribe``, ``subscribePattern`` or ``assign``."""
        return "subscribe" if self.subscribe else "subscribePattern" if self.pattern else "assign"

    @classmethod
    def parse(cls, options: Mapping[str, str], batch: bool = False) -> KafkaSourceOptions:
        """Parses Spark's (case-insensitive) option map.

        Args:
            options: the reader's options.
            batch: for ``spark.read`` (else ``spark.readStream``): startingOffsets defaults to
                earliest and may not be latest; the ending options are allowed.

        Raises:
            OptionError: naming the first bad option and the valid choices.
        """
        opts = {k.lower(): v for k, v in options.items()}
        for given in options:
            key = given.lower()
            if key in _RESERVED:
                raise OptionError(given, f"cannot be set for the lastagent-kafka source: {_RESERVED[key]}")
            SOURCE_OPTIONS.check_known(given, "the lastagent-kafka source")
        if not opts.get("kafka.bootstrap.servers", "").strip():
            raise OptionError("kafka.bootstrap.servers", "is required, e.g. .option('kafka.bootstrap.servers', "
                                                         "'host:9092')")
        chosen = [k for k in ("subscribe", "subscribePattern", "assign") if opts.get(k.lower(), "").strip()]
        if len(chosen) != 1:
            got = " and ".join(chosen) if chosen else "none"
            raise OptionError("subscribe", f"give exactly one of subscribe, subscribePattern, assign (got {got})")
        subscribe: tuple[str, ...] = ()
        pattern = assign = None
        if chosen[0] == "subscribe":
            subscribe = tuple(t.strip() for t in opts["subscribe"].split(",") if t.strip())
            if not subscribe:
                raise OptionError("subscribe", "lists no topic; give comma-separated topic names")
        elif chosen[0] == "subscribePattern":
            pattern = opts["subscribepattern"].strip()
            try:
                re.compile(pattern)
            except re.error as e:
                raise OptionError("subscribePattern", f"{pattern!r} is not a valid regular expression: {e}") from None
        else:
            raw = _json(opts, "assign", '{"topicA":[0,1]}')
            if (not isinstance(raw, dict) or not raw
                    or not all(isinstance(v, list) and v and all(type(p) is int and p >= 0 for p in v)
                               for v in raw.values())):
                raise OptionError("assign", 'must be a JSON object of topic to partition list, e.g. {"topicA":[0,1]}')
            assign = {t: tuple(sorted(set(ps))) for t, ps in raw.items()}

        starting_text = str(opts.get("startingoffsets", "earliest" if batch else "latest")).strip()
        starting: str | dict[str, dict[int, int]] = starting_text
        if starting_text.lower() in ("earliest", "latest", "group"):
            starting = starting_text.lower()
            if starting == "group" and not opts.get("kafka.group.id", "").strip():
                raise OptionError("startingOffsets", "'group' needs 'kafka.group.id' (the group whose offsets to use)")
        else:
            example = '{"topicA":{"0":23,"1":-2}}'
            if not starting_text.startswith("{"):
                raise OptionError("startingOffsets", f"{starting_text!r} is not valid; give earliest, latest, group or "
                                                     f"JSON such as {example}")
            starting = _partition_map(_json(opts, "startingOffsets", example), "startingOffsets", example)
            if any(v < -2 for parts in starting.values() for v in parts.values()):
                raise OptionError("startingOffsets", "offsets must be >= 0, or -2 (earliest) or -1 (latest)")
        if batch and (starting == "latest" or (isinstance(starting, dict) and any(
                v == LATEST for parts in starting.values() for v in parts.values()))):
            raise OptionError("startingOffsets", "latest (-1) is not allowed in a batch read, which would read "
                                                 "nothing; give earliest, group or offsets")
        ending, end_ts, end_by_ts = _ending(opts, batch)
        by_ts = None
        if opts.get("startingoffsetsbytimestamp", "").strip():
            example = '{"topicA":{"0":1700000000000}}'
            by_ts = _partition_map(_json(opts, "startingOffsetsByTimestamp", example),
                                   "startingOffsetsByTimestamp", example)
        ts_strategy = SOURCE_OPTIONS.choice(opts, "startingOffsetsByTimestampStrategy")
        isolation = SOURCE_OPTIONS.choice(opts, "kafka.isolation.level")
        client = {k[len("kafka."):]: str(v) for k, v in opts.items() if k.startswith("kafka.")}
        client["isolation.level"] = isolation
        api_timeout = SOURCE_OPTIONS.integer_value(opts, "kafka.default.api.timeout.ms")
        client.pop("default.api.timeout.ms", None)  # a Java client setting: ours, not librdkafka's
        return cls(
            client_config=KafkaConfig.parse(client),
            subscribe=subscribe,
            pattern=pattern,
            assign=assign,
            starting=starting,
            starting_timestamp=SOURCE_OPTIONS.integer(opts, "startingTimestamp"),
            starting_by_timestamp=by_ts,
            timestamp_strategy=ts_strategy,
            batch=batch,
            ending=ending,
            ending_timestamp=end_ts,
            ending_by_timestamp=end_by_ts,
            max_offsets_per_trigger=SOURCE_OPTIONS.integer(opts, "maxOffsetsPerTrigger"),
            min_offsets_per_trigger=SOURCE_OPTIONS.integer(opts, "minOffsetsPerTrigger"),
            max_trigger_delay_ms=_duration(opts, "maxTriggerDelay"),
            min_partitions=SOURCE_OPTIONS.integer(opts, "minPartitions"),
            fail_on_data_loss=SOURCE_OPTIONS.boolean(opts, "failOnDataLoss"),
            include_headers=SOURCE_OPTIONS.boolean(opts, "includeHeaders"),
            poll_timeout_ms=SOURCE_OPTIONS.integer_value(opts, "kafkaConsumer.pollTimeoutMs"),
            api_timeout_ms=api_timeout,
            batch_rows=SOURCE_OPTIONS.integer_value(opts, "maxRecordsPerArrowBatch"),
            group_id_prefix=SOURCE_OPTIONS.raw(opts, "groupIdPrefix").strip() or "lastagent-source",
        )


def _duration(opts: Mapping[str, str], name: str) -> int:
    """Milliseconds of a time-string option (``15m``, ``30s``, ``500ms``), named in the error."""
    text = SOURCE_OPTIONS.raw(opts, name).strip() or str(SOURCE_OPTIONS[name].default)  # blank: the default
    try:
        return parse_duration(text, name)
    except ValueError:
        raise OptionError(name, f"{text!r} is not a duration; give a number and a unit, as Spark's time strings: "
                                "500ms, 30s, 15m, 1h") from None
