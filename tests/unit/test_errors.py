"""One exception hierarchy, in one module; and no module of the package that needs another to import first."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import lastagent
from lastagent import errors

pytestmark = pytest.mark.unit

#: Raised and caught inside one function (``table_properties.until_committed`` retries on it); never reaches a caller.
INTERNAL = {"LostRace"}


def _modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(lastagent.__path__, "lastagent.")]
    return [n for n in names if n != "lastagent._native"]


def test_every_exception_lastagent_raises_is_defined_in_errors():
    elsewhere = set()
    for name in _modules():
        module = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, errors.LastAgentError) and cls.__module__ == name != "lastagent.errors" and cls_name not in INTERNAL:
                elsewhere.add(f"{name}.{cls_name}")
    assert not elsewhere, f"move to lastagent.errors: {sorted(elsewhere)}"
    assert len([c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, errors.LastAgentError)]) >= 20


@pytest.mark.parametrize("name", ["lastagent.kafka.oauth", "lastagent.kafka.config", "lastagent.errors"])
def test_a_module_imports_on_its_own_in_a_fresh_interpreter(name):
    done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]


#: What no executor module imports: the driver's EndTxn and listing client, the committer and its wiring, a Delta
#: library (a task reads the table's schema from its JSON: ``lastagent.delta.files.arrow_schema``).
DRIVER_ONLY = ("lastagent.kafka.xa", "lastagent.core.committer", "lastagent.sinks.link_ports", "deltalake")


@pytest.mark.parametrize("name", ["lastagent.sinks.kafka_sink", "lastagent.sinks.delta_sink", "lastagent.sinks.row_chain",
                                  "lastagent.sinks.task_outputs", "lastagent.kafka.branch"])
def test_what_executors_import_leaves_the_drivers_transaction_client_out(name):
    """A task unpickles the sinks' writers from these modules: the branch writer and the row chain, never the
    driver's EndTxn and listing client (lastagent.kafka.xa), the committer or a Delta library."""
    code = f"import sys, {name}; print(sorted(m for m in {DRIVER_ONLY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"{name} imports {done.stdout.strip()}"


def _imports(path) -> set[str]:
    """Every module a source file imports, wherever in the file (function-level imports too)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_the_core_imports_no_io_library_and_nothing_of_lastagent_but_errors():
    """core/ holds the protocol, the ports, the ownership rules, the record and the committer that interprets the
    rules; the adapters (Delta, Kafka, Spark's checkpoint) are wired where a query starts. So core imports the
    standard library's pure modules, itself, ``lastagent.errors`` and the inert crash-point hook ``lastagent.faults``,
    and nothing else, not even inside a function."""
    from pathlib import Path

    core = Path(lastagent.__file__).parent / "core"
    assert sorted(p.name for p in core.glob("*.py"))  # the package as installed has its sources
    pure = {"__future__", "json", "re", "enum", "threading", "logging", "time", "dataclasses", "typing",
            "collections.abc"}
    allowed = ("lastagent.core", "lastagent.errors", "lastagent.faults")

    def fine(module: str) -> bool:  # "from lastagent import faults" reads as "lastagent" and "lastagent.faults"
        return (module == "lastagent" or module.startswith(allowed)
                or any(module == p or module.startswith(f"{p}.") for p in pure))

    wrong = {f"{p.name}: {m}" for p in core.glob("*.py") for m in _imports(p) if not fine(m)}
    assert not wrong, f"core imports what it must not: {sorted(wrong)}"


def test_lastagent_reads_and_commits_delta_tables_through_delta_kernel_alone():
    """One Delta engine: no module of the package as installed imports delta-rs (``deltalake``), anywhere in the file;
    every read and commit goes through Delta Kernel in ``lastagent._native`` (``lastagent.delta.snapshot``,
    ``lastagent.delta.kernel``), and ``deltalake`` is no dependency of the package."""
    from pathlib import Path

    import tomllib

    package = Path(lastagent.__file__).parent
    sources = sorted(package.rglob("*.py"))
    assert len(sources) > 50  # the package as installed has its sources
    wrong = {f"{p.relative_to(package)}: {m}" for p in sources for m in _imports(p)
             if m == "deltalake" or m.startswith("deltalake.")}
    assert not wrong, f"lastagent imports delta-rs: {sorted(wrong)}"
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("deltalake")], project["dependencies"]


def test_a_failed_query_start_reaches_the_user_as_itself_through_pysparks_pickler():
    """The sinks start while pyspark pickles the writer; pyspark's pickler turns any other error into
    "Could not serialize object", which hid the broker-version refusal (and a kafka-python ValueError) of issue 52."""
    from pyspark.serializers import CloudPickleSerializer

    from lastagent.sinks.query_run import StartsWhenShipped

    class Refusing(StartsWhenShipped):
        def __init__(self, error: Exception) -> None:
            self.error = error

        def start(self):
            raise self.error

    for error in (errors.KafkaProtocolError("the broker at b:9092 (Kafka 2.8 or similar) does not support EndTxn"),
                  ValueError("93 is not a valid ApiKey")):
        with pytest.raises(errors.QueryStartError) as raised:
            CloudPickleSerializer().dumps(Refusing(error))
        assert str(raised.value) == f"the query could not start: {type(error).__name__}: {error}"
        assert raised.value.__cause__ is error and "serialize" not in str(raised.value)
