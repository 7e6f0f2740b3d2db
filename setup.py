"""Everything about the package is in pyproject.toml. This file only turns a build from source on a machine
without a Rust toolchain into one clear error (instead of setuptools-rust's), naming the wheels to use.

It acts only on the commands that compile (building a wheel or installing); making the sdist or reading the
metadata needs no toolchain.
"""

import os
import shutil
import sys

from setuptools import setup

COMPILING = {"bdist_wheel", "build", "build_ext", "build_rust", "install", "develop", "editable_wheel"}

NO_TOOLCHAIN = """
lastagent: this is lastagent's source distribution, and building it needs a Rust toolchain (`cargo`, from
https://rustup.rs), crates.io and OpenSSL 3 headers: its Kafka path (lastagent._native) compiles librdkafka.
There is no `cargo` on PATH here.

Install a wheel instead; nothing is compiled then:

    pip install --only-binary lastagent lastagent

Wheels exist for CPython 3.10+ on Linux with glibc 2.28 or newer, on x86_64 and aarch64
(manylinux_2_28, docs/install.md). pip fell back to this source distribution because none of them fits
this machine: check `python -c "import platform; print(platform.machine(), platform.libc_ver())"`
(an older glibc, musl/Alpine, another CPU or OS), or pip is older than 20.3 (upgrade it). On a cluster,
build or download the wheel elsewhere and install the .whl file (docs/install.md).
"""

if COMPILING & set(sys.argv[1:]) and shutil.which(os.environ.get("CARGO", "cargo")) is None:
    sys.exit(NO_TOOLCHAIN)

setup()
