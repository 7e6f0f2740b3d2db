"""Portable wheels of lastagent (``make wheels``): ``manylinux_2_28`` ``cp310-abi3`` wheels for x86_64 and aarch64,
built on this machine without Docker.

The compiled Kafka path (``native/``) is built by ``cargo zigbuild``: zig's clang and linker against glibc 2.28's
symbol versions, for any CPU architecture Rust has a standard library for here. The ``portable`` feature of
native/Cargo.toml builds OpenSSL (openssl-src) and zlib from source and links them in statically, with librdkafka
and zstd (always built from source), so the extension needs nothing beyond the manylinux allow-list (glibc,
libgcc_s). The Python part is built by setuptools without setuptools-rust (a ``py3-none-any`` wheel), and the
two are put together here into one platform wheel, tagged ``cp310-abi3-manylinux_2_28_<arch>``, then shown by
``auditwheel show``.

Run from the repository root with the wheel tools' Python (the Makefile's ``~/.cache/lastagent/wheel-tools`` virtualenv:
ziglang, cargo-zigbuild, auditwheel, setuptools, wheel; not setuptools-rust)::

    ~/.cache/lastagent/wheel-tools/bin/python dev/build_wheels.py --arch x86_64 --arch aarch64 --out dist
    ~/.cache/lastagent/wheel-tools/bin/python dev/build_wheels.py --arch x86_64 --install-into .venv/bin/python
    ~/.cache/lastagent/wheel-tools/bin/python dev/build_wheels.py --arch x86_64 --clippy          # make lint
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GLIBC = "2.28"
NATIVE_MEMBER = "lastagent/_native.abi3.so"


def default_target_dir() -> Path:
    """cargo's target dir: ``LASTAGENT_CARGO_TARGET_DIR``, else ``lastagent/wheel-target`` in the user's cache
    directory (``$XDG_CACHE_HOME``, else ``~/.cache``), shared by every clone on the machine as pip's, cargo's
    registry and Maven's caches are. The first build compiles Delta Kernel's stack, librdkafka and OpenSSL (10 to
    16 minutes on a 2-core machine); a later build, from any clone, compiles lastagent's own crate only."""
    given = os.environ.get("LASTAGENT_CARGO_TARGET_DIR")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lastagent" / "wheel-target"


def _wrappers(target_dir: Path) -> Path:
    """The C toolchain's wrapper scripts (dev/wheels/zig*), copied beside the target dir: build scripts note the
    compiler's path (the cc crate reruns when CC changes), so it must be the same path from every clone."""
    where = target_dir / "wrappers"
    where.mkdir(parents=True, exist_ok=True)
    for name in ("zigcc", "zigcxx", "zigar", "zigranlib"):
        source, copy = ROOT / "dev" / "wheels" / name, where / name
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            shutil.copy2(source, copy)  # a changed wrapper is a changed compiler: cargo rebuilds what used it
    return where


def _env(arch: str, target_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    wrappers = _wrappers(target_dir)
    tools = str(Path(sys.executable).parent)
    # cargo-zigbuild and the zig it runs (python -m ziglang) come from the wheel tools' virtualenv.
    env["PATH"] = tools + os.pathsep + env.get("PATH", "")
    env.update({
        "CARGO_TARGET_DIR": str(target_dir),
        # librdkafka's ./configure and make (rdkafka-sys) read CC, CXX, AR and RANLIB, not the cc crate's CC_<target>.
        "CC": str(wrappers / "zigcc"),
        "CXX": str(wrappers / "zigcxx"),
        "AR": str(wrappers / "zigar"),
        "RANLIB": str(wrappers / "zigranlib"),
        "LASTAGENT_ZIG_TARGET": f"{arch}-linux-gnu.{GLIBC}",
        # librdkafka's `make libs` builds its C++ library (src-cpp) too, which the extension does not link:
        # make is told to build src only (a command-line variable, through GNUMAKEFLAGS because rdkafka-sys sets
        # MAKEFLAGS itself). OpenSSL's make has no such variable.
        "GNUMAKEFLAGS": "LIBSUBDIRS=src",
        # OpenSSL is linked in statically, so its OPENSSLDIR (/usr/local/ssl) is not where the system keeps its
        # CA certificates: with this, librdkafka probes the usual CA bundle paths (/etc/ssl/certs/ca-certificates.crt,
        # /etc/pki/tls/certs/ca-bundle.crt, ...) when no ssl.ca.location is given, as librdkafka's own static builds
        # do (rdkafka_ssl.c). Given to librdkafka's compiles only (dev/wheels/zigcc): as CFLAGS it would also
        # reach the cc crate's, whose change rebuilds OpenSSL.
        "LASTAGENT_ZIG_CFLAGS": "-DWITH_STATIC_LIB_libcrypto=1",
        # `make libs` links librdkafka.so too (unused: the static library goes in); its version script names
        # symbols of a debug build, which lld refuses unless told (GNU ld lets them pass).
        "LDFLAGS": "-Wl,--undefined-version",
        # No symbol tables or debug sections in the shipped extension (a third of its size).
        "CARGO_PROFILE_RELEASE_STRIP": "symbols",
    })
    return env


def _cargo(command: list[str], arch: str, target_dir: Path, *extra: str) -> None:
    cmd = [*command, "--release", "--locked", "--manifest-path", str(ROOT / "native" / "Cargo.toml"),
           "--target", f"{arch}-unknown-linux-gnu.{GLIBC}", "--features", "portable", *extra]
    print("wheels:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=_env(arch, target_dir), cwd=ROOT)


def build_native(arch: str, target_dir: Path) -> Path:
    _cargo(["cargo", "zigbuild"], arch, target_dir)
    return target_dir / f"{arch}-unknown-linux-gnu" / "release" / "lib_native.so"


def clippy(arch: str, target_dir: Path) -> None:
    """Clippy with warnings as errors on native/, built as the wheel is (same target, features, compilers and
    environment), so the build scripts' outputs (OpenSSL, librdkafka) are reused rather than built again."""
    _cargo(["cargo-zigbuild", "clippy"], arch, target_dir, "--quiet", "--", "-D", "warnings")


def build_pure(out: Path) -> Path:
    """The Python part as a py3-none-any wheel: setuptools' own build hook, without setuptools-rust (whose
    table in pyproject.toml is then ignored), so nothing is compiled."""
    try:
        import setuptools_rust  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("wheels: setuptools-rust is installed in this Python: the pure build would compile "
                         "native/ with the system toolchain; use a virtualenv without it (make wheels)")
    shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools' build dir may hold removed modules
    code = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    res = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, check=True, capture_output=True,
                         text=True)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    name = res.stdout.strip().splitlines()[-1]
    return out / name


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def assemble(pure: Path, native: Path, arch: str, out: Path) -> Path:
    """The platform wheel: the pure wheel's files, the extension as lastagent/_native.abi3.so, WHEEL's tag
    and Root-Is-Purelib changed, RECORD written anew."""
    dist, version = pure.name.split("-")[:2]
    tag = f"cp310-abi3-manylinux_{GLIBC.replace('.', '_')}_{arch}"
    wheel = out / f"{dist}-{version}-{tag}.whl"
    dist_info = f"{dist}-{version}.dist-info"
    records: list[str] = []
    with zipfile.ZipFile(pure) as src, zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as dst:

        def add(name: str, data: bytes, mode: int = 0o644) -> None:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(info, data)
            records.append(f"{name},{_record_hash(data)},{len(data)}")

        for item in src.infolist():
            if item.filename.endswith("/RECORD") or item.filename.endswith("/WHEEL"):
                continue
            if item.filename.startswith("lastagent/_native") and item.filename.endswith(".so"):
                raise SystemExit(f"wheels: the pure wheel {pure.name} holds {item.filename}: it was compiled")
            add(item.filename, src.read(item))
        add(NATIVE_MEMBER, native.read_bytes(), 0o755)
        add(f"{dist_info}/WHEEL", ("Wheel-Version: 1.0\nGenerator: lastagent dev/build_wheels.py\n"
                                   f"Root-Is-Purelib: false\nTag: {tag}\n").encode())
        record_name = f"{dist_info}/RECORD"
        records.append(f"{record_name},,")
        info = zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0))
        info.external_attr = 0o100644 << 16
        dst.writestr(info, "\n".join(records) + "\n", zipfile.ZIP_DEFLATED)
    return wheel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", choices=["x86_64", "aarch64"], help="default: both")
    parser.add_argument("--out", default="dist", help="where the wheels go (default dist/)")
    parser.add_argument("--target-dir", default=str(default_target_dir()),
                        help="cargo's target dir (default ~/.cache/lastagent/wheel-target, or LASTAGENT_CARGO_TARGET_DIR: "
                             "make setup, make wheels and make lint of every clone share it)")
    parser.add_argument("--install-into", metavar="PYTHON",
                        help="then install the wheel built (one --arch) into this Python, without its dependencies")
    parser.add_argument("--clippy", action="store_true",
                        help="run clippy -D warnings on native/ as it is built for the wheel, instead of building")
    args = parser.parse_args()
    if args.install_into and len(args.arch or []) != 1:
        parser.error("--install-into needs exactly one --arch (the installing Python's)")
    if args.clippy:
        for arch in args.arch or ["x86_64"]:
            clippy(arch, Path(args.target_dir))
        return 0
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pure = build_pure(Path(tmp))
        for arch in args.arch or ["x86_64", "aarch64"]:
            started = time.monotonic()
            native = build_native(arch, Path(args.target_dir))
            wheel = assemble(pure, native, arch, out)
            print(f"wheels: {wheel} ({wheel.stat().st_size / 1e6:.1f} MB; extension {native.stat().st_size / 1e6:.1f} MB "
                  f"uncompressed; {time.monotonic() - started:.0f} s)", flush=True)
            subprocess.run([str(Path(sys.executable).parent / "auditwheel"), "show", str(wheel)], check=True)
            if args.install_into:
                subprocess.run([args.install_into, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                                str(wheel)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
