"""What the package tests share: the portable wheel ``make setup`` built, and a process environment with no
Rust toolchain and none of the repository's settings, as on a user's cluster node."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Where a cluster node's Python and Java are; rustup's ~/.cargo/bin is not among them.
NO_TOOLCHAIN_PATH = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"])


def no_toolchain_env() -> dict[str, str]:
    """This process's environment without Python, virtualenv, lastagent, cargo or rustup settings, and a PATH
    on which neither ``cargo`` nor ``rustc`` is found (asserted, so that the check cannot pass by accident)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "LASTAGENT_", "VIRTUAL_ENV", "CARGO", "RUSTUP", "PYSPARK_"))}
    env["PATH"] = NO_TOOLCHAIN_PATH
    for tool in ("cargo", "rustc"):
        assert shutil.which(tool, path=NO_TOOLCHAIN_PATH) is None, f"{tool} is on {NO_TOOLCHAIN_PATH}: not a clean check"
    return env


def portable_wheel(arch: str | None = None) -> Path | None:
    """``dist/``'s ``manylinux_2_28`` wheel for ``arch`` (this machine's by default), or None."""
    arch = arch or platform.machine()
    wheels = sorted((ROOT / "dist").glob(f"lastagent-*-cp310-abi3-manylinux_2_28_{arch}.whl"))
    return wheels[-1] if wheels else None


@pytest.fixture(scope="session")
def host_wheel() -> Path:
    """The portable wheel for this machine: ``make setup`` builds it (dev/build_wheels.py) and installs it into
    ``.venv``, so under ``make test`` it is always there; its absence is a failure, not a skip."""
    wheel = portable_wheel()
    if wheel is None:
        pytest.fail(f"no dist/lastagent-*-cp310-abi3-manylinux_2_28_{platform.machine()}.whl: make setup builds it")
    return wheel
