#!/usr/bin/env python3
"""Real CUDA holders for the real-GPU scenario (tests/gpu/gpu_scenario.py); needs torch + a GPU.

One program, several roles, each started by the scenario runner as its own process:

* ``engine``: like vLLM's ``EngineCore_DP0`` with a multiprocessing executor. It renames itself
  (cmdline with setproctitle, comm with prctl, as vLLM does) before CUDA starts, creates a small
  CUDA context on its GPU (a 1-element tensor: the context is what nvidia-smi then lists for it),
  and spawns ``--workers`` ``worker`` processes that hold the GiBs. On SIGTERM it does what
  vLLM's shutdown does: TERM its workers, wait for them, exit 0.
* ``worker``: ``VLLM::Worker``; allocates ``--gib`` on its GPU; exits on SIGTERM (default
  action) or when its parent's pipe closes (vLLM workers watch a death pipe the same way).
* ``stubborn``: ignores SIGTERM (only SIGKILL ends it); renames itself AFTER CUDA started, to
  see whether nvidia-smi's process_name is read live or cached at context creation.
* ``trainer``: started with CUDA_VISIBLE_DEVICES=<gpu>; allocates ``--gib`` and runs a small
  matmul every 0.2 s without growing its memory (warmed up before it reports ready).
* ``plain``: allocates ``--gib``, default signal handling (the driver-release floor runs).
* ``probe``: creates a context, prints ``torch.cuda.mem_get_info`` etc. as JSON, waits for a
  line on stdin (the runner reads nvidia-smi meanwhile), exits.

Every holder writes a ready file (JSON: pid, role, gpu, bytes) once its memory is allocated.
"""
import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time

PR_SET_NAME = 15
HERE = os.path.dirname(os.path.abspath(__file__))


def rename(title):
    """vLLM's rename: setproctitle rewrites the cmdline (and, in 1.3+, comm); prctl makes sure."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)


def write_ready(path, doc):
    if not path:
        return
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.rename(tmp, path)


def allocate(gpu, gib):
    """Hold ``gib`` GiB on CUDA device ``gpu`` (plain cudaMalloc through torch, touched)."""
    import torch

    torch.cuda.set_device(gpu)
    n = int(gib * (1 << 30))
    buf = torch.zeros(n, dtype=torch.uint8, device="cuda:%d" % gpu) if n else \
        torch.zeros(1, device="cuda:%d" % gpu)
    torch.cuda.synchronize(gpu)
    return buf


def wait_forever(watch_fd=None):
    """Sleep until killed; with ``watch_fd``, exit when it reaches EOF (the parent is gone)."""
    while True:
        if watch_fd is None:
            time.sleep(3600)
            continue
        r, _, _ = select.select([watch_fd], [], [], 3600)
        if r and not os.read(watch_fd, 4096):
            os._exit(0)


def role_worker(args):
    rename(args.title or "VLLM::Worker")
    buf = allocate(args.gpu, args.gib)
    write_ready(args.ready, {"pid": os.getpid(), "role": "worker", "gpu": args.gpu,
                             "bytes": buf.numel()})
    wait_forever(0 if args.watch_stdin else None)


def role_engine(args):
    rename(args.title or "VLLM::EngineCore_DP0")
    ctx = allocate(args.gpu, 0)  # the small CUDA context nvidia-smi lists for EngineCore
    workers = []
    readies = []
    for n in range(args.workers):
        ready = "%s.worker%d" % (args.ready, n)
        try:
            os.unlink(ready)
        except OSError:
            pass
        readies.append(ready)
        cmd = [sys.executable, os.path.abspath(__file__), "worker", "--gpu", str(args.gpu),
               "--gib", str(args.worker_gib), "--ready", ready, "--watch-stdin"]
        workers.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, close_fds=True))

    def on_term(signum, frame):
        for w in workers:
            try:
                w.send_signal(signal.SIGTERM)
            except OSError:
                pass
        end = time.monotonic() + 5.0
        for w in workers:
            try:
                w.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    deadline = time.monotonic() + 120
    pids = []
    for w, ready in zip(workers, readies):
        while not os.path.exists(ready):
            if w.poll() is not None:
                sys.stderr.write("engine: worker %d exited %s\n" % (w.pid, w.returncode))
                sys.exit(1)
            if time.monotonic() > deadline:
                sys.exit("engine: workers not ready")
            time.sleep(0.02)
        pids.append(w.pid)
    write_ready(args.ready, {"pid": os.getpid(), "role": "engine", "gpu": args.gpu,
                             "workers": pids, "bytes": ctx.numel()})
    wait_forever()


def role_stubborn(args):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    buf = allocate(args.gpu, args.gib)
    if args.title:
        rename(args.title)  # after CUDA started: does nvidia-smi show the old or the new name?
    write_ready(args.ready, {"pid": os.getpid(), "role": "stubborn", "gpu": args.gpu,
                             "bytes": buf.numel()})
    wait_forever()


def role_trainer(args):
    import torch

    buf = allocate(0, args.gib)  # device 0 of CUDA_VISIBLE_DEVICES: the GPU the runner chose
    a = torch.randn(2048, 2048, device="cuda:0")
    b = torch.randn(2048, 2048, device="cuda:0")
    out = torch.empty(2048, 2048, device="cuda:0")
    for _ in range(3):  # warm-up: cuBLAS workspace and kernels exist before "ready"
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    write_ready(args.ready, {"pid": os.getpid(), "role": "trainer",
                             "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                             "bytes": buf.numel()})
    while True:
        torch.matmul(a, b, out=out)
        torch.cuda.synchronize()
        time.sleep(0.2)


def role_plain(args):
    buf = allocate(args.gpu, args.gib)
    write_ready(args.ready, {"pid": os.getpid(), "role": "plain", "gpu": args.gpu,
                             "bytes": buf.numel()})
    wait_forever()


def role_probe(args):
    """What a new CUDA process (vLLM at start-up) sees: mem_get_info after its own context."""
    import torch

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(0)
    doc = {"pid": os.getpid(), "role": "probe", "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "free_bytes": free, "total_bytes": total,
           "torch_reserved_bytes": torch.cuda.memory_reserved(0),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "device_name": torch.cuda.get_device_name(0)}
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
    sys.stdin.readline()


ROLES = {"engine": role_engine, "worker": role_worker, "stubborn": role_stubborn,
         "trainer": role_trainer, "plain": role_plain, "probe": role_probe}


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpu_holders")
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("--gpu", type=int, default=0, help="CUDA device index")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--worker-gib", type=float, default=4.0)
    p.add_argument("--title", default=None)
    p.add_argument("--ready", default=None)
    p.add_argument("--watch-stdin", action="store_true")
    args = p.parse_args(argv)
    ROLES[args.role](args)


if __name__ == "__main__":
    main()
