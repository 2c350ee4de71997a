"""The CLI's commands are imported lazily (gpufleet/cli/__init__.py COMMANDS, LazyGroup), and
that changes nothing a user sees: the help listing is the one the real commands give (at any
width), the table's short help is each command's real first sentence, an unknown command is
still exit 2 with click's suggestion, shell completion still lists the commands. Subprocess
runs use a fresh interpreter, so what a command imports is what one start imports.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.utils import make_default_short_help

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMAND_MODULES = ("clean_cmd", "disconnect_cmd", "export_cmd", "fit_cmd", "health_cmd", "hosts_cmd", "init_cmd", "run_cmd",
                   "slurm_cmd", "status_cmd", "top", "trust_cmd")


def _python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "GPUFLEET_INVENTORY"}
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), environ.get("PYTHONPATH")) if p)
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=environ, timeout=60, stdin=subprocess.DEVNULL)


def test_the_table_names_every_command_with_its_real_short_help() -> None:
    """Every command module's commands are in COMMANDS under the right module, and the text
    kept there is the command's own first sentence: they cannot drift apart."""
    import importlib

    from gpufleet.cli import COMMANDS, cli

    for module in COMMAND_MODULES:
        importlib.import_module(f"gpufleet.cli.{module}")
    real = dict(cli.commands)
    assert set(real) == set(COMMANDS)
    for name, command in real.items():
        module, short_help = COMMANDS[name]
        assert command.callback is not None and command.callback.__module__ == f"gpufleet.cli.{module}"
        assert command.short_help is None and not command.hidden and not command.deprecated
        assert short_help == make_default_short_help(command.help or "", 10 ** 6), name


LISTING = (
    "import json, sys, click\n"
    "from gpufleet.cli import cli, _load_all\n"
    "def helps():\n"
    "    return {w: cli.get_help(click.Context(cli, info_name='gpufleet', terminal_width=w,"
    " max_content_width=w)) for w in (40, 60, 80, 100, 200, 400)}\n"
    "lazy = helps()\n"
    "mods = sorted(m for m in sys.modules if m.startswith('gpufleet.cli.'))\n"
    "_load_all()\n"
    "print(json.dumps({'lazy': lazy, 'real': helps(), 'mods': mods}))\n"
)


def test_the_help_listing_is_the_real_commands_at_any_width_and_imports_none() -> None:
    res = _python(LISTING)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["mods"] == [], "listing the commands imported %s" % out["mods"]
    for width, text in out["real"].items():
        assert "status" in text and "trust" in text
        assert out["lazy"][width] == text, width


@pytest.mark.parametrize("args,module", [
    (["status", "--help"], "status_cmd"),
    (["serve", "--help"], "export_cmd"),
    (["slurm", "epilog", "--help"], "slurm_cmd"),
    (["hosts", "--help"], "hosts_cmd"),
])
def test_a_command_imports_only_its_own_module(args: list[str], module: str) -> None:
    code = ("import sys\nfrom gpufleet.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as e:\n    code = e.code\n"
            "print(sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('gpufleet.cli.')"
            " and m.rsplit('.', 1)[1] in %r), code)\n" % (COMMAND_MODULES,))
    res = _python(code, *args)
    assert res.returncode == 0, res.stderr
    assert "Usage: gpufleet " in res.stdout
    assert res.stdout.strip().splitlines()[-1] == "[%r] 0" % module


def test_an_unknown_command_is_exit_2_with_the_suggestion() -> None:
    """click suggests from the registered commands: the lazy group must load them first."""
    res = _python("from gpufleet.cli import main; main()", "stat")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.splitlines() == [
        "gpufleet: error: No such command 'stat'. Did you mean 'status'? (see gpufleet --help)"]
    res = _python("from gpufleet.cli import main; main()", "nosuch")
    assert res.returncode == 2 and res.stderr.splitlines() == [
        "gpufleet: error: No such command 'nosuch'. (see gpufleet --help)"]


def test_shell_completion_lists_the_commands() -> None:
    res = _python("from gpufleet.cli import main; main()", _GPUFLEET_COMPLETE="bash_complete",
                  COMP_WORDS="gpufleet s", COMP_CWORD="1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["plain,serve", "plain,slurm", "plain,status"]


def test_get_command_of_an_unknown_name_is_none() -> None:
    from gpufleet.cli import cli

    ctx = click.Context(cli)
    assert cli.get_command(ctx, "no-such-command") is None
    assert cli.get_command(ctx, "hosts") is cli.commands["hosts"]


def test_prefetch_imports_in_the_background_and_leaves_errors_to_the_real_import() -> None:
    code = ("import sys\nfrom gpufleet.cli import prefetch\n"
            "assert 'gpufleet.render.status' not in sys.modules\n"
            "t = prefetch('gpufleet.render.status', 'gpufleet_no_such_module', 'json.tool')\n"
            "t.join(30)\n"
            "print(t.name, t.daemon, 'gpufleet.render.status' in sys.modules, 'json.tool' in sys.modules)\n"
            "try:\n    import gpufleet_no_such_module\nexcept ImportError as e:\n    print('raised', e.name)\n")
    res = _python(code)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    # loaded in order, stopped at the first failure, which the real import raises itself
    assert res.stdout.splitlines() == ["gpufleet-prefetch True True False", "raised gpufleet_no_such_module"]


def test_prefetch_calls_a_function_and_the_agent_payload_it_warms_is_the_one_sent() -> None:
    """``"module:function"`` is called on the thread; AGENT_PAYLOAD names the cached function
    whose value every run sends (if remote/ renames it, this fails instead of the warm-up
    silently doing nothing)."""
    code = ("import sys\nfrom gpufleet.cli import AGENT_PAYLOAD, prefetch\n"
            "prefetch(AGENT_PAYLOAD).join(60)\n"
            "import gpufleet.remote as r\n"
            "print(int(r.compressed_agent.ready), AGENT_PAYLOAD)\n"
            "import zlib\nprint(zlib.decompress(r.compressed_agent()) == r.agent_source())\n")
    res = _python(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["1 gpufleet.remote:compressed_agent", "True"]


def test_a_prefetch_after_the_first_start_waits_for_the_first_command_process() -> None:
    """``after_first_start``: nothing is imported until a run has started its process
    (transport.FIRST_START, set by run.start_process); with no process at all
    it still imports after PREFETCH_WAIT_S."""
    code = ("import sys, time\nfrom gpufleet.cli import prefetch, PREFETCH_WAIT_S\n"
            "from gpufleet.transport import FIRST_START\n"
            "from gpufleet.transport.stream import run_process\n"
            "t = prefetch('json.tool', after_first_start=True)\n"
            "time.sleep(PREFETCH_WAIT_S / 3)\n"
            "print(FIRST_START.is_set(), 'json.tool' in sys.modules)\n"
            "print(run_process(['true'], b'', 10).exit_code)\n"
            "t.join(10)\n"
            "print(FIRST_START.is_set(), 'json.tool' in sys.modules)\n")
    res = _python(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["False False", "0", "True True"]
    idle = ("import sys, time\nfrom gpufleet.cli import prefetch, PREFETCH_WAIT_S\n"
            "t0 = time.monotonic()\n"
            "prefetch('json.tool', after_first_start=True).join(10)\n"
            "print('json.tool' in sys.modules, time.monotonic() - t0 >= PREFETCH_WAIT_S * 0.9)\n")
    res = _python(idle)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["True True"]
