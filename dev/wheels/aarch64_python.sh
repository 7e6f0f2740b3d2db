#!/bin/sh
# An aarch64 CPython 3.11 to try the aarch64 wheel with on an x86_64 Debian machine, without root changes:
# Debian bookworm's arm64 packages (python3.11-minimal and the libraries it needs) and qemu-user-static,
# fetched with apt-get into its own state directory (no dpkg --add-architecture, nothing installed) and
# unpacked into $DIR (default .cache/aarch64-python). Then, for example:
#
#   $DIR/qemu/usr/bin/qemu-aarch64-static -L $DIR/sysroot $DIR/sysroot/usr/bin/python3.11 -c 'import platform; print(platform.machine())'
#
# tests/package/test_portable_wheel.py uses it when it is there (make aarch64-python).
set -eu
DIR=${1:-.cache/aarch64-python}
mkdir -p "$DIR/apt/lists/partial" "$DIR/apt/archives/partial" "$DIR/debs" "$DIR/sysroot" "$DIR/qemu"
DIR=$(cd "$DIR" && pwd)
ARM="-o APT::Architectures::=arm64 -o APT::Architecture=arm64 -o Dir::State::Lists=$DIR/apt/lists -o Dir::Cache=$DIR/apt -o Dir::State::status=/dev/null -o Debug::NoLocking=1"
# shellcheck disable=SC2086  # ARM is a list of options
apt-get $ARM -q update >/dev/null
cd "$DIR/debs"
# shellcheck disable=SC2086
apt-get $ARM -q download libc6:arm64 libgcc-s1:arm64 zlib1g:arm64 libexpat1:arm64 libffi8:arm64 \
  python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 2>&1 | grep -v "unsandboxed" || true
apt-get -q download qemu-user-static 2>&1 | grep -v "unsandboxed" || true
for deb in ./*_arm64.deb; do dpkg-deb -x "$deb" "$DIR/sysroot"; done
dpkg-deb -x ./qemu-user-static_*.deb "$DIR/qemu"
"$DIR/qemu/usr/bin/qemu-aarch64-static" -L "$DIR/sysroot" "$DIR/sysroot/usr/bin/python3.11" \
  -c 'import platform, sys; print("aarch64-python:", platform.machine(), sys.version.split()[0], platform.libc_ver())'
