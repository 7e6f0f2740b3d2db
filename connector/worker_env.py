"""Fills in, before any query starts, the environment map Spark's Python streaming sources add to.

Driver side. Why (issue 41; ``docs/install.md``, "Spark versions", several queries in one driver): Spark keeps one mutable map of
environment variables per Python data source function (``PythonFunction.envVars``), shared by every query of the
JVM that uses the format: the source's, reader's and writer's functions all point at it, and a format Spark
discovered (the ``pyspark_lastagent_*`` modules) keeps its map for the JVM's life. ``PythonStreamingSourceRunner``
puts its keys into that map in place, without a lock, each time a query's source starts. The first start adds
them, so the map grows (and a Scala ``HashMap`` re-hashes); two queries starting at the same moment then insert
concurrently and can leave the map damaged (seen: its size said 6, iterating it gave 5), after which every task that
carries it fails to serialize: ``Illegal size 5 of collection, expected 6``, for every query of that driver
until the JVM ends. Once the keys are present, a start only replaces values, which changes nothing structural.

So :func:`fill` adds those keys, with the values the runner itself would put, to the map of each lastagent format
the session resolves (registered or discovered), before the user's queries start.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Mapping
from typing import Any

from lastagent.spark_versions import parse_version

log = logging.getLogger("lastagent")

#: The Python data source names whose functions' maps are filled.
FORMATS = ("lastagent-kafka", "lastagent-delta")
#: Spark's conf key and default for the Python worker's socket timeout (``PYTHON_AUTH_SOCKET_TIMEOUT``).
SOCKET_TIMEOUT_CONF = ("spark.python.authenticate.socketTimeout", "15s")
#: Spark's conf key and default for its I/O buffer size (``BUFFER_SIZE``).
BUFFER_SIZE_CONF = ("spark.buffer.size", "65536")


# -- pure -------------------------------------------------------------------------------------------


def runner_keys(version: str) -> tuple[str, ...]:
    """The keys ``PythonStreamingSourceRunner.init`` puts on this pyspark (read from its bytecode, 4.0.5 to 4.3.0).

    Only these are added, so a map holds nothing the runner of that Spark would not put there itself.
    """
    keys: tuple[str, ...] = ("SPARK_LOCAL_DIRS", "SPARK_AUTH_SOCKET_TIMEOUT", "SPARK_BUFFER_SIZE")
    if (parse_version(version) or (0, 0)) >= (4, 2):
        keys += ("SPARK_PYTHON_RUNTIME",)
    return keys


def missing(present: Container[str], wanted: Mapping[str, str]) -> dict[str, str]:
    """The entries of ``wanted`` whose key is not in ``present``; a key already there keeps its value."""
    return {key: value for key, value in wanted.items() if key not in present}


# -- the JVM, through py4j ----------------------------------------------------------------------------


def runner_values(spark: Any, version: str) -> dict[str, str]:
    """The values the runner would put, computed as it does from the driver's ``SparkEnv`` and conf."""
    conf = spark.sparkContext.getConf()
    timeout = spark.sparkContext._jvm.org.apache.spark.network.util.JavaUtils.timeStringAsSec(
        conf.get(*SOCKET_TIMEOUT_CONF))
    values = {"SPARK_LOCAL_DIRS": ",".join(_local_dirs(spark)), "SPARK_AUTH_SOCKET_TIMEOUT": str(timeout),
              "SPARK_BUFFER_SIZE": str(int(conf.get(*BUFFER_SIZE_CONF))), "SPARK_PYTHON_RUNTIME": "PYTHON_WORKER"}
    return {key: values[key] for key in runner_keys(version)}


def _local_dirs(spark: Any) -> list[str]:
    """``SparkEnv.get.blockManager.diskBlockManager.localDirs``, the driver's block manager directories.

    Called through method handles, not py4j's reflection: on Spark 4.3.0 py4j cannot list ``SparkEnv``'s methods
    (one of them names a protobuf class that is not on the driver's class path).
    """
    jvm, gateway = spark.sparkContext._jvm, spark.sparkContext._gateway
    lookup, method_type = jvm.java.lang.invoke.MethodHandles.publicLookup(), jvm.java.lang.invoke.MethodType

    def cls(name: str) -> Any:
        return jvm.java.lang.Class.forName(name)

    def arguments(*values: Any) -> Any:
        array = gateway.new_array(jvm.java.lang.Object, len(values))
        for i, value in enumerate(values):
            array[i] = value
        return array

    def call(target: Any, owner: str, name: str, returns: str) -> Any:
        handle = lookup.findVirtual(cls(owner), name, method_type.methodType(cls(returns)))
        return handle.invokeWithArguments(arguments(target))

    env_class = "org.apache.spark.SparkEnv"
    env = lookup.findStatic(cls(env_class), "get", method_type.methodType(cls(env_class))).invokeWithArguments(
        arguments())
    blocks = call(env, env_class, "blockManager", "org.apache.spark.storage.BlockManager")
    disk = call(blocks, "org.apache.spark.storage.BlockManager", "diskBlockManager",
                "org.apache.spark.storage.DiskBlockManager")
    return [str(d.getPath()) for d in call(disk, "org.apache.spark.storage.DiskBlockManager", "localDirs",
                                           "[Ljava.io.File;")]


def _manager(spark: Any) -> Any:
    """The session's ``DataSourceManager`` (py4j), or None on a Spark Connect session, whose driver JVM this
    process cannot reach."""
    jsession = getattr(spark, "_jsparkSession", None)
    return None if jsession is None else jsession.sessionState().dataSourceManager()


def resolved(spark: Any) -> set[str]:
    """The lastagent formats ``spark`` resolves now (discovered or registered); empty on Spark Connect."""
    manager = _manager(spark)
    return set() if manager is None else {name for name in FORMATS if manager.dataSourceExists(name)}


def env_maps(spark: Any) -> list[Any]:
    """The distinct ``envVars`` maps (py4j proxies) of the lastagent formats ``spark`` resolves now; none on
    Spark Connect (there the server's JVM holds them)."""
    manager = _manager(spark)
    maps: dict[int, Any] = {}
    for name in sorted(resolved(spark)):
        env = manager.lookupDataSource(name).dataSourceCls().envVars()
        maps[spark.sparkContext._jvm.java.lang.System.identityHashCode(env)] = env
    return list(maps.values())


def fill(spark: Any, maps: list[Any]) -> int:
    """Adds the runner's keys each of ``maps`` lacks, with the runner's values; returns how many it added.

    Call it before the session's queries start: the point is that no source start adds a key afterwards.
    """
    if not maps:
        return 0
    import pyspark

    values = runner_values(spark, str(pyspark.__version__))
    added = 0
    for env in maps:
        for key, value in missing({key for key in values if env.containsKey(key)}, values).items():
            env.put(key, value)
            added += 1
    log.debug("lastagent: added %d keys to %d Python data source environment maps (Spark's race, issue 41)",
              added, len(maps))
    return added
