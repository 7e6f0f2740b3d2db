"""Prints lastagent's pinned dependencies and those of the extras named on the command line, one per line, from
pyproject.toml: ``make setup`` installs them into .venv, then installs the portable wheel it built with
``--no-deps`` (a plain ``pip install ".[extras]"`` would compile native/ a second time, with the system's
OpenSSL and compiler, into a wheel no user gets).

    python dev/requirements.py spark connect test > .cache/requirements.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"requirements: no extra {', '.join(unknown)} in pyproject.toml (there are: {', '.join(optional)})")
    return list(project["dependencies"]) + [r for e in extras for r in optional[e]]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
