"""Show gpufleet against the lab, as an operator would see it (the README's and notes' output).

    sudo python3 tests/lab/demo.py            # status --all, health --all, clean dry run, clean, status
    sudo python3 tests/lab/demo.py --swap     # the model-swap runbook: dry run, then for real
    sudo python3 tests/lab/demo.py --small    # a workstation, an older driver, a GPU missing

Starts the three fleets of the product (a WSL2 workstation with its 1680 MiB reservation, an
8-GPU training node with a vLLM family on GPUs 0-3 and a trainer on 4-7, a 2-GPU inference
node whose nvidia-smi is off PATH) plus a dead host, and prints each command with its exit
code and wall time. Needs what the lab needs (root, sshd, unshare).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fake_systemctl import install_systemctl  # noqa: E402
from lab import Lab  # noqa: E402

REPO = HERE.parent.parent


def gpufleet(args: list[str], env: dict) -> int:
    shown = "gpufleet " + " ".join(shlex.quote(a) for a in args)
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "gpufleet", *args], capture_output=True, text=True, env=env)
    took = time.monotonic() - started
    print(f"$ {shown}")
    sys.stdout.write(res.stdout)
    sys.stdout.write(res.stderr)
    print(f"# exit {res.returncode}, {took:.2f} s wall\n")
    return res.returncode


HEALTH_FIELDS = ["persistence_mode", "pcie.link.gen.current", "pcie.link.gen.max",
                 "pcie.link.width.current", "pcie.link.width.max", "clocks_event_reasons.active",
                 "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
                 "retired_pages.pending"]


def small_fleet(lab: Lab, tmp: str, env: dict) -> int:
    """A workstation (a python3 job, an nvtop-like monitor), a node whose older driver gives no
    health reading, one that lost a GPU (the inventory expects 4): status, then health."""
    ws = lab.add_host("workstation", gpus=1, gpu_name="NVIDIA GeForce RTX 5090", total_mib=32607)
    ws.spawn_holder(gpus=[0], mib=3000, user=lab.user,
                    argv=["python3", f"/home/{lab.user}/train.py", "--epochs", "3"])
    ws.spawn_monitor(title="nvtop")
    old = lab.add_host("old-driver", gpus=2, nvml=False, invalid_fields=HEALTH_FIELDS)
    short = lab.add_host("short-node", gpus=3)
    fleet = lab.inventory_yaml([ws, old, short], path=Path(tmp) / "fleet.yaml",
                               **{"short-node": {"gpus": 4}})
    gpufleet(["-i", str(fleet), "status"], env)
    return gpufleet(["-i", str(fleet), "health"], env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swap", action="store_true", help="run the model-swap runbook instead")
    parser.add_argument("--small", action="store_true",
                        help="a workstation, a node with an older driver, one short of a GPU")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Lab(Path(tmp) / "lab") as lab:
        home = Path(tmp) / "home"
        home.mkdir()
        # COLUMNS: the tables as a 120-column terminal shows them (a pipe gets whole lines)
        env = dict(os.environ, HOME=str(home), PYTHONPATH=str(REPO), COLUMNS="120")
        if args.small:
            return small_fleet(lab, tmp, env)
        wsl = lab.add_host("bigmama", gpus=1, wsl2=True, gpu_name="NVIDIA GeForce RTX 5090",
                           total_mib=32607, reserved_mib=0, ghost_mib=1680)
        train = lab.add_host("train-node", gpus=8, release_delay_s=0.2)
        infer = lab.add_host("blackwell", gpus=8, gpu_name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
                             total_mib=97887, nvidia_smi="/usr/local/nvidia/bin/nvidia-smi")
        dead = lab.dead_host("old-node")
        train.spawn_vllm(gpus=[0, 1, 2, 3], mib=716)
        # a job as people start one: comm is python3, the command line says what runs
        train.spawn_holder(gpus=[4, 5, 6, 7], mib=[30000] * 4, user=lab.user, argv=[
            "python3", f"/home/{lab.user}/dflash/train_dflash.py", "--config",
            "configs/dflash-8b.yaml", "--epochs", "3"])
        train.spawn_monitor(title="nvtop")
        health_port = 18000 + os.getpid() % 1000
        systemctl = install_systemctl(infer, {
            "vllm-minimax": {"gpus": list(range(8)), "mib": 60000, "title": "VLLM::Worker"},
            "vllm-kimi": {"gpus": list(range(8)), "mib": 70000, "title": "VLLM::Worker",
                          "health_port": health_port, "health_delay": 1.0}})
        infer.exec([systemctl, "start", "vllm-minimax.service"])
        # vLLM workers that escaped the unit's cgroup (the seed's "96 GB stayed used after
        # systemctl stop"): `systemctl stop` does not end them; the clean step must.
        infer.spawn_vllm(gpus=list(range(8)), mib=30000)
        fleet = lab.inventory_yaml(
            [wsl, train, infer, dead], path=Path(tmp) / "fleet.yaml",
            defaults={"connect_timeout": 3, "command_timeout": 60},
            groups={"training": ["train-node"], "inference": ["blackwell"]},
            bigmama={"unattributed_mib": 1680, "tags": ["wsl2", "workstation"]},
            **{"train-node": {"protect": ["*train_dflash*"]}})
        inv = ["-i", str(fleet)]
        audit = ["--audit-log", str(Path(tmp) / "audit.jsonl")]
        if args.swap:
            swap = [*inv, "run", str(REPO / "playbooks" / "model-swap.yaml"), "--host", "blackwell",
                    "-e", "OLD_UNIT=vllm-minimax", "-e", "NEW_UNIT=vllm-kimi",
                    "-e", f"SYSTEMCTL={systemctl}",
                    "-e", f"HEALTH_URL=http://127.0.0.1:{health_port}/health", "-e", "START_TIMEOUT=60"]
            gpufleet([*swap, "--dry-run"], env)
            return gpufleet([*swap, "--yes"], env)
        gpufleet([*inv, "status", "--all"], env)
        gpufleet([*inv, "health", "--all"], env)
        gpufleet([*inv, "clean", "--host", "train-node", "--gpus", "0-3", "--dry-run"], env)
        gpufleet([*inv, "clean", "--host", "train-node", "--gpus", "0-3", "--yes", *audit], env)
        gpufleet([*inv, "status", "--host", "train-node"], env)
        gpufleet([*inv, "fit", "--host", "bigmama", "--weights-gib", "27.57",
                  "--activations-gib", "2.7", "--util", "0.945", "--context-mib", "0"], env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
