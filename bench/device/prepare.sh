#!/bin/sh
# Run HERE (a Debian 12 machine with apt and a pip index), from the repo root:
#   sh bench/device/prepare.sh
# Downloads into .device/bench/ (git-ignored) what bench/device/run.sh needs on the GPU machine,
# which has no network: Debian 12's iproute2 and the libraries its `ip` links against (ldd after
# dpkg -x: libbpf, libelf, libmnl, libbsd, libmd, libcap, libz) in .device/bench/debs/, and
# manylinux wheels of parallel-ssh, ssh2-python, ansible-core, prometheus_client, ClusterShell
# and all their dependencies in .device/bench/whl/, and a prebuilt fake libnvidia-ml.so.1 for
# the lab (.device/bench/fakenvml/). ~22 MiB in all.
#   GF_PYVER=3.11 (default 3.12): wheels for that CPython (3.12 = the GPU machine's).
#   GF_ALL=1: also .device/ossh/ (OpenSSH's .debs) and .device/gpu-whl/ (gpufleet's own
#             dependencies), which the lead carries already (docs/real-gpu.md): for a dry run.
set -eu
out=.device/bench
pyver=${GF_PYVER:-3.12}
abi=cp$(echo "$pyver" | tr -d .)
mkdir -p "$out/debs" "$out/whl"
rm -f "$out"/debs/*.deb "$out"/whl/*
( cd "$out/debs" && apt-get download -q iproute2 libbpf1 libelf1 libmnl0 libbsd0 libmd0 libcap2 \
    zlib1g 2>&1 | grep -v '^W: Download is performed unsandboxed' || true )
wheels() {  # DIR PACKAGE...: binary wheels for the target interpreter, dependencies included
  d=$1; shift
  python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform any \
      --python-version "$pyver" --implementation cp --abi "$abi" --abi abi3 --abi none \
      -d "$d" "$@" 2>&1 | grep -v "^WARNING: Location 'file:" || true
}
wheels "$out/whl" parallel-ssh ssh2-python ssh-python ansible-core prometheus_client ClusterShell
# The lab's fake libnvidia-ml.so.1, built here (glibc 2.36; runs on 2.39): run.sh uses it only
# where the GPU machine's compiler cannot build it (no libc6-dev headers, say).
mkdir -p "$out/fakenvml"
cp "$(python3 tests/lab/fakenvml/fakenvml_build.py)" "$out/fakenvml/libnvidia-ml.so.1"
# run.sh refuses a prebuilt library older than the source (a stale fake once let the device's
# clean rows run without the release delay the current fake simulates)
sha256sum < tests/lab/fakenvml/fakenvml.c | cut -d' ' -f1 > "$out/fakenvml/fakenvml.c.sha256"
if [ "${GF_ALL:-0}" = 1 ]; then
  mkdir -p .device/ossh .device/gpu-whl
  ( cd .device/ossh && apt-get download -q openssh-server openssh-client openssh-sftp-server \
      libwrap0 libnsl2 libtirpc3 libtirpc-common libedit2 libfido2-1 libcbor0.8 2>&1 \
      | grep -v '^W: Download is performed unsandboxed' || true )
  wheels .device/gpu-whl fabric paramiko invoke cryptography cffi pycparser bcrypt pynacl \
      decorator deprecated wrapt click tabulate pyyaml setproctitle
fi
ls "$out/debs" | grep -q '^iproute2_' || { echo "prepare: iproute2 .deb missing" >&2; exit 1; }
ls "$out/whl" | grep -q '^ansible_core-' || { echo "prepare: ansible-core wheel missing" >&2; exit 1; }
ls "$out/whl" | grep -q '^ssh2_python-' || { echo "prepare: ssh2-python wheel missing" >&2; exit 1; }
echo "prepared $out (CPython $pyver):"
ls "$out/debs" "$out/whl"
du -sh "$out/debs" "$out/whl"; du -sh "$out"
