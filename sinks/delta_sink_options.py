"""Options of the ``lastagent-delta`` sink, parsed once at query start. Driver side.

The Delta table is the last agent: its own commit decides the epoch, so there is no
``arbitrationTable``. Kafka settings (``kafka.*``) are needed only when the link has Kafka side
outputs (``deadLetterTopic``, ``sideTopics``). Every error names the option and what would be
right.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from lastagent.core import xid
from lastagent.errors import OptionError
from lastagent.kafka.config import KafkaConfig
from lastagent.options import Option, OptionTable
from lastagent.sinks.kafka_sink_options import DEFAULT_TRANSACTION_TIMEOUT_MS
from lastagent.storage import StorageConfig, location

#: Producer settings the sink owns (same reasons as the Kafka sink's).
_RESERVED = ("kafka.transactional.id", "kafka.enable.idempotence", "kafka.key.serializer",
             "kafka.value.serializer")

#: The sink's options. Parsing reads them through this table and docs/options.md is generated
#: from it (``python -m lastagent.options_doc``).
DELTA_SINK_OPTIONS = OptionTable([
    Option("path", "string", None, "Location of the target Delta table (.start(path) or .option('path', ...)); "
                                   "created on the first batch."),
    Option("link", "string", None, "Stable name of this link (query). Its epochs are recorded in the table as Delta "
                                   "txn actions (appId = link) and it names the Kafka side outputs' transactional "
                                   "ids; renaming it breaks recovery. Letters, digits, '.', '_' and '-', short enough "
                                   f"that the XA gtrid '<link>:<epoch>' fits {xid.MAXGTRIDSIZE} bytes.",
           max_length=xid.MAX_LINK_LENGTH),
    Option("checkpointLocation", "string", None, "Spark's checkpoint location (required: recovery depends on it)."),
    Option("partitionBy", "list", "", "Comma-separated partition columns used when the sink creates the table; must "
                                      "match an existing table's (given none, an existing table's are used). Use this "
                                      "option: Spark does not pass writeStream.partitionBy(...) to Python data "
                                      "sources."),
    Option("mergeSchema", "boolean", "false", "true: new columns of the query are added to the table's schema (as "
                                              "Delta's mergeSchema). false: a schema mismatch fails the query before "
                                              "anything is committed."),
    Option("targetFileSizeMB", "integer", "128", "A task starts a new data file after this many megabytes (bounded "
                                                 "memory; no flood of tiny files at small triggers beyond one file per "
                                                 "task and partition value).", minimum=1),
    Option("transformer", "string", "", "A Python callable 'module:function' applied on executors to each Arrow "
                                        "record batch before delivery (pyarrow.RecordBatch -> pyarrow.RecordBatch or "
                                        "Table). If it fails on a batch, it is applied record by record and failing "
                                        "records go to the dead letters."),
    Option("deadLetterTopic", "string", "", "Kafka topic for records that fail the transformer, fail conversion to "
                                            "the table's schema, or are too large for a side topic (larger than "
                                            "kafka.message.max.bytes, so the client refuses them at once); written in "
                                            "the same epoch (a prepared Kafka branch committed after the Delta commit). "
                                            "Unset: such a record fails the batch — nothing is dropped. A side-topic "
                                            "record the broker refuses (its topic's max.message.bytes is smaller) fails "
                                            "the task's whole Kafka transaction, so it fails the task, naming the row: "
                                            "keep kafka.message.max.bytes and kafka.batch.size at or below the side "
                                            "topics' limit."),
    Option("deadLetterTable", "string", "", "Path of a Delta table for dead letters the topic did not take (or all of "
                                            "them when deadLetterTopic is unset): the next link in the chain. Its rows "
                                            "are committed after the target table's commit, once per epoch "
                                            "(txn(link, epoch)). With neither set, a failing record fails the batch."),
    Option("deadLetterSendAttempts", "integer", "3", "Attempts to hand one dead letter to the dead-letter topic before "
                                                     "the batch fails.", minimum=1),
    Option("sideTopics", "list", "", "Comma-separated Kafka topics that receive every delivered row as a follow-up "
                                     "message (value: the row as JSON, key: the 'key' column if any), in the same "
                                     "epoch."),
    Option("keepHeaders", "list", "", "Comma-separated header keys to keep in the 'headers' column (others are "
                                      "dropped)."),
    Option("dropHeaders", "list", "", "Comma-separated header keys to drop from the 'headers' column."),
    Option("kafka.bootstrap.servers", "string", "", "Kafka bootstrap servers; required with deadLetterTopic or "
                                                    "sideTopics."),
    Option("kafka.transaction.timeout.ms", "integer", str(DEFAULT_TRANSACTION_TIMEOUT_MS),
           "Kafka aborts a prepared side-output branch after this; at most the broker's transaction.max.timeout.ms. "
           "An epoch with side outputs is decided only while each branch has a quarter of this (at most 2 "
           "minutes) left; a longer epoch is rolled back and the query stops (EpochNotDecidedError).",
           minimum=1000),
    Option("kafka.default.api.timeout.ms", "integer", "60000",
           "How long one Kafka request of the driver or a task (ending or describing a branch, listing the link's "
           "transactions, reading topics and broker settings) keeps retrying through broker loss: a node restarting, "
           "the coordinator or a leader moving, too few in-sync replicas. Then the query fails with "
           "KafkaUnavailableError, naming the broker's condition (the Java client's setting).", minimum=1),
    Option("phase2Parallelism", "integer", "8", "Kafka branches committed in parallel after the Delta commit.",
           minimum=1),
], exempt_prefixes=("kafka.", "storage."), others="kafka.* producer settings and storage.* settings (docs/storage.md)")
_COLUMN = re.compile(r"^[^ ,;{}()\n\t=]+$")


def _partition_by(opts: Mapping[str, str]) -> tuple[str, ...]:
    cols = DELTA_SINK_OPTIONS.comma_list(opts, "partitionBy")
    for c in cols:
        if not _COLUMN.match(c):
            raise OptionError("partitionBy", f"{c!r} is not a valid column name")
    return cols


def _transformer(opts: Mapping[str, str]) -> str | None:
    spec = str(opts.get("transformer", "")).strip()
    if not spec:
        return None
    module, sep, func = spec.partition(":")
    if not sep or not module or not func or not func.isidentifier():
        raise OptionError("transformer", f"{spec!r} is not 'module:function', e.g. 'my_pkg.rules:clean'")
    return spec


@dataclass(frozen=True)
class DeltaSinkOptions(xid.LinkIds):
    """The ``lastagent-delta`` sink's checked options (picklable; shipped to executors)."""

    path: str
    link: str
    checkpoint_location: str
    partition_by: tuple[str, ...] = ()
    merge_schema: bool = False
    target_file_bytes: int = 128 << 20
    transformer: str | None = None
    dead_letter_topic: str | None = None
    dead_letter_table: str | None = None
    dead_letter_attempts: int = 3
    side_topics: tuple[str, ...] = ()
    keep_headers: tuple[str, ...] = ()
    drop_headers: tuple[str, ...] = ()
    client_config: KafkaConfig = field(default_factory=lambda: KafkaConfig({}))
    transaction_timeout_ms: int = DEFAULT_TRANSACTION_TIMEOUT_MS
    phase2_parallelism: int = 8
    # Read by the committer; the table's own commit history is the arbitration, so Delta's log
    # retention (not ours) decides how long records stay.
    cleanup_every: int = 1 << 62
    retention_epochs: int = 0
    storage: StorageConfig = field(default_factory=StorageConfig)

    @property
    def has_kafka(self) -> bool:
        """True when the link writes Kafka side outputs (and so has Kafka branches)."""
        return bool(self.dead_letter_topic or self.side_topics)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> DeltaSinkOptions:
        """Parses Spark's (case-insensitive) option map.

        Raises:
            OptionError: naming the first bad option and what would be right.
        """
        opts = {k.lower(): str(v) for k, v in options.items()}
        for key in opts:
            if key.startswith("kafka."):
                if key in _RESERVED:
                    raise OptionError(key, "is set by the sink and cannot be given")
                continue
            DELTA_SINK_OPTIONS.check_known(key, "the lastagent-delta sink")
        hints = {
            "path": "give the target table: .start('/data/orders') or .option('path', '/data/orders')",
            "link": "give the query a stable name, e.g. .option('link', 'orders-to-delta')",
            "checkpointLocation": "exactly-once needs Spark's checkpoint: .option('checkpointLocation', path)",
        }
        for required, hint in hints.items():
            if not opts.get(required.lower(), "").strip():
                raise OptionError(required, f"is required; {hint}")
        dead_letter = opts.get("deadlettertopic", "").strip() or None
        side = DELTA_SINK_OPTIONS.comma_list(opts, "sideTopics")
        client = {k[len("kafka."):]: v for k, v in opts.items() if k.startswith("kafka.")}
        client.pop("transaction.timeout.ms", None)
        DELTA_SINK_OPTIONS.integer_value(opts, "kafka.default.api.timeout.ms")  # checked against the table; KafkaConfig keeps it
        if (dead_letter or side) and not client.get("bootstrap.servers", "").strip():
            which = "deadLetterTopic" if dead_letter else "sideTopics"
            raise OptionError("kafka.bootstrap.servers", f"is required when '{which}' is set; "
                                                         "e.g. .option('kafka.bootstrap.servers', 'host:9092')")
        storage = StorageConfig.parse(options)
        for option in ("path", "checkpointLocation", "deadLetterTable"):
            if opts.get(option.lower(), "").strip():
                storage.check(location(opts[option.lower()], option))
        keep = DELTA_SINK_OPTIONS.comma_list(opts, "keepHeaders")
        drop = DELTA_SINK_OPTIONS.comma_list(opts, "dropHeaders")
        if keep and drop:
            raise OptionError("keepHeaders", "give keepHeaders or dropHeaders, not both")
        return cls(
            path=opts["path"].strip(),
            link=xid.check_link(opts["link"].strip()),
            checkpoint_location=opts["checkpointlocation"].strip(),
            partition_by=_partition_by(opts),
            merge_schema=DELTA_SINK_OPTIONS.boolean(opts, "mergeSchema"),
            target_file_bytes=DELTA_SINK_OPTIONS.integer_value(opts, "targetFileSizeMB") << 20,
            transformer=_transformer(opts),
            dead_letter_topic=dead_letter,
            dead_letter_table=opts.get("deadlettertable", "").strip() or None,
            dead_letter_attempts=DELTA_SINK_OPTIONS.integer_value(opts, "deadLetterSendAttempts"),
            side_topics=side,
            keep_headers=keep,
            drop_headers=drop,
            client_config=KafkaConfig.parse(client),
            transaction_timeout_ms=DELTA_SINK_OPTIONS.integer_value(opts, "kafka.transaction.timeout.ms"),
            phase2_parallelism=DELTA_SINK_OPTIONS.integer_value(opts, "phase2Parallelism"),
            storage=storage,
        )
