"""Running the real `gpufleet` CLI against the test lab, and reading what it printed.

The CLI runs as a subprocess (the installed entry point, through this interpreter) with HOME
set to a per-test directory, so the audit log, ~/.ssh and ~/.config/gpufleet/known_hosts of
the machine are never read or written. Tables are parsed by column position (tabulate's
"simple" format: a dashes line under the header gives every column's span).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

GPUFLEET = [sys.executable, "-c", "from gpufleet.cli import main; main()"]
# The checkout under test comes first on the child's path (the CLI runs from HOME, where an
# installed gpufleet from another checkout would otherwise be imported).
REPO_ROOT = Path(__file__).resolve().parents[2]
# Variables that would point the CLI at the machine's own files instead of the test's.
_SCRUB = ("GPUFLEET_INVENTORY", "GPUFLEET_AUDIT_LOG", "SSH_AUTH_SOCK", "SSH_AGENT_PID")


@dataclass
class CliRun:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float

    def json(self) -> dict[str, Any]:
        try:
            return json.loads(self.stdout)
        except ValueError:
            raise AssertionError("stdout is not one JSON document:\n%s\nstderr:\n%s"
                                 % (self.stdout, self.stderr)) from None

    def host(self, name: str) -> dict[str, Any]:
        """The JSON document's entry for one host."""
        hosts = [h for h in self.json()["hosts"] if h["host"] == name]
        assert len(hosts) == 1, "host %s appears %d times in %s" % (name, len(hosts), self.stdout)
        return hosts[0]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __str__(self) -> str:
        return "gpufleet %s -> exit %d after %.2fs\n--- stdout\n%s--- stderr\n%s" % (
            " ".join(self.argv), self.rc, self.seconds, self.stdout, self.stderr)


def run_gpufleet(home: Path, inventory: Optional[Path], *args: str, timeout: float = 180,
                 stdin: Optional[str] = None) -> CliRun:
    """`gpufleet -i INVENTORY ARGS...` with HOME=home; stdin is not a terminal."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env["HOME"] = str(home)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    argv = (["-i", str(inventory)] if inventory is not None else []) + [str(a) for a in args]
    started = time.monotonic()
    res = subprocess.run(GPUFLEET + argv, capture_output=True, text=True, env=env, timeout=timeout,
                         input=stdin if stdin is not None else "", cwd=str(home))
    return CliRun(argv, res.returncode, res.stdout, res.stderr, time.monotonic() - started)


def assert_no_traceback(run: CliRun) -> None:
    assert "Traceback" not in run.output, str(run)


def assert_one_line_error(run: CliRun, *fragments: str) -> str:
    """Exit 2, stderr exactly one `gpufleet: error: ...` line holding every fragment."""
    assert run.rc == 2, str(run)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpufleet: error: "), str(run)
    for fragment in fragments:
        assert fragment in lines[0], str(run)
    assert_no_traceback(run)
    return lines[0]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A private HOME for one test (audit log, known_hosts, ~/.ssh all start empty)."""
    path = tmp_path / "home"
    path.mkdir()
    return path


# --- tables -----------------------------------------------------------------------------------


def parse_table(text: str, first_header: str) -> list[dict[str, str]]:
    """Rows of the tabulate table whose header line starts with ``first_header``.

    A line whose first cell is empty continues the row above (multi-line cells, e.g. several
    holders of one GPU); continued cells are joined with newlines. Parsing stops at the first
    line after the table that does not fit (the summary line, reasons).
    """
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(first_header) and i + 1 < len(lines) and set(lines[i + 1]) <= {"-", " "}:
            break
    else:
        raise AssertionError("no table with header %r in:\n%s" % (first_header, text))
    header, dashes = lines[i], lines[i + 1]
    spans = []
    start = None
    for pos, ch in enumerate(dashes + " "):
        if ch == "-" and start is None:
            start = pos
        elif ch != "-" and start is not None:
            spans.append((start, pos))
            start = None
    names = [header[a:b].strip() for a, b in spans]
    rows: list[dict[str, str]] = []
    for line in lines[i + 2:]:
        if not line.strip() or len(line) > len(dashes) + 1:
            break
        cells = [line[a:b].strip() for a, b in spans]
        if any(line[b:b + 1].strip() for a, b in spans[:-1]):
            break  # text across a column gap: not a table line
        if cells[0] == "" and rows:
            for name, cell in zip(names, cells):
                if cell:
                    rows[-1][name] = (rows[-1][name] + "\n" + cell) if rows[-1][name] else cell
            continue
        rows.append(dict(zip(names, cells)))
    return rows


def lines_after_table(text: str, first_header: str) -> list[str]:
    """The lines printed after the table (summary, reasons)."""
    rows = parse_table(text, first_header)
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header))
    # header + dashes + each row's lines
    n = 2
    for row in rows:
        n += max(len(cell.split("\n")) for cell in row.values())
    return lines[start + n:]


# --- host keys ------------------------------------------------------------------------------


def sha256_fingerprint(host_key_line: str) -> str:
    """`SHA256:...` of a known_hosts line's key, as OpenSSH prints it (computed here, not by
    gpufleet, so the test can catch a wrong fingerprint)."""
    blob = base64.b64decode(host_key_line.split()[2])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


# --- host processes ---------------------------------------------------------------------------


def sshd_pid(host: Any) -> int:
    """The host's listening sshd (its PidFile)."""
    return int(host.path("/run/gflab/sshd.pid").read_text().split()[0])


def host_pids(host: Any) -> dict[int, list[str]]:
    """Every live process of the host: pid -> argv."""
    out = {}
    for entry in host.path("/proc").iterdir():
        if entry.name.isdigit() and host.alive(int(entry.name)):
            try:
                out[int(entry.name)] = host.cmdline(int(entry.name))
            except OSError:
                continue
    return out


def wait_for(cond: Any, timeout: float = 15.0, what: str = "condition") -> None:
    """Poll for lab set-up (not a timing assertion): fail only if it never happens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("timed out waiting for %s" % what)


def signals_of(doc: dict[str, Any], pid: int) -> list[tuple[str, str]]:
    """(signal, outcome) pairs the agent reported for one pid, in order."""
    return [(s["signal"], s["outcome"]) for s in doc["signals"] if s["pid"] == pid]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def audit_signals(path: Path) -> list[dict[str, Any]]:
    """The signal lines of an audit log (each clean also appends one verdict line)."""
    return [r for r in read_jsonl(path) if r.get("event") != "verdict"]
