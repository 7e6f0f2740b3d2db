"""Pid files of the development servers (the Kafka broker, the S3 server). Standard library only."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def port_taken(port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """True while the process runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def read_pid(pid_file: Path) -> int | None:
    """The pid the file records, if that process still runs."""
    if not pid_file.exists():
        return None
    try:
        pid = int(pid_file.read_text().strip())
    except ValueError:
        return None
    return pid if pid_alive(pid) else None


def stop(pid_file: Path, wait_s: float = 30.0) -> None:
    """SIGTERM to the recorded process, SIGKILL after ``wait_s``; removes the pid file. Nothing if none runs."""
    pid = read_pid(pid_file)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)


def kill(pid_file: Path) -> None:
    """SIGKILL to the recorded process (crash tests), waiting until it is gone; removes the pid file."""
    pid = read_pid(pid_file)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            time.sleep(0.05)
    pid_file.unlink(missing_ok=True)
