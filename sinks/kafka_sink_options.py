"""Options of the ``lastagent-kafka`` sink, parsed once at query start. Driver side.

Spark's own ``kafka`` sink options keep their names (``kafka.bootstrap.servers``, any
``kafka.*`` producer setting, ``topic``); the protocol adds ``link`` and
``arbitrationTable``. Every error names the option and what would be right.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lastagent.core import xid
from lastagent.errors import OptionError
from lastagent.kafka.config import KafkaConfig
from lastagent.options import Option, OptionTable
from lastagent.storage import StorageConfig, location

#: Producer settings the sink owns: a user value would break the protocol or the row schema.
_RESERVED = {
    "kafka.transactional.id": "the sink names each branch's transactional.id from 'link' (per run, task partition and attempt)",
    "kafka.enable.idempotence": "transactions need the idempotent producer",
    "kafka.key.serializer": "keys are written as bytes; cast the 'key' column to string or binary",
    "kafka.value.serializer": "values are written as bytes; cast the 'value' column to string or binary",
}

DEFAULT_TRANSACTION_TIMEOUT_MS = 900_000

#: The sink's options. Parsing reads them through this table and docs/options.md is generated
#: from it (``python -m lastagent.options_doc``).
SINK_OPTIONS = OptionTable([
    Option("kafka.bootstrap.servers", "string", None, "Kafka bootstrap servers, host:port[,host:port]."),
    Option("link", "string", None, "Stable name of this link (query). Names its transactional ids and its arbitration "
                                   "records; renaming it breaks recovery. Letters, digits, '.', '_' and '-', short "
                                   f"enough that the XA gtrid '<link>:<epoch>' fits {xid.MAXGTRIDSIZE} bytes.",
           max_length=xid.MAX_LINK_LENGTH),
    Option("arbitrationTable", "string", None, "Path of the Delta table that holds the arbitration record of every "
                                               "decided epoch (created on first use; readable with "
                                               "spark.read.format('delta'))."),
    Option("topic", "string", "", "Topic for every row; overrides the 'topic' column, as in Spark's kafka sink."),
    Option("kafka.transaction.timeout.ms", "integer", str(DEFAULT_TRANSACTION_TIMEOUT_MS),
           "Kafka aborts a prepared branch after this; at most the broker's transaction.max.timeout.ms. An epoch "
           "is decided only while each of its branches has a quarter of this (at most 2 minutes) left; a longer "
           "epoch is rolled back and the query stops (EpochNotDecidedError), to be replayed on restart.",
           minimum=1000),
    Option("kafka.default.api.timeout.ms", "integer", "60000",
           "How long one Kafka request of the driver or a task (ending or describing a branch, listing the link's "
           "transactions, reading topics and broker settings) keeps retrying through broker loss: a node restarting, "
           "the coordinator or a leader moving, too few in-sync replicas. Then the query fails with "
           "KafkaUnavailableError, naming the broker's condition (the Java client's setting).", minimum=1),
    Option("arbitrationRetentionEpochs", "integer", "100", "Confirmed epochs kept in the arbitration table before "
                                                           "cleanup.", minimum=0),
    Option("arbitrationCleanupEvery", "integer", "50", "Run arbitration cleanup and compaction every N epochs.",
           minimum=1),
    Option("phase2Parallelism", "integer", "8", "Branches committed in parallel in phase 2.", minimum=1),
    Option("checkpointLocation", "string", None, "Spark's checkpoint location (required: recovery depends on it)."),
], exempt=("path",), exempt_prefixes=("kafka.", "storage."),
   others="kafka.* producer settings and storage.* settings (docs/storage.md)")


@dataclass(frozen=True)
class KafkaSinkOptions(xid.LinkIds):
    """The sink's checked options (picklable; shipped to executors with the writer)."""

    link: str
    arbitration_table: str
    client_config: KafkaConfig
    topic: str | None
    transaction_timeout_ms: int
    retention_epochs: int
    cleanup_every: int
    phase2_parallelism: int
    checkpoint_location: str
    extra: dict[str, str] = field(default_factory=dict)
    storage: StorageConfig = field(default_factory=StorageConfig)

    @property
    def bootstrap_servers(self) -> str:
        return self.client_config["bootstrap.servers"]

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> KafkaSinkOptions:
        """Parses Spark's (case-insensitive) option map.

        Raises:
            OptionError: naming the first bad option and the valid choices.
        """
        opts = {k.lower(): v for k, v in options.items()}
        for key in opts:
            if key.startswith("kafka."):
                if key in _RESERVED:
                    raise OptionError(key, f"is set by the sink and cannot be given: {_RESERVED[key]}")
                continue
            SINK_OPTIONS.check_known(key, "the lastagent-kafka sink")
        storage = StorageConfig.parse(options)
        for required in ("kafka.bootstrap.servers", "link", "arbitrationTable", "checkpointLocation"):
            if not opts.get(required.lower(), "").strip():
                hint = {
                    "checkpointLocation": "exactly-once needs Spark's checkpoint: .option('checkpointLocation', path)",
                    "link": "give the query a stable name, e.g. .option('link', 'orders-to-kafka')",
                    "arbitrationTable": "give a Delta table path for the decisions, "
                                        "e.g. .option('arbitrationTable', '/data/lastagent/arbitration')",
                    "kafka.bootstrap.servers": "e.g. .option('kafka.bootstrap.servers', 'host:9092')",
                }[required]
                raise OptionError(required, f"is required; {hint}")
        link = xid.check_link(opts["link"].strip())
        timeout = SINK_OPTIONS.integer_value(opts, "kafka.transaction.timeout.ms")
        client = {k[len("kafka."):]: v for k, v in opts.items() if k.startswith("kafka.")}
        client.pop("transaction.timeout.ms", None)
        SINK_OPTIONS.integer_value(opts, "kafka.default.api.timeout.ms")  # checked against the table; KafkaConfig keeps it
        for option in ("arbitrationTable", "checkpointLocation"):
            storage.check(location(opts[option.lower()], option))
        return cls(
            link=link,
            arbitration_table=opts["arbitrationtable"].strip(),
            client_config=KafkaConfig.parse(client),
            topic=(opts.get("topic") or "").strip() or None,
            transaction_timeout_ms=timeout,
            retention_epochs=SINK_OPTIONS.integer_value(opts, "arbitrationRetentionEpochs"),
            cleanup_every=SINK_OPTIONS.integer_value(opts, "arbitrationCleanupEvery"),
            phase2_parallelism=SINK_OPTIONS.integer_value(opts, "phase2Parallelism"),
            checkpoint_location=opts["checkpointlocation"],
            storage=storage,
        )
