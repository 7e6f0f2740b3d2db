"""What the package tests share: the portable wheel ``make setup`` built, and a process environment with no
Rust toolchain and none of the repository's settings, as on a user's cluster node."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
from support import NO_TOOLCHAIN_PATH, no_toolchain_env, portable_wheel  # noqa: F401  (the package tests' names)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def host_wheel() -> Path:
    """The portable wheel for this machine: ``make setup`` builds it (dev/build_wheels.py) and installs it into
    ``.venv``, so under ``make test`` it is always there; its absence is a failure, not a skip."""
    wheel = portable_wheel()
    if wheel is None:
        pytest.fail(f"no dist/lastagent-*-cp310-abi3-manylinux_2_28_{platform.machine()}.whl: make setup builds it")
    return wheel
