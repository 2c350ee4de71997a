"""The tables as a person at a 120-column terminal sees them: the real CLI on a real pty
(python's pty module; the window size set with TIOCSWINSZ) against lab hosts. ERROR,
CRITICAL, UNKNOWN and a dirty verdict are coloured, nothing wraps; NO_COLOR and a pipe get
plain text, and a pipe gets whole lines."""
from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path
from typing import Any, Optional

from cli_helpers import GPUFLEET, REPO_ROOT, home, parse_table, run_gpufleet  # noqa: F401  (home: fixture)

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour (SGR); the progress line on stderr uses \x1b[K


def visible(text: str) -> list[str]:
    """The lines a terminal ends up showing: colour dropped, and of a line redrawn in place
    (the progress line: \r, erase) what was written last."""
    return [ANSI.sub("", line.rsplit("\r", 1)[-1].replace("\x1b[K", ""))
            for line in text.split("\n")]
RED, MAGENTA, RESET = "\x1b[31m", "\x1b[35m", "\x1b[0m"
HEALTH_FIELDS = ["persistence_mode", "pcie.link.gen.current", "pcie.link.gen.max",
                 "pcie.link.width.current", "pcie.link.width.max", "clocks_event_reasons.active",
                 "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
                 "retired_pages.pending"]


def on_pty(home: Path, inventory: Path, *args: str, columns: int = 120,
           env: Optional[dict[str, str]] = None, timeout: float = 120) -> tuple[int, str]:
    """(exit code, everything the terminal got) of `gpufleet -i INVENTORY ARGS` on a pty of
    ``columns`` x 50; the process is ours and waited for."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    full = {k: v for k, v in os.environ.items()
            if k not in ("NO_COLOR", "COLUMNS", "LINES", "GPUFLEET_INVENTORY", "SSH_AUTH_SOCK")}
    full.update(HOME=str(home), TERM="xterm-256color",
                PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + [full["PYTHONPATH"]]
                                           if full.get("PYTHONPATH") else [str(REPO_ROOT)]))
    full.update(env or {})
    proc = subprocess.Popen(GPUFLEET + ["-i", str(inventory), *args], stdin=slave, stdout=slave,
                            stderr=slave, env=full, cwd=str(home), start_new_session=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the CLI closed its end
                break
            if not chunk:
                break
            out += chunk
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, out.decode("utf-8", "replace").replace("\r\n", "\n")


def test_a_terminal_gets_colour_and_120_columns_a_pipe_plain_whole_lines(
        lab: Any, make_host: Any, home: Path) -> None:
    sick = make_host("gpu-node-01", gpus=8, remapped_failure=[1],
                     gpu_name="NVIDIA RTX PRO 6000 Blackwell Server Edition", total_mib=97887)
    sick.spawn_vllm(gpus=[0, 1, 2, 3], mib=30000)
    trainer = sick.spawn_holder(gpus=[4, 5, 6, 7], mib=[40000] * 4, user=lab.user, argv=[
        "python3", "/home/%s/dflash/train_dflash.py" % lab.user, "--config",
        "configs/dflash-70b.yaml", "--epochs", "3"])
    sick.spawn_monitor(title="nvtop")
    blind = make_host("blind", gpus=1, nvml=False, invalid_fields=HEALTH_FIELDS)
    inv = lab.inventory_yaml([sick, blind, lab.dead_host("gone")], connect_timeout=2)

    rc, screen = on_pty(home, inv, "status")
    assert rc == 1, screen  # the dead host
    lines = visible(screen)
    assert max(len(line) for line in lines) <= 120, screen
    # short of room, HEALTH puts its code under the severity: the severity is painted
    assert f"{RED}CRITICAL{RESET}" in screen and "remap_failure" in screen, screen
    assert f"{MAGENTA}UNKNOWN{RESET}" in screen, screen
    assert RED + "ERROR: connection refused" in screen, screen
    assert f"{trainer} {lab.user} 40000MiB" in screen and "train_dflash.py --config" in screen
    assert " clients " in screen and "RTX PRO 6000" in screen

    rc, plain = on_pty(home, inv, "status", env={"NO_COLOR": "1"})
    assert rc == 1 and not ANSI.search(plain), plain
    assert [ln for ln in visible(screen) if ln.startswith("gpu-node-01  ")] == \
        [ln for ln in visible(plain) if ln.startswith("gpu-node-01  ")]

    piped = run_gpufleet(home, inv, "status")
    assert piped.rc == 1 and "\x1b[" not in piped.stdout, str(piped)
    assert ("%d %s 40000MiB train_dflash.py --config configs/dflash-70b.yaml --epochs 3"
            % (trainer, lab.user)) in piped.stdout, str(piped)

    wide = run_gpufleet(home, inv, "status", "--wide", "--host", "gpu-node-01", "--host", "blind")
    rows = {(r["HOST"], r["GPU"]): r for r in parse_table(wide.stdout, "HOST")}
    # NVML's readings (the fake driver's recorded 37 C, 126 W); none through nvidia-smi
    assert (rows[("gpu-node-01", "0")]["TEMP (C)"], rows[("gpu-node-01", "0")]["POWER (W)"]) == (
        "37", "126"), str(wide)
    assert (rows[("blind", "0")]["TEMP (C)"], rows[("blind", "0")]["POWER (W)"]) == ("n/a", "n/a")

    rc, health = on_pty(home, inv, "health", "--host", "gpu-node-01")
    assert rc == 1 and f"{RED}CRITICAL{RESET}" in health, health


def test_a_dirty_verdict_is_red_on_a_terminal(lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("keeps", gpus=1)
    host.spawn_holder(gpus=[0], mib=2000, title="keeper")
    inv = lab.inventory_yaml([host])
    rc, screen = on_pty(home, inv, "clean", "--all", "--gpus", "0", "--yes", "--protect", "keeper",
                        "--timeout", "1", "--grace", "1")
    assert rc == 1 and f"{RED}dirty{RESET}" in screen, screen
    piped = run_gpufleet(home, inv, "clean", "--all", "--gpus", "0", "--yes", "--protect", "keeper",
                         "--timeout", "1", "--grace", "1")
    assert piped.rc == 1 and " dirty " in piped.stdout and "\x1b[" not in piped.stdout
