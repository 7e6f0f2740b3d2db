"""Resolves the Spark-side jars (delta-spark, spark-sql-kafka) from Maven Central once.

Maven copies the runtime closure of ``dev/spark/pom.xml`` into ``.cache/spark/jars``; jars that
pyspark already ships (by artifact name, any version) are dropped so pyspark's own versions win.
Tests and the demo pass the rest as ``spark.jars``; nothing is resolved on each run.

Usage: ``python dev/spark_jars.py`` (prints the jar directory). Standard library only.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LASTAGENT_CACHE", ROOT / ".cache"))
JARS = CACHE / "spark" / "jars"
POM = ROOT / "dev" / "spark" / "pom.xml"
_VERSIONED = re.compile(r"^(?P<name>.+?)-\d[\w.\-]*\.jar$")


def _artifact(jar_name: str) -> str:
    m = _VERSIONED.match(jar_name)
    return m.group("name") if m else jar_name


def pyspark_jars_dir() -> Path:
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise SystemExit("spark-jars: pyspark is not installed in this interpreter; run `make setup`")
    return Path(spec.origin).parent / "jars"


def resolve() -> list[Path]:
    """Returns the extra jars, resolving them the first time."""
    marker = JARS / ".complete"
    if not marker.exists():
        staging = JARS.with_name("jars.staging")
        shutil.rmtree(staging, ignore_errors=True)
        print("spark-jars: resolving delta-spark and spark-sql-kafka from Maven Central ...", flush=True)
        result = subprocess.run(
            ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
             f"-DoutputDirectory={staging}", "-DincludeScope=runtime"],
            capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise SystemExit(f"spark-jars: mvn failed:\n{result.stdout}{result.stderr}")
        shipped = {_artifact(p.name) for p in pyspark_jars_dir().glob("*.jar")}
        for jar in staging.glob("*.jar"):
            if _artifact(jar.name) in shipped:
                jar.unlink()
        shutil.rmtree(JARS, ignore_errors=True)
        staging.rename(JARS)
        marker.write_text("ok\n")
    return sorted(JARS.glob("*.jar"))


if __name__ == "__main__":
    jars = resolve()
    print(f"spark-jars: {len(jars)} jars in {JARS}")
    sys.exit(0)
