"""The Delta feature table and the rules it gives a table: pure, no Spark, no I/O (FileWriter aside, on tmp)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lastagent.delta.features import (
    FEATURES,
    Constraint,
    GeneratedColumn,
    IdentityColumn,
    TableRules,
    UnsupportedTableFeatureError,
    markdown,
    table_features,
    write_rules,
)
from lastagent.delta.files import FileWriter, physical_fields
from lastagent.errors import ArbitrationError, IdentityExhaustedError, SchemaMismatchError
from lastagent.sinks.table_rows import IdentityValues, RowChecker

pytestmark = pytest.mark.unit


def _field(name: str, kind: object = "integer", nullable: bool = True, **metadata: object) -> dict:
    return {"name": name, "type": kind, "nullable": nullable, "metadata": metadata}


def _schema(*fields: dict) -> str:
    return json.dumps({"type": "struct", "fields": list(fields)})


def _rules(reader: int = 1, writer: int = 2, rf: list[str] | None = None, wf: list[str] | None = None,
           config: dict | None = None, schema: str | None = None) -> TableRules:
    return write_rules("/t", "target table", reader, writer, rf, wf, config or {}, schema or _schema(_field("id")))


def test_a_plain_table_needs_nothing():
    assert _rules() == TableRules()


def test_legacy_versions_imply_their_features():
    assert table_features(1, 2, None, None) == {"appendOnly", "invariants"}
    assert table_features(2, 5, None, None) == {"appendOnly", "invariants", "checkConstraints", "changeDataFeed",
                                                "generatedColumns", "columnMapping"}
    assert "identityColumns" in table_features(1, 6, None, None)


def _identity(name: str = "id", kind: object = "long", **more: object) -> dict:
    return _field(name, kind, **{"delta.identity.start": 1, "delta.identity.step": 1,
                                 "delta.identity.allowExplicitInsert": False, **more})


def test_identity_columns_are_rules_with_their_marks_and_refused_where_delta_does_not_define_them():
    assert _rules(writer=6) == TableRules()
    assert _rules(writer=6, schema=_schema(_identity(), _field("v"))) == TableRules(
        identity=(IdentityColumn("id", 1, 1, None, True),))
    by_default = _identity("sk", **{"delta.identity.start": 100, "delta.identity.step": -3,
                                    "delta.identity.highWaterMark": 94, "delta.identity.allowExplicitInsert": True})
    (sk,) = _rules(1, 7, None, ["identityColumns"], schema=_schema(by_default)).identity
    assert sk == IdentityColumn("sk", 100, -3, 94, False) and sk.base == 91
    assert IdentityColumn("id", 5, 2, None, True).base == 5
    with pytest.raises(UnsupportedTableFeatureError, match="'identityColumns'.*column 'id' is an identity column of "
                                                           "type integer"):
        _rules(writer=6, schema=_schema(_identity(kind="integer")))
    with pytest.raises(UnsupportedTableFeatureError, match="'identityColumns'.*step is 0"):
        _rules(writer=6, schema=_schema(_identity(**{"delta.identity.step": 0})))
    with pytest.raises(UnsupportedTableFeatureError, match="'identityColumns'.*also has rowTracking"):
        _rules(1, 7, None, ["identityColumns", "rowTracking", "domainMetadata"], schema=_schema(_identity()))


def test_identity_values_are_unique_across_tasks_and_batches_and_beyond_the_mark():
    schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
    up, down = IdentityColumn("id", 1, 1, 41, True), IdentityColumn("id", 0, -5, None, False)
    seen: dict[int, list[int]] = {}
    for column in (up, down):
        values = []
        for partition in (0, 1, 7):
            ids = IdentityValues((column,), partition)
            for rows in (3, 0, 2):
                batch = pa.record_batch([pa.nulls(rows, pa.int64()), pa.array(["x"] * rows)], schema=schema)
                values += ids.fill(batch, {"v"}).column("id").to_pylist()
        seen[column.step] = values
    assert len(set(seen[1])) == len(seen[1]) == 15 and min(seen[1]) == 42  # one step past the mark
    assert len(set(seen[-5])) == 15 and max(seen[-5]) == 0 and all(v % 5 == 0 for v in seen[-5])
    with pytest.raises(SchemaMismatchError, match=r"the rows give identity column\(s\) \['id'\]"):
        IdentityValues((up,), 0).fill(pa.record_batch([pa.array([1]), pa.array(["x"])], schema=schema), {"id", "v"})
    with pytest.raises(IdentityExhaustedError, match="BIGINT"):
        IdentityValues((IdentityColumn("id", 1, 1, 2**63 - 10, True),), 3).fill(  # the second row's slot: 65539
            pa.record_batch([pa.nulls(2, pa.int64()), pa.array(["x", "y"])], schema=schema), {"v"})
    with pytest.raises(IdentityExhaustedError, match="at most 65536 partitions"):
        IdentityValues((up,), 1 << 16)


def test_the_epochs_commit_moves_each_identity_mark_to_the_furthest_value_its_files_hold():
    from lastagent.delta.target_table import high_water_marks

    schema = _schema(_identity(), _identity("down", **{"delta.identity.step": -2, "delta.columnMapping.physicalName":
                                                       "col-9", "delta.identity.highWaterMark": -10}), _field("v"))
    up, down = IdentityColumn("id", 1, 1, None, True), IdentityColumn("down", 1, -2, -10, True)

    def add(lo: int, hi: int, dlo: int, dhi: int, rows: int = 2) -> dict:
        return {"path": "f", "stats": json.dumps({"numRecords": rows, "minValues": {"id": lo, "col-9": dlo},
                                                  "maxValues": {"id": hi, "col-9": dhi}})}

    moved = json.loads(high_water_marks(schema, (up, down), (add(1, 65537, -12, -14), add(2, 131074, -16, -12)), "/t"))
    marks = {f["name"]: f["metadata"].get("delta.identity.highWaterMark") for f in moved["fields"]}
    assert marks == {"id": 131074, "down": -16, "v": None}
    assert high_water_marks(schema, (up, down), (), "/t") is None  # no rows, no move
    after = (IdentityColumn("id", 1, 1, 131074, True), IdentityColumn("down", 1, -2, -16, True))
    assert high_water_marks(json.dumps(moved), after, (add(5, 9, -12, -14),), "/t") is None  # not past the marks
    with pytest.raises(ArbitrationError, match="file f has no statistics for identity column 'id'"):
        high_water_marks(schema, (up,), ({"path": "f", "stats": '{"numRecords": 1, "maxValues": {}}'},), "/t")


@pytest.mark.parametrize("feature", [f.name for f in FEATURES if not f.written])
def test_every_refused_feature_is_refused_by_name(feature):
    readers = next(f.readers for f in FEATURES if f.name == feature)
    with pytest.raises(UnsupportedTableFeatureError) as err:
        _rules(3 if readers else 1, 7, [feature] if readers else None, [feature, "appendOnly"])
    assert err.value.feature == feature
    assert str(err.value).startswith(f"Delta table /t (target table) uses the table feature '{feature}', which "
                                     "lastagent-delta does not write: ")


def test_a_feature_not_in_the_list_is_refused():
    with pytest.raises(UnsupportedTableFeatureError, match="'someFutureFeature'.*not in lastagent's list"):
        _rules(1, 7, None, ["appendOnly", "someFutureFeature"])


def test_the_variant_feature_alone_is_written_a_variant_column_refused():
    assert _rules(3, 7, ["deletionVectors", "variantType"], ["deletionVectors", "variantType"]) == TableRules()
    with pytest.raises(UnsupportedTableFeatureError, match="'variantType'.*VARIANT column"):
        _rules(3, 7, ["variantType"], ["variantType"], schema=_schema(_field("v", "variant")))


@pytest.mark.parametrize(("metadata", "feature"), [({"CURRENT_DEFAULT": "7"}, "allowColumnDefaults"),
                                                   ({"delta.invariants": "{}"}, "invariants"),
                                                   ({"__COLLATIONS": "{}"}, "collations-preview")])
def test_column_metadata_that_needs_a_writer_is_refused_even_without_its_feature_listed(metadata, feature):
    with pytest.raises(UnsupportedTableFeatureError) as err:
        _rules(1, 7, None, ["appendOnly", "invariants"], schema=_schema(_field("a", **metadata)))
    assert err.value.feature == feature


def test_a_transaction_retention_is_refused():
    with pytest.raises(UnsupportedTableFeatureError, match="'delta.setTransactionRetentionDuration'"):
        _rules(config={"delta.setTransactionRetentionDuration": "interval 1 days"})


def test_rules_gather_constraints_generated_columns_not_null_paths_and_column_mapping():
    nested = {"type": "struct", "fields": [_field("x", nullable=False), _field("y")]}
    schema = _schema(_field("id", "long", nullable=False), _field("s", nested),
                     _field("d", **{"delta.generationExpression": "id * 2"}))
    rules = _rules(2, 7, None, ["columnMapping", "checkConstraints", "generatedColumns", "v2Checkpoint"],
                   {"delta.columnMapping.mode": "name", "delta.constraints.pos": "id > 0"}, schema)
    assert rules == TableRules("name", (Constraint("pos", "id > 0"),), (GeneratedColumn("d", "id * 2"),),
                               ("id", "s.x"))


def test_docs_carry_the_feature_table():
    docs = (Path(__file__).parents[2] / "docs" / "delta.md").read_text()
    assert markdown() in docs, "docs/delta.md is stale: python -m lastagent.delta.features"


def test_not_null_is_checked_through_structs():
    t = pa.struct([pa.field("x", pa.int32())])
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("s", t)])
    batch = pa.record_batch([pa.array([1, None, 3, 4]), pa.array([{"x": 1}, {"x": 2}, {"x": None}, None], t)],
                            schema=schema)
    good, failed = RowChecker(TableRules(not_null=("id", "s.x")), schema, ("id", "s"), "UTC").apply(batch)
    assert good.column("id").to_pylist() == [1, 4]  # a null struct holds no null field
    assert [(f.row.column("id")[0].as_py(), f.reason) for f in failed] == [(None, "not-null:id"), (3, "not-null:s.x")]
    assert all("null" in str(f.error) and "2" not in str(f.error) for f in failed)  # names the column, not the row


def test_files_of_a_column_mapped_table_use_physical_names_and_field_ids(tmp_path):
    delta = _schema(_field("id", "long", **{"delta.columnMapping.physicalName": "col-a", "delta.columnMapping.id": 1}),
                    _field("s", {"type": "struct", "fields": [
                        _field("x", **{"delta.columnMapping.physicalName": "col-c", "delta.columnMapping.id": 3})]},
                        **{"delta.columnMapping.physicalName": "col-b", "delta.columnMapping.id": 2}),
                    _field("p", "string", **{"delta.columnMapping.physicalName": "col-d", "delta.columnMapping.id": 4}))
    t = pa.struct([pa.field("x", pa.int32())])
    logical = pa.schema([pa.field("id", pa.int64()), pa.field("s", t), pa.field("p", pa.string())])
    writer = FileWriter(str(tmp_path), "l", 0, 0, 0, 0, partition_by=("p",), physical=physical_fields(logical, delta))
    writer.write(pa.record_batch([pa.array([1, 2]), pa.array([{"x": 5}, None], t), pa.array(["a", "a"])],
                                 schema=logical))
    (add,) = writer.close()
    assert add["partitionValues"] == {"col-d": "a"} and add["path"].startswith("col-d=a/")
    stats = json.loads(add["stats"])
    assert stats["minValues"] == {"col-a": 1} and stats["nullCount"] == {"col-a": 0, "col-b": 1}
    stored = pq.read_schema(tmp_path / add["path"])
    assert stored.names == ["col-a", "col-b"]
    assert stored.field("col-a").metadata == {b"PARQUET:field_id": b"1"}
    assert stored.field("col-b").type.field(0).name == "col-c"
    assert writer.schema is not None and writer.schema.names == ["id", "s", "p"]  # the commit still sees logical names


def test_char_and_varchar_lengths_are_rules_nested_ones_refused():
    schema = _schema(_field("a", "string", __CHAR_VARCHAR_TYPE_STRING="varchar(3)"),
                     _field("b", "string", __CHAR_VARCHAR_TYPE_STRING="char(2)"))
    assert _rules(schema=schema).lengths == (("a", 3), ("b", 2))
    nested = _schema(_field("s", {"type": "struct", "fields": [_field("v", "string")]},
                            __CHAR_VARCHAR_TYPE_STRING="struct<v:varchar(2)>"))
    with pytest.raises(UnsupportedTableFeatureError, match="'CHAR/VARCHAR'.*column 's' is struct<v:varchar"):
        _rules(schema=nested)


def test_a_value_longer_than_its_varchar_goes_to_the_dead_letters():
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("name", pa.string())])
    batch = pa.record_batch([pa.array([1, 2, 3]), pa.array(["abc", "abcd", None])], schema=schema)
    good, failed = RowChecker(TableRules(lengths=(("name", 3),)), schema, ("id", "name"), "UTC").apply(batch)
    assert good.column("id").to_pylist() == [1, 3]
    assert [(f.row.column("id")[0].as_py(), f.reason) for f in failed] == [(2, "length:name")]


@pytest.mark.parametrize("features", [["rowTracking", "domainMetadata"], ["clustering", "domainMetadata"],
                                      ["inCommitTimestamp"], ["domainMetadata"]])
def test_a_feature_only_kernel_commits_with_sends_the_commits_through_kernel(features):
    """Row tracking, clustering, in-commit timestamps and domain metadata are written, by Delta Kernel; a
    v2-checkpoint table is written with or without them (its checkpoints come from kernel either way)."""
    assert _rules(1, 7, None, features) == TableRules(kernel=True)
    assert _rules(3, 7, ["deletionVectors", "v2Checkpoint"], [*features, "deletionVectors", "v2Checkpoint"]) == \
        TableRules(kernel=True)
    assert _rules(3, 7, ["v2Checkpoint"], ["v2Checkpoint"]) == TableRules()


def test_column_defaults_are_rules_committed_by_kernel_nested_ones_refused():
    from lastagent.delta.features import ColumnDefault

    schema = _schema(_field("id"), _field("amount", CURRENT_DEFAULT="7"))
    assert _rules(1, 7, None, ["allowColumnDefaults"], schema=schema) == TableRules(
        kernel=True, defaults=(ColumnDefault("amount", "7"),))
    nested = _schema(_field("s", {"type": "struct", "fields": [_field("a", CURRENT_DEFAULT="1")]}))
    with pytest.raises(UnsupportedTableFeatureError, match=r"column 's.a' has a DEFAULT inside a struct"):
        _rules(1, 7, None, ["allowColumnDefaults"], schema=nested)


def test_a_kernel_table_with_a_constraint_or_a_generated_column_is_refused_naming_it():
    """Kernel 0.30.1's write gate refuses both; the start says so before anything is claimed."""
    with pytest.raises(UnsupportedTableFeatureError, match=r"'checkConstraints'.*also has rowTracking.*Delta Kernel"):
        _rules(1, 7, None, ["rowTracking", "domainMetadata", "checkConstraints"], {"delta.constraints.c": "id > 0"})
    generated = _schema(_field("id"), _field("g", **{"delta.generationExpression": "id * 2"}))
    with pytest.raises(UnsupportedTableFeatureError, match=r"'generatedColumns'.*also has inCommitTimestamp"):
        _rules(1, 7, None, ["inCommitTimestamp", "generatedColumns"], schema=generated)


def test_lastagents_own_tables_with_a_kernel_feature_are_refused_by_name():
    """The dead-letter and arbitration tables get lastagent's plain appends: row tracking there is refused, naming
    it."""
    from types import SimpleNamespace

    from lastagent.delta.features import require_plain
    from lastagent.delta.snapshot import Protocol

    table = SimpleNamespace(protocol=Protocol(1, 7, None, ("rowTracking", "domainMetadata")), configuration={},
                            schema_json=_schema(_field("reason", "string")))
    with pytest.raises(UnsupportedTableFeatureError, match=r"\(dead-letter table\) uses the table feature "
                                                           r"'rowTracking'.*as plain appends"):
        require_plain(table, "/d", "dead-letter table")
    table.protocol = Protocol(1, 7, None, ("identityColumns",))
    table.schema_json = _schema(_identity(), _field("reason", "string"))
    with pytest.raises(UnsupportedTableFeatureError, match=r"'identityColumns'.*lastagent's own rows"):
        require_plain(table, "/d", "dead-letter table")


def test_a_broken_check_is_named_even_when_another_name_prefixes_it():
    schema = pa.schema([pa.field("amount", pa.int32())])
    rules = TableRules(constraints=(Constraint("pos", "amount > -5"), Constraint("positive", "amount > 0")))
    batch = pa.record_batch([pa.array([1, -1, -9])], schema=schema)
    _, failed = RowChecker(rules, schema, ("amount",), "UTC").apply(batch)
    assert [f.reason for f in failed] == ["check-constraint:positive", "check-constraint:pos"]


def test_a_task_outside_utc_refuses_an_expression_that_depends_on_the_time_zone():
    """The driver checks as for UTC; the task knows Spark's session zone and refuses before writing."""
    from lastagent.errors import UnsupportedExpressionError

    schema = pa.schema([pa.field("ts", pa.timestamp("us", tz="UTC")), pa.field("day", pa.date32())])
    rules = TableRules(generated=(GeneratedColumn("day", "CAST(ts AS DATE)"),))
    assert RowChecker(rules, schema, ("ts",), "UTC").expressions is not None
    for zone in ("America/New_York", "unknown"):
        with pytest.raises(UnsupportedExpressionError, match="generated column 'day'"):
            RowChecker(rules, schema, ("ts",), zone)
