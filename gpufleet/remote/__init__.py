"""The remote side: the agent's source and the constant command that runs it on a host.

Nothing from the inventory or from process names becomes shell text: the command below is a
constant (only the interpreter path varies, and the transport shlex-quotes it), and the
agent plus its request travel on stdin as ``<len>\\n<zlib(agent source)><request JSON>``.
The agent is sent compressed (about 60 KB -> 18 KB): on a 100 ms link that is a quarter of a
second less per host (bench/README.md).
"""
from __future__ import annotations

import functools
import json
import zlib
from pathlib import Path
from typing import Any, List, Mapping

AGENT_FILE = "agent.py"

#: The -c program of docs/DESIGN.md ("Running the agent"): read stdin, exec the agent.
BOOTSTRAP = (
    'import sys,zlib;d=sys.stdin.buffer.read();n=d.index(b"\\n");k=int(d[:n]);'
    'exec(compile(zlib.decompress(d[n+1:n+1+k]),"gpufleet-agent","exec"),'
    '{"__name__":"gpufleet_agent","REQUEST":d[n+1+k:]})'
)


def agent_source() -> bytes:
    """The agent's source bytes, read from the file beside this module (works installed too)."""
    try:
        from importlib import resources

        return resources.files(__name__).joinpath(AGENT_FILE).read_bytes()
    except (ImportError, AttributeError, FileNotFoundError):  # pragma: no cover - old Pythons
        return (Path(__file__).resolve().parent / AGENT_FILE).read_bytes()


def bootstrap_command(python: str = "python3", sudo: bool = False) -> List[str]:
    """argv that runs the agent: ``[sudo -n] PYTHON -c BOOTSTRAP`` (sudo never prompts)."""
    argv = ["sudo", "-n"] if sudo else []
    return argv + [python, "-c", BOOTSTRAP]


@functools.lru_cache(maxsize=1)
def compressed_agent() -> bytes:
    return zlib.compress(agent_source(), 9)


def encode_request(request: Mapping[str, Any]) -> bytes:
    """The stdin payload: ``<len>\\n<zlib(agent source)><request JSON>``; the request is data only."""
    source = compressed_agent()
    payload = json.dumps(dict(request), separators=(",", ":")).encode("utf-8")
    return str(len(source)).encode("ascii") + b"\n" + source + payload
