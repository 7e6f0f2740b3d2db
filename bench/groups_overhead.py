"""Where reliable groups' time goes: Python's ``transformWithState`` path alone, and the rules alone.

* Spark: a processor that only passes its rows through and counts them in one value state, row-based
  (``transformWithState``) and with pandas (``transformWithStateInPandas``), on groups_bench's stream
  (BENCH_GROUP_ROWS, default 500,000 here), RocksDB, ``noop`` sink. Compare with groups_bench's
  figure for ``reliable_groups`` on the same size.
* Outside Spark: the rule core's cost per message (parsing the fields, ``receive``) and the state's
  encoding plus decoding per group, on 200,000 messages of 1,000 groups.

Run with ``make bench`` (or ``cd bench && python groups_overhead.py``). Prints JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("BENCH_GROUP_ROWS", "500000")
os.environ.setdefault("BENCH_ROWS_PER_FILE", "125000")

import groups_bench  # reads the sizes above
import pandas as pd
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import StatefulProcessor

from lastagent.groups import rules as group_rules
from lastagent.groups.step import ROCKSDB, message
from lastagent.spark_session import local_session

SCHEMA = "GroupId string, SequenceNumber long, value binary"


class RowPassThrough(StatefulProcessor):
    def init(self, handle):
        self.count = handle.getValueState("n", "n long")

    def handleInputRows(self, key, rows, timerValues):
        out = [Row(GroupId=r.GroupId, SequenceNumber=r.SequenceNumber, value=r.value) for r in rows]
        self.count.update((len(out),))
        return iter(out)

    def close(self) -> None:
        pass


class PandasPassThrough(StatefulProcessor):
    def init(self, handle):
        self.count = handle.getValueState("n", "n long")

    def handleInputRows(self, key, rows, timerValues):
        frames = list(rows)
        df = pd.concat(frames) if len(frames) > 1 else frames[0]
        self.count.update((len(df),))
        yield df[["GroupId", "SequenceNumber", "value"]]

    def close(self) -> None:
        pass


def rule_core() -> dict:
    n, groups = 200_000, 1000
    msgs = [(f"g{i % groups}", i // groups) for i in range(n)]
    t0 = time.perf_counter()
    for group, seq in msgs:
        message({"GroupId": group, "SequenceNumber": str(seq), "ExpiryTime": "9999999999999"}, 1000, None, None,
                False, None)
    t1 = time.perf_counter()
    states: dict[str, group_rules.GroupState] = {}
    for group, seq in msgs:
        state, _ = group_rules.receive(states.get(group) or group_rules.GroupState(group),
                                       group_rules.Message(group, seq, 9_999_999_999_999), 1000)
        states[group] = state
    t2 = time.perf_counter()
    for state in states.values():
        group_rules.decode(state.group, group_rules.encode(state))
    t3 = time.perf_counter()
    return {"parse_us_per_message": round(1e6 * (t1 - t0) / n, 1), "receive_us_per_message": round(1e6 * (t2 - t1) / n, 1),
            "encode_decode_us_per_group": round(1e6 * (t3 - t2) / len(states), 1)}


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="lastagent-groups-overhead-"))
    try:
        rows, _ = groups_bench.write_stream(work / "stream")
        spark = local_session("lastagent-groups-overhead", extra_conf={"spark.sql.streaming.stateStore.providerClass": ROCKSDB})
        spark.sparkContext.setLogLevel("ERROR")
        passes = {"row_pass_through": lambda g: g.transformWithState(RowPassThrough(), SCHEMA, "Append", "None"),
                  "pandas_pass_through": lambda g: g.transformWithStateInPandas(PandasPassThrough(), SCHEMA, "Append",
                                                                                "None")}
        results = {}
        for name, build in passes.items():
            src = (spark.readStream.schema(spark.read.parquet(str(work / "stream")).schema)
                   .option("maxFilesPerTrigger", groups_bench.FILES_PER_TRIGGER).parquet(str(work / "stream")))
            query = (build(src.groupBy("GroupId")).writeStream.format("noop")
                     .option("checkpointLocation", str(work / f"ckpt-{name}")).trigger(availableNow=True).start())
            start = time.perf_counter()
            query.awaitTermination()
            results[name] = {"rows_per_s": round(rows / (time.perf_counter() - start))}
        spark.stop()
        print(json.dumps({"rows": rows, "spark": results, "rule_core": rule_core()}, indent=2))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
