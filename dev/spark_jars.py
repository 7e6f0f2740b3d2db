"""Resolves the Spark-side jars from Maven Central once.

Three sets, each the runtime closure of a pom copied by Maven into its own directory:

* ``dev/spark/pom.xml`` → ``.cache/spark/jars``: delta-spark and spark-sql-kafka.
* ``dev/spark/s3a-pom.xml`` → ``.cache/spark/s3a-jars``: Hadoop's s3a filesystem (hadoop-aws) with
  the individual AWS SDK v2 modules it uses, not the SDK's 686 MB ``bundle``.
* ``dev/spark/delta-minor-pom.xml`` → ``.cache/spark/delta-<version>-spark-<minor>-jars``: Delta for another
  Spark minor than the development one (the Spark-version tier), on demand.

Jars that pyspark already ships (by artifact name, any version) are dropped from both, so pyspark's
own versions win. Tests and the demo pass the rest as ``spark.jars``; nothing is resolved on each run.

Usage: ``python dev/spark_jars.py [--s3a]`` (prints the jar directory). Standard library only.
"""

from __future__ import annotations

import argparse
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
S3A_JARS = CACHE / "spark" / "s3a-jars"
S3A_POM = ROOT / "dev" / "spark" / "s3a-pom.xml"
DELTA_MINOR_POM = ROOT / "dev" / "spark" / "delta-minor-pom.xml"
_VERSIONED = re.compile(r"^(?P<name>.+?)-\d[\w.\-]*\.jar$")


def _artifact(jar_name: str) -> str:
    m = _VERSIONED.match(jar_name)
    return m.group("name") if m else jar_name


def pyspark_jars_dir() -> Path:
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise SystemExit("spark-jars: pyspark is not installed in this interpreter; run `make setup`")
    return Path(spec.origin).parent / "jars"


def _resolve(pom: Path, jars: Path, what: str, shipped_dir: Path | None = None,
             properties: dict[str, str] | None = None) -> list[Path]:
    """The runtime closure of pom (with ``properties`` set) minus what pyspark ships (this interpreter's, or the
    jars in ``shipped_dir``), in jars; resolved the first time."""
    marker = jars / ".complete"
    if not marker.exists():
        staging = jars.with_name(f"{jars.name}.staging")
        shutil.rmtree(staging, ignore_errors=True)
        print(f"spark-jars: resolving {what} from Maven Central ...", flush=True)
        result = subprocess.run(
            ["mvn", "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
             f"-DoutputDirectory={staging}", "-DincludeScope=runtime",
             *(f"-D{k}={v}" for k, v in (properties or {}).items())],
            capture_output=True, text=True, check=False,
        )
        if result.returncode != 0:
            raise SystemExit(f"spark-jars: mvn failed:\n{result.stdout}{result.stderr}")
        shipped = {_artifact(p.name) for p in (shipped_dir or pyspark_jars_dir()).glob("*.jar")}
        for jar in staging.glob("*.jar"):
            if _artifact(jar.name) in shipped:
                jar.unlink()
        shutil.rmtree(jars, ignore_errors=True)
        staging.rename(jars)
        marker.write_text("ok\n")
    return sorted(jars.glob("*.jar"))


def resolve() -> list[Path]:
    """Returns the extra jars (delta-spark, spark-sql-kafka), resolving them the first time."""
    return _resolve(POM, JARS, "delta-spark and spark-sql-kafka")


def resolve_delta_for(pyspark_jars: Path, minor: str, delta_version: str) -> list[Path]:
    """Delta for another pyspark than this interpreter's (its ``jars`` directory, its ``minor``, e.g. ``4.0``): the
    runtime closure of ``delta-spark_<minor>_2.13`` minus what that pyspark ships, resolved the first time into
    ``.cache/spark/delta-<version>-spark-<minor>-jars``."""
    databind = sorted(pyspark_jars.glob("jackson-databind-*.jar"))
    if not databind:
        raise SystemExit(f"spark-jars: no jackson-databind jar in {pyspark_jars}")
    jackson = databind[0].name[len("jackson-databind-"):-len(".jar")]
    return _resolve(DELTA_MINOR_POM, CACHE / "spark" / f"delta-{delta_version}-spark-{minor}-jars",
                    f"Delta {delta_version} for Spark {minor}", shipped_dir=pyspark_jars,
                    properties={"spark.minor": minor, "delta.version": delta_version, "jackson.version": jackson})


def resolve_s3a() -> list[Path]:
    """Returns the s3a jars (hadoop-aws and its AWS SDK v2 modules), resolving them the first time."""
    return _resolve(S3A_POM, S3A_JARS, "hadoop-aws and the AWS SDK v2 modules it uses")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--s3a", action="store_true", help=f"the s3a jars ({S3A_POM.name}) instead")
    args = parser.parse_args()
    jars, where = (resolve_s3a(), S3A_JARS) if args.s3a else (resolve(), JARS)
    print(f"spark-jars: {len(jars)} jars in {where}")
    sys.exit(0)
