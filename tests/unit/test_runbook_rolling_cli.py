"""`gpufleet run` rolling on `connection: local` hosts (no SSH): --retry narrowed by a
selection, and Ctrl-C in a batch. The lab runs are tests/integration/test_runbooks_rolling_lab.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


# ----------------------------------------------------------------- the CLI, on connection: local hosts


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from gpufleet.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          cwd=str(home), env=dict(os.environ, HOME=str(home)))


def test_retry_narrowed_by_host_keeps_the_others_in_the_file(tmp_path: Path) -> None:
    """Five local hosts, c fails the canary-then-2 roll: d and e never run; a --retry narrowed
    to d runs d alone and leaves c and e in the retry file."""
    (tmp_path / "fleet.yaml").write_text("hosts:\n" + "".join(f"  {n}: {{connection: local}}\n" for n in "abcde"))
    log = tmp_path / "ran"
    (tmp_path / "rb.yaml").write_text(textwrap.dedent(f"""\
        serial: [1, 2]
        max_fail_percentage: 0
        steps:
          - kind: local_command
            argv: [sh, -c, 'echo "$GPUFLEET_HOST" >> {log}; test "$GPUFLEET_HOST" != c']
        """))
    retry = tmp_path / ".local/state/gpufleet/retry/rb.hosts"
    first = _cli(tmp_path, "-i", "fleet.yaml", "run", "rb.yaml", "--all", "--yes")
    assert first.returncode == 1, first.stdout + first.stderr
    ran = log.read_text().split()
    assert ran[0] == "a" and sorted(ran[1:]) == ["b", "c"]  # the canary, then b and c together
    assert retry.read_text().splitlines()[1:] == ["c", "d", "e"]
    assert "not run (nothing done there, never contacted): d, e" in first.stdout

    narrowed = _cli(tmp_path, "-i", "fleet.yaml", "run", "rb.yaml", "--retry", "--host", "d", "--yes")
    assert narrowed.returncode == 0, narrowed.stdout + narrowed.stderr
    assert log.read_text().split()[3:] == ["d"]
    assert retry.read_text().splitlines()[1:] == ["c", "e"]

    none = _cli(tmp_path, "-i", "fleet.yaml", "run", "rb.yaml", "--retry", "--host", "a", "--yes")
    assert none.returncode == 2 and none.stderr == "gpufleet: error: --retry: none of the hosts to retry (c, e) is selected\n"


def test_ctrl_c_in_a_batch_lets_it_finish_and_starts_no_later_batch(tmp_path: Path) -> None:
    """SIGINT (to the CLI this test started, by its pid) while the canary runs: the canary
    finishes, no later batch starts, exit 130, the rest are in the retry file."""
    (tmp_path / "fleet.yaml").write_text("hosts:\n" + "".join(f"  {n}: {{connection: local}}\n" for n in "abc"))
    log = tmp_path / "ran"
    (tmp_path / "rb.yaml").write_text(textwrap.dedent(f"""\
        serial: 1
        steps:
          - kind: local_command
            argv: [sh, -c, 'echo "$GPUFLEET_HOST" >> {log}; sleep 1.5']
        """))
    proc = subprocess.Popen([sys.executable, "-c", "from gpufleet.cli import main; main()", "-i", "fleet.yaml",
                             "run", "rb.yaml", "--all", "--yes"], cwd=str(tmp_path), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HOME=str(tmp_path)))
    deadline = time.monotonic() + 30
    while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert log.read_text().split() == ["a"]
    assert "stopped after batch 1: interrupted" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("a ")]
    assert [r[:5] for r in rows] == [["a", "1", "local_command", "local_command", "ok"]]  # let finish
    retry = tmp_path / ".local/state/gpufleet/retry/rb.hosts"
    assert retry.read_text().splitlines()[1:] == ["b", "c"]
