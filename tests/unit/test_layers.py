"""The package as installed stands in layers: no import cycle, between its rooms (a subpackage, or a top-level module)
or between its modules, counting imports made inside functions too. So no import points up the layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lastagent

pytestmark = pytest.mark.unit

ROOT = Path(lastagent.__file__).parent


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the installed package (``lastagent._native`` is compiled)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(("lastagent", *parts[:-1])) if parts[-1] == "__init__" else ".".join(("lastagent", *parts))
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The lastagent modules a file imports, wherever in the file; ``from lastagent import x`` is module x when
    there is one, else the package's ``__init__``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def _room(module: str) -> str:
    """A subpackage is one room (``lastagent.delta.files`` -> ``delta/``); a top-level module is its own."""
    parts = module.split(".")
    return f"{parts[1]}/" if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[1]).is_dir()) else module


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as a path, or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    assert "lastagent.core.protocol" in modules and "lastagent.sinks.delta_sink" in modules  # the layout as installed
    edges = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    cycle = _cycle(edges)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_rooms_stand_in_layers():
    """core/, kafka/, delta/, sinks/, sources/, groups/ and the top-level modules: none imports a room above it."""
    modules = _modules()
    edges: dict[str, set[str]] = {}
    for m, p in modules.items():
        edges.setdefault(_room(m), set()).update(_room(t) for t in _imports(p, modules) if _room(t) != _room(m))
    cycle = _cycle(edges)
    assert not cycle, "rooms that import each other: " + " -> ".join(cycle)
    assert not edges["core/"] - {"lastagent.errors", "lastagent.faults"}, edges["core/"]
