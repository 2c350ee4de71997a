"""gpufleet.remote: the constant bootstrap argv of docs/DESIGN.md, the stdin framing, and the
agent's pieces joined into the one payload a host execs."""
from __future__ import annotations

import ast
import hashlib
import json
import shlex
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from gpufleet.remote import (AGENT_PIECES, JOINED_MARK, agent_key, agent_source,
                             bootstrap_command, encode_request, join_pieces, loader_source,
                             piece_source)

REPO = Path(__file__).resolve().parents[2]

NASTY = "$(touch PWNED) `touch PWNED2`; rm -rf / | cat && echo 'q\" \\ \n\0 ünï"


def design_command():
    """The command line exactly as docs/DESIGN.md spells it."""
    for line in (REPO / "docs" / "DESIGN.md").read_text().splitlines():
        if line.strip().startswith("[sudo -n] PYTHON -"):
            return shlex.split(line.strip()[len("[sudo -n] "):])
    raise AssertionError("bootstrap command not found in DESIGN.md")


def test_argv_is_exactly_the_design():
    design = design_command()
    assert design[:5] == ["PYTHON", "-S", "-E", "-s", "-c"] and len(design) == 6
    assert bootstrap_command("PYTHON") == design
    assert bootstrap_command("/opt/py/bin/python3", sudo=True) == \
        ["sudo", "-n", "/opt/py/bin/python3"] + design[1:]
    assert bootstrap_command() == ["python3"] + design[1:]


# Every public function and class of gpufleet/remote/agent.py before it was split into pieces
# (the pieces each hold one concern), and its public constants: the joined payload still defines them all (but
# DEFAULT_LOCK, the lock in /tmp that any user could hold: remote/lock.py's names below
# replace it).
SINGLE_FILE_FUNCTIONS = (
    "AgentDeadline", "Auditor", "CmdResult", "Deadline", "Job", "ParseError", "acquire_lock",
    "ancestors_of", "attach_minors", "check_complete", "classify_survivor", "clean", "clean_shm",
    "container_facts", "container_from_cgroup_text", "container_of", "denied_reasons",
    "denied_warning", "device_target", "emit", "empty_clean_doc", "exited", "find_nvidia_smi",
    "first_line", "fmt_seconds", "format_cmdline", "gpu_minors_from_proc", "gpu_query_argv",
    "has_exited", "hidepid_active", "is_kernel_thread", "is_wsl2", "leader_gone_fd_dirs", "main",
    "mapped_devices", "na", "normalize_bus_id", "parse_apps_csv", "parse_cgroup", "parse_gpu_csv",
    "parse_int", "parse_maps_devices", "parse_proc_information", "parse_q_minors",
    "parse_request", "parse_stat", "parse_status_uid", "parse_versions", "process_entry",
    "python_too_old", "query_gpus", "query_used", "read_bytes", "read_bytes_bounded", "read_stat",
    "read_text", "refusal", "reset_gpus", "reset_refusal", "run_cmd", "scan_fds", "self_context",
    "send_signal", "smi_failure", "snapshot", "split_row", "stop_units", "stuck_thread",
    "user_name", "valid_unit", "wait_exit", "wait_memory", "which",
)
SINGLE_FILE_CONSTANTS = (
    "AGENT_VERSION", "APP_FIELDS", "BUS_RE", "CMDLINE_MAX", "CUDA_RE", "DEV", "DEVICE_RE",
    "DRIVER_RE", "GPU_DEVICE_RE", "GPU_FIELDS", "GPU_KEYS", "INT_FIELDS", "INT_RE",
    "INVALID_FIELD_RE", "MAPS_LIMIT", "MAPS_TIMEOUT_S", "OPTIONAL_GPU_FIELDS", "PF_KTHREAD",
    "PROC", "Q_HEADER_RE", "Q_KV_RE", "REQUIRED_GPU_FIELDS", "SHM_LEFTOVER_RE", "SMI_FALLBACKS",
    "SYSTEMCTL_FALLBACKS", "UNIT_RE",
)
# The host lock's piece (remote/lock.py): only its owner can create or open the lock.
LOCK_NAMES = (
    "HOLDER_CMDLINE_MAX", "LockRefused", "ROOT_LOCK", "USER_LOCK", "default_lock_path",
    "has_open", "lock_for_clean", "lock_holder", "open_lock", "open_lock_dir",
    "ownership_problem", "parse_lock_line", "runtime_dir", "wait_flock",
)


def payload_tree() -> ast.Module:
    return ast.parse(agent_source().decode("utf-8"), "gpufleet-agent")


def test_payload_compiles_and_defines_everything_the_single_file_did():
    compile(agent_source(), "gpufleet-agent", "exec")
    tree = payload_tree()
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    assert sorted(set(SINGLE_FILE_FUNCTIONS) - defined) == []
    assert sorted(set(SINGLE_FILE_CONSTANTS) - assigned) == []
    assert sorted(set(LOCK_NAMES) - defined - assigned) == []


def test_payload_has_no_import_of_a_piece_left():
    tree = payload_tree()
    relative = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    ours = [m for m in modules if m.split(".")[0] in ("gpufleet",) + AGENT_PIECES]
    assert relative == [] and ours == []
    assert JOINED_MARK.encode() not in agent_source()


def test_payload_is_the_pieces_in_order_without_their_marked_imports():
    text = agent_source().decode("utf-8")
    at = 0
    for name in AGENT_PIECES:
        source = piece_source(name)
        imports = [range(n.lineno - 1, n.end_lineno or n.lineno) for n in ast.parse(source).body
                   if isinstance(n, ast.ImportFrom) and n.level]
        kept = "".join(line for i, line in enumerate(source.splitlines(keepends=True))
                       if not any(i in span for span in imports))
        i = text.find(kept, at)
        assert i >= 0, "%s.py is not in the payload after the pieces before it" % name
        at = i + len(kept)
    assert agent_source() is agent_source()  # joined once per process (remote.once)


@pytest.mark.parametrize("source", [
    "from .parse import first_line\n",  # not marked
    "def f():\n    from .parse import first_line  # joined\n",  # not at the top level
])
def test_joiner_refuses_an_import_it_would_not_drop(source):
    with pytest.raises(ValueError, match="marked"):
        join_pieces([("parse", "X = 1\n"), ("broken", source)])


def test_joiner_drops_marked_imports_also_in_parentheses():
    joined = join_pieces([("a", "X = 1\n"),
                          ("b", "from .a import (  # joined\n    X,\n)\nY = X\n")])
    ns: dict = {}
    exec(compile(joined, "joined", "exec"), ns)
    assert ns["Y"] == 1 and "import" not in joined


def test_encode_request_framing_keeps_metacharacters_as_data():
    request = {"mode": "clean", "operator": NASTY, "units": [{"unit": NASTY}]}
    data = encode_request(request)
    n = data.index(b"\n")
    head = data[:n].split()
    loader, k, m = (int(x) for x in head[:3])
    assert head[3].decode() == agent_key() == hashlib.blake2b(agent_source(),
                                                              digest_size=16).hexdigest()
    at = n + 1
    assert data[at : at + loader] == loader_source() == piece_source("loader").encode()
    at += loader
    assert zlib.decompress(data[at : at + k]) == agent_source()
    assert k < len(agent_source()) // 2  # sent compressed
    assert len(data) == at + k + m  # every part by length: nothing after them
    assert json.loads(data[at + k :]) == request


def test_bootstrap_reads_by_length_and_leaves_stdin_open():
    """The agent and request are read by their lengths, not to end of file: a one-shot
    snapshot answers while the controller still holds stdin open (what watch mode needs)."""
    proc = subprocess.Popen(bootstrap_command(sys.executable), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        proc.stdin.write(encode_request({"mode": "snapshot", "deadline_s": 20}))
        proc.stdin.flush()  # and NOT closed
        line = proc.stdout.readline()
        assert json.loads(line)["mode"] == "snapshot"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


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


def test_once_computes_once_while_many_threads_ask_at_the_same_time() -> None:
    """Every host's thread asks for the agent at the start of a fan-out: one join, not one
    per thread (an lru_cache computes in each caller until the first one has finished)."""
    import threading
    import time

    from gpufleet.remote import once

    calls = []

    @once
    def slow() -> object:
        calls.append(1)
        time.sleep(0.05)
        return object()

    start = threading.Barrier(8)
    got: list = []

    def ask() -> None:
        start.wait()
        got.append(slow())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 8 and all(g is got[0] for g in got)
    assert slow.ready
