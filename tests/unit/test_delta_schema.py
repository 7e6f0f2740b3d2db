"""A Delta schema as Arrow and back without a Delta library (``lastagent.delta.files.arrow_schema``,
``delta_schema_json``): what delta-rs gives, for every type a table can hold, nested ones and field metadata too,
and for the Arrow types a transformer may hand a new table."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pytest

from lastagent.delta.files import arrow_schema, delta_arrow_schema, delta_schema_json

pytestmark = pytest.mark.unit


def _f(name, kind, nullable=True, metadata=None):
    return {"name": name, "type": kind, "nullable": nullable, "metadata": metadata or {}}


SCHEMAS = {
    "primitives": [_f(n, n) for n in ("string", "long", "integer", "short", "byte", "float", "double", "boolean",
                                      "binary", "date", "timestamp", "timestamp_ntz")]
                  + [_f("d", "decimal(10,2)"), _f("d38", "decimal(38, 18)"), _f("k", "long", False)],
    "nested": [
        _f("a", {"type": "array", "elementType": "string", "containsNull": True}),
        _f("b", {"type": "array", "elementType": "long", "containsNull": False}, False),
        _f("m", {"type": "map", "keyType": "string", "valueType": "long", "valueContainsNull": True}),
        _f("mn", {"type": "map", "keyType": "integer", "valueType": "double", "valueContainsNull": False}),
        _f("s", {"type": "struct", "fields": [_f("x", "integer", False), _f("y", {
            "type": "array", "elementType": {"type": "struct", "fields": [_f("z", "timestamp")]},
            "containsNull": True})]}),
    ],
    "column mapping, identity, generated, defaults, comments": [
        _f("id", "long", False, {"delta.columnMapping.id": 1, "delta.columnMapping.physicalName": "col-1a",
                                 "delta.identity.start": 1, "delta.identity.step": 1,
                                 "delta.identity.allowExplicitInsert": False}),
        _f("g", "integer", True, {"delta.generationExpression": "id * 2", "comment": "twice"}),
        _f("s", {"type": "struct", "fields": [_f("inner", "string", True, {"delta.columnMapping.id": 3,
                                                                            "CURRENT_DEFAULT": "'x'"})]},
           True, {"delta.columnMapping.id": 2}),
    ],
    "variant": [_f("v", "variant")],
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_delta_schema_maps_to_the_arrow_schema_delta_rs_gives(name):
    deltalake = pytest.importorskip("deltalake")
    text = json.dumps({"type": "struct", "fields": SCHEMAS[name]})
    expected = pa.schema(deltalake.Schema.from_json(text).to_arrow())
    got = arrow_schema(text)
    assert [_shape(f) for f in got] == [_shape(f) for f in expected], (got, expected)


def _shape(f: pa.Field) -> tuple:
    """A field's name, nullability, metadata (as a dict: delta-rs keeps it in no order) and type, at every depth."""
    t = f.type
    if pa.types.is_struct(t):
        inner: object = [_shape(t.field(i)) for i in range(t.num_fields)]
    elif pa.types.is_list(t):
        inner = ["list", _shape(t.value_field)]
    elif pa.types.is_map(t):
        inner = ["map", _shape(t.key_field), _shape(t.item_field)]
    else:
        inner = str(t)
    return f.name, f.nullable, dict(f.metadata or {}), inner


def test_a_type_it_does_not_know_is_named():
    with pytest.raises(ValueError, match="'interval' has no Arrow mapping"):
        arrow_schema(json.dumps({"type": "struct", "fields": [_f("i", "interval")]}))


#: Arrow types a transformer may give a new table's rows, beside those of SCHEMAS.
ARROW_TYPES = [pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(), pa.dictionary(pa.int32(), pa.string()),
               pa.string_view(), pa.binary_view(), pa.large_string(), pa.large_binary(), pa.binary(4), pa.date64(),
               pa.timestamp("ms", tz="UTC"), pa.timestamp("us"), pa.list_view(pa.int32()), pa.list_(pa.int32(), 2),
               pa.large_list(pa.field("e", pa.string(), False)), pa.null(), pa.struct([]),
               pa.map_(pa.string(), pa.field("v", pa.int64(), False))]
NOT_DELTA = [pa.float16(), pa.time64("us"), pa.duration("us"), pa.timestamp("us", tz="Europe/Paris"),
             pa.decimal256(40, 2), pa.timestamp("ns"), pa.timestamp("s")]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_arrow_form_of_a_delta_schema_maps_back_as_delta_rs_maps_it(name):
    deltalake = pytest.importorskip("deltalake")
    arrow = delta_arrow_schema(arrow_schema(json.dumps({"type": "struct", "fields": SCHEMAS[name]})))
    assert json.loads(delta_schema_json(arrow)) == json.loads(deltalake.Schema.from_arrow(arrow).to_json())


@pytest.mark.parametrize("kind", ARROW_TYPES, ids=str)
def test_an_arrow_type_maps_to_the_delta_type_delta_rs_gives(kind):
    deltalake = pytest.importorskip("deltalake")
    arrow = pa.schema([pa.field("x", kind), pa.field("y", kind, pa.types.is_null(kind), metadata={"comment": "c"})])
    assert json.loads(delta_schema_json(arrow)) == json.loads(deltalake.Schema.from_arrow(arrow).to_json())


@pytest.mark.parametrize("kind", NOT_DELTA, ids=str)
def test_an_arrow_type_delta_cannot_hold_is_refused_naming_the_column(kind):
    with pytest.raises(ValueError, match=re.escape(f"column 's.x': Arrow type {kind} has no Delta type")):
        delta_schema_json(pa.schema([pa.field("s", pa.struct([pa.field("x", kind)]))]))
