"""`gpufleet init` writes a commented fleet.yaml that loads as written; runbooks are found by
name; the first-run hint points at `gpufleet init` (an installed gpufleet has no
fleet.yaml.example or docs/ to point at: tests/integration/test_packaging.py builds the wheel).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from gpufleet.config.inventory import IMPLICIT_HINT, load_inventory

REPO_ROOT = Path(__file__).resolve().parents[2]
SSH_CONFIG = """\
# the operator's hosts
Host gpu-a gpu-b
    HostName 10.0.0.5
Host *.lab !bastion-x node?
    User ops
Host=solo
host "with space" 007 bad@name
Include ~/.ssh/config.d/*
Match host gpu-a exec "true"
    Port 2222
"""


def gpufleet(home: Path, *args: str, cwd: Optional[Path] = None,
             path: Optional[str] = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_INVENTORY"}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p))
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "gpufleet", *args], cwd=str(cwd or home),
                          env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_init_writes_a_commented_inventory_that_loads(tmp_path: Path) -> None:
    res = gpufleet(tmp_path, "init")
    assert res.returncode == 0, res.stderr
    written = tmp_path / "fleet.yaml"
    assert res.stdout == "wrote fleet.yaml: this machine (connection: local); check it with " \
                         "`gpufleet -i fleet.yaml hosts`\n"
    inv = load_inventory(written)
    assert [(h.name, h.connection) for h in inv.hosts] == [("localhost", "local")]
    text = written.read_text()
    for key in ("address:", "port:", "identity_file:", "protect:", "unattributed_mib:", "tags:",
                "groups:", "ssh_persist:", "host_key_policy:"):
        assert key in text, key  # every common key is shown, commented where not set
    listed = gpufleet(tmp_path, "hosts")  # ./fleet.yaml is found without -i
    assert listed.returncode == 0 and "localhost" in listed.stdout and listed.stderr == ""


def test_init_never_overwrites(tmp_path: Path) -> None:
    target = tmp_path / "mine.yaml"
    target.write_text("hosts:\n  keep-me: {connection: local}\n")
    for args in (["init", str(target)], ["-i", str(target), "init"], ["init", "-i", str(target)]):
        res = gpufleet(tmp_path, *args)
        assert res.returncode == 2
        assert res.stderr.splitlines() == [
            f"gpufleet: error: {target} exists: not overwritten (remove it, or name another path)"]
        assert target.read_text() == "hosts:\n  keep-me: {connection: local}\n"


def test_init_into_a_new_folder(tmp_path: Path) -> None:
    target = tmp_path / ".config" / "gpufleet" / "fleet.yaml"
    res = gpufleet(tmp_path, "init", str(target))
    assert res.returncode == 0, res.stderr
    assert load_inventory(target).hosts[0].name == "localhost"


def test_ssh_config_aliases_are_the_concrete_host_names() -> None:
    from gpufleet.config.starter import ssh_config_aliases

    aliases, unusable, include = ssh_config_aliases(SSH_CONFIG)
    assert aliases == ["gpu-a", "gpu-b", "solo", "007"]
    assert unusable == ["with space", "bad@name"]
    assert include is True
    assert ssh_config_aliases("Host *\n  User x\n") == ([], [], False)


def test_the_ssh_config_inventory_loads_with_each_alias_as_its_address() -> None:
    from gpufleet.config.starter import ssh_config_aliases, starter_inventory

    aliases, unusable, include = ssh_config_aliases(SSH_CONFIG)
    text = starter_inventory(aliases, tuple(unusable), include)
    from gpufleet.config.inventory import parse_inventory

    inv = parse_inventory(text)
    assert [(h.name, h.address, h.port, h.user) for h in inv.hosts] == [
        ("gpu-a", "gpu-a", None, None), ("gpu-b", "gpu-b", None, None),
        ("solo", "solo", None, None), ("007", "007", None, None)]
    assert "Include" in text and "with space, bad@name" in text


def test_init_from_ssh_config_reads_only_the_file(tmp_path: Path) -> None:
    """No ssh on PATH: nothing can be resolved, and init still writes every alias."""
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text(SSH_CONFIG)
    empty = tmp_path / "bin"
    empty.mkdir()
    res = gpufleet(tmp_path, "init", "--from-ssh-config", path=str(empty))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("wrote fleet.yaml: 4 host(s) from ~/.ssh/config;")
    inv = load_inventory(tmp_path / "fleet.yaml")
    assert [h.name for h in inv.hosts] == ["gpu-a", "gpu-b", "solo", "007"]


@pytest.mark.parametrize("config", [None, "Host *\n  User ops\n"], ids=["missing", "wildcards"])
def test_init_from_ssh_config_without_hosts_writes_nothing(tmp_path: Path,
                                                          config: Optional[str]) -> None:
    if config is not None:
        (tmp_path / ".ssh").mkdir()
        (tmp_path / ".ssh" / "config").write_text(config)
    res = gpufleet(tmp_path, "init", "--from-ssh-config")
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith("gpufleet: error: ") and "nothing written" in res.stderr
    assert not (tmp_path / "fleet.yaml").exists()


def test_the_first_run_hint_points_at_init() -> None:
    assert "`gpufleet init`" in IMPLICIT_HINT and "--from-ssh-config" in IMPLICIT_HINT
    assert "fleet.yaml.example" not in IMPLICIT_HINT and "docs/" not in IMPLICIT_HINT


def test_a_shipped_runbook_is_found_by_name_from_any_folder(tmp_path: Path) -> None:
    res = gpufleet(tmp_path, "run", "model-swap", "--dry-run", "--all", "-e", "OLD_UNIT=old",
                   "-e", "NEW_UNIT=new")
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[0]
    assert first.startswith("runbook model-swap (") and "gpufleet/playbooks/model-swap.yaml" in first
    res = gpufleet(tmp_path, "run", "pre-train.yaml", "--dry-run", "--all")
    assert res.returncode == 0, res.stderr
    res = gpufleet(tmp_path, "run", "model-swp", "--dry-run", "--all")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "gpufleet: error: model-swp: runbook not found: not a file, nor a shipped runbook "
        "(model-swap, model-swap-rolling, pre-train, wsl2-preflight)"]


def test_a_file_wins_over_a_shipped_name(tmp_path: Path) -> None:
    (tmp_path / "model-swap").write_text("name: mine\nsteps:\n  - name: look\n    kind: report\n")
    res = gpufleet(tmp_path, "run", "model-swap", "--dry-run", "--all")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("runbook mine (model-swap) on 1 host(s):")


def test_the_checkouts_playbooks_folder_is_the_shipped_one() -> None:
    from gpufleet.runbook.load import SHIPPED_DIR, shipped_runbooks

    assert shipped_runbooks() == ["model-swap", "model-swap-rolling", "pre-train", "wsl2-preflight"]
    assert (REPO_ROOT / "playbooks").resolve() == SHIPPED_DIR


@pytest.mark.parametrize("text", ["", "name: x\n"], ids=["empty", "no-steps"])
def test_a_runbook_without_steps_points_at_examples_the_install_has(text: str) -> None:
    """docs/ is not installed; the shipped runbooks are: the message names their folder."""
    from gpufleet.errors import UsageError
    from gpufleet.runbook.load import SHIPPED_DIR, parse_runbook

    with pytest.raises(UsageError) as raised:
        parse_runbook(text)
    assert f"(examples: {SHIPPED_DIR})" in str(raised.value) and "docs/" not in str(raised.value)
    assert (SHIPPED_DIR / "model-swap.yaml").is_file()
