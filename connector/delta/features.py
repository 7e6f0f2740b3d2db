"""Which Delta table features ``lastagent-delta`` writes as Spark's Delta writer does, and which it refuses.

Pure (no I/O): the driver reads a table's protocol, configuration and schema at query start and
hands them to :func:`write_rules`, which either returns what the tasks must do to every row
(:class:`TableRules`) or raises :class:`UnsupportedTableFeatureError` naming the feature and the
table, before anything is claimed or written.

Delta's protocol says a writer must not write to a table whose writer features it does not
support. :data:`FEATURES` is the one list: every feature of the current Delta protocol (and the
preview names Spark and Databricks write), with what the sink does about it. A feature not in
the list is refused. ``docs/delta.md`` is generated from it (``python -m lastagent.delta.features``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lastagent.errors import UnsupportedTableFeatureError

if TYPE_CHECKING:
    from lastagent.delta.snapshot import Snapshot


@dataclass(frozen=True)
class Feature:
    """One Delta table feature and what the sink does about it.

    Attributes:
        name: the protocol's name of the feature.
        readers: True for reader-and-writer features, False for writer-only ones.
        written: True when the sink honours it on every append; False when a table with it is refused.
        how: what the sink does (written) or why it refuses (refused), one sentence for the docs.
    """

    name: str
    readers: bool
    written: bool
    how: str


FEATURES: tuple[Feature, ...] = (
    Feature("appendOnly", False, True, "the sink only appends files; it never removes or rewrites one"),
    Feature("invariants", False, True,
            "Spark lists it on every table; a column that has a legacy invariant (`delta.invariants` metadata) "
            "is refused"),
    Feature("checkConstraints", False, True,
            "every CHECK constraint is evaluated on the executor before a file is staged; a row that breaks one "
            "goes to the dead letters with the constraint's name (no dead-letter target: the epoch fails); an "
            "expression outside the supported subset is refused at start"),
    Feature("generatedColumns", False, True,
            "generated values are computed on the executor as Spark computes them, or checked with "
            "`(value <=> expression) IS TRUE` when the query gives the column; an expression outside the "
            "supported subset is refused at start"),
    Feature("changeDataFeed", False, True,
            "appends need no change-data files: readers take inserted rows from the add actions"),
    Feature("columnMapping", True, True,
            "modes `name` and `id`: files carry physical names and field ids; statistics and partition values "
            "are keyed by physical names; mergeSchema is refused on such a table (new columns would need ids)"),
    Feature("deletionVectors", True, True, "appended files carry no deletion vector; readers need none for them"),
    Feature("timestampNtz", True, True, "TIMESTAMP_NTZ columns are written as parquet timestamps not adjusted to UTC"),
    Feature("vacuumProtocolCheck", True, True, "concerns VACUUM only; appends are unaffected"),
    Feature("v2Checkpoint", True, True,
            "appends are plain commits; the checkpoints every delta.checkpointInterval versions are V2 ones, "
            "written by Delta Kernel"),
    Feature("allowColumnDefaults", False, True,
            "a top-level column the query does not give gets its DEFAULT, computed on the executors by the "
            "expression engine of generated columns (an expression outside its subset is refused at start); a "
            "column the query gives keeps its values, nulls included; the commit is made by Delta Kernel"),
    Feature("identityColumns", False, True,
            "a BIGINT identity column the query does not give gets values no two tasks share (the task's partition "
            "interleaved with its row count, from the high-water mark up, in steps of the column's step) and the "
            "epoch's commit moves `delta.identity.highWaterMark` to the highest value written, so Spark's later "
            "writes go on above it; a query that gives the column is refused at start, and so is a table that also "
            "has a feature only Delta Kernel's transaction writes (that transaction cannot carry the new mark)"),
    Feature("rowTracking", False, True,
            "each file gets a baseRowId and defaultRowCommitVersion and the commit moves the row-id high-water mark "
            "(Delta Kernel's transaction), so `_metadata.row_id` is unique across epochs and tasks and Spark's "
            "later writes go on from it; the commit is made by Delta Kernel"),
    Feature("clustering", False, True,
            "the clustering columns stay as the table's domain records them; every file carries statistics for "
            "them (Delta Kernel checks it), so a later OPTIMIZE clusters; the commit is made by Delta Kernel"),
    Feature("inCommitTimestamp", False, True,
            "every commit carries an inCommitTimestamp above the previous commit's (Delta Kernel's transaction; "
            "lastagent's property commits compute it the same way)"),
    Feature("domainMetadata", False, True,
            "the table's domains are kept as they are; only row tracking's high-water mark moves, in the commit "
            "that adds the rows; the commit is made by Delta Kernel"),
    Feature("icebergCompatV1", False, False,
            "UniForm requires Iceberg metadata conversion after each commit, which only Spark's writer does"),
    Feature("icebergCompatV2", False, False,
            "UniForm requires Iceberg metadata conversion after each commit, which only Spark's writer does"),
    Feature("icebergWriterCompatV1", False, False, "as icebergCompatV2 (UniForm)"),
    Feature("typeWidening", True, True,
            "files are written in each column's current type (a widened column's old files keep theirs, as the "
            "protocol says; its type history stays in the column's metadata); the commit is made by Delta Kernel"),
    Feature("typeWidening-preview", True, True, "as typeWidening"),
    Feature("variantType", True, True,
            "the feature alone needs nothing of an appender; a table with a VARIANT column is refused, since the sink "
            "does not write the Variant encoding"),
    Feature("variantType-preview", True, True, "as variantType"),
    Feature("variantShredding-preview", True, False,
            "shredded Variant columns need the shredding layout, which the sink does not write"),
    Feature("catalogManaged", True, False,
            "commits must go through the table's catalog (Unity Catalog), not to the log directly"),
    Feature("catalogOwned-preview", True, False, "as catalogManaged"),
    Feature("checkpointProtection", False, False,
            "lastagent's log cleanup does not read the protected versions "
            "(delta.requireCheckpointProtectionBeforeVersion)"),
    Feature("collations-preview", True, False, "string comparisons of collated columns differ from binary ones"),
)

_BY_NAME = {f.name: f for f in FEATURES}

#: Features a legacy protocol (writer version < 7, reader version < 3) implies, by version.
_LEGACY_WRITER = ((2, ("appendOnly", "invariants")), (3, ("checkConstraints",)),
                  (4, ("changeDataFeed", "generatedColumns")), (5, ("columnMapping",)), (6, ("identityColumns",)))

#: Features only Delta Kernel commits with (delta-rs 1.6.6 refuses a table that has one): a table with any of
#: them gets its epochs' commits from kernel (:attr:`TableRules.kernel`). In the order errors name them (domain
#: metadata comes with the first two, so it is named last).
KERNEL_FEATURES = ("rowTracking", "clustering", "inCommitTimestamp", "allowColumnDefaults", "typeWidening",
                   "typeWidening-preview", "domainMetadata")

#: Spark keeps a CHAR(n) / VARCHAR(n) column as a string with this metadata.
_CHAR_VARCHAR = "__CHAR_VARCHAR_TYPE_STRING"
_LENGTH = re.compile(r"(char|varchar)\((\d+)\)", re.IGNORECASE)

#: Table properties a writer must honour that are no feature of their own.
_REFUSED_PROPERTIES = {
    "delta.setTransactionRetentionDuration": (
        "it lets Delta forget application transaction ids (txn), and the link's txn is how lastagent knows which "
        "epochs a table holds, so an expired one could write an epoch twice"),
}


@dataclass(frozen=True)
class Constraint:
    """A CHECK constraint: its name (as in ``ALTER TABLE ... ADD CONSTRAINT``) and its SQL expression."""

    name: str
    sql: str


@dataclass(frozen=True)
class GeneratedColumn:
    """A generated column and its generation expression (SQL)."""

    column: str
    sql: str


@dataclass(frozen=True)
class IdentityColumn:
    """A top-level identity column (``GENERATED ALWAYS|BY DEFAULT AS IDENTITY``) as the epoch's start read it.

    Attributes:
        column: its name.
        start, step: ``delta.identity.start`` and ``delta.identity.step`` (never 0).
        high_water_mark: ``delta.identity.highWaterMark``, the furthest value written (None before the first).
        always: GENERATED ALWAYS (``delta.identity.allowExplicitInsert`` false).
    """

    column: str
    start: int
    step: int
    high_water_mark: int | None
    always: bool

    @property
    def base(self) -> int:
        """The epoch's first value: one step past the high-water mark, or the start."""
        return self.start if self.high_water_mark is None else self.high_water_mark + self.step


@dataclass(frozen=True)
class ColumnDefault:
    """A top-level column's DEFAULT (its ``CURRENT_DEFAULT`` SQL), for rows that do not give the column."""

    column: str
    sql: str


@dataclass(frozen=True)
class TableRules:
    """What each task must do to the rows of one table: worked out on the driver, applied on executors.

    Attributes:
        column_mapping: ``none``, ``name`` or ``id`` (``delta.columnMapping.mode``).
        constraints: the table's CHECK constraints.
        generated: the table's generated columns.
        not_null: paths of the columns (``a`` or ``a.b`` for a struct's field) declared NOT NULL.
        defaults: the table's column defaults (``allowColumnDefaults``).
        identity: the table's identity columns (``identityColumns``), with their high-water marks: a commit that
            finds another mark than the epoch's start did is refused (another writer wrote values meanwhile).
        kernel: the table has a feature only Delta Kernel commits with (:data:`KERNEL_FEATURES`): the epoch's
            commit goes through kernel's transaction, and mergeSchema is refused (that transaction cannot add them).
        lengths: (column, n) of the top-level VARCHAR(n) and CHAR(n) columns: Spark's writer refuses a
            longer value (``length(column) <= n``) and stores the value as given (read-side padding).
    """

    column_mapping: str = "none"
    constraints: tuple[Constraint, ...] = ()
    generated: tuple[GeneratedColumn, ...] = ()
    not_null: tuple[str, ...] = ()
    lengths: tuple[tuple[str, int], ...] = ()
    kernel: bool = False
    defaults: tuple[ColumnDefault, ...] = ()
    identity: tuple[IdentityColumn, ...] = ()

    @property
    def rows_checked(self) -> bool:
        """True when rows must pass through constraints, generated, defaulted or identity columns, lengths or
        NOT NULL."""
        return bool(self.constraints or self.generated or self.not_null or self.lengths or self.defaults
                    or self.identity)


def table_features(min_reader: int, min_writer: int, reader_features: Sequence[str] | None,
                   writer_features: Sequence[str] | None) -> set[str]:
    """Every feature the protocol names or implies (legacy versions imply fixed sets)."""
    named = set(reader_features or ()) | set(writer_features or ())
    if min_writer < 7:
        named |= {f for version, names in _LEGACY_WRITER if min_writer >= version for f in names}
    if min_reader == 2:
        named.add("columnMapping")
    return named


def _fields(schema: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(path, field) of every struct field, nested ones included (through arrays and maps)."""
    for f in schema.get("fields", ()):
        path = f"{prefix}{f['name']}"
        yield path, f
        yield from _nested(f["type"], path + ".")


def _nested(t: Any, prefix: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if not isinstance(t, dict):
        return
    if t.get("type") == "struct":
        yield from _fields(t, prefix)
    elif t.get("type") == "array":
        yield from _nested(t["elementType"], prefix)
    elif t.get("type") == "map":
        yield from _nested(t["keyType"], prefix)
        yield from _nested(t["valueType"], prefix)


def column_types(t: Any) -> Iterator[str]:
    """Every primitive type name in a Delta schema JSON node (through structs, arrays and maps)."""
    if isinstance(t, str):
        yield t
    elif isinstance(t, dict):
        for key in ("elementType", "keyType", "valueType"):
            if key in t:
                yield from column_types(t[key])
        for f in t.get("fields", ()):
            yield from column_types(f["type"])


def _not_null(schema: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Paths of NOT NULL fields reached through nullable-or-not structs only (arrays and maps: their own flags)."""
    for f in schema.get("fields", ()):
        path = f"{prefix}{f['name']}"
        if not f.get("nullable", True):
            yield path
        if isinstance(f["type"], dict) and f["type"].get("type") == "struct":
            yield from _not_null(f["type"], path + ".")


def write_rules(table: str, role: str, min_reader: int, min_writer: int, reader_features: Sequence[str] | None,
                writer_features: Sequence[str] | None, configuration: Mapping[str, str | None],
                schema_json: str) -> TableRules:
    """Checks that the sink can write the table as Spark would and says how. Driver, at query start.

    Args:
        table: the table's path, for the error.
        role: what the table is to the link ("target table", "dead-letter table", "arbitration table").
        min_reader, min_writer, reader_features, writer_features: the table's protocol.
        configuration: the table's properties.
        schema_json: the table's schema (Delta JSON).

    Raises:
        UnsupportedTableFeatureError: the first feature (in :data:`FEATURES` order, unknown ones last)
            the table has and the sink does not write.
    """
    def refuse(feature: str, why: str) -> UnsupportedTableFeatureError:
        return UnsupportedTableFeatureError(feature, table, role, why)

    config = {k: v for k, v in configuration.items() if v is not None}
    named = table_features(min_reader, min_writer, reader_features, writer_features)
    schema = json.loads(schema_json)
    fields = list(_fields(schema))
    for feature in FEATURES:
        if feature.written or feature.name not in named:
            continue
        raise refuse(feature.name, feature.how)
    unknown = sorted(named - set(_BY_NAME))
    if unknown:
        raise refuse(unknown[0], "the feature is not in lastagent's list of Delta features, so it cannot know "
                                 "what a writer must do for it")
    for key, why in _REFUSED_PROPERTIES.items():
        if key in config:
            raise refuse(key, why)
    for path, f in fields:
        metadata = f.get("metadata", {})
        if "delta.invariants" in metadata:
            raise refuse("invariants", f"column '{path}' has a legacy invariant (delta.invariants), which the sink "
                                       "does not evaluate")
        if any(k.startswith("delta.identity.") for k in metadata) and ("." in path or f["type"] != "long"):
            raise refuse("identityColumns", f"column '{path}' is an identity column " + (
                "inside a struct" if "." in path else f"of type {f['type']}") + ", which Delta does not define")
        if "CURRENT_DEFAULT" in metadata and ("allowColumnDefaults" not in named or "." in path):
            raise refuse("allowColumnDefaults", f"column '{path}' has a DEFAULT" + (
                " inside a struct (Spark's defaults are for top-level columns)" if "." in path
                else " but the table does not list the allowColumnDefaults feature"))
        if "__COLLATIONS" in metadata:
            raise refuse("collations-preview", f"column '{path}' has a collation")
        kind = metadata.get(_CHAR_VARCHAR)
        if kind is not None and ("." in path or not _LENGTH.fullmatch(kind)):
            raise refuse("CHAR/VARCHAR", f"column '{path}' is {kind}; the sink checks the length of top-level "
                                         "CHAR and VARCHAR columns only")
    for t in column_types({"fields": schema.get("fields", ())}):
        if t in ("variant", "void"):
            raise refuse("variantType" if t == "variant" else "void",
                         f"the table has a {t.upper()} column, which the sink does not write")
    mode = (config.get("delta.columnMapping.mode") or "none").lower()
    if mode not in ("none", "name", "id"):
        raise refuse("columnMapping", f"delta.columnMapping.mode={mode!r} is not a mode of the protocol")
    constraints = tuple(Constraint(k[len("delta.constraints."):], v) for k, v in sorted(config.items())
                        if k.startswith("delta.constraints."))
    generated = tuple(GeneratedColumn(f["name"], f["metadata"]["delta.generationExpression"])
                      for f in schema.get("fields", ()) if "delta.generationExpression" in f.get("metadata", {}))
    nested_generated = [p for p, f in fields if "." in p and "delta.generationExpression" in f.get("metadata", {})]
    if nested_generated:
        raise refuse("generatedColumns", f"nested field '{nested_generated[0]}' is generated")
    lengths = tuple((f["name"], int(m[2])) for f in schema.get("fields", ())
                    if (m := _LENGTH.fullmatch(f.get("metadata", {}).get(_CHAR_VARCHAR, ""))))
    defaults = tuple(ColumnDefault(f["name"], f["metadata"]["CURRENT_DEFAULT"]) for f in schema.get("fields", ())
                     if "CURRENT_DEFAULT" in f.get("metadata", {}))
    identity = tuple(_identity(f) for f in schema.get("fields", ())
                     if any(k.startswith("delta.identity.") for k in f.get("metadata", {})))
    if any(i.step == 0 for i in identity):
        raise refuse("identityColumns", "an identity column's step is 0, which Delta does not allow")
    kernel = _kernel_feature(named)
    if kernel and (constraints or generated or identity):
        found = "checkConstraints" if constraints else "generatedColumns" if generated else "identityColumns"
        raise refuse(found, f"the table also has {kernel}, whose commits lastagent makes through "
                            f"Delta Kernel, and Delta Kernel 0.30.1 refuses to write to a table with {found}")
    return TableRules(mode, constraints, generated, tuple(_not_null(schema)), lengths, bool(kernel), defaults,
                      identity)


def _identity(f: Mapping[str, Any]) -> IdentityColumn:
    metadata = f["metadata"]
    mark = metadata.get("delta.identity.highWaterMark")
    return IdentityColumn(f["name"], int(metadata.get("delta.identity.start", 1)),
                          int(metadata.get("delta.identity.step", 1)),
                          None if mark is None else int(mark),
                          not bool(metadata.get("delta.identity.allowExplicitInsert", False)))


def rules_of(table: Snapshot, where: str, role: str) -> TableRules:
    """What a writer must do to the rows of a table (as read), or the feature it cannot write. Driver.

    Raises:
        UnsupportedTableFeatureError: naming the feature and the table.
    """
    protocol = table.protocol
    return write_rules(where, role, protocol.min_reader_version, protocol.min_writer_version,
                       protocol.reader_features, protocol.writer_features, table.configuration, table.schema_json)


def require_plain(table: Snapshot, where: str, role: str, nullable: bool = True) -> None:
    """Refuses a table lastagent writes with its own fixed rows (dead letters, arbitration records). Driver.

    Such a table may have no constraint, generated column or column mapping, no feature the sink
    does not write or writes only through Delta Kernel (:data:`KERNEL_FEATURES`), and (``nullable``)
    no NOT NULL column, since lastagent's rows leave some columns null. lastagent creates these
    tables itself; a table made elsewhere must look like one it made.
    """
    rules = rules_of(table, where, role)
    if rules.kernel:  # lastagent's own tables get plain appends, not kernel's transaction, which these need
        raise UnsupportedTableFeatureError(_kernel_feature(_named(table)) or "", where, role,
                                           f"lastagent writes the {role} as plain appends, without Delta Kernel's "
                                           "transaction, which such a table needs; give it a path of its own and "
                                           "lastagent creates it")
    found = ("columnMapping" if rules.column_mapping != "none" else "checkConstraints" if rules.constraints
             else "generatedColumns" if rules.generated else "identityColumns" if rules.identity
             else "CHAR/VARCHAR" if rules.lengths else "NOT NULL" if nullable and rules.not_null else None)
    if found is not None:
        raise UnsupportedTableFeatureError(found, where, role, f"the {role} holds lastagent's own rows, written "
                                                               "as lastagent creates the table; give it a path of its own")


def _kernel_feature(named: set[str]) -> str | None:
    """The first of :data:`KERNEL_FEATURES` the table has, if any."""
    return next((f for f in KERNEL_FEATURES if f in named), None)


def _named(table: Snapshot) -> set[str]:
    protocol = table.protocol
    return table_features(protocol.min_reader_version, protocol.min_writer_version, protocol.reader_features,
                          protocol.writer_features)


def markdown() -> str:
    """The feature table of ``docs/delta.md``."""
    lines = ["| feature | readers too | lastagent-delta | what it does |", "|---|---|---|---|"]
    for f in FEATURES:
        lines.append(f"| `{f.name}` | {'yes' if f.readers else 'no'} | {'written' if f.written else 'refused'} | {f.how} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
