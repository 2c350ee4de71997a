"""`gpufleet serve` over N lab hosts: scrape latency, refresh cost, RSS over a soak (prints numbers).

Targets (a scrape never waits for a host): a scrape answers in <= 50 ms from the cached snapshot; a refresh costs what
one `status --all` costs; RSS stays flat over a 30-minute soak of one scrape a second.

    python3 bench/serve_bench.py                      # as root: N=128, 30 min soak
    python3 bench/serve_bench.py --hosts 32 --soak 60 # a shorter run

Hosts are test-lab hosts on loopback (no delay line: this measures gpufleet, not the link),
8 fake H200 GPUs each and one holder. The serve process is started here and stopped by its
recorded PID. Not a test: pytest never collects bench/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "lab"))

from lab import Lab  # noqa: E402

sys.path.insert(0, str(HERE))
from live_bench import descendants, tree_pss_kib  # noqa: E402

GPUFLEET = [sys.executable, "-c", "from gpufleet.cli import main; main()"]
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def env(home: str) -> dict[str, str]:
    out = dict(os.environ, HOME=home)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), out.get("PYTHONPATH")) if p)
    return out


def scrape(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    with DIRECT.open(url, timeout=30) as resp:
        body = resp.read()
    return (time.perf_counter() - started) * 1000, body


def rss_kib(pid: int) -> str:
    """The serve process's RSS, and the PSS of it with its ssh processes (OpenSSH masters)."""
    own = -1
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            own = int(line.split()[1])
    return f"{own} (with {len(descendants(pid))} ssh: PSS {tree_pss_kib(pid)})"


def metric(body: bytes, name: str) -> float:
    m = re.search(rb"^%s(?:\{[^}]*\})? (\S+)$" % name.encode(), body, re.M)
    return float(m.group(1)) if m else float("nan")


def refreshes(body: bytes) -> float:
    return sum(float(v) for v in re.findall(rb"^gpufleet_refreshes_total\{[^}]*\} (\S+)$", body, re.M))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--soak", type=float, default=1800.0, help="seconds of one scrape a second")
    ap.add_argument("--max-age", type=float, default=15.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Lab(Path(tmp) / "lab") as lab:
        hosts = []
        for i in range(args.hosts):
            h = lab.add_host(f"node{i:03d}", gpus=8, gpu_name="NVIDIA H200", total_mib=143771)
            h.spawn_holder(gpus=[0], mib=71680, title="VLLM::Worker_TP0")
            hosts.append(h)
        inv = lab.inventory_yaml(hosts)
        home = tempfile.mkdtemp(dir=tmp)
        started = time.monotonic()
        st = subprocess.run(GPUFLEET + ["-i", str(inv), "status", "--all", "--json"],
                            env=env(home), capture_output=True, text=True, cwd=home)
        status_s = time.monotonic() - started
        assert all(h["ok"] for h in json.loads(st.stdout)["hosts"]), st.stderr
        serve = subprocess.Popen(GPUFLEET + ["-i", str(inv), "serve", "--listen", "127.0.0.1:0",
                                             "--max-age", str(args.max_age)],
                                 env=env(home), cwd=home, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            assert serve.stderr is not None
            line = serve.stderr.readline()
            base = re.search(r"(http://\S+)/metrics", line).group(1)  # type: ignore[union-attr]
            while True:
                try:
                    if DIRECT.open(base + "/healthz", timeout=5).status == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.2)
            first_ms, body = scrape(base + "/metrics")
            print(f"hosts {args.hosts}; status --all --json wall {status_s:.2f} s; serve's refresh "
                  f"{metric(body, 'gpufleet_refresh_seconds'):.2f} s (over held sessions); "
                  f"exposition {len(body)} bytes")
            times, rss, t_end = [], [(0.0, rss_kib(serve.pid))], time.monotonic() + args.soak
            t0 = time.monotonic()
            while time.monotonic() < t_end:
                ms, body = scrape(base + "/metrics")
                times.append(ms)
                if len(times) % 60 == 0:
                    rss.append((time.monotonic() - t0, rss_kib(serve.pid)))
                time.sleep(max(0.0, 1.0 - ms / 1000))
            rss.append((time.monotonic() - t0, rss_kib(serve.pid)))
            times.sort()
            print(f"scrapes {len(times)}: median {statistics.median(times):.1f} ms, p99 "
                  f"{times[int(0.99 * (len(times) - 1))]:.1f} ms, max {times[-1]:.1f} ms")
            print(f"refreshes during the soak: {refreshes(body):.0f}; last refresh "
                  f"{metric(body, 'gpufleet_refresh_seconds'):.2f} s")
            print("RSS KiB over the soak (s: KiB): " + ", ".join(f"{t:.0f}: {k}" for t, k in rss))
        finally:
            os.kill(serve.pid, signal.SIGTERM)
            serve.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
