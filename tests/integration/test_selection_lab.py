"""Commands that change hosts need hosts named; protect patterns match as an operator expects.

`clean`, `run` with a runbook that changes hosts and `slurm undrain` refuse to run without
--host, -g, --tag or --all (one line, exit 2, nothing connected, nothing signalled), while the
read-only commands keep acting on every host. `--protect WORD` protects a command line that
contains WORD (as pgrep matches); a pattern that matches no process is a note in the plan.
Real CLI, real sshd lab hosts, real holder processes; every test checks who is still alive.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cli_helpers import (  # noqa: F401  (home: fixture)
    assert_no_traceback,
    assert_one_line_error,
    home,
    read_jsonl,
    run_gpufleet,
)

SELECT = "name them with --host NAME, -g GROUP, --tag TAG or --all"
FAST = ("--grace", "1", "--timeout", "15")
TRAINER = "python3 train_dflash.py --lr 3e-4"


def logins(*hosts: Any) -> list[int]:
    """SSH logins each host accepted so far (its sshd log): did anything connect?"""
    return [(h.dir / "sshd.log").read_text().count("Accepted publickey") for h in hosts]


def audit_of(home: Path) -> list[dict[str, Any]]:
    path = home / ".local" / "state" / "gpufleet" / "audit.jsonl"
    return read_jsonl(path) if path.exists() else []


def pair(lab: Any, make_host: Any) -> tuple[Any, Any, Path]:
    a = make_host("sel-a", gpus=2)
    a.holder = a.spawn_holder(gpus=[0], mib=3000, title="trainer")
    b = make_host("sel-b", gpus=1)
    b.holder = b.spawn_holder(gpus=[0], mib=2000, title="server")
    inv = lab.inventory_yaml([a, b], groups={"both": [a, b]}, **{"sel-b": {"tags": ["infer"]}})
    return a, b, inv


def test_clean_without_hosts_named_is_one_line_and_touches_nothing(lab: Any, make_host: Any,
                                                                   home: Path) -> None:
    a, b, inv = pair(lab, make_host)
    before = logins(a, b)
    for args in (["--yes"], ["--yes", "--json"], ["--gpus", "0", "--yes", *FAST], ["--dry-run"]):
        run = run_gpufleet(home, inv, "clean", *args, timeout=60)
        line = assert_one_line_error(run, SELECT)
        assert line == f"gpufleet: error: clean changes hosts: {SELECT}", str(run)
        assert run.stdout == "", str(run)
    assert logins(a, b) == before  # nothing connected, so nothing was planned or signalled
    assert a.alive(a.holder) and b.alive(b.holder)
    assert audit_of(home) == []

    # the read-only commands still default to every host
    status = run_gpufleet(home, inv, "status", "--json", timeout=60)
    assert status.rc == 0 and [h["host"] for h in status.json()["hosts"]] == ["sel-a", "sel-b"]
    hosts = run_gpufleet(home, inv, "hosts", timeout=60)
    assert hosts.rc == 0 and "sel-a" in hosts.stdout and "sel-b" in hosts.stdout, str(hosts)

    # named: --host cleans that host only; -g, --tag and --all are selections too
    done = run_gpufleet(home, inv, "clean", "--host", "sel-a", "--yes", "--json", *FAST)
    assert done.rc == 0 and done.host("sel-a")["verdict"] == "clean", str(done)
    assert a.wait_gone(a.holder, 10) and b.alive(b.holder)
    for args in (["-g", "both"], ["--tag", "infer"], ["--all"]):
        dry = run_gpufleet(home, inv, "clean", *args, "--dry-run", "--json", timeout=60)
        assert dry.rc == 0 and "sel-b" in {h["host"] for h in dry.json()["hosts"]}, str(dry)
    assert b.alive(b.holder)


def test_the_implicit_localhost_needs_a_selection_too(home: Path) -> None:
    """No fleet.yaml: gpufleet acts on this machine alone, and a clean must still name it
    (--dry-run only: if the refusal were missing, nothing on this machine is signalled)."""
    run = run_gpufleet(home, None, "clean", "--dry-run", timeout=60)
    line = assert_one_line_error(run, "clean changes hosts")
    assert "--host localhost or --all" in line, str(run)
    for args in (["--host", "localhost"], ["--all"]):
        named = run_gpufleet(home, None, "clean", *args, "--dry-run", "--json", timeout=60)
        assert_no_traceback(named)
        assert "changes hosts" not in named.stderr, str(named)
        assert [h["host"] for h in named.json()["hosts"]] == ["localhost"], str(named)


def test_a_runbook_that_changes_hosts_needs_them_named(lab: Any, make_host: Any, home: Path,
                                                       tmp_path: Path) -> None:
    a, b, inv = pair(lab, make_host)
    freeing = tmp_path / "free.yaml"
    freeing.write_text("name: free\nsteps:\n  - name: free GPU 0\n    kind: clean\n"
                       "    gpus: 0\n    grace: 1\n")
    looking = tmp_path / "look.yaml"
    looking.write_text("name: look\nsteps:\n  - name: look\n    kind: report\n    gpus: all\n")
    before = logins(a, b)
    for args in (["--yes"], ["--yes", "--json"], ["--dry-run"]):
        run = run_gpufleet(home, inv, "run", str(freeing), *args, timeout=60)
        assert_one_line_error(run, "runbook free changes hosts (clean)", SELECT)
    assert logins(a, b) == before
    assert a.alive(a.holder) and b.alive(b.holder)

    # a read-only runbook still runs on every host without a selection
    look = run_gpufleet(home, inv, "run", str(looking), "--json", timeout=120)
    assert look.rc == 0 and [h["host"] for h in look.json()["hosts"]] == ["sel-a", "sel-b"], \
        str(look)

    done = run_gpufleet(home, inv, "run", str(freeing), "--host", "sel-b", "--yes", "--json",
                        timeout=120)
    assert done.rc == 0 and [h["host"] for h in done.json()["hosts"]] == ["sel-b"], str(done)
    assert b.wait_gone(b.holder, 10) and a.alive(a.holder)


def fake_scontrol(tmp_path: Path, node: str) -> tuple[Path, Path]:
    """An scontrol that shows ``node`` drained by gpufleet and records every call."""
    calls = tmp_path / "scontrol.calls"
    shown = tmp_path / "show-node.txt"
    shown.write_text(f"NodeName={node} Arch=x86_64 State=IDLE+DRAIN ThreadsPerCore=1 "
                     "Reason=gpufleet: GPU 0: 716 MiB held by pid 4711 python3 (uid 1001) "
                     "after KILL [root@2026-12-01T12:41:22]\n")
    script = tmp_path / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n"
                      f"if [ \"$1\" = show ]; then cat {shown}; fi\nexit 0\n")
    os.chmod(script, 0o755)
    return script, calls


def test_slurm_undrain_needs_hosts_named(lab: Any, make_host: Any, home: Path,
                                         tmp_path: Path) -> None:
    host = make_host("sel-node", gpus=1)
    inv = lab.inventory_yaml([host])
    scontrol, calls = fake_scontrol(tmp_path, "sel-node")
    before = logins(host)
    for args in ([], ["--dry-run"]):
        run = run_gpufleet(home, inv, "slurm", "undrain", "--scontrol", str(scontrol), *args,
                           timeout=60)
        assert_one_line_error(run, "slurm undrain resumes Slurm nodes", SELECT)
    assert not calls.exists() and logins(host) == before  # neither Slurm nor the host asked

    done = run_gpufleet(home, inv, "slurm", "undrain", "--scontrol", str(scontrol),
                        "--host", "sel-node", timeout=60)
    assert done.rc == 0 and "resumed" in done.stdout, str(done)
    assert "update NodeName=sel-node State=RESUME" in calls.read_text().splitlines()


def test_protect_word_spares_a_command_line_that_contains_it(lab: Any, make_host: Any,
                                                             home: Path) -> None:
    host = make_host("sel-p", gpus=2)
    trainer = host.spawn_holder(gpus=[0], mib=3000, title=TRAINER)
    leftover = host.spawn_holder(gpus=[1], mib=1000, title="leftover")
    assert " ".join(host.cmdline(trainer)).startswith(TRAINER)
    inv = lab.inventory_yaml([host], protect=["*trian_prod*"])
    before = logins(host)
    for bad in ("", "train\x1b[2J"):  # an unset shell variable; a terminal escape
        empty = run_gpufleet(home, inv, "clean", "--host", "sel-p", "--protect", bad, "--yes",
                             timeout=60)
        assert_one_line_error(empty, "--protect %r: expected a word or a glob" % bad)
    assert logins(host) == before and host.alive(trainer) and host.alive(leftover)

    dry = run_gpufleet(home, inv, "clean", "--host", "sel-p", "--protect", "train_dflash",
                       "--protect", "typo_name", "--dry-run", timeout=60)
    assert dry.rc == 0, str(dry)
    assert f"refused {trainer} " in dry.stdout and "protected by 'train_dflash'" in dry.stdout
    notes = [ln.strip() for ln in dry.stdout.splitlines() if ln.strip().startswith("note:")]
    assert "note: --protect 'typo_name' matches no GPU process on sel-p: a typo?" in notes, notes
    assert ("note: inventory protect '*trian_prod*' matches no GPU process on sel-p: a typo?"
            in notes), notes
    assert not any("'train_dflash' matches" in n for n in notes), notes

    run = run_gpufleet(home, inv, "clean", "--host", "sel-p", "--protect", "train_dflash",
                       "--yes", "--json", *FAST)
    assert_no_traceback(run)
    doc = run.host("sel-p")
    assert [t["pid"] for t in doc["targets"]] == [leftover]
    assert {r["pid"]: r["reason"] for r in doc["refused"]}[trainer] == \
        "protected by 'train_dflash'"
    assert host.wait_gone(leftover, 10) and host.alive(trainer)
    assert {r["pid"] for r in audit_of(home) if r.get("event") != "verdict"} == {leftover}
