"""Fault injection for crash tests: SIGKILL the driver at a named protocol point.

Set ``LASTAGENT_CRASH_AT=<point>`` (optionally ``<point>:<n>`` to crash at the n-th time the
point is reached in this process tree, counted in ``LASTAGENT_CRASH_STATE``, a file path) in the
environment of a driver started in a session of its own, with ``LASTAGENT_CRASH_PGID`` set to its
process group; when the code reaches that point, the driver's process group (the Python driver
and its JVM) and the worker's own group (pyspark's daemon and workers) are killed with SIGKILL,
as a machine loss would.
Unset, :func:`point` costs one dict lookup.

Points are named where they are called, e.g. ``after_prepare``, ``after_arbitration``,
``between_branch_commits``, ``after_phase2``, ``in_recovery``. Points named ``task_*`` kill only
the Python worker that reaches them (a task attempt dies mid-write; Spark retries it).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV = "LASTAGENT_CRASH_AT"
STATE_ENV = "LASTAGENT_CRASH_STATE"
#: The driver's process group. pyspark's worker daemon runs in a group of its own, so a
#: fault reached in a Python worker kills the driver's group first, then its own.
PGID_ENV = "LASTAGENT_CRASH_PGID"


def point(name: str) -> None:
    """Kills the process group here if ``LASTAGENT_CRASH_AT`` names this point."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    if nth:
        state = Path(os.environ.get(STATE_ENV, "/tmp/lastagent-crash-count"))
        count = int(state.read_text() or "0") + 1 if state.exists() else 1
        state.write_text(str(count))
        if count != int(nth):
            return
    marker = os.environ.get(STATE_ENV)
    if marker:
        Path(marker + ".fired").write_text(name)
    if name.startswith("task_"):
        # A task-level fault: only this Python worker dies, as an executor process would;
        # Spark sees the task fail and retries it.
        os.kill(os.getpid(), signal.SIGKILL)
    driver_group = os.environ.get(PGID_ENV)
    if driver_group and int(driver_group) != os.getpgid(0):
        os.killpg(int(driver_group), signal.SIGKILL)
    os.killpg(os.getpgid(0), signal.SIGKILL)
