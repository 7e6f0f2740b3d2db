"""Benchmark: what one epoch's Delta commit costs, as lastagent makes it now and as it made it before (issue 43).

The driver's decision (`TargetTableStore.decide`: read the table, check the link's ownership and txn, commit the
epoch's files with `txn(link, epoch)` and the record naming its branches) on tables Spark SQL makes:

* `delta-rs`: a plain table (`CREATE TABLE ... USING delta`) committed by delta-rs's transaction, as lastagent did
  before every commit went through Delta Kernel (the same reads and checks, then `create_write_transaction`);
* `plain`: the same plain table as the sink commits it now: a plain append lastagent composes, written
  put-if-absent by Delta Kernel's storage layer;
* `kernel-plain`: the same plain table through Delta Kernel's transaction (a store forced to it);
* `kernel`: what Delta gives a new table (deletion vectors, row tracking, in-commit timestamps, liquid clustering),
  committed by Delta Kernel's transaction (row ids, the high-water mark, the in-commit timestamp, clustering
  statistics checked).

Each epoch adds one file per branch (1, 4, 16 branches: one task's file and branch each), files written before the
timed part by the sink's own file writer; the tables take turns epoch by epoch so all see the same machine.
Then the claim: one property commit, delta-rs's `set_table_properties` against lastagent's (kernel's storage layer),
on two more plain tables. Every table is read back by Spark at the end and must hold every row once.

Run: `cd bench && ../.venv/bin/python delta_commit_bench.py` (BENCH_EPOCHS, default 20 per branch count).
Prints a JSON summary (medians in ms).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from lastagent.core.arbitration import ArbitrationRecord
from lastagent.delta import kernel as delta_kernel
from lastagent.delta.files import FileWriter
from lastagent.delta.target_table import StagedEpoch, TargetTableStore
from lastagent.spark_session import local_session

EPOCHS = int(os.environ.get("BENCH_EPOCHS", "20"))
BRANCHES = (1, 4, 16)
ROWS_PER_FILE = 1000
WORK = tempfile.mkdtemp(prefix="lastagent-bench-delta-commit-")
PLAIN = "CREATE TABLE delta.`{p}` (id BIGINT, amount BIGINT) USING delta"
TABLES = {
    "delta-rs": PLAIN,
    "plain": PLAIN,
    "kernel-plain": PLAIN,
    "kernel": ("CREATE TABLE delta.`{p}` (id BIGINT, amount BIGINT) USING delta CLUSTER BY (amount) TBLPROPERTIES "
               "('delta.enableDeletionVectors'='true', 'delta.enableRowTracking'='true', "
               "'delta.enableInCommitTimestamps'='true')"),
}


class KernelStore(TargetTableStore):
    """The target table's store with every epoch through Delta Kernel's transaction (the sink uses it where a
    feature needs it)."""

    def rules(self, table):
        return replace(super().rules(table), kernel=True)


class DeltaRsStore(TargetTableStore):
    """The decision as lastagent made it before issue 43's last step: the same reads and checks, then delta-rs's
    transaction (adds, `txn`, the record's keys; no re-try of a lost version; its post-commit checkpoint hook)."""

    def decide(self, record, generation, staged=None):
        from deltalake.transaction import AddAction, CommitProperties, PostCommitHookProperties, Transaction

        from lastagent.core.arbitration import Decision

        table = self.table()
        assert not self._superseded(record.link, generation, self._ownership_in(table, record.link))
        assert (table.transaction_version(record.link) or -1) < record.epoch
        self._same_rules(table, staged)
        metadata = {"lastagent.link": record.link, "lastagent.epoch": str(record.epoch), "lastagent.gxid": record.gxid,
                    "lastagent.branches": json.dumps(list(record.branches)),
                    "lastagent.attempts": json.dumps([list(a) for a in staged.attempts])}
        props = CommitProperties(custom_metadata=metadata, max_commit_retries=0, app_transactions=[
            Transaction(app_id=record.link, version=record.epoch, last_updated=int(time.time() * 1000))])
        adds = [AddAction(a["path"], a["size"], a["partitionValues"], a["modificationTime"], a["dataChange"],
                          a["stats"]) for a in staged.adds]
        version = table.version() + 1
        table.create_write_transaction(adds, "append", table.schema(), commit_properties=props,
                                       post_commithook_properties=PostCommitHookProperties(create_checkpoint=True))
        if version % 10 == 0:  # Spark's interval, as the sink kept it then
            table.update_incremental()
            table.create_checkpoint()
        return Decision(record, won=True)


def staged(path: str, link: str, epoch: int, branches: int, first_id: int, rules) -> StagedEpoch:
    adds = []
    for task in range(branches):
        writer = FileWriter(path, link, 1, epoch, task, 0)
        ids = pa.array(range(first_id + task * ROWS_PER_FILE, first_id + (task + 1) * ROWS_PER_FILE), pa.int64())
        writer.write(pa.record_batch([ids, pc.multiply(ids, 3)], names=["id", "amount"]))
        adds.extend(writer.close())
    return StagedEpoch(tuple(adds), None, tuple((t, 0) for t in range(branches)), (), rules)


def main() -> None:
    spark = local_session("bench-delta-commit")
    paths = {name: f"{WORK}/{name}" for name in TABLES}
    for name, ddl in TABLES.items():
        spark.sql(ddl.format(p=paths[name]))
    kinds = {"delta-rs": DeltaRsStore, "kernel-plain": KernelStore}
    stores = {name: kinds.get(name, TargetTableStore)(p) for name, p in paths.items()}
    ms: dict[str, dict[int, list[float]]] = {name: {n: [] for n in BRANCHES} for name in TABLES}
    link, epoch, rows = "bench", 0, 0
    for name, store in stores.items():  # first-run ownership: generation 0 of a table that has no owner
        assert store.ownership(link) is None, name
    for branches in BRANCHES:
        for _ in range(EPOCHS):
            order = list(TABLES)[epoch % len(TABLES):] + list(TABLES)[:epoch % len(TABLES)]
            for name in order:
                store = stores[name]
                epoch_files = staged(paths[name], link, epoch, branches, rows, store.rules(store.table()))
                record = ArbitrationRecord(link, epoch, f"g-{epoch}", tuple(f'{{"b": {b}}}' for b in range(branches)))
                start = time.perf_counter()
                assert store.decide(record, 0, epoch_files).won
                ms[name][branches].append((time.perf_counter() - start) * 1000)
            rows += branches * ROWS_PER_FILE
            epoch += 1
    for name, p in paths.items():
        assert spark.read.format("delta").load(p).distinct().count() == rows, name
    claims: dict[str, list[float]] = {"delta-rs": [], "kernel": []}  # both on plain tables
    for name, took in claims.items():
        p = f"{WORK}/claim-{name}"
        spark.sql(PLAIN.format(p=p))
        for i in range(EPOCHS):
            table = DeltaTable(p)
            start = time.perf_counter()
            if name == "delta-rs":
                table.alter.set_table_properties({"lastagent.bench": str(i)}, raise_if_not_exists=False)
            else:
                delta_kernel.set_properties(table.table_uri, None, table.version(), table.metadata().id,
                                            {"lastagent.bench": str(i)}, "a claim")
            took.append((time.perf_counter() - start) * 1000)
    summary = {
        "epochs_per_branch_count": EPOCHS, "rows_per_file": ROWS_PER_FILE,
        "decide_ms_median": {name: {n: round(statistics.median(v), 1) for n, v in by.items()} for name, by in ms.items()},
        "decide_ms_p90": {name: {n: round(statistics.quantiles(v, n=10)[-1], 1) for n, v in by.items()}
                          for name, by in ms.items()},
        "over_delta_rs": {name: {n: round(statistics.median(ms[name][n]) / statistics.median(ms["delta-rs"][n]), 2)
                                 for n in BRANCHES} for name in ("plain", "kernel-plain", "kernel")},
        "claim_ms_median": {name: round(statistics.median(v), 1) for name, v in claims.items()},
    }
    print(json.dumps(summary, indent=2))
    spark.stop()
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
