#!/bin/bash
# The benchmark on the GPU machine (no network, no apt, no pip index, no ip/sshd/ssh), from the
# repo root, with .device/ carried (bench/device/prepare.sh, docs/real-gpu.md):
#   bash bench/device/run.sh OUTDIR [more bench/run.py options, which override the defaults below]
# 1. unpacks .device/ossh/*.deb and .device/bench/debs/*.deb into $GF_DEVICE_WORK/root and makes
#    wrappers (ip, ssh, ssh-keygen, sshd) that set LD_LIBRARY_PATH for those programs only;
# 2. installs .device/gpu-whl and .device/bench/whl wheels with pip --no-index --target;
# 3. starts the machine's own sshd (tests/gpu/ossh.sh) in a cgroup of its own: the real host;
# 4. runs bench/run.py (lab hosts on this machine's cores + the real host), writing into OUTDIR:
#    RESULTS-device.md, results-device.json, run.log;
# 5. runs tests/gpu/gpu_scenario.py (1+1 rounds) with its round 1 also through that sshd:
#    OUTDIR/scenario/ (results.json, log.txt, fixtures*/) and OUTDIR/scenario.txt;
# then stops the sshd it started (by its recorded pid) and removes its cgroup.
# GF_DEVICE_WORK (default /var/tmp/gfdevice: outside /tmp and /root, which lab hosts make private,
# so their sshd can run from there), GF_PYTHON (default /opt/torch/.venv/bin/python3, else
# python3), GF_REAL=0 (no real host), GF_QUICK=1 (a small run: N=1,4, one RTT; for a dry run),
# GF_WARM=1 (bench/run.py --warm: gpufleet and Ansible also timed over the connections they
# keep, next to their cold runs), GF_SCENARIO=0 (no step 5), GF_SCENARIO_S (its time limit, default 150 s), GF_BENCH (a bash
# command run instead of steps 4 and 5, with the set-up above: e.g. another bench of bench/, as
# GF_BENCH='python3 bench/serve_bench.py --hosts 128 --soak 120'; OUTDIR is "$GF_OUT" there).
set -euo pipefail
main() {  # the whole script is parsed before it runs (an edit meanwhile cannot break it)
[ $# -ge 1 ] || { echo "usage: bash bench/device/run.sh OUTDIR [bench/run.py options]" >&2; exit 2; }
mkdir -p "$1"
out=$(cd "$1" && pwd); shift
repo=$(pwd)
dev=$repo/.device
[ -f "$repo/bench/run.py" ] || { echo "run.sh: run it from the repo root" >&2; exit 2; }
for d in "$dev/ossh" "$dev/gpu-whl" "$dev/bench/debs" "$dev/bench/whl"; do
  [ -d "$d" ] || { echo "run.sh: $d missing (bench/device/prepare.sh; carry .device)" >&2; exit 2; }
done
W=${GF_DEVICE_WORK:-/var/tmp/gfdevice}
PY=${GF_PYTHON:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=$(command -v python3)
exec > >(tee "$out/run.log") 2>&1
echo "run.sh: $(date -u '+%F %T UTC') python $PY ($("$PY" -V 2>&1)), work $W, out $out"
rm -rf "$W"
mkdir -p "$W/root" "$W/bin" "$W/sbin" "$W/site"

# 1. Debian's OpenSSH and iproute2, unpacked; wrappers so only these programs see their libraries.
for d in "$dev"/ossh/*.deb "$dev"/bench/debs/*.deb; do dpkg -x "$d" "$W/root"; done
libs=$W/root/usr/lib/x86_64-linux-gnu:$W/root/lib/x86_64-linux-gnu
wrap() {  # DIR NAME REAL
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
    "$libs" "$3" > "$1/$2"
  chmod 755 "$1/$2"
}
ipbin=$W/root/bin/ip; [ -x "$ipbin" ] || ipbin=$W/root/sbin/ip
wrap "$W/bin" ip "$ipbin"
for t in ssh ssh-keygen scp sftp; do wrap "$W/bin" "$t" "$W/root/usr/bin/$t"; done
wrap "$W/sbin" sshd "$W/root/usr/sbin/sshd"  # execs sshd by its absolute path (sshd re-exec)
id sshd >/dev/null 2>&1 || useradd -r -d /run/sshd -s /usr/sbin/nologin sshd
mkdir -p /run/sshd && chmod 755 /run/sshd
"$W/bin/ip" -V; "$W/bin/ssh" -V

# 2. Python packages from the carried wheels only.
# One wheel per project: gpu-whl's (gpufleet's own) where both directories have one.
have=$(cd "$dev/gpu-whl" && ls ./*.whl | sed 's|^\./||; s/-.*//' | tr 'A-Z' 'a-z')
whls=("$dev"/gpu-whl/*.whl)
for f in "$dev"/bench/whl/*.whl; do
  n=$(basename "$f" | sed 's/-.*//' | tr 'A-Z' 'a-z')
  printf '%s\n' "$have" | grep -qx "$n" || whls+=("$f")
done
pip=("$PY" -m pip)
"$PY" -m pip --version >/dev/null 2>&1 || pip=(pip)  # an interpreter without pip: the one on PATH
"${pip[@]}" install -q --disable-pip-version-check --no-index --no-deps --target "$W/site" "${whls[@]}"
export PATH=$W/bin:$W/site/bin:$PATH
export PYTHONPATH=$repo:$W/site${PYTHONPATH:+:$PYTHONPATH}
export GFLAB_SSHD=$W/sbin/sshd LANG=C.UTF-8 LC_ALL=C.UTF-8 PYTHONDONTWRITEBYTECODE=1
printf '#!/bin/sh\nexec %s -m gpufleet "$@"\n' "$PY" > "$W/bin/gpufleet"; chmod 755 "$W/bin/gpufleet"
# Bytecode, as an install has it (pip compiles what it installs; the wheels above are): this
# machine sets PYTHONDONTWRITEBYTECODE=1 and the carried tree has no __pycache__, so without
# this every gpufleet run would compile its modules from source (~0.1-0.2 s of CPU a run) while
# Ansible and parallel-ssh, installed by pip, would not.
"$PY" -m compileall -q -j 0 "$repo/gpufleet" "$W/site" >/dev/null || true
"$PY" -c 'import gpufleet, pssh, ssh2, ansible, fabric; print("gpufleet from", gpufleet.__file__)'
# The hosts' sessions run the agent (and Ansible's module) with python3 from their PATH.
linked=""
if ! PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin command -v python3 >/dev/null; then
  ln -s "$(readlink -f "$PY")" /usr/local/bin/python3 && linked=/usr/local/bin/python3
  echo "run.sh: no python3 on the hosts' PATH: linked $linked -> $(readlink -f "$PY")"
fi

# The lab's fake libnvidia-ml.so.1 is compiled on first use; where this machine's compiler
# cannot (no libc headers), the one prepare.sh built goes where the lab's build looks first.
if ! printf '#include <dirent.h>\n#include <stdio.h>\nint f(void){return 0;}\n' \
    | "${CC:-cc}" -x c -shared -fPIC -o "$W/cc-probe.so" - 2>/dev/null; then
  echo "run.sh: the C compiler cannot build the fake NVML here: using the prebuilt one"
  built_from=$(cat "$dev/bench/fakenvml/fakenvml.c.sha256" 2>/dev/null || echo none)
  if [ "$built_from" != "$(sha256sum < tests/lab/fakenvml/fakenvml.c | cut -d' ' -f1)" ]; then
    echo "run.sh: the prebuilt fake NVML is not built from this tests/lab/fakenvml/fakenvml.c" \
      "(run bench/device/prepare.sh again here)" >&2
    exit 2
  fi
  "$PY" - "$dev/bench/fakenvml/libnvidia-ml.so.1" <<'PYEOF'
import hashlib, os, shutil, sys, tempfile
sys.path.insert(0, "tests/lab/fakenvml")
import fakenvml_build as f
cc = f.compiler()
key = hashlib.sha256(f.SOURCE.read_bytes() + "\0".join([cc] + f.CFLAGS).encode()).hexdigest()[:16]
d = os.path.join(tempfile.gettempdir(), "gflab-fakenvml", key)
os.makedirs(d, exist_ok=True)
shutil.copy(sys.argv[1], os.path.join(d, f.SONAME))
os.chmod(os.path.join(d, f.SONAME), 0o755)
print("prebuilt fake NVML ->", d, "; the lab builds:", f.build())
PYEOF
fi

# 3. The real host: this machine's own sshd, in a cgroup of its own (its sessions inherit it).
real_args=()
sshd_pid=""
cg=""
cleanup() {
  [ -n "$sshd_pid" ] && kill "$sshd_pid" 2>/dev/null || true
  [ -n "$linked" ] && rm -f "$linked"
  if [ -n "$cg" ]; then
    for _ in 1 2 3 4 5 6 7 8 9 10; do rmdir "$cg" 2>/dev/null && break; sleep 0.3; done
  fi
}
trap cleanup EXIT
if [ "${GF_REAL:-1}" = 1 ]; then
  v2root=${GFBENCH_CGROUP2:-/sys/fs/cgroup}
  if [ -n "${GFBENCH_CGROUP2:-}" ] || { [ ! -d /sys/fs/cgroup/cpuacct ] && [ -f "$v2root/cgroup.controllers" ]; }; then
    cg=$v2root$(sed -n 's/^0:://p' /proc/self/cgroup); cg=${cg%/}/gfbench-real$$
  else
    cg=/sys/fs/cgroup/cpuacct/gfbench-real$$
  fi
  mkdir "$cg" || { echo "run.sh: cannot make cgroup $cg: the real host's CPU is not measured"; cg=""; }
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  sh -c '[ -z "$1" ] || echo $$ > "$1/cgroup.procs"; exec sh tests/gpu/ossh.sh "$2" "$3" "$4"' sh \
    "$cg" "$dev/ossh" "$port" "$W/ossh"
  sshd_pid=$(cat "$W/ossh/sshd.pid")
  smi=$(command -v nvidia-smi || command -v /usr/local/nvidia/bin/nvidia-smi || true)
  [ -n "$smi" ] && "$smi" -L || echo "run.sh: no nvidia-smi here"
  real_args=(--real-host "127.0.0.1:$port:$W/ossh/id_ed25519:$W/ossh/known_hosts")
  [ -z "$cg" ] || real_args+=(--real-host-cgroup "$cg")
fi

if [ -n "${GF_BENCH:-}" ]; then  # another bench on the same set-up, instead of 4 and 5
  rc=0
  GF_OUT=$out PATH=$(dirname "$PY"):$PATH bash -c "$GF_BENCH" || rc=$?
  echo "run.sh: GF_BENCH exit $rc; $(date -u '+%T UTC')"
  exit $rc
fi

# 4. The bench. Sized for ~7 min on 16 cores (bench/README.md, "On the GPU machine").
if [ "${GF_QUICK:-0}" = 1 ]; then
  sizing=(--ns 1,4 --rtts 20 --ns-far '' --runs 2 --pipelining-ns 1 --fail-n 4 --fail-k 0,1
          --fail-over 0 --clean-ns 1 --clean-runs 1 --real-runs 1 --deadline-s 300)
else
  sizing=(--ns 1,8,32,128 --rtts 20,100 --ns-far 1,32 --runs 3 --slow-s 5 --seq-max-n 1
          --seq-max-n-first 32 --pipelining-ns 1,32 --fail-n 32 --fail-k 0,1,4,8 --fail-over 8
          --clean-ns 1,32 --clean-runs 3 --clean-rtts 20,0 --scale-forks 128 --real-runs 2
          --deadline-s 390)
fi
[ "${GF_WARM:-0}" = 1 ] && sizing+=(--warm)  # its warm runs take ~half as long again
label="$(nproc) cores, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)"
rc=0
"$PY" bench/run.py "${sizing[@]}" "${real_args[@]}" --machine-label "$label" \
  --out "$out/RESULTS-device.md" --raw "$out/results-device.json" --plot "$out/wall_vs_n-device.png" \
  "$@" || rc=$?
echo "run.sh: bench exit $rc; $(date -u '+%T UTC')"

# 5. The real-GPU scenario, round 1 also through this sshd (GF_SCENARIO=0: not run).
if [ "${GF_SCENARIO:-1}" = 1 ] && [ -n "$sshd_pid" ] && [ -n "${smi:-}" ]; then
  src=0
  timeout -s TERM "${GF_SCENARIO_S:-150}" "$PY" tests/gpu/gpu_scenario.py --out "$out/scenario" \
    --rounds 1 --light-rounds 1 --floor-holders 2 --budget 40 --ssh-state "$W/ossh" \
    --ssh-port "$port" > "$out/scenario.txt" 2>&1 || src=$?
  tail -25 "$out/scenario.txt"
  echo "run.sh: scenario exit $src; $(date -u '+%T UTC')"
  [ "$src" = 0 ] || [ "$rc" != 0 ] || rc=1
fi
exit $rc
}
main "$@"
