"""The portable wheels (``make wheels``) where there is no compiler, and the sdist with and without a toolchain.

- This machine's ``manylinux_2_28`` wheel from ``dist/`` (``make setup`` builds it, as ``make wheels`` does):
  ``auditwheel show`` accepts it (the manylinux tag, no library outside the policy's allow-list), and installed
  with ``--no-deps`` into a fresh virtualenv whose PATH has no ``cargo`` or ``rustc``, ``lastagent._native``
  loads and ``lastagent --version`` prints the librdkafka and the static OpenSSL inside. A few seconds.
  (test_installed_wheel.py runs both links' queries from the same wheel.)
- The aarch64 wheel under qemu-user (make aarch64-python): --version and a produce/consume round trip through
  ``lastagent._native``; skipped without the wheel or the emulator. About 10 seconds.
- The sdist built where ``cargo`` is missing fails with lastagent's message naming the wheels, not a
  build tool's trace (setup.py). About 2 seconds.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import ROOT, no_toolchain_env, portable_wheel

pytestmark = pytest.mark.package


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_auditwheel_accepts_the_portable_wheel(host_wheel):
    tools = os.environ.get("LASTAGENT_WHEEL_TOOLS") or str(Path.home() / ".cache" / "lastagent" / "wheel-tools")
    auditwheel = Path(tools) / "bin" / "auditwheel"
    assert auditwheel.exists(), f"no {auditwheel}: make setup installs it"
    done = _run([str(auditwheel), "show", str(host_wheel)], ROOT, dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    text = " ".join((done.stdout + done.stderr).split())
    # auditwheel names the most compatible tag the symbols allow (2.28 or older) and, when the extension
    # needs a library outside the allow-list, says so and lists it.
    tag = re.search(rf'consistent with the following platform tag: "manylinux_(\d+)_(\d+)_{platform.machine()}"', text)
    assert tag, text
    assert (int(tag.group(1)), int(tag.group(2))) <= (2, 28), text
    assert "external shared libraries" not in text, text  # "The following external shared libraries are required"


def test_the_wheel_holds_the_package_and_the_two_plugin_modules_once(host_wheel):
    """Only lastagent's modules, its typing files and compiled extension, Spark's two plugin modules and the metadata:
    connector/plugins lies inside lastagent's directory, and a build writes its egg-info there, which setuptools'
    package data once shipped again as lastagent/plugins/."""
    import zipfile

    names = zipfile.ZipFile(host_wheel).namelist()
    assert [n for n in names if "plugins" in n or "egg-info" in n] == [], names
    assert sorted(n for n in names if not n.startswith(("lastagent/", "lastagent-"))) == [
        "pyspark_lastagent_delta.py", "pyspark_lastagent_kafka.py"], names
    assert {"lastagent/py.typed", "lastagent/_native.pyi", "lastagent/sinks/row_chain.py"} <= set(names)


def test_portable_wheel_loads_without_a_toolchain(tmp_path, host_wheel):
    env = no_toolchain_env()
    users = tmp_path / "users-venv"
    venv.create(users, with_pip=True)
    python = str(users / "bin" / "python")
    done = _run([python, "-m", "pip", "install", "-q", "--no-deps", "--only-binary", ":all:", str(host_wheel)], tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    loaded = _run([python, "-c", "import lastagent._native as n; print(n.__file__, n.librdkafka_version())"], work, env)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith(str(users)) and "_native.abi3.so" in loaded.stdout, loaded.stdout
    version = _run([str(users / "bin" / "lastagent"), "--version"], work, env)
    assert version.returncode == 0, version.stdout + version.stderr
    out = version.stdout
    assert "lastagent 0.1.0" in out, out
    features = re.search(r"librdkafka 2\.12\.1 \(builtin.features: ([^)]*)\)", out)
    assert features, out
    for feature in ("ssl", "sasl_scram", "sasl_oauthbearer", "zstd", "gzip", "snappy", "lz4"):
        assert feature in features.group(1).split(","), out
    # The static OpenSSL 3 of the wheel (openssl-src), not the system's (whose OPENSSLDIR is /usr/lib/ssl here).
    assert re.search(r"^OpenSSL 3\.\d+\.\d+ .*OPENSSLDIR: \"/usr/local/ssl\"", out, re.M), out
    assert "pyspark not importable" in out, out  # --no-deps: no pyspark in this virtualenv


def _sdist(tmp_path: Path) -> Path:
    sdist_dir = tmp_path / "sdist"
    made = _run([sys.executable, "setup.py", "-q", "sdist", "-d", str(sdist_dir)], ROOT, dict(os.environ))
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    assert made.returncode == 0, made.stdout + made.stderr
    return next(sdist_dir.glob("lastagent-*.tar.gz"))


@pytest.mark.source_build
def test_the_sdist_builds_where_a_toolchain_is(tmp_path):
    """Where no wheel fits (an older glibc, musl), pip builds the sdist: setuptools-rust compiles native/ with the
    machine's compiler and OpenSSL 3 headers. The wheel it makes installs and its extension loads. A fresh
    compile of librdkafka, Arrow and PyO3 (about 3 minutes): make test-wheel runs it, make test does not."""
    env = {**os.environ, "CARGO_TARGET_DIR": str(tmp_path / "cargo-target")}
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "out"),
                  str(_sdist(tmp_path))], tmp_path, env, timeout=1200)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheel = next((tmp_path / "out").glob("lastagent-*.whl"))
    assert "-cp310-abi3-linux_" in wheel.name, wheel.name  # built for this machine only: not a portable tag
    users = tmp_path / "users-venv"
    venv.create(users, with_pip=True)
    python = str(users / "bin" / "python")
    done = _run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], tmp_path, no_toolchain_env())
    assert done.returncode == 0, done.stdout + done.stderr
    loaded = _run([python, "-c", "import lastagent._native as n; print(n.librdkafka_version(), n.openssl_version())"],
                  tmp_path, no_toolchain_env())
    assert loaded.returncode == 0 and loaded.stdout.startswith("2.12.1 "), loaded.stdout + loaded.stderr


def test_the_sdist_without_cargo_says_to_use_a_wheel(tmp_path):
    """The sdist's own build step (what pip runs after fetching the build requirements; through pip the same
    text shows under "Building wheel for lastagent (pyproject.toml) did not run successfully"), with no cargo
    on PATH. The build hook is called directly so that no build requirements are fetched (about 2 s)."""
    sdist = _sdist(tmp_path)
    shutil.unpack_archive(sdist, tmp_path / "unpacked")
    tree = next((tmp_path / "unpacked").glob("lastagent-*"))
    hook = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    done = _run([sys.executable, "-c", hook, str(tmp_path / "wheel")], tree, no_toolchain_env())
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "needs a Rust toolchain" in out and "pip install --only-binary lastagent lastagent" in out, out
    assert "Traceback" not in out and "can't find Rust compiler" not in out, out


def test_aarch64_wheel_round_trip_under_emulation(tmp_path, kafka_bootstrap, new_topic):
    """The aarch64 wheel's extension under qemu-user with Debian's arm64 CPython 3.11 (make aarch64-python):
    ``lastagent --version``, then a transactional produce and a read back through ``lastagent._native``
    (dev/wheels/roundtrip.py). The wheel is unpacked, not pip-installed: that Python has no pip. About 10 s."""
    wheel = portable_wheel("aarch64")
    emu = ROOT / ".cache" / "aarch64-python"
    qemu, sysroot = emu / "qemu" / "usr" / "bin" / "qemu-aarch64-static", emu / "sysroot"
    if wheel is None or not qemu.exists():
        pytest.skip("needs dist/lastagent-*-manylinux_2_28_aarch64.whl (make wheels) and .cache/aarch64-python "
                    "(make aarch64-python)")
    site = tmp_path / "site"
    shutil.unpack_archive(wheel, site, format="zip")
    python = [str(qemu), "-L", str(sysroot), str(sysroot / "usr" / "bin" / "python3.11")]
    env = no_toolchain_env()
    version = _run([*python, "-m", "lastagent.cli", "--version"], tmp_path, {**env, "PYTHONPATH": str(site)})
    assert version.returncode == 0, version.stdout + version.stderr
    assert "aarch64, glibc" in version.stdout and "librdkafka 2.12.1" in version.stdout, version.stdout
    assert re.search(r"^OpenSSL 3\.\d+\.\d+ ", version.stdout, re.M), version.stdout
    trip = _run([*python, str(ROOT / "dev" / "wheels" / "roundtrip.py"), str(site), kafka_bootstrap, new_topic()],
                tmp_path, env)
    assert trip.returncode == 0 and "round trip ok" in trip.stdout, trip.stdout + trip.stderr
    assert trip.stdout.startswith("aarch64 "), trip.stdout
