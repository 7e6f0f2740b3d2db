"""Generates docs/options.md from the option tables of the source and the sink.

Run ``python -m lastagent.options_doc > docs/options.md``; a unit test fails when the file is
stale, so the tables stay the one place an option is described.
"""

from __future__ import annotations

from lastagent.sinks.delta_sink_options import DELTA_SINK_OPTIONS
from lastagent.sinks.kafka_sink_options import SINK_OPTIONS
from lastagent.sources.kafka_source_options import SOURCE_OPTIONS


def _table(options: dict[str, tuple[str | None, str]]) -> list[str]:
    lines = ["| option | default | meaning |", "|---|---|---|"]
    for name, (default, text) in options.items():
        shown = "(required)" if default is None else f"`{default}`" if default else ""
        lines.append(f"| `{name}` | {shown} | {text.replace('|', '&#124;')} |")
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
        "## `lastagent-kafka` source (`spark.readStream`)",
        "",
        *_table(SOURCE_OPTIONS),
        "",
        "## `lastagent-kafka` sink (`df.writeStream`)",
        "",
        *_table(SINK_OPTIONS),
        "",
        "## `lastagent-delta` sink (`df.writeStream`)",
        "",
        *_table(DELTA_SINK_OPTIONS),
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
