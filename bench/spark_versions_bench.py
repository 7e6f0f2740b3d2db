"""Benchmark: the same queries on each Spark 4 minor, in one run, to measure what pyspark 4.0's row-based
stream writer costs the sinks (4.0 hands ``write`` rows, which lastagent turns back into Arrow; 4.1+ hands Arrow).

For each pyspark (default 4.0.5 4.1.4 4.2.1 4.3.0) a virtualenv in .cache/bench-spark-versions/<version> with the
portable wheel from dist/ and that pyspark; in each, on one topic of BENCH_ROWS records (default 500,000, 100-byte
values, 4 partitions), Trigger.AvailableNow queries (one batch each), BENCH_REPEAT times (default 3), median:

- ``lastagent-kafka`` source -> ``noop`` (the read, the same code on every minor),
- ``lastagent-kafka`` source -> ``lastagent-kafka`` sink,
- ``lastagent-kafka`` source -> ``lastagent-delta`` sink.

Prints one JSON document: seconds per query and, per minor, the sinks' time less the read's, against 4.1's.

    python bench/spark_versions_bench.py [4.0.5 4.1.4 ...]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import venv
from pathlib import Path

from common import BOOTSTRAP, fill_topic
from kafka.admin import KafkaAdminClient, NewTopic

ROOT = Path(__file__).resolve().parents[1]
ROWS = int(os.environ.get("BENCH_ROWS", "500000"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))
VERSIONS = sys.argv[1:] or ["4.0.5", "4.1.4", "4.2.1", "4.3.0"]

QUERIES = textwrap.dedent("""
    import json, os, sys, time, uuid
    from pyspark.sql import SparkSession
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    boot, topic, work, repeat = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    def timed(sink):
        name = uuid.uuid4().hex[:8]
        df = (spark.readStream.format("lastagent-kafka").option("kafka.bootstrap.servers", boot)
              .option("subscribe", topic).option("startingOffsets", "earliest").load().selectExpr("key", "value"))
        w = df.writeStream.option("checkpointLocation", f"{work}/ckpt-{name}").trigger(availableNow=True)
        if sink == "noop":
            w = w.format("noop")
        elif sink == "kafka":
            w = (w.format("lastagent-kafka").option("kafka.bootstrap.servers", boot).option("topic", topic + "-out")
                 .option("link", f"bench-{name}").option("arbitrationTable", f"{work}/arb-{name}"))
        else:
            w = w.format("lastagent-delta").option("link", f"bench-{name}").option("path", f"{work}/table-{name}")
        start = time.monotonic()
        q = w.start()
        q.awaitTermination()
        assert q.exception() is None, q.exception()
        return time.monotonic() - start, sum(p["numInputRows"] for p in q.recentProgress)

    timed("noop")  # warm-up: Python workers, consumers
    out = {}
    for sink in ("noop", "kafka", "delta"):
        runs = [timed(sink) for _ in range(repeat)]
        out[sink] = {"seconds": [round(s, 2) for s, _ in runs], "rows": runs[0][1]}
    import pyspark
    print("RESULT " + json.dumps({"pyspark": pyspark.__version__, **out}))
    spark.stop()
""")


def user_python(version: str) -> str:
    wheel = sorted((ROOT / "dist").glob("lastagent-*-cp310-abi3-manylinux_2_28_*.whl"))
    if not wheel:
        raise SystemExit("no portable wheel in dist/: run make setup")
    home = ROOT / ".cache" / "bench-spark-versions" / version
    python = home / "bin" / "python"
    if not python.exists():
        venv.create(home, with_pip=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel[-1])],
                   check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel[-1]), f"pyspark=={version}"], check=True)
    return str(python)


def main() -> None:
    admin = KafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    topic = fill_topic(admin, 4, ROWS, 100)
    admin.create_topics([NewTopic(topic + "-out", 4, 1)])
    results = {}
    for version in VERSIONS:
        python = user_python(version)
        with tempfile.TemporaryDirectory(prefix="lastagent-bench-") as work:
            done = subprocess.run([python, "-c", QUERIES, BOOTSTRAP, topic, work, str(REPEAT)], cwd=work,
                                  capture_output=True, text=True, check=False)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"pyspark {version}: no result\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        r = json.loads(line[len("RESULT "):])
        results[version] = {k: {"median_s": statistics.median(v["seconds"]), **v} for k, v in r.items() if k != "pyspark"}
        print(version, json.dumps(results[version]), file=sys.stderr, flush=True)
    base = next((v for v in VERSIONS if v.startswith("4.1")), VERSIONS[-1])
    summary = {}
    for version, r in results.items():
        read = r["noop"]["median_s"]
        summary[version] = {sink: {"median_s": r[sink]["median_s"], "write_s": round(r[sink]["median_s"] - read, 2),
                                   "write_vs_" + base: round((r[sink]["median_s"] - read)
                                                             / max(results[base][sink]["median_s"]
                                                                   - results[base]["noop"]["median_s"], 0.01), 2)}
                            for sink in ("kafka", "delta")}
        summary[version]["read_s"] = read
    print(json.dumps({"rows": ROWS, "value_bytes": 100, "partitions": 4, "repeat": REPEAT, "results": results,
                      "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
