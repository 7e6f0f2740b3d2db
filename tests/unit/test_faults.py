"""Fault points are inert in the installed package; only a test's hook makes them do anything."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import lastagent
from lastagent import faults

pytestmark = pytest.mark.unit


def test_points_do_nothing_without_a_hook_and_call_an_installed_one():
    faults.point("after_arbitration")  # no hook: nothing happens
    seen: list[str] = []
    faults.install(seen.append)
    try:
        faults.point("after_arbitration")
    finally:
        faults.install(None)
    faults.point("after_phase2")
    assert seen == ["after_arbitration"]


def test_nothing_in_the_installed_package_can_kill_a_process():
    """The crash hook lives in tests/crashhook; the demo, which kills its drivers, lives in dev/."""
    root = Path(lastagent.__file__).parent
    modules = [m.name for m in pkgutil.walk_packages([str(root)], "lastagent.")]
    assert "lastagent.core.committer" in modules and "lastagent.demo" not in modules
    for path in root.rglob("*.py"):
        text = path.read_text()
        for call in ("os.kill(", "os.killpg(", "import signal", "signal.SIG"):
            assert call not in text, f"{path.relative_to(root)} contains {call}"
    importlib.import_module("lastagent.examples")  # the example pipelines import without Spark running
