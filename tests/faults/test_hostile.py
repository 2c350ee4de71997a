"""Hostile input: process titles and command lines, inventory values, command-line options
and runbook variables carrying shell metacharacters, quotes, newlines, terminal escapes,
non-UTF-8 bytes and 100 kB lengths.

Each payload would create a canary file if any layer ever ran it as shell text; the canary
must never appear (locally or in any lab host). Processes with hostile names are cleaned or
spared exactly as their GPU evidence says, and the census proves which are alive. Every
payload tried is counted in the session ledger (faultkit.LEDGER.hostile_inputs).
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from faultkit import (
    LEDGER,
    Canary,
    agent_audit,
    assert_gone_exactly,
    assert_no_traceback,
    census,
    real_python,
    run_cli,
    run_on_pty,
    settle,
    signals,
    wait_for,
)

CMDLINE_MAX = 4096  # what the agent keeps of a command line (gpufleet/remote/agent.py)

# fakecuda with extra, hostile argv: they stay in /proc/PID/cmdline, fakecuda never sees them
HOLD = ("import runpy, sys; sys.argv = ['fakecuda.py', '--detach', '--gpus', sys.argv[1], "
        "'--mib', sys.argv[2]]; runpy.run_path('/run/gflab/fakecuda.py', run_name='__main__')")
ESC = "\x1b"


def titles(canary: Canary) -> list:
    """Process titles (setproctitle + prctl, as vLLM renames itself)."""
    return canary.payloads() + [
        "\x1b[2J\x1b[1;31mFAKE OK\x1b[0m",  # clears the operator's screen, paints a lie
        "VLLM::Worker\r\nnet-ok 0 0 0 - - clean",  # a forged table row
        ") S 1 1 1 (",  # /proc/PID/stat's comm delimiters
        "ünïcödé ✓ 日本語 " + "x" * 40,
    ]


def raw_argvs(canary: Canary) -> list:
    """Command-line words as raw bytes: undecodable, huge, multi-line."""
    c = canary.path.encode()
    return [
        [b"\xff\xfe\x80 invalid utf-8 \xc3\x28", b"caf\xe9 $(touch " + c + b")"],
        [b"A" * 100_000],
        [b"x" * 50_000 + b"$(touch " + c + b")", b"y" * 50_000],
        [b"line1\nline2\n`touch " + c + b"`\n", b"'\"\\"],
        [b"--protect", b"*", b"--gpus", b"all", b"; touch " + c],
    ]


def spawn_raw(host: Any, gpu: int, mib: int, extra: list) -> int:
    res = host.exec([real_python(), "-c", HOLD, str(gpu), str(mib)] + extra, timeout=60)
    assert res.returncode == 0, res.stderr
    return int(json.loads(res.stdout.strip().splitlines()[-1])["pid"])


def expected_cmdline(argv: list) -> str:
    """/proc/PID/cmdline as the agent reports it: NULs as spaces, UTF-8 with replacement."""
    raw = b"\0".join(a if isinstance(a, bytes) else a.encode() for a in argv)
    return raw.replace(b"\0", b" ").rstrip(b" ").decode("utf-8", "replace")[:CMDLINE_MAX]


@pytest.fixture(scope="module")
def module_canary(tmp_path_factory: Any) -> Canary:
    return Canary(tmp_path_factory.mktemp("hostile-home"))


@pytest.fixture(scope="module")
def hostile_host(lab: Any, module_canary: Canary) -> Any:
    """A host whose GPU 0 holders, GPU 1 holders and CPU-only bystanders all carry hostile
    titles or command lines (shared by the two tests below: status first, then clean)."""
    canary = module_canary
    host = lab.add_host("hostile", gpus=2)
    host.gpu0, host.gpu1, host.cpu, host.argv, host.title = [], [], [], {}, {}
    for n, title in enumerate(titles(canary)):
        host.gpu0.append(host.spawn_holder(gpus=[0], mib=100 + n, title=title, via="exec"))
        host.gpu1.append(host.spawn_holder(gpus=[1], mib=100 + n, title=title, via="exec"))
        host.cpu.append(host.spawn_holder(gpus=[], mib=0, title=title, no_devices=True,
                                          via="exec"))
        host.title.update({host.gpu0[-1]: title, host.gpu1[-1]: title, host.cpu[-1]: title})
    LEDGER.hostile("process title", 3 * len(titles(canary)))
    for n, extra in enumerate(raw_argvs(canary)):
        pid = spawn_raw(host, 0, 50 + n, extra)
        host.gpu0.append(pid)
        host.argv[pid] = [real_python(), "-c", HOLD, "0", str(50 + n)] + extra
    LEDGER.hostile("raw command line", len(raw_argvs(canary)))
    settle(host)
    host.before = census(host)
    yield host
    host.stop()


def test_hostile_process_names_are_data_in_status(hostile_host: Any, lab: Any, home: Path,
                                                  module_canary: Canary) -> None:
    host, canary = hostile_host, module_canary
    inv = lab.inventory_yaml([host])
    run = run_cli(home, inv, "status", "--json")
    assert run.rc == 0, str(run)
    doc = run.host("hostile")
    procs = {p["pid"]: p for g in doc["gpus"] for p in g["processes"]}
    assert set(procs) == set(host.gpu0) | set(host.gpu1)
    for pid, title in host.title.items():
        if pid not in host.cpu:
            assert procs[pid]["cmdline"] == title, (pid, procs[pid])
    for pid, argv in host.argv.items():
        assert procs[pid]["cmdline"] == expected_cmdline(argv), pid
        assert len(procs[pid]["cmdline"]) <= CMDLINE_MAX
    table = run_on_pty(home, inv, "status")  # on a terminal: click strips nothing there
    assert table.rc == 0, str(table)
    assert ESC not in table.stdout, "raw escapes reach the terminal:\n" + table.stdout
    # a title's newline must not start a line of its own: the forged row never appears
    assert not any(line.startswith(("net-ok", "touch ")) for line in table.stdout.splitlines())
    assert canary.found([host]) == []
    assert_gone_exactly(host, host.before, set())


def test_hostile_process_names_are_cleaned_by_evidence_only(hostile_host: Any, lab: Any,
                                                            home: Path,
                                                            module_canary: Canary) -> None:
    host, canary = hostile_host, module_canary
    glob = host.title[host.gpu0[0]]  # "$(touch /tmp/gf-canary-...)", itself hostile
    # no * ? [ in it: a word, so it protects every command line that contains it (that title,
    # and the raw command line "caf\xe9 $(touch ...)"), as pgrep would find them
    protected = {pid for pid in host.gpu0
                 if glob in (host.title.get(pid) or expected_cmdline(host.argv[pid]))}
    assert host.gpu0[0] in protected and len(protected) == 2, protected
    LEDGER.hostile("protect glob", 1)
    inv = lab.inventory_yaml([host])
    dry = run_on_pty(home, inv, "clean", "--host", "hostile", "--gpus", "0", "--dry-run",
                     "--protect", glob)
    assert dry.rc == 0, str(dry)
    assert ESC not in dry.stdout, "raw escapes reach the terminal:\n" + dry.stdout
    run = run_cli(home, inv, "clean", "--host", "hostile", "--gpus", "0", "--yes", "--json",
                  "--protect", glob, "--grace", "2")
    doc = run.host("hostile")
    assert sorted((r["pid"], r["reason"]) for r in doc["refused"]) == sorted(
        (pid, "protected by %r" % glob) for pid in protected)
    expected = set(host.gpu0) - protected
    assert {t["pid"] for t in doc["targets"]} == expected
    assert sorted(signals(doc["signals"])) == sorted((p, "TERM", "sent") for p in expected)
    assert run.rc == 1, str(run)  # the protected holder keeps GPU 0 busy: dirty
    assert doc["verdict"] == "dirty"
    cmdlines = {r["pid"]: r["cmdline"] for r in agent_audit(host)}
    for pid, argv in host.argv.items():  # the host-side audit keeps the exact words
        if pid in expected:
            assert cmdlines[pid] == expected_cmdline(argv)
    assert canary.found([host]) == []
    assert_gone_exactly(host, host.before, expected)


# --------------------------------------------------------------------------- inventory values


def gpufleet_main(*argv: str) -> tuple:
    """The CLI in-process: (exit code, stdout, stderr); never lets an exception escape."""
    from gpufleet.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: Any = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


REJECTED_FIELDS = ("name", "address", "user", "python", "tag", "group", "port")


def inventory_with(field: str, value: str) -> dict:
    host: dict = {"address": "127.0.0.1", "port": 22}
    doc: dict = {"hosts": {"h1": host}}
    if field == "name":
        doc["hosts"] = {value: host}
    elif field == "tag":
        host["tags"] = [value]
    elif field == "group":
        doc["groups"] = {value: ["h1"]}
    elif field == "port":
        host["port"] = value
    else:
        host[field] = value
    return doc


def test_hostile_names_users_and_addresses_are_refused(tmp_path: Path, canary: Canary,
                                                       monkeypatch: Any) -> None:
    """Fields that name things (and become SSH parameters) refuse shell text outright: one
    line, exit 2, nothing contacted."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    tried = 0
    for payload in canary.payloads():
        for field in REJECTED_FIELDS:
            path = tmp_path / "fleet.yaml"
            path.write_text(yaml.safe_dump(inventory_with(field, payload)))
            for command in (["hosts"], ["status"], ["clean", "--all", "--yes"]):
                code, out, err = gpufleet_main("-i", str(path), *command)
                lines = [ln for ln in err.splitlines() if ln.strip()]
                assert code == 2 and len(lines) == 1, (field, payload, command, err)
                assert lines[0].startswith("gpufleet: error: %s:" % path), lines
                assert "Traceback" not in out + err
            tried += 1
    LEDGER.hostile("inventory name/user/address", tried)
    assert canary.found() == []


def test_hostile_paths_and_globs_are_data(lab: Any, make_host: Any, home: Path,
                                          canary: Canary) -> None:
    """Paths and protect globs are accepted as written and used as data: a key file or
    known_hosts file that does not exist, an nvidia-smi that is not there, a glob that matches
    nothing. The host is reached (or not) for those reasons alone; nothing runs."""
    host = make_host("paths", gpus=1)
    job = host.spawn_holder(gpus=[0], mib=800, title="job")
    settle(host)
    before = census(host)
    payloads = canary.payloads()
    entries = {}
    for n, p in enumerate(payloads):
        flat = p.replace("\n", " ")  # a path or glob may not hold control characters
        entries["key-%d" % n] = lab.host_entry(host, identity_file=str(home / flat))
        entries["kh-%d" % n] = lab.host_entry(host, known_hosts_file=str(home / flat))
        entries["smi-%d" % n] = lab.host_entry(host, nvidia_smi="/opt/" + flat)
    entries["globs"] = lab.host_entry(host, protect=[p.replace("\n", " ") for p in payloads])
    LEDGER.hostile("inventory path/glob", 3 * len(payloads) + len(payloads))
    inv = home / "fleet.yaml"
    inv.write_text(yaml.safe_dump({"hosts": entries, "defaults": {"connect_timeout": 5}}))
    status = run_cli(home, inv, "--forks", "8", "status", "--json")
    assert status.rc == 1, str(status)
    assert_no_traceback(status)
    for n, p in enumerate(payloads):
        flat = p.replace("\n", " ")
        key = status.host("key-%d" % n)["error"]
        assert key.startswith("authentication failed for root@") and "not found" in key, key
        assert status.host("kh-%d" % n)["error"].startswith("unknown host key for ")
        assert status.host("smi-%d" % n)["error"] == "nvidia-smi not found: /opt/" + flat
    assert status.host("globs")["ok"] is True
    run = run_cli(home, inv, "clean", "--yes", "--json", "--host", "globs")
    assert run.rc == 0, str(run)
    assert signals(run.host("globs")["signals"]) == [(job, "TERM", "sent")]
    assert canary.found([host]) == []
    assert_gone_exactly(host, before, {job})


def test_hostile_command_line_options(lab: Any, make_host: Any, home: Path, canary: Canary,
                                      monkeypatch: Any) -> None:
    """--host globs, --gpus lists, -g, --tag and --audit-log paths with shell text."""
    host = make_host("opts", gpus=1)
    job = host.spawn_holder(gpus=[0], mib=800, title="job")
    settle(host)
    before = census(host)
    inv = lab.inventory_yaml([host])
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    tried = 0
    for payload in canary.payloads():
        for option in ("--host", "--group", "--tag", "--gpus"):
            code, out, err = gpufleet_main("-i", str(inv), "clean", "--yes", option, payload)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert code == 2 and len(lines) == 1, (option, payload, out, err)
            assert lines[0].startswith("gpufleet: error: ") and out == "", (out, err)
            tried += 1
    LEDGER.hostile("command-line option", tried)
    audit = home / "logs" / canary.payloads()[0]  # a directory named "$(touch /tmp" ...
    LEDGER.hostile("audit-log path", 1)
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json", "--audit-log", audit)
    assert run.rc == 0, str(run)
    assert signals(json.loads(line) for line in audit.read_text().splitlines()) == [
        (job, "TERM", "sent")]
    assert canary.found([host]) == []
    assert_gone_exactly(host, before, {job})


# --------------------------------------------------------------------------- runbooks


def test_hostile_runbook_variables_are_data(lab: Any, make_host: Any, home: Path,
                                            canary: Canary) -> None:
    """-e values reach a shell step's command as ONE quoted word and an argv step as one
    argument: the host receives each value byte for byte, and nothing runs."""
    host = make_host("runbook", gpus=1)
    payloads = canary.payloads() + ["", "-n", "--", "'", '"', "\\", "$", "{{ V0 }}"]
    steps = []
    args = []
    for n, value in enumerate(payloads):
        steps.append({"name": "shell %d" % n, "kind": "shell",
                      "command": "printf %%s {{ V%d }} > /tmp/rb-shell-%d" % (n, n)})
        steps.append({"name": "argv %d" % n, "kind": "shell",
                      "argv": ["/bin/sh", "-c", 'printf %s "$1" > /tmp/rb-argv-' + str(n), "sh",
                               "{{ V%d }}" % n]})
        args += ["-e", "V%d=%s" % (n, value)]
    book = home / "hostile.yaml"
    book.write_text(yaml.safe_dump({"name": "hostile", "steps": steps}))
    LEDGER.hostile("runbook variable", 2 * len(payloads))
    inv = lab.inventory_yaml([host])
    run = run_cli(home, inv, "run", str(book), "--all", "--yes", "--json", *args)
    assert run.rc == 0, str(run)
    for n, value in enumerate(payloads):
        assert host.path("/tmp/rb-shell-%d" % n).read_text() == value, n
        assert host.path("/tmp/rb-argv-%d" % n).read_text() == value, n
    assert canary.found([host]) == []


@pytest.mark.parametrize("kind,field", [
    ("stop_units", "units"), ("start_unit", "unit"), ("clean", "gpus"), ("clean", "protect"),
    ("wait_http", "url"), ("wait_free", "gpus")])
def test_hostile_runbook_variables_in_typed_fields(lab: Any, home: Path, canary: Canary,
                                                   kind: str, field: str,
                                                   monkeypatch: Any) -> None:
    """A value that must be a unit, GPU list or URL is validated after substitution: one line,
    exit 2, no host contacted (the inventory's only host does not even exist)."""
    dead = lab.dead_host("typed-dead")
    inv = lab.inventory_yaml([dead])
    step: dict = {"kind": kind, field: "{{ V }}"}
    if field == "protect":
        step[field] = ["{{ V }}"]
    if kind == "wait_free":
        step["min_free_mib"] = 1
    book = home / "typed.yaml"
    book.write_text(yaml.safe_dump({"steps": [step]}))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    for payload in canary.payloads():
        code, out, err = gpufleet_main("-i", str(inv), "run", str(book), "--all", "--yes",
                                       "-e", "V=" + payload)
        if field == "protect" and "\n" not in payload:  # globs are data: accepted, then the
            assert code == 1 and "connection refused" in out + err, (out, err)  # host is dead
        else:
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert code == 2 and len(lines) == 1, (payload, out, err)
            assert lines[0].startswith("gpufleet: error: %s:" % book), lines
        assert "Traceback" not in out + err
    LEDGER.hostile("runbook typed field", len(canary.payloads()))
    assert canary.found() == []


# --------------------------------------------------------------------------- forged CSV rows


def start_detached(host: Any, argv: list, user: str = "root") -> int:
    """``argv`` in the host, detached (its parent becomes the host's init); its pid."""
    script = '"$@" </dev/null >/dev/null 2>&1 & echo $!'
    res = host.exec(["setsid", "sh", "-c", script, "sh"] + argv, user=user, check=True)
    pid = int(res.stdout.strip().splitlines()[-1])
    wait_for(lambda: host.comm(pid) == argv[0].rsplit("/", 1)[-1], 10, "%s started" % argv[0])
    return pid


def test_an_unprivileged_title_cannot_aim_a_clean_at_root_processes(lab: Any, make_host: Any,
                                                                    home: Path) -> None:
    """uid 65534 titles its GPU job like rows of nvidia-smi's CSV naming two root processes
    that hold no GPU memory: a plain sleep, and a GPU monitor (every /dev/nvidiaN open,
    nothing mapped). Where nvidia-smi printed a name's commas verbatim, that forged rows: the
    clean signalled the monitor. The agent now asks nvidia-smi for no process name, so no row
    names them: status lists the real holders with their real memory, the clean never aims
    at the victims, and the attacker's job is judged by its own evidence (listed, its GPU's
    device file open, a CUDA context): cleaned, as root may."""
    host = make_host("forged", gpus=2, nvml=False)  # a forged row exists only in nvidia-smi's CSV
    sleeper = start_detached(host, ["sleep", "100000"])
    monitor = host.spawn_monitor(title="gpu-exporter", via="exec")
    uuid0 = host.smi("--query-gpu=uuid", "--format=csv,noheader").stdout.split()[0]
    title = "x, 100, %s\n%d, a, 3000, %s\n%d, b" % (uuid0, sleeper, uuid0, monitor)
    attacker = host.spawn_holder(gpus=[0], mib=3000, title=title, user="nobody", via="exec")
    honest = host.spawn_holder(gpus=[1], mib=900, title="honest", via="exec")
    assert host.cmdline(attacker)[0] == title and host.ssh(  # the premise: uid 65534's title
        ["stat", "-c", "%u", "/proc/%d" % attacker]).stdout.strip() == "65534"
    LEDGER.hostile("forged nvidia-smi row", 1)
    settle(host)
    before = census(host)
    victims = {sleeper, monitor}
    inv = lab.inventory_yaml([host])
    status = run_cli(home, inv, "status", "--json")
    assert status.rc == 0, str(status)
    gpus = status.host("forged")["gpus"]
    assert [[(p["pid"], p["used_mib"]) for p in g["processes"]] for g in gpus] == [
        [(attacker, 3000)], [(honest, 900)]]
    assert [g["attributed_mib"] for g in gpus] == [3000, 900]
    assert [p["listing"] for g in gpus for p in g["processes"]] == ["verified", "verified"]
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json", "--gpus", "0", "--grace", "2")
    doc = run.host("forged")
    assert not victims & {s["pid"] for s in doc["signals"]}, doc["signals"]
    assert not victims & ({t["pid"] for t in doc["targets"]} | {r["pid"] for r in doc["refused"]})
    assert [(t["pid"], t["evidence"], t["used_mib"]) for t in doc["targets"]] == [
        (attacker, "nvidia-smi", 3000)]
    assert [c["pid"] for c in doc["clients"]] == [monitor]  # a GPU client, left alone
    assert run.rc == 0, str(run)
    assert_gone_exactly(host, before, {attacker})
    assert all(host.alive(p) for p in victims | {honest})


def test_a_title_with_a_newline_does_not_blind_gpufleet(lab: Any, make_host: Any,
                                                        home: Path) -> None:
    """A process named "a\\nb" splits its nvidia-smi row in two; the rest of the host must
    still be readable and cleanable (one user must not blind the operator)."""
    host = make_host("newline", gpus=2)
    odd = host.spawn_holder(gpus=[0], mib=1200, title="first line\nsecond, line")
    job = host.spawn_holder(gpus=[1], mib=800, title="job")
    LEDGER.hostile("newline in process name", 1)
    settle(host)
    before = census(host)
    inv = lab.inventory_yaml([host])
    status = run_cli(home, inv, "status", "--json")
    assert status.rc == 0, str(status)
    gpus = status.host("newline")["gpus"]
    assert [[(p["pid"], p["used_mib"]) for p in g["processes"]] for g in gpus] == [
        [(odd, 1200)], [(job, 800)]]
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 0, str(run)
    assert sorted(signals(run.host("newline")["signals"])) == sorted(
        [(odd, "TERM", "sent"), (job, "TERM", "sent")])
    assert_gone_exactly(host, before, {odd, job})
