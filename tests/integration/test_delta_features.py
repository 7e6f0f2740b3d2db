"""Tables users bring: lastagent-delta against Spark's own Delta writer, on tables made with Spark SQL.

For each Delta feature the sink writes, the same rows go once through Spark's ``delta`` sink and
once through ``lastagent-delta`` into two tables made by the same DDL, and Spark's reader must see
identical rows (generated values and renamed columns included). For each feature it refuses, the
query fails at start naming the feature, and the table is left as it was.
"""

from __future__ import annotations

import json
import uuid

import pytest

pytestmark = pytest.mark.integration

#: The source's columns; each case selects from them what its table takes.
ROWS = [(i, i * 10 - 30, f"n{i}", f"p{i % 2}") for i in range(12)]


@pytest.fixture
def source(spark, tmp_path):
    """A Delta table of 12 rows in 2 commits (2 micro-batches with maxFilesPerTrigger=1)."""
    path = str(tmp_path / "source")
    df = spark.createDataFrame(ROWS, "id BIGINT, amount INT, name STRING, part STRING")
    df.filter("id < 6").coalesce(1).write.format("delta").save(path)
    df.filter("id >= 6").coalesce(1).write.format("delta").mode("append").save(path)
    return path


def _stream(spark, source, checkpoint, table, select, **options):
    df = spark.readStream.format("delta").option("maxFilesPerTrigger", "1").load(source).selectExpr(*select)
    writer = (df.writeStream.format("lastagent-delta").option("link", f"f-{uuid.uuid4().hex[:8]}")
              .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True))
    for k, v in options.items():
        writer = writer.option(k, v)
    return writer.start(table)


def _make(spark, ddl, after, path):
    spark.sql(ddl.format(t=f"delta.`{path}`"))
    for statement in after:
        spark.sql(statement.format(t=f"delta.`{path}`"))


def _rows(spark, path, where="true"):
    return sorted(tuple(r) for r in spark.read.format("delta").load(path).filter(where).collect())


def _detail(spark, path):
    d = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").collect()[0].asDict()
    return {k: d[k] for k in ("partitionColumns", "clusteringColumns", "minReaderVersion", "minWriterVersion")} | {
        "tableFeatures": sorted(d["tableFeatures"]),
        "properties": {k: v for k, v in d["properties"].items() if not k.startswith("lastagent.")}}


# name -> (DDL, statements after it, the query's columns)
WRITTEN = {
    "check constraint, not null, deletion vectors, v2 checkpoints": (
        "CREATE TABLE {t} (id BIGINT NOT NULL, amount INT, name STRING NOT NULL) USING delta TBLPROPERTIES "
        "('delta.enableDeletionVectors'='true', 'delta.checkpointPolicy'='v2', 'delta.checkpointInterval'='2')",
        ["ALTER TABLE {t} ADD CONSTRAINT sane CHECK (amount >= -100 AND name IS NOT NULL)"],
        ["id", "amount", "name"]),
    "generated columns, one a partition": ("CREATE TABLE {t} (id BIGINT, amount INT, name STRING, "
                                           "doubled INT GENERATED ALWAYS AS (amount * 2), "
                                           "up STRING GENERATED ALWAYS AS (upper(name))) USING delta PARTITIONED BY (up)",
                                           [], ["id", "amount", "name"]),
    "column mapping name, renamed, append only, change data feed": (
        "CREATE TABLE {t} (id BIGINT, amount INT, name STRING, part STRING) USING delta PARTITIONED BY (part) "
        "TBLPROPERTIES ('delta.columnMapping.mode'='name', 'delta.appendOnly'='true', "
        "'delta.enableChangeDataFeed'='true')",
        ["ALTER TABLE {t} RENAME COLUMN amount TO amt", "ALTER TABLE {t} RENAME COLUMN part TO region"],
        ["id", "amount AS amt", "name", "part AS region"]),
    "column mapping id, nested rename": ("CREATE TABLE {t} (id BIGINT, s STRUCT<a: INT, b: STRING>) USING delta "
                                         "TBLPROPERTIES ('delta.columnMapping.mode'='id')",
                                         ["ALTER TABLE {t} RENAME COLUMN s.a TO x"],
                                         ["id", "named_struct('x', amount, 'b', name) AS s"]),
    # Written through Delta Kernel (docs/delta.md): delta-rs 1.6.6 cannot commit to these.
    "row tracking": ("CREATE TABLE {t} (id BIGINT, amount INT, name STRING) USING delta "
                     "TBLPROPERTIES ('delta.enableRowTracking'='true')", [], ["id", "amount", "name"]),
    "liquid clustering": ("CREATE TABLE {t} (id BIGINT, amount INT, name STRING) USING delta CLUSTER BY (amount, id)",
                          [], ["id", "amount", "name"]),
    "in-commit timestamps": ("CREATE TABLE {t} (id BIGINT, amount INT, name STRING) USING delta "
                             "TBLPROPERTIES ('delta.enableInCommitTimestamps'='true')", [], ["id", "amount", "name"]),
    # Spark's writer fills a column the rows lack with its DEFAULT (cast to the column's type), keeps one they give.
    "column defaults": ("CREATE TABLE {t} (id BIGINT, amount INT DEFAULT 7, name STRING DEFAULT 'n/a', "
                        "note STRING DEFAULT concat('a', 'b'), level BIGINT NOT NULL DEFAULT 3, part STRING) USING delta "
                        "TBLPROPERTIES ('delta.feature.allowColumnDefaults'='supported')", [],
                        ["id", "IF(id = 4, NULL, name) AS name", "part"]),
    # A column widened after a file of its old type was written: new files carry the current type.
    "type widening": ("CREATE TABLE {t} (id BIGINT, amount INT, name STRING) USING delta "
                      "TBLPROPERTIES ('delta.enableTypeWidening'='true')",
                      ["INSERT INTO {t} VALUES (-1, 5, 'old')", "ALTER TABLE {t} ALTER COLUMN amount TYPE BIGINT"],
                      ["id", "CAST(amount AS BIGINT) * 3000000000 AS amount", "name"]),
    "what Delta gives a new table: deletion vectors, row tracking, in-commit timestamps, clustering, v2 checkpoints": (
        "CREATE TABLE {t} (id BIGINT, amount INT, name STRING, part STRING) USING delta CLUSTER BY (id) "
        "TBLPROPERTIES ('delta.enableDeletionVectors'='true', 'delta.enableRowTracking'='true', "
        "'delta.enableInCommitTimestamps'='true', 'delta.checkpointPolicy'='v2', 'delta.checkpointInterval'='2', "
        "'delta.columnMapping.mode'='name')", ["ALTER TABLE {t} RENAME COLUMN part TO region"],
        ["id", "amount", "name", "part AS region"]),
}


#: Cases with a test of their own below (the same read-back and DESCRIBE DETAIL checks, in _twins, and more).
OWN_TESTS = ("row tracking", "liquid clustering", "in-commit timestamps")


@pytest.mark.parametrize("case", [c for c in WRITTEN if c not in OWN_TESTS])
def test_rows_read_back_as_spark_wrote_them(spark, source, tmp_path, case):
    ddl, after, select = WRITTEN[case]
    theirs, ours = str(tmp_path / "spark"), str(tmp_path / "ours")
    for path in (theirs, ours):
        _make(spark, ddl, after, path)
    before, initial = _detail(spark, ours), len(_rows(spark, ours))
    spark.read.format("delta").load(source).selectExpr(*select).write.format("delta").mode("append").save(theirs)
    _stream(spark, source, tmp_path / "ckpt", ours, select).awaitTermination()
    assert _rows(spark, ours) == _rows(spark, theirs) and len(_rows(spark, ours)) == initial + len(ROWS)
    # Data skipping on the files' statistics (keyed by physical names under column mapping) agrees.
    assert _rows(spark, ours, "id >= 6") == _rows(spark, theirs, "id >= 6") and len(_rows(spark, ours, "id >= 6")) == 6
    # The run's claim changed nothing of the table but lastagent's own properties: protocol versions,
    # features, clustering columns and every other property as they were (a writer-version-7 table too).
    assert _detail(spark, ours) == before
    if case.startswith("check constraint"):  # no classic checkpoint in a v2-checkpoint table
        from pathlib import Path

        assert not list(Path(ours, "_delta_log").glob("*.checkpoint.parquet"))
    if case.startswith("column mapping name"):  # Spark's own writer still appends to the table after ours
        spark.read.format("delta").load(source).selectExpr(*select).limit(1).write.format("delta").mode("append") \
            .save(ours)
        assert len(_rows(spark, ours)) == initial + len(ROWS) + 1


def _twins(spark, source, tmp_path, case):
    """The case's two tables: Spark's ``delta`` writer's and lastagent-delta's (two epochs), same rows; as in
    test_rows_read_back_as_spark_wrote_them, Spark reads the same rows from both, data skipping agrees, and the
    run changed nothing of the table's DESCRIBE DETAIL but lastagent's own properties."""
    ddl, after, select = WRITTEN[case]
    theirs, ours = str(tmp_path / "spark"), str(tmp_path / "ours")
    for path in (theirs, ours):
        _make(spark, ddl, after, path)
    before = _detail(spark, ours)
    spark.read.format("delta").load(source).selectExpr(*select).write.format("delta").mode("append").save(theirs)
    _stream(spark, source, tmp_path / "ckpt", ours, select).awaitTermination()
    assert _rows(spark, ours) == _rows(spark, theirs) and len(_rows(spark, ours)) == len(ROWS)
    assert _rows(spark, ours, "id >= 6") == _rows(spark, theirs, "id >= 6") and len(_rows(spark, ours, "id >= 6")) == 6
    assert _detail(spark, ours) == before
    return theirs, ours


def _log(path):
    """Each version's actions, read from the JSON log (checkpoints leave the JSON files in place)."""
    from pathlib import Path

    return {int(f.stem): [json.loads(line) for line in f.read_text().splitlines()]
            for f in sorted(Path(path, "_delta_log").glob("*.json"))}


def _row_ids(spark, path):
    return {r.id: (r.row_id, r.row_commit_version) for r in spark.read.format("delta").load(path)
            .select("id", "_metadata.row_id", "_metadata.row_commit_version").collect()}


def test_row_ids_are_unique_across_epochs_and_tasks_and_stay_through_optimize(spark, source, tmp_path):
    """Row tracking, written by Delta Kernel: every row has an id and a commit version (one per epoch's
    commit), Spark's INSERT afterwards goes on above the high-water mark, and OPTIMIZE keeps every row's."""
    theirs, ours = _twins(spark, source, tmp_path, "row tracking")
    ids = _row_ids(spark, ours)
    assert len(ids) == len(ROWS) and None not in {v for pair in ids.values() for v in pair}
    assert len({row_id for row_id, _ in ids.values()}) == len(ROWS)
    assert sorted(row_id for row_id, _ in ids.values()) == sorted(row_id for row_id, _ in _row_ids(spark, theirs).values())
    assert len({version for _, version in ids.values()}) == 2  # one commit per epoch
    domains = [a["domainMetadata"] for actions in _log(ours).values() for a in actions if "domainMetadata" in a]
    assert json.loads(domains[-1]["configuration"])["rowIdHighWaterMark"] == len(ROWS) - 1
    spark.sql(f"INSERT INTO delta.`{ours}` VALUES (100, 1, 'x'), (101, 2, 'y')")
    ids = _row_ids(spark, ours)
    assert len({row_id for row_id, _ in ids.values()}) == len(ROWS) + 2
    assert {ids[100][0], ids[101][0]} == {len(ROWS), len(ROWS) + 1}
    spark.sql(f"OPTIMIZE delta.`{ours}`")
    assert spark.sql(f"DESCRIBE HISTORY delta.`{ours}` LIMIT 1").collect()[0].operation == "OPTIMIZE"
    assert _row_ids(spark, ours) == ids


def _marks(path):
    """Each identity column's high-water mark in the table's newest metaData."""
    metadata = [a["metaData"] for actions in _log(path).values() for a in actions if "metaData" in a][-1]
    return {f["name"]: f["metadata"].get("delta.identity.highWaterMark")
            for f in json.loads(metadata["schemaString"])["fields"] if "delta.identity.step" in f["metadata"]}


def test_identity_values_are_unique_and_sparks_later_insert_goes_on_beyond_the_mark(spark, source, tmp_path):
    """Identity columns (GENERATED ALWAYS, and BY DEFAULT with a negative step), written by lastagent from three
    tasks an epoch: every row gets a value no other row has, on the column's step from its start; each epoch's
    commit moves delta.identity.highWaterMark to the furthest value written; Spark's INSERT afterwards goes on
    beyond it without a collision; the other columns read back as Spark's own writer wrote them."""
    ddl = ("CREATE TABLE {t} (sk BIGINT GENERATED ALWAYS AS IDENTITY (START WITH 10 INCREMENT BY 3), "
           "down BIGINT GENERATED BY DEFAULT AS IDENTITY (START WITH -1 INCREMENT BY -2), id BIGINT, amount INT) "
           "USING delta")
    theirs, ours = str(tmp_path / "spark"), str(tmp_path / "ours")
    for path in (theirs, ours):
        _make(spark, ddl, [], path)
    before = _detail(spark, ours)
    spark.read.format("delta").load(source).select("id", "amount").write.format("delta").mode("append").save(theirs)
    df = spark.readStream.format("delta").option("maxFilesPerTrigger", "1").load(source).select("id", "amount")
    (df.repartition(3).writeStream.format("lastagent-delta").option("link", "identity")
     .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start(ours).awaitTermination())

    def read(path):
        return spark.read.format("delta").load(path).collect()

    rows = read(ours)
    assert sorted((r.id, r.amount) for r in rows) == sorted((r.id, r.amount) for r in read(theirs))
    sk, down = [r.sk for r in rows], [r.down for r in rows]
    assert len(set(sk)) == len(set(down)) == len(ROWS)
    assert all(v >= 10 and (v - 10) % 3 == 0 for v in sk) and all(v <= -1 and (v + 1) % 2 == 0 for v in down)
    assert _marks(ours) == {"sk": max(sk), "down": min(down)}
    assert _detail(spark, ours) == before  # the marks live in the schema; protocol and properties as they were
    spark.sql(f"INSERT INTO delta.`{ours}` (id, amount) VALUES (100, 1), (101, 2)")
    after = read(ours)
    assert len({r.sk for r in after}) == len({r.down for r in after}) == len(ROWS) + 2
    assert min(r.sk for r in after if r.id >= 100) > max(sk) and max(r.down for r in after if r.id >= 100) < min(down)


def test_a_query_that_gives_an_identity_column_is_refused_at_start(spark, tmp_path):
    from deltalake import DeltaTable

    from lastagent.errors import SchemaMismatchError
    from lastagent.sinks.delta_sink import DeltaStreamWriter

    ours = str(tmp_path / "ours")
    _make(spark, "CREATE TABLE {t} (id BIGINT GENERATED BY DEFAULT AS IDENTITY, amount INT) USING delta", [], ours)
    writer = DeltaStreamWriter({"path": ours, "link": "given", "checkpointLocation": str(tmp_path / "ckpt")},
                               spark.read.format("delta").load(ours).schema)
    with pytest.raises(SchemaMismatchError, match=r"column\(s\) \['id'\] are identity columns"):
        writer.start()
    assert DeltaTable(ours).version() == 0  # nothing claimed, nothing written


def test_a_clustered_table_keeps_its_columns_and_a_later_optimize_clusters_it(spark, source, tmp_path):
    """Liquid clustering, written by Delta Kernel: the clustering columns stay, every file lastagent adds
    carries statistics for them, and Spark's OPTIMIZE then clusters the table (rows unchanged)."""
    theirs, ours = _twins(spark, source, tmp_path, "liquid clustering")
    assert _detail(spark, ours)["clusteringColumns"] == _detail(spark, theirs)["clusteringColumns"] == ["amount", "id"]
    adds = [a["add"] for actions in _log(ours).values() if any("txn" in a for a in actions)
            for a in actions if "add" in a]
    assert len(adds) >= 2
    for add in adds:
        stats = json.loads(add["stats"])
        assert stats["numRecords"] > 0 and {"amount", "id"} <= set(stats["minValues"]) & set(stats["maxValues"])
    before = _rows(spark, ours)
    spark.sql(f"OPTIMIZE delta.`{ours}`")
    assert spark.sql(f"DESCRIBE HISTORY delta.`{ours}` LIMIT 1").collect()[0].operation == "OPTIMIZE"
    assert _rows(spark, ours) == before
    assert _rows(spark, ours, "amount > 40") == _rows(spark, theirs, "amount > 40") != []


def test_every_commit_carries_an_in_commit_timestamp_above_the_previous_one(spark, source, tmp_path):
    """In-commit timestamps, written by Delta Kernel (and by lastagent's claim): each commit's first action is its
    commitInfo with an inCommitTimestamp strictly above the one before; Spark's history and time travel go by them."""
    theirs, ours = _twins(spark, source, tmp_path, "in-commit timestamps")
    spark.sql(f"INSERT INTO delta.`{ours}` VALUES (100, 1, 'x')")
    log = _log(ours)
    stamps = [actions[0]["commitInfo"]["inCommitTimestamp"] for _, actions in sorted(log.items())]
    assert stamps == sorted(set(stamps)) and len(stamps) == len(log) >= 5  # create, claim, 2 epochs, insert
    ops = [actions[0]["commitInfo"]["operation"] for _, actions in sorted(log.items())]
    assert ops.count("STREAMING UPDATE") == 2 and "SET TBLPROPERTIES" in ops
    history = {r.version: r for r in spark.sql(f"DESCRIBE HISTORY delta.`{ours}`").selectExpr(
        "version", "unix_millis(timestamp) AS ms", "date_format(timestamp, 'yyyy-MM-dd HH:mm:ss.SSS') AS at").collect()}
    assert [history[v].ms for v in sorted(history)] == stamps
    first_epoch = ops.index("STREAMING UPDATE")
    as_of = spark.read.format("delta").option("timestampAsOf", history[first_epoch].at).load(ours)
    assert as_of.count() == 6


def test_kernels_write_gate_names_what_it_refuses(spark, tmp_path):
    """The start asks Delta Kernel's write gate on every table whose commits go through kernel (after lastagent's own
    list, which refuses these cases first): it names the feature, and passes a table kernel writes."""
    from deltalake import DeltaTable

    from lastagent.delta import kernel as delta_kernel

    refused, written = str(tmp_path / "refused"), str(tmp_path / "written")
    _make(spark, "CREATE TABLE {t} (id BIGINT) USING delta", ["ALTER TABLE {t} ADD CONSTRAINT c CHECK (id > 0)"], refused)
    _make(spark, WRITTEN["row tracking"][0], [], written)
    def gate(path: str) -> str | None:
        table = DeltaTable(path)
        return delta_kernel.write_gate(path, None, table.version(), table.metadata().id)

    assert "Feature 'checkConstraints' is not supported" in (gate(refused) or "")
    assert gate(written) is None


def test_merge_schema_on_a_kernel_table_is_refused_naming_the_column(spark, source, tmp_path):
    """mergeSchema's new column would be a delta-rs schema commit, which such a table refuses: nothing is written."""
    ours = str(tmp_path / "ours")
    _make(spark, "CREATE TABLE {t} (id BIGINT, amount INT) USING delta TBLPROPERTIES ('delta.enableRowTracking'='true')",
          [], ours)
    version = len(_log(ours))
    q = _stream(spark, source, tmp_path / "ckpt", ours, ["id", "amount", "name"], mergeSchema="true")
    with pytest.raises(Exception, match=r"column 'name' is not in the table, and mergeSchema does not add columns.*"
                                        r"ALTER TABLE \.\.\. ADD COLUMN"):
        q.awaitTermination()
    assert spark.read.format("delta").load(ours).count() == 0
    assert [a[0]["commitInfo"]["operation"] for v, a in sorted(_log(ours).items()) if v >= version] in (
        [], ["SET TBLPROPERTIES"])  # at most the run's claim


def test_rows_breaking_a_rule_go_to_the_dead_letters_with_its_name(spark, source, tmp_path):
    ddl = ("CREATE TABLE {t} (id BIGINT, amount INT NOT NULL, name VARCHAR(2), doubled INT GENERATED ALWAYS AS "
           "(amount * 2)) USING delta TBLPROPERTIES ('delta.columnMapping.mode'='name')")
    after = ["ALTER TABLE {t} ADD CONSTRAINT positive CHECK (amount > 0)", "ALTER TABLE {t} RENAME COLUMN name TO nm"]
    # Rows 0-3 have amount <= 0 (CHECK); row 5's amount is null (NOT NULL); rows 10 and 11 have
    # 3-character names (VARCHAR(2)).
    select = ["id", "IF(id = 5, NULL, amount) AS amount", "name AS nm"]
    theirs, ours, dead = str(tmp_path / "spark"), str(tmp_path / "ours"), str(tmp_path / "dead")
    for path in (theirs, ours):
        _make(spark, ddl, after, path)
    good = spark.read.format("delta").load(source).selectExpr(*select).filter("amount > 0 AND length(nm) <= 2")
    good.write.format("delta").mode("append").save(theirs)
    _stream(spark, source, tmp_path / "ckpt", ours, select, deadLetterTable=dead).awaitTermination()
    assert _rows(spark, ours) == _rows(spark, theirs) and len(_rows(spark, ours)) == 5
    letters = spark.read.format("delta").load(dead).select("reason", "value").collect()
    by_id = {json.loads(r.value)["id"]: r.reason for r in letters}
    assert by_id == {0: "check-constraint:positive", 1: "check-constraint:positive", 2: "check-constraint:positive",
                     3: "check-constraint:positive", 5: "not-null:amount", 10: "length:nm", 11: "length:nm"}


def test_without_a_dead_letter_target_the_epoch_fails_naming_the_constraint(spark, source, tmp_path):
    ours = str(tmp_path / "ours")
    _make(spark, "CREATE TABLE {t} (id BIGINT, amount INT) USING delta",
          ["ALTER TABLE {t} ADD CONSTRAINT positive CHECK (amount > 0)"], ours)
    q = _stream(spark, source, tmp_path / "ckpt", ours, ["id", "amount"])
    with pytest.raises(Exception, match=r"check-constraint:positive"):
        q.awaitTermination()
    assert spark.read.format("delta").load(ours).count() == 0


# name -> (DDL, statements after it, the feature named in the error)
REFUSED = {
    "identity column and row tracking": ("CREATE TABLE {t} (id BIGINT GENERATED ALWAYS AS IDENTITY, amount INT) USING "
                                         "delta TBLPROPERTIES ('delta.enableRowTracking'='true')", [],
                                         "identityColumns"),
    "uniform": ("CREATE TABLE {t} (id BIGINT, amount INT) USING delta TBLPROPERTIES "
                "('delta.enableIcebergCompatV2'='true', 'delta.columnMapping.mode'='name')", [], "icebergCompatV2"),
    "transaction retention": ("CREATE TABLE {t} (id BIGINT, amount INT) USING delta TBLPROPERTIES "
                              "('delta.setTransactionRetentionDuration'='interval 1 days')", [],
                              "delta.setTransactionRetentionDuration"),
}


def test_a_feature_the_sink_does_not_write_fails_the_query_at_start(spark, source, tmp_path):
    from deltalake import DeltaTable

    ddl, after, feature = REFUSED["identity column and row tracking"]
    ours = str(tmp_path / "ours")
    _make(spark, ddl, after, ours)
    q = _stream(spark, source, tmp_path / "ckpt", ours, ["id", "amount"])
    with pytest.raises(Exception, match=rf"Delta table {ours} \(target table\) uses the table feature '{feature}'"):
        q.awaitTermination()
    assert DeltaTable(ours).version() == 0  # nothing claimed, nothing written


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_feature_the_sink_does_not_write_is_refused_at_start_by_name(spark, tmp_path, case):
    """The start every query runs before its tasks (as in the query above), on each refused table."""
    from deltalake import DeltaTable

    from lastagent.sinks.delta_sink import DeltaStreamWriter

    ddl, after, feature = REFUSED[case]
    ours = str(tmp_path / "ours")
    _make(spark, ddl, after, ours)
    version = DeltaTable(ours).version()
    writer = DeltaStreamWriter({"path": ours, "link": "refused", "checkpointLocation": str(tmp_path / "ckpt")},
                               spark.read.format("delta").load(ours).select("id", "amount").schema)
    with pytest.raises(Exception) as err:
        writer.start()
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"Delta table {ours} (target table) uses the table feature '{feature}', which "
                            "lastagent-delta does not write: "), first
    assert DeltaTable(ours).version() == version  # nothing claimed, nothing written


def test_a_dead_letter_table_with_a_constraint_is_refused_at_start(spark, source, tmp_path):
    from deltalake import DeltaTable

    ours, dead = str(tmp_path / "ours"), str(tmp_path / "dead")
    _make(spark, "CREATE TABLE {t} (id BIGINT, amount INT) USING delta", [], ours)
    _make(spark, "CREATE TABLE {t} (reason STRING) USING delta",
          ["ALTER TABLE {t} ADD CONSTRAINT r CHECK (reason IS NOT NULL)"], dead)
    q = _stream(spark, source, tmp_path / "ckpt", ours, ["id", "amount"], deadLetterTable=dead)
    with pytest.raises(Exception, match=r"\(dead-letter table\) uses the table feature 'checkConstraints'"):
        q.awaitTermination()
    assert DeltaTable(ours).version() == 0


def test_an_arbitration_table_with_a_constraint_is_refused(spark, tmp_path):
    """The Kafka sink's arbitration table (option arbitrationTable): lastagent's own rows only."""
    from lastagent.delta.arbitration_table import DeltaArbitrationStore
    from lastagent.errors import UnsupportedTableFeatureError

    arb = str(tmp_path / "arb")
    _make(spark, "CREATE TABLE {t} (link STRING, epoch BIGINT, gxid STRING, branches STRING, decided_at TIMESTAMP, "
                 "confirmed_through BIGINT) USING delta", ["ALTER TABLE {t} ADD CONSTRAINT e CHECK (epoch > 0)"], arb)
    with pytest.raises(UnsupportedTableFeatureError, match=r"\(arbitration table\) uses the table feature 'checkConstraints'"):
        DeltaArbitrationStore(arb).ownership("any")


def test_a_table_changed_while_the_epoch_ran_is_not_committed(tmp_path):
    """An ALTER TABLE ... ADD CONSTRAINT between the epoch's start and its commit: the tasks checked
    the rows against the old rules, so the commit refuses (delta-rs sets the scene, no Spark needed)."""
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    from lastagent.core.arbitration import ArbitrationRecord
    from lastagent.delta.features import TableRules
    from lastagent.delta.target_table import StagedEpoch, TargetTableStore
    from lastagent.errors import TableChangedError

    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": pa.array([1], pa.int64())}))
    store = TargetTableStore(path)
    started = store.rules(store.table())
    assert started == TableRules()
    DeltaTable(path).alter.add_constraint({"positive": "id > 0"})
    add = {"path": "x.parquet", "size": 1, "partitionValues": {}, "modificationTime": 0, "dataChange": True,
           "stats": "{}"}
    version = DeltaTable(path).version()
    with pytest.raises(TableChangedError, match=r"changed while the epoch ran"):
        store.decide(ArbitrationRecord("l", 0, "g", ()), 0, StagedEpoch((add,), None, ((0, 0),), (), started))
    assert DeltaTable(path).version() == version
