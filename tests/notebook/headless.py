"""Runs a Databricks source-format notebook (``# Databricks notebook source``) top to bottom, headless.

Cells are separated by ``# COMMAND ----------``. A cell of ``# MAGIC %md`` lines is documentation and is
skipped; a ``# MAGIC %pip`` cell is skipped too (``make setup`` installed the package, as ``%pip`` would
have); any other magic is an error. Python cells run in one namespace holding what a Databricks
notebook has: ``spark``, ``dbutils.widgets`` (``text``/``get``, values from ``widgets``) and
``display`` (prints a DataFrame as ``show`` does). What the cells print is returned.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

HEADER = "# Databricks notebook source"
SEPARATOR = "# COMMAND ----------"


class _Widgets:
    def __init__(self, values: dict[str, str]) -> None:
        self._given = dict(values)
        self._values: dict[str, str] = {}

    def text(self, name: str, default: str, label: str | None = None) -> None:
        self._values[name] = self._given.get(name, default)

    def get(self, name: str) -> str:
        if name not in self._values:
            raise KeyError(f"no widget named {name!r}: define it with dbutils.widgets.text first")
        return self._values[name]


class _DBUtils:
    def __init__(self, widgets: dict[str, str]) -> None:
        self.widgets = _Widgets(widgets)


def cells(path: Path) -> list[str]:
    """The notebook's cells, as source text."""
    text = path.read_text()
    if not text.startswith(HEADER):
        raise ValueError(f"{path} is not a Databricks source notebook (first line is not {HEADER!r})")
    return [c.strip("\n") for c in text[len(HEADER):].split(SEPARATOR)]


def _magic(cell: str) -> str | None:
    """The magic command of a ``# MAGIC`` cell (``%md``, ``%pip``...), or None for a Python cell."""
    lines = [line for line in cell.splitlines() if line.strip()]
    if lines and all(line.startswith("# MAGIC") for line in lines):
        return lines[0].removeprefix("# MAGIC").split()[0]
    return None


def run(path: Path, spark: Any, widgets: dict[str, str]) -> str:
    """Runs every cell of the notebook at ``path``; returns what they printed. A failing cell raises."""
    out = io.StringIO()

    def display(df: Any) -> None:
        with contextlib.redirect_stdout(out):
            df.show(truncate=False)

    namespace: dict[str, Any] = {"spark": spark, "dbutils": _DBUtils(widgets), "display": display,
                                 "__name__": "__main__"}
    for number, cell in enumerate(cells(path), start=1):
        magic = _magic(cell)
        if magic in ("%md", "%pip"):
            continue
        if magic is not None:
            raise ValueError(f"{path.name} cell {number}: magic {magic} has no headless stand-in")
        with contextlib.redirect_stdout(out):
            exec(compile(cell, f"{path.name}:cell{number}", "exec"), namespace)  # the notebook is ours
    return out.getvalue()
