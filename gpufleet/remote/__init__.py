"""The remote side: the agent's source and the constant command that runs it on a host.

Nothing from the inventory or from process names becomes shell text: the command below is a
constant (only the interpreter path varies, and the transport shlex-quotes it), and the
agent plus its request travel on stdin as ``<k> <m>\\n<zlib(agent source): k bytes><request
JSON: m bytes>``, read by length: stdin stays open after them, so a resident agent (watch
mode) hears the controller's keep-alives on it and sees it close.

The agent is several small standard-library modules here (``AGENT_PIECES``), joined at send
time into ONE source with ONE global namespace: each piece's imports of earlier pieces are
marked ``# joined`` and dropped, the rest is concatenated in dependency order. So a piece is a
real module that imports and tests on its own, and a host still gets one exec. The joined
source is sent compressed (about 65 KB -> 19 KB): on a 100 ms link that is a quarter of a
second less per host (bench/README.md).
"""
from __future__ import annotations

import functools
import json
import zlib
from pathlib import Path
from typing import Any, List, Mapping, Sequence, Tuple

#: The agent's pieces in dependency order: a piece imports only pieces before it (its
#: default arguments are evaluated when the joined source runs, top to bottom).
AGENT_PIECES = ("parse", "jobs", "procfs", "nvml", "kmsg", "snapshot", "clean", "watch", "main")
#: The comment that marks an import of another piece; the joiner drops those statements.
JOINED_MARK = "# joined"

#: How every program sent to a host is started (the agent, the wait_http probe): no site
#: import (-S: on a host with a large site-packages that alone is ~50 ms of a ~60 ms start, and
#: a sitecustomize / .pth there would run first), no PYTHON* variables (-E: PYTHONPATH,
#: PYTHONSTARTUP, PYTHONHOME of the login environment), no user site (-s). The programs are
#: standard library only, so nothing they need comes from site. All three exist since 2.x.
PYTHON_FLAGS = ("-S", "-E", "-s")

#: The -c program of docs/DESIGN.md ("Running the agent"): read the agent and the request by
#: length (a header line ``k m``), exec the agent; the rest of stdin is left to the agent.
BOOTSTRAP = (
    'import sys,zlib;b=sys.stdin.buffer;k,m=map(int,b.readline().split());'
    'exec(compile(zlib.decompress(b.read(k)),"gpufleet-agent","exec"),'
    '{"__name__":"gpufleet_agent","REQUEST":b.read(m)})'
)


def piece_source(name: str) -> str:
    """One piece's source text, read from the file beside this module (works installed too)."""
    filename = name + ".py"
    try:
        from importlib import resources

        return resources.files(__name__).joinpath(filename).read_text(encoding="utf-8")
    except (ImportError, AttributeError, FileNotFoundError):  # pragma: no cover - old Pythons
        return (Path(__file__).resolve().parent / filename).read_text(encoding="utf-8")


def join_pieces(pieces: Sequence[Tuple[str, str]]) -> str:
    """(name, source) pairs -> one source: each piece's imports of other pieces (a line
    ``from .piece import ...  # joined`` at column 0, parenthesised ones to their closing
    parenthesis) are dropped, as in the joined source those names are already global. An
    import of a piece that is not marked, or not at the top level, is an error rather than a
    payload that fails on a host. A plain line scan: this runs in every controller process."""
    out = ["# gpufleet remote agent (gpufleet/remote/, joined). Standard library only; "
           "must run on Python 3.6+.\n"]
    for name, text in pieces:
        out.append("# ---- %s.py\n" % name)
        lines = text.splitlines(keepends=True)
        i = 0
        while i < len(lines):
            line = lines[i]
            if not line.lstrip().startswith("from ."):
                out.append(line)
                i += 1
                continue
            if line[0].isspace() or JOINED_MARK not in line:
                raise ValueError("%s.py line %d: an import of another agent piece must be at "
                                 "the top level and marked %r" % (name, i + 1, JOINED_MARK))
            if "(" in line.split("#")[0]:
                while ")" not in lines[i].split("#")[0]:
                    i += 1
                    if i == len(lines):
                        raise ValueError("%s.py: unclosed import" % name)
            i += 1
    return "".join(out)


@functools.lru_cache(maxsize=1)
def agent_source() -> bytes:
    """The agent as a host runs it: the pieces joined in AGENT_PIECES order."""
    return join_pieces([(name, piece_source(name)) for name in AGENT_PIECES]).encode("utf-8")


def bootstrap_command(python: str = "python3", sudo: bool = False) -> List[str]:
    """argv that runs the agent: ``[sudo -n] PYTHON -S -E -s -c BOOTSTRAP`` (sudo never
    prompts; the flags: PYTHON_FLAGS)."""
    argv = ["sudo", "-n"] if sudo else []
    return argv + [python, *PYTHON_FLAGS, "-c", BOOTSTRAP]


@functools.lru_cache(maxsize=1)
def compressed_agent() -> bytes:
    return zlib.compress(agent_source(), 9)


def encode_request(request: Mapping[str, Any]) -> bytes:
    """The stdin payload: ``<k> <m>\\n<zlib(agent source)><request JSON>``, k and m their
    lengths in bytes; the request is data only. One-shot runs close stdin after it; watch
    mode keeps writing keep-alive lines after it (remote/watch.py)."""
    source = compressed_agent()
    payload = json.dumps(dict(request), separators=(",", ":")).encode("utf-8")
    return b"%d %d\n" % (len(source), len(payload)) + source + payload
