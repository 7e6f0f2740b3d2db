"""A class-data archive of Spark's driver JVM, so the tests' many short-lived drivers start in a third of the CPU.

Most of a crash test is Spark driver JVMs starting (each test starts several, and kills them): on a 2-core
machine the JVM's class loading and its JIT compilers were the largest CPU cost of ``make test``. Java's
class-data sharing (a dynamic CDS archive, JDK 13+) maps the classes of a finished run instead of loading and
verifying them from jars again; the client compiler alone (``-XX:TieredStopAtLevel=1``) and the serial
collector cut the rest for a JVM that lives a minute. Measured on this machine, a local session that starts,
aggregates and writes Parquet: 15.5-18.5 s of JVM CPU by default, 4.4 s with these options (``docs/testing.md``).

What users run is unchanged: only ``tests/conftest.py`` sets ``SPARK_SUBMIT_OPTS`` (:func:`jvm_options`), and the
tiers that stand for a user's machine (the installed wheel, the Spark versions) leave it out. A JVM that cannot
use the archive (another JDK, another class path) runs without it, silently.

Usage: ``python dev/spark_cds.py`` (in the virtualenv with pyspark; prints the archive's path). Dumps
``.cache/spark/cds/spark-<pyspark version>.jsa`` by running a small Spark workload once (about 30 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CDS_DIR = ROOT / ".cache" / "spark" / "cds"

#: JIT and collector settings for short-lived test drivers; the archive is added when it exists.
FAST_START = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

#: What the archive is made from: a session as the tests build it (Delta's and s3a's jars), a batch
#: aggregation, Parquet and Delta written and read, and a streaming query to Delta.
WORKLOAD = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from lastagent.spark_session import local_session
import spark_jars
work = Path(sys.argv[1])
spark = local_session("lastagent-cds", extra_conf={"spark.jars": ",".join(str(j) for j in spark_jars.S3A_JARS.glob("*.jar"))})
spark.range(100000).selectExpr("id % 7 AS k", "id").groupBy("k").count().collect()
spark.range(1000).write.mode("overwrite").parquet(str(work / "parquet"))
spark.read.parquet(str(work / "parquet")).count()
spark.range(1000).write.format("delta").mode("overwrite").save(str(work / "delta"))
query = (spark.readStream.format("delta").load(str(work / "delta")).writeStream.format("delta")
         .option("checkpointLocation", str(work / "ckpt")).trigger(availableNow=True).start(str(work / "copy")))
query.awaitTermination(120)
print(spark.sparkContext._gateway.proc.pid)
spark.stop()
"""


def archive() -> Path | None:
    """This pyspark's archive, if dumped."""
    try:
        from importlib.metadata import version

        path = CDS_DIR / f"spark-{version('pyspark')}.jsa"
    except ImportError:
        return None
    return path if path.exists() else None


def jvm_options(short_lived: bool = True) -> str:
    """``SPARK_SUBMIT_OPTS`` for the tests' drivers: the archive when there is one, and :data:`FAST_START` for a
    driver that lives a minute or two (not for the test session's own, which runs every integration test and
    gains from the optimising compiler)."""
    path = archive()
    # -Xlog:cds*=off: a JVM that cannot map the archive (another JDK or class path) says so on stdout; it then
    # simply loads its classes from the jars.
    shared = f"-XX:SharedArchiveFile={path} -Xlog:cds*=off" if path else ""
    return " ".join(o for o in (FAST_START if short_lived else "", shared) if o)


def dump() -> Path:
    """Runs :data:`WORKLOAD` once with ``-XX:ArchiveClassesAtExit``; returns the archive."""
    import shutil
    import tempfile
    from importlib.metadata import version

    CDS_DIR.mkdir(parents=True, exist_ok=True)
    target = CDS_DIR / f"spark-{version('pyspark')}.jsa"
    partial = target.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lastagent-cds-"))
    env = dict(os.environ, SPARK_SUBMIT_OPTS=f"{FAST_START} -XX:ArchiveClassesAtExit={partial} -Xlog:cds*=off")
    try:
        done = subprocess.run([sys.executable, "-c", WORKLOAD, str(work), str(ROOT / "dev")], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # The JVM exits after this interpreter (its stdin closes) and writes the archive as it exits: wait for that.
    jvm = Path(f"/proc/{done.stdout.split()[-1]}") if done.returncode == 0 and done.stdout.split() else None
    deadline = time.monotonic() + 300
    while jvm is not None and jvm.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    if done.returncode != 0 or not partial.exists():
        raise SystemExit(f"spark-cds: the workload failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    partial.rename(target)
    return target


if __name__ == "__main__":
    print(f"spark-cds: {dump()}")
