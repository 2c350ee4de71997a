"""What a process runs, in a few words an operator recognises (pure): ``train_dflash.py
--epochs 3``, ``vllm serve Qwen3-235B --tp 8``, ``-m sglang.launch_server ...``,
``torchrun train.py ...``, ``bash -c ...``.

The kernel's comm names the interpreter (``python3``), which tells nothing when eight jobs are
python3; the command line tells what runs. So: the script or module instead of the
interpreter, the script a launcher (torchrun, accelerate, deepspeed) starts instead of the
launcher's own options, paths cut to their last part, the rest of the arguments as they are,
and the whole cut to a width with ``...`` (as nvidia-smi marks a cut process name). A title a
process gave itself (vLLM's ``VLLM::Worker_TP0``) is kept; when only comm took a title and the
command line still says what started it, both are shown (``VLLM::Worker_TP: -m vllm...``).

The text is safe to print: control and other non-printable characters (escape sequences,
newlines, bidirectional overrides) are shown escaped, never passed to the terminal, since
anyone can choose their process's command line.
"""
from __future__ import annotations

import os
import re

from gpufleet.render.common import terminal_safe

WIDTH = 40
CUT = "..."
_PYTHON = re.compile(r"^(python|pypy)[0-9.]*[dmu]?$")
SHELLS = frozenset(["sh", "bash", "dash", "zsh", "ksh", "ash", "busybox"])
# Python options that take the next word as their value (python3 --help)
_PY_VALUE_OPTS = frozenset(["-W", "-X", "--check-hash-based-pycs"])
# launchers whose first script (or -m module) is what runs; their options come before it
LAUNCHERS = frozenset(["torchrun", "torch.distributed.run", "torch.distributed.launch",
                       "accelerate", "deepspeed"])


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


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, a cut marked ``...``."""
    if len(text) <= width:
        return text
    return text[: max(0, width - len(CUT))] + CUT


def command_summary(cmdline: str, comm: str = "", width: int = WIDTH) -> str:
    """What runs, in at most ``width`` characters: the script or module and its arguments;
    after ``comm:`` when comm is a title (``VLLM::Worker_TP``) the command line does not say."""
    words = [_short_path(w) for w in _words(cmdline.split())]
    if not words:
        return cut(_printable(comm or "?"), width)
    text = " ".join(words)
    title = comm.strip()
    if "::" in title and not words[0].startswith(title):
        text = f"{title}: {text}"
    return cut(_printable(text), width)
