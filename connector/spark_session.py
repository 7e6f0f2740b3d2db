"""A local Spark session with Delta and the jars ``make setup`` resolved. Driver side.

Used by the demo, the benchmarks and the tests; users on a cluster or Databricks bring their own
session and only need ``pip install lastagent``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pyspark.sql import SparkSession


def local_session(app_name: str = "lastagent", master: str = "local[2]", jars_dir: str | None = None,
                  extra_conf: dict[str, str] | None = None) -> SparkSession:
    """Builds (or returns the running) local session with delta-spark and spark-sql-kafka.

    Args:
        app_name: Spark application name.
        master: Spark master URL.
        jars_dir: directory of extra jars; defaults to ``$LASTAGENT_SPARK_JARS`` or the
            repository's ``.cache/spark/jars`` filled by ``make setup``.
        extra_conf: further Spark settings; a ``spark.jars`` there is added to the resolved jars.
    """
    # Python workers must run the interpreter that has lastagent and its dependencies.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # Bind Spark to loopback: servers here listen on 127.0.0.1 only.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    jars_path = Path(jars_dir or os.environ.get("LASTAGENT_SPARK_JARS", "") or _default_jars_dir())
    jars = sorted(str(p) for p in jars_path.glob("*.jar"))
    extra = dict(extra_conf or {})
    more = [j for j in extra.pop("spark.jars", "").split(",") if j.strip()]
    if not jars:
        raise FileNotFoundError(
            f"no jars in {jars_path}: run `make setup` (it resolves delta-spark and spark-sql-kafka "
            "from Maven Central) or set LASTAGENT_SPARK_JARS"
        )
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.jars", ",".join(jars + more))
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
        .config("spark.sql.shuffle.partitions", "2")
        # Delta rebuilds a table's state from its log in 50 partitions by default, sized for clusters; on a
        # local session that is 50 tasks per snapshot of a small table (as Delta's own tests set it).
        .config("spark.databricks.delta.snapshotPartitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        .config("spark.python.worker.reuse", "true")
    )
    for key, value in extra.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _default_jars_dir() -> Path:
    # connector/ in a checkout, site-packages/lastagent when installed: walk up to the repo root.
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / ".cache" / "spark" / "jars").is_dir():
            return parent / ".cache" / "spark" / "jars"
    return Path.cwd() / ".cache" / "spark" / "jars"
