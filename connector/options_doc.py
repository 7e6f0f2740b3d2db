"""Generates docs/options.md from the option tables of the source and the sinks.

Run ``python -m lastagent.options_doc > docs/options.md``; a unit test fails when the file is
stale, so the tables stay the one place an option is described.
"""

from __future__ import annotations

from lastagent.options import OptionTable
from lastagent.sinks.delta_sink_options import DELTA_SINK_OPTIONS
from lastagent.sinks.kafka_sink_options import SINK_OPTIONS
from lastagent.sources.kafka_source_options import SOURCE_OPTIONS
from lastagent.storage import STORAGE_SETTINGS


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "&#124;")


def _table(options: OptionTable) -> list[str]:
    """The Markdown table of one format's options, one row per :class:`~lastagent.options.Option`."""
    lines = ["| option | type | default | range | meaning |", "|---|---|---|---|---|"]
    for row in options.rows():
        shown = "(required)" if row.default is None else f"`{row.default}`" if row.default else ""
        lines.append(f"| `{row.name}` | {row.type} | {shown} | {_cell(row.range)} | {_cell(row.doc)} |")
    return lines


def render() -> str:
    """The whole of docs/options.md."""
    out = [
        "# Options",
        "",
        "Generated from the option tables in `sources/kafka_source_options.py`,",
        "`sinks/kafka_sink_options.py` and `sinks/delta_sink_options.py` by",
        "`python -m lastagent.options_doc`; do not edit by hand.",
        "Option names are case-insensitive, as in Spark. Any other `kafka.*` option is passed to",
        "the Kafka client (librdkafka) without the prefix; an unknown option is an error that",
        "names it.",
        "",
        "Types: `list` is comma-separated; `json` is a JSON text; `choice` is one of the words in",
        "the range column (case-insensitive); `boolean` is true or false. Ranges are inclusive and",
        "checked when the query starts.",
        "",
        "## `lastagent-kafka` source (`spark.readStream`)",
        "",
        *_table(SOURCE_OPTIONS),
        "",
        "## `lastagent-kafka` sink (`df.writeStream`)",
        "",
        "A keyed record goes to the partition Spark's `kafka` sink gives it (the Java producer's",
        "murmur2 of the key: librdkafka's `partitioner=murmur2_random`, also for the `lastagent-delta`",
        "sink's Kafka outputs); `kafka.partitioner` chooses another. A `partition` column wins.",
        "Each task's producer is new, so it waits less before connecting the broker it learned",
        "than librdkafka does by default (`reconnect.backoff.ms` 10, not 100; later reconnects still",
        "back off to `reconnect.backoff.max.ms`): `kafka.reconnect.backoff.ms` sets it.",
        "",
        *_table(SINK_OPTIONS),
        "",
        "## `lastagent-delta` sink (`df.writeStream`)",
        "",
        *_table(DELTA_SINK_OPTIONS),
        "",
        "## `storage.*` settings (both sinks, and `lastagent --storage KEY=VALUE`)",
        "",
        "How lastagent reaches tables and checkpoints on object stores (docs/storage.md). The names are",
        "object_store's configuration keys (delta-rs's storage options: the same names) with the prefix",
        "`storage.`; any other `storage.*` name is passed to Delta Kernel's store as it is. A setting not given is",
        "taken from the environment of the process doing the I/O (driver or executor), as object_store and the",
        "cloud SDKs take it.",
        "",
        *_table(STORAGE_SETTINGS),
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
