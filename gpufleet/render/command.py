"""What a process runs, in a few words an operator recognises (pure): ``train_dflash.py
--epochs 3``, ``vllm serve Qwen3-235B --tp 8``, ``-m sglang.launch_server ...``,
``torchrun train.py ...``, ``bash -c ...``.

The kernel's comm names the interpreter (``python3``), which tells nothing when eight jobs are
python3; the command line tells what runs. So: the script or module instead of the
interpreter, the script a launcher (torchrun, accelerate, deepspeed) starts instead of the
launcher's own options, paths cut to their last part, the rest of the arguments as they are,
and the whole cut to a width with ``...`` (as nvidia-smi marks a cut process name). A title a
process gave itself (vLLM's ``VLLM::Worker_TP0``) is kept; when only comm took a name and the
command line still says what started it, both are shown (``VLLM::Worker_TP: -m vllm...``).

The text is safe to print: control and other non-printable characters (escape sequences,
newlines, bidirectional overrides) are shown escaped, never passed to the terminal, since
anyone can choose their process's command line.
"""
from __future__ import annotations

import os
import re
from typing import Optional

from gpufleet.core.model import Snapshot
from gpufleet.render.common import cut, terminal_safe

WIDTH = 40
_PYTHON = re.compile(r"^(python|pypy)[0-9.]*[dmu]?$")
SHELLS = frozenset(["sh", "bash", "dash", "zsh", "ksh", "ash", "busybox"])
# Python options that take the next word as their value (python3 --help)
_PY_VALUE_OPTS = frozenset(["-W", "-X", "--check-hash-based-pycs"])
# launchers whose first script (or -m module) is what runs; their options come before it
LAUNCHERS = frozenset(["torchrun", "torch.distributed.run", "torch.distributed.launch",
                       "accelerate", "deepspeed"])
# comms that name no program (PyTorch names its main thread)
GENERIC_COMMS = frozenset(["pt_main_thread"])


def _base(word: str) -> str:
    return os.path.basename(word.rstrip("/")) or word


def _short_path(word: str) -> str:
    """/models/Qwen/Qwen3-235B -> Qwen3-235B; --model=/m/x -> --model=x; an HF id stays."""
    if "=" in word and word.startswith("-"):
        key, _, value = word.partition("=")
        return key + "=" + _short_path(value)
    if word.startswith(("/", "./", "../", "~/")) and len(word) > 1:
        return _base(word)
    return word


def _python(prog: str, rest: list[str]) -> list[str]:
    """``python3 [opts] script args`` -> [script, args]; ``-m mod`` and ``-c`` kept."""
    i = 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "-":
        opt = rest[i]
        if opt in ("-m", "-c") and i + 1 < len(rest):
            if opt == "-m" and rest[i + 1] in LAUNCHERS:
                return _launcher(rest[i + 1], rest[i + 2:])
            return ([prog] if opt == "-c" else []) + [opt] + rest[i + 1:]
        i += 2 if opt in _PY_VALUE_OPTS else 1
    if i >= len(rest):
        return [prog] + rest
    script = _base(rest[i])
    if script in LAUNCHERS:
        return _launcher(script, rest[i + 1:])
    return [script] + rest[i + 1:]


def _launcher(name: str, rest: list[str]) -> list[str]:
    """``torchrun --nproc_per_node 8 train.py --lr 1`` -> torchrun train.py --lr 1."""
    name = "torchrun" if name.startswith("torch.distributed") else name
    words = rest[1:] if name == "accelerate" and rest[:1] == ["launch"] else rest
    for i, word in enumerate(words):
        if word.endswith(".py") and not word.startswith("-"):
            return [name, _base(word)] + words[i + 1:]
        if word in ("-m", "--module") and i + 1 < len(words):
            return [name, "-m"] + words[i + 1:]
    return [name] + rest


def _shell(prog: str, rest: list[str]) -> list[str]:
    """``bash -c 'script'`` is its script; ``bash run.sh args`` is run.sh args."""
    for i, word in enumerate(rest):
        if word.startswith("-") and not word.startswith("--") and "c" in word[1:]:
            return [prog, "-c"] + rest[i + 1:]
        if not word.startswith("-"):
            return [_base(word)] + rest[i + 1:]
    return [prog] + rest


def _without_env(argv: list[str]) -> list[str]:
    """``env [-i] [VAR=value ...] program args`` -> program args."""
    if not argv or _base(argv[0]) != "env":
        return argv
    i = 1
    while i < len(argv) and (argv[i].startswith("-") or "=" in argv[i]):
        i += 1
    return argv[i:] or argv[:1]


def _words(argv: list[str]) -> list[str]:
    """The interesting words of an argv (its first word a program, a path or a title)."""
    argv = _without_env(argv)
    if not argv:
        return []
    prog, rest = _base(argv[0]), argv[1:]
    if _PYTHON.match(prog):
        return _python(prog, rest)
    if prog in SHELLS:
        return _shell(prog, rest)
    if prog in LAUNCHERS:
        return _launcher(prog, rest)
    return [prog] + rest


def _printable(text: str) -> str:
    """Control characters escaped (the one terminal-safe function), then anything else a
    terminal would not print as itself (bidi overrides, zero-width): \\u202e."""
    text = terminal_safe(text, one_line=True)
    return "".join(ch if ch.isprintable() else "\\u%04x" % ord(ch) for ch in text)


def command_summary(cmdline: str, comm: str = "", width: int = WIDTH) -> str:
    """What runs, in at most ``width`` characters: the script or module and its arguments;
    after ``comm:`` when comm is a name the process took (``VLLM::Worker_TP``, prctl) that
    the command line does not say."""
    argv = _without_env(cmdline.split())
    words = [_short_path(w) for w in _words(argv)]
    if not words:
        return cut(_printable(comm or "?"), width)
    text = " ".join(words)
    name = comm.strip()
    if name and not (_PYTHON.match(name) or name in SHELLS or name in GENERIC_COMMS
                     or _base(argv[0]).startswith(name)
                     or any(w.startswith(name) for w in words)):
        text = f"{name}: {text}"
    return cut(_printable(text), width)


def foreign_container(snapshot: Snapshot, container: Optional[str]) -> Optional[str]:
    """The container a process runs in when it is not the agent's own (core.policy's rule):
    inside a container every process is in it, and saying so on each line says nothing."""
    facts = snapshot.facts
    own = facts.container if facts.in_container else None
    return container if container and container != own else None


def process_cells(snapshot: Snapshot, pid: int, fallback: str,
                  width: int = WIDTH) -> tuple[str, str, str]:
    """(user, container or "", what runs) of a process for a table or the live screen; a PID
    not in this /proc (another PID namespace) is known by ``fallback`` (nvidia-smi's argv[0])."""
    proc = snapshot.processes.get(pid)
    if proc is None:
        return "?", "", command_summary("", fallback or "?", width)
    ctr = foreign_container(snapshot, proc.container)
    if ctr and proc.container_name:  # the runtime's name, as `docker ps` shows it
        ctr = proc.container_name
    return (terminal_safe(proc.user or "?", one_line=True),
            terminal_safe(ctr, one_line=True) if ctr else "",
            command_summary(proc.cmdline, proc.comm, width))
