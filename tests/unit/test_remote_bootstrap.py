"""gpufleet.remote: the constant bootstrap argv of docs/DESIGN.md and the stdin framing."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import zlib
from pathlib import Path

from gpufleet.remote import agent_source, bootstrap_command, encode_request

REPO = Path(__file__).resolve().parents[2]

NASTY = "$(touch PWNED) `touch PWNED2`; rm -rf / | cat && echo 'q\" \\ \n\0 ünï"


def design_command():
    """The command line exactly as docs/DESIGN.md spells it."""
    for line in (REPO / "docs" / "DESIGN.md").read_text().splitlines():
        if line.strip().startswith("[sudo -n] PYTHON -c '"):
            return shlex.split(line.strip()[len("[sudo -n] "):])
    raise AssertionError("bootstrap command not found in DESIGN.md")


def test_argv_is_exactly_the_design():
    design = design_command()
    assert design[:2] == ["PYTHON", "-c"] and len(design) == 3
    assert bootstrap_command("PYTHON") == design
    assert bootstrap_command("/opt/py/bin/python3", sudo=True) == \
        ["sudo", "-n", "/opt/py/bin/python3"] + design[1:]
    assert bootstrap_command() == ["python3"] + design[1:]


def test_agent_source_is_the_file():
    assert agent_source() == (REPO / "gpufleet" / "remote" / "agent.py").read_bytes()


def test_encode_request_framing_keeps_metacharacters_as_data():
    request = {"mode": "clean", "operator": NASTY, "units": [{"unit": NASTY}]}
    data = encode_request(request)
    n = data.index(b"\n")
    k = int(data[:n])
    assert zlib.decompress(data[n + 1 : n + 1 + k]) == agent_source()
    assert k < len(agent_source()) // 2  # sent compressed
    assert json.loads(data[n + 1 + k :]) == request


def test_bootstrap_runs_through_a_shell_and_directly(tmp_path):
    """SSH hands the command to the remote shell: one shell parse must give back the argv;
    the request (with shell metacharacters) travels on stdin and is never evaluated."""
    payload = encode_request({"mode": "snapshot", "deadline_s": 10,
                              "nvidia_smi": str(tmp_path / NASTY.replace("\0", "")),
                              "operator": NASTY})
    argv = bootstrap_command(sys.executable)
    for cmd in (argv, ["sh", "-c", " ".join(shlex.quote(a) for a in argv)]):
        out = subprocess.run(cmd, input=payload, stdout=subprocess.PIPE, cwd=str(tmp_path),
                             timeout=60, check=True).stdout
        doc = json.loads(out)
        assert doc["agent_version"] == 1 and doc["mode"] == "snapshot"
        assert doc["nvidia_smi"]["error"].startswith("nvidia-smi not found")
    assert not list(tmp_path.glob("PWNED*"))
