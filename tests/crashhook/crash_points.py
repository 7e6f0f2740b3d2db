"""The crash tests' fault hook: SIGKILL at a named protocol point (see :mod:`lastagent.faults`).

``LASTAGENT_CRASH_AT=<point>`` (or ``<point>:<n>``: the n-th time the point is reached in this
process tree, counted in the file ``LASTAGENT_CRASH_STATE``) names the point. When the code reaches
it, the driver's process group (the Python driver and its JVM, ``LASTAGENT_CRASH_PGID``) and this
process's own group (pyspark's daemon and workers) are killed with SIGKILL, as a machine loss would.
Points named ``task_*`` kill only the Python worker that reaches them (a task attempt dies
mid-write; Spark retries it), or with ``LASTAGENT_CRASH_SCOPE=machine`` the whole worker machine
it runs on: the group ``LASTAGENT_MACHINE_PGID`` (a standalone worker's JVM and its executor JVMs,
see tests/cluster) and its own (pyspark's daemon leads a group of its own). ``<state>.fired``
names the point that fired.

``LASTAGENT_PAUSE_AT=<point>`` with ``LASTAGENT_PAUSE_DIR=<dir>`` pauses instead, so that a harness can
break something at that exact point (kill a broker between the decision and phase 2): once
``<dir>/armed`` exists, each thread that reaches the point (one query's commit) writes
``<dir>/paused-<pid>-<thread>`` and waits for ``<dir>/resume``, once per thread; a pause longer than
``PAUSE_LIMIT_S`` raises, so a harness that never resumes fails the query instead of hanging it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

PAUSE_LIMIT_S = 600.0
_paused: set[int] = set()


def _counted(state: Path) -> int:
    """Counts one more time the point was reached, under a lock: the threads of one driver (several queries) and
    the processes of its tree reach a point at the same moment, and an unlocked read-and-write counted two as one
    (a shared-driver crash test saw its second point fire on the third)."""
    import fcntl

    with open(f"{state}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # each open is its own lock holder: threads exclude each other too
        count = int(state.read_text() or "0") + 1 if state.exists() else 1
        state.write_text(str(count))
        return count


def kill_at(name: str) -> None:
    spec = os.environ.get("LASTAGENT_CRASH_AT", "")
    target, _, nth = spec.partition(":")
    if target != name:
        return
    state = Path(os.environ.get("LASTAGENT_CRASH_STATE", "/tmp/lastagent-crash-count"))
    if nth and _counted(state) != int(nth):
        return
    Path(str(state) + ".fired").write_text(name)
    if name.startswith("task_"):
        machine = os.environ.get("LASTAGENT_MACHINE_PGID")
        if os.environ.get("LASTAGENT_CRASH_SCOPE") == "machine":
            if not machine:
                raise RuntimeError("LASTAGENT_CRASH_SCOPE=machine, but this worker has no LASTAGENT_MACHINE_PGID")
            os.killpg(int(machine), signal.SIGKILL)
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    driver_group = os.environ.get("LASTAGENT_CRASH_PGID")
    if driver_group and int(driver_group) != os.getpgid(0):
        os.killpg(int(driver_group), signal.SIGKILL)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def pause_at(name: str) -> None:
    if name != os.environ.get("LASTAGENT_PAUSE_AT"):
        return
    where = Path(os.environ["LASTAGENT_PAUSE_DIR"])
    thread = threading.get_ident()
    if not (where / "armed").exists() or thread in _paused:
        return
    _paused.add(thread)
    (where / f"paused-{os.getpid()}-{thread}").write_text(name)
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while not (where / "resume").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"paused at {name} for {PAUSE_LIMIT_S:.0f} s and never resumed ({where})")
        time.sleep(0.1)
