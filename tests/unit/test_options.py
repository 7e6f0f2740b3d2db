"""The option tables: every bound, type and default they declare is what parse() enforces and the docs show."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from lastagent.core import xid
from lastagent.errors import OptionError
from lastagent.options import Option, OptionTable
from lastagent.options_doc import render
from lastagent.sinks.delta_sink_options import DELTA_SINK_OPTIONS, DeltaSinkOptions
from lastagent.sinks.kafka_sink_options import SINK_OPTIONS, KafkaSinkOptions
from lastagent.sources.kafka_source_options import SOURCE_OPTIONS, KafkaSourceOptions

pytestmark = pytest.mark.unit


def _source(options: Mapping[str, str]) -> Any:
    # Batch reads accept every source option (the ending* ones are refused in streaming).
    return KafkaSourceOptions.parse(options, batch=True)


#: format → (its table, a minimal valid option map, its parse).
FORMATS: dict[str, tuple[OptionTable, dict[str, str], Callable[[Mapping[str, str]], Any]]] = {
    "source": (SOURCE_OPTIONS, {"kafka.bootstrap.servers": "h:9092", "subscribe": "t"}, _source),
    "kafka-sink": (SINK_OPTIONS, {"kafka.bootstrap.servers": "h:9092", "link": "orders", "arbitrationTable": "/arb",
                                  "checkpointLocation": "/ckpt"}, KafkaSinkOptions.parse),
    "delta-sink": (DELTA_SINK_OPTIONS, {"path": "/t", "link": "orders", "checkpointLocation": "/ckpt"},
                   DeltaSinkOptions.parse),
}


def _cases(keep: Callable[[Option], bool]) -> list[Any]:
    return [pytest.param(fmt, o.name, id=f"{fmt}:{o.name}") for fmt, (table, _, _) in FORMATS.items()
            for o in table if keep(o)]


def _parse(fmt: str, **extra: str) -> Any:
    table, base, parse = FORMATS[fmt]
    return parse({**base, **extra})


def _refused(fmt: str, **extra: str) -> OptionError:
    with pytest.raises(OptionError) as e:
        _parse(fmt, **extra)
    return e.value


BOUNDED = _cases(lambda o: o.type == "integer" and o.minimum is not None)
CAPPED = _cases(lambda o: o.type == "integer" and o.maximum is not None)
BOOLEANS = _cases(lambda o: o.type == "boolean")
CHOICES = _cases(lambda o: o.type == "choice")
ALL = _cases(lambda o: True)


def test_the_parametrized_cases_are_not_empty():
    """Guards the tests below: an empty parametrization would pass without checking anything."""
    for fmt, (table, _, _) in FORMATS.items():
        assert any(o.type == "integer" and o.minimum is not None for o in table), fmt
    assert len(BOUNDED) >= 15 and len(BOOLEANS) >= 3 and len(CHOICES) >= 2
    assert len(ALL) == sum(len(table) for table, _, _ in FORMATS.values())


def test_every_integer_option_declares_its_lower_bound():
    missing = [f"{fmt}:{o.name}" for fmt, (table, _, _) in FORMATS.items() for o in table
               if o.type == "integer" and o.minimum is None]
    assert not missing, f"integer options without a minimum in the table: {missing}"


@pytest.mark.parametrize("fmt, name", BOUNDED)
def test_integer_minimum_in_the_table_is_the_one_parse_enforces(fmt, name):
    table = FORMATS[fmt][0]
    minimum = table[name].minimum
    assert minimum is not None
    e = _refused(fmt, **{name: str(minimum - 1)})
    assert e.option == name
    assert str(e) == f"option '{name}': {minimum - 1} is too small; give a whole number >= {minimum}"
    _parse(fmt, **{name: str(minimum)})
    _parse(fmt, **{name: f" {minimum} "})


def test_integer_maximum_in_the_table_is_the_one_parse_enforces():
    for param in CAPPED:  # none today; checked here as soon as an option declares one
        fmt, name = param.values
        maximum = FORMATS[fmt][0][name].maximum
        e = _refused(fmt, **{name: str(maximum + 1)})
        assert e.option == name and "is too large" in str(e)
        _parse(fmt, **{name: str(maximum)})


@pytest.mark.parametrize("fmt, name", BOUNDED)
def test_integer_options_refuse_words_naming_the_bound(fmt, name):
    minimum = FORMATS[fmt][0][name].minimum
    e = _refused(fmt, **{name: "many"})
    assert e.option == name
    assert str(e) == f"option '{name}': 'many' is not an integer; give a whole number >= {minimum}"


@pytest.mark.parametrize("fmt, name", BOOLEANS)
def test_boolean_options_refuse_maybe(fmt, name):
    e = _refused(fmt, **{name: "maybe"})
    assert e.option == name
    assert str(e) == f"option '{name}': 'maybe' is not a boolean; give true or false"
    _parse(fmt, **{name: "TRUE"})
    _parse(fmt, **{name: "false"})


@pytest.mark.parametrize("fmt, name", CHOICES)
def test_choice_options_accept_exactly_their_choices(fmt, name):
    option = FORMATS[fmt][0][name]
    for choice in option.choices:
        _parse(fmt, **{name: choice.upper()})
    e = _refused(fmt, **{name: "bogus"})
    assert e.option == name and "'bogus' is not valid" in str(e)
    assert all(choice in str(e) for choice in option.choices)


@pytest.mark.parametrize("fmt", ["kafka-sink", "delta-sink"])
def test_link_length_limit_comes_from_xid_in_table_parse_and_docs(fmt):
    table = FORMATS[fmt][0]
    link = table["link"]
    assert link.type == "string" and link.max_length == xid.MAX_LINK_LENGTH
    row = next(r for r in table.rows() if r.name == "link")
    assert row.range == f"1 to {xid.MAX_LINK_LENGTH} characters"
    assert f"| `link` | string | (required) | 1 to {xid.MAX_LINK_LENGTH} characters |" in render()
    # The limit the docs show is the one parse enforces.
    assert _parse(fmt, link="a" * xid.MAX_LINK_LENGTH).link == "a" * xid.MAX_LINK_LENGTH
    assert _refused(fmt, link="a" * (xid.MAX_LINK_LENGTH + 1)).option == "link"


@pytest.mark.parametrize("fmt, name", ALL)
def test_every_option_in_the_table_is_accepted_by_parse(fmt, name):
    option = FORMATS[fmt][0][name]
    samples = {"integer": str(option.minimum or 0), "boolean": "true", "json": "{}", "list": "a",
               "choice": option.choices[0] if option.choices else ""}
    value = option.default or samples.get(option.type, "x")
    for spelled in (name, name.upper(), name.lower()):
        try:
            _parse(fmt, **{spelled: value})
        except OptionError as e:  # a bad value is fine here; an unknown name is not
            assert "unknown option" not in str(e), str(e)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_unknown_options_list_exactly_the_tables_options(fmt):
    table = FORMATS[fmt][0]
    e = _refused(fmt, noSuchOption="1")
    assert e.option.lower() == "nosuchoption" and "unknown option for the lastagent-" in str(e)
    listed = str(e).split("valid options: ", 1)[1].split(", and kafka.* ")[0].split(", ")
    assert listed == sorted(o.name for o in table if not o.name.startswith("kafka."))


@pytest.mark.parametrize("fmt, name", [c for c in ALL if not c.values[1].startswith("kafka.")])
def test_a_misspelt_option_is_unknown_and_the_right_one_suggested(fmt, name):
    e = _refused(fmt, **{name + "x": "1"})
    assert "unknown option" in str(e) and f"did you mean '{name}'?" in str(e)


@pytest.mark.parametrize("fmt, name", _cases(lambda o: o.required))
def test_required_in_the_table_is_required_by_parse(fmt, name):
    table, base, parse = FORMATS[fmt]
    with pytest.raises(OptionError, match=f"^option '{name}': is required"):
        parse({k: v for k, v in base.items() if k != name})


@pytest.mark.parametrize("fmt, name", _cases(lambda o: bool(o.default)))
def test_giving_the_documented_default_changes_nothing(fmt, name):
    table, base, parse = FORMATS[fmt]
    default = table[name].default
    assert default
    if fmt == "source":
        # Batch reads start at earliest; the documented startingOffsets default is the streaming one.
        batch = name.startswith("ending")
        assert (KafkaSourceOptions.parse({**base, name: default}, batch=batch)
                == KafkaSourceOptions.parse(base, batch=batch))
    else:
        assert parse({**base, name: default}) == parse(base)


def test_blank_integers_keep_each_formats_behaviour():
    assert _parse("source", maxOffsetsPerTrigger=" ").max_offsets_per_trigger is None
    assert _parse("source", **{"kafkaConsumer.pollTimeoutMs": ""}).poll_timeout_ms == 120_000
    assert str(_refused("kafka-sink", phase2Parallelism="")) == ("option 'phase2Parallelism': '' is not an integer; "
                                                                 "give a whole number >= 1")
    assert _refused("delta-sink", targetFileSizeMB="").option == "targetFileSizeMB"


def test_docs_rows_show_type_default_and_range():
    doc = render()
    assert "| option | type | default | range | meaning |" in doc
    assert "| `phase2Parallelism` | integer | `8` | >= 1 |" in doc
    assert "| `kafka.isolation.level` | choice | `read_committed` | read_committed, read_uncommitted |" in doc
    assert "| `startingOffsetsByTimestampStrategy` | choice | `error` | error, latest |" in doc
    for table, _, _ in FORMATS.values():
        for row in table.rows():
            assert f"| `{row.name}` | {row.type} |" in doc


def test_range_text_and_bounds_messages():
    both = Option("n", "integer", "5", "d", minimum=1, maximum=10)
    assert both.range_text() == "1 to 10"
    assert Option("n", "integer", "", "d", maximum=10).range_text() == "<= 10"
    assert Option("s", "string", "", "d", max_length=3).range_text() == "at most 3 characters"
    assert Option("s", "string", None, "d", max_length=3).range_text() == "1 to 3 characters"
    assert Option("c", "choice", "a", "d", choices=("a", "b", "c")).range_text() == "a, b, c"
    table = OptionTable([both, Option("c", "choice", "a", "d", choices=("a", "b", "c"))])
    with pytest.raises(OptionError, match="^option 'n': 11 is too large; give a whole number from 1 to 10$"):
        table.integer({"n": "11"}, "N")
    with pytest.raises(OptionError, match="^option 'c': 'd' is not valid; give a, b or c$"):
        table.choice({"c": "D"}, "c")
    assert table.integer({}, "n") == 5 and table.choice({"c": "B"}, "c") == "b"
    with pytest.raises(TypeError):
        table.boolean({}, "n")


@pytest.mark.parametrize("kwargs", [
    {"type": "float", "default": ""},
    {"type": "integer", "default": "0", "minimum": 1},
    {"type": "integer", "default": "ten"},
    {"type": "boolean", "default": "yes"},
    {"type": "choice", "default": "c", "choices": ("a", "b")},
    {"type": "choice", "default": "a"},
    {"type": "string", "default": "", "minimum": 1},
    {"type": "integer", "default": "", "max_length": 3},
])
def test_inconsistent_declarations_fail_at_import(kwargs):
    with pytest.raises(ValueError, match="option table"):
        Option("x", doc="d", **kwargs)


def test_a_name_declared_twice_is_refused():
    with pytest.raises(ValueError, match="declared twice"):
        OptionTable([Option("a", "string", "", "d"), Option("A", "string", "", "d")])
