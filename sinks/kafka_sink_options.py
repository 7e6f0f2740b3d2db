"""Options of the ``lastagent-kafka`` sink, parsed once at query start. Driver side.

Spark's own ``kafka`` sink options keep their names (``kafka.bootstrap.servers``, any
``kafka.*`` producer setting, ``topic``); the protocol adds ``link`` and
``arbitrationTable``. Every error names the option and what would be right.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field

from lastagent import xid
from lastagent.errors import OptionError

#: Producer settings the sink owns: a user value would break the protocol or the row schema.
_RESERVED = {
    "kafka.transactional.id": "the sink names each branch's transactional.id from 'link' (bounded per link)",
    "kafka.enable.idempotence": "transactions need the idempotent producer",
    "kafka.key.serializer": "keys are written as bytes; cast the 'key' column to string or binary",
    "kafka.value.serializer": "values are written as bytes; cast the 'value' column to string or binary",
}

DEFAULT_TRANSACTION_TIMEOUT_MS = 900_000

#: The sink's own options: name → (default or None when required, description). Docs are
#: generated from this table.
SINK_OPTIONS: dict[str, tuple[str | None, str]] = {
    "kafka.bootstrap.servers": (None, "Kafka bootstrap servers, host:port[,host:port]."),
    "link": (None, "Stable name of this link (query). Names its transactional ids and its arbitration "
                   "records; renaming it breaks recovery. Letters, digits, '.', '_' and '-', at most 44 "
                   "(so the XA gtrid '<link>:<epoch>' fits 64 bytes)."),
    "arbitrationTable": (None, "Path of the Delta table that holds the arbitration record of every decided "
                               "epoch (created on first use; readable with spark.read.format('delta'))."),
    "topic": ("", "Topic for every row; overrides the 'topic' column, as in Spark's kafka sink."),
    "kafka.transaction.timeout.ms": (str(DEFAULT_TRANSACTION_TIMEOUT_MS),
                                     "Kafka aborts a prepared branch after this; must stay well above an epoch's "
                                     "decide + commit time and at most the broker's transaction.max.timeout.ms."),
    "arbitrationRetentionEpochs": ("100", "Confirmed epochs kept in the arbitration table before cleanup."),
    "arbitrationCleanupEvery": ("50", "Run arbitration cleanup and compaction every N epochs."),
    "phase2Parallelism": ("8", "Branches committed in parallel in phase 2."),
    "checkpointLocation": (None, "Spark's checkpoint location (required: recovery depends on it)."),
}
_KNOWN = {k.lower(): k for k in SINK_OPTIONS}


def _int(options: Mapping[str, str], name: str, minimum: int) -> int:
    raw = options.get(name.lower(), SINK_OPTIONS[name][0])
    try:
        value = int(str(raw))
    except ValueError:
        raise OptionError(name, f"{raw!r} is not an integer; give a whole number >= {minimum}") from None
    if value < minimum:
        raise OptionError(name, f"{value} is too small; give a whole number >= {minimum}")
    return value


@dataclass(frozen=True)
class KafkaSinkOptions(xid.LinkIds):
    """The sink's checked options (picklable; shipped to executors with the writer)."""

    link: str
    arbitration_table: str
    client_config: dict[str, str]
    topic: str | None
    transaction_timeout_ms: int
    retention_epochs: int
    cleanup_every: int
    phase2_parallelism: int
    checkpoint_location: str
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def bootstrap_servers(self) -> str:
        return self.client_config["bootstrap.servers"]

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> "KafkaSinkOptions":
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
            if key not in _KNOWN and key not in ("path",):
                valid = ", ".join(sorted(k for k in SINK_OPTIONS if not k.startswith("kafka.")))
                near = difflib.get_close_matches(key, list(_KNOWN), n=1)
                hint = f"did you mean '{_KNOWN[near[0]]}'? " if near else ""
                raise OptionError(key, f"unknown option for the lastagent-kafka sink; {hint}valid options: {valid}, "
                                       "and kafka.* producer settings")
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
        timeout = _int(opts, "kafka.transaction.timeout.ms", 1000)
        client = {k[len("kafka."):]: v for k, v in opts.items() if k.startswith("kafka.")}
        client.pop("transaction.timeout.ms", None)
        return cls(
            link=link,
            arbitration_table=opts["arbitrationtable"].strip(),
            client_config=client,
            topic=(opts.get("topic") or "").strip() or None,
            transaction_timeout_ms=timeout,
            retention_epochs=_int(opts, "arbitrationRetentionEpochs", 0),
            cleanup_every=_int(opts, "arbitrationCleanupEvery", 1),
            phase2_parallelism=_int(opts, "phase2Parallelism", 1),
            checkpoint_location=opts["checkpointlocation"],
        )
