"""The remote side: the agent's source and the constant command that runs it on a host.

Nothing from the inventory or from process names becomes shell text: the command below is a
constant (only the interpreter path varies, and the transport shlex-quotes it), and the
loader, the agent and its request travel on stdin as ``<n> <k> <m> <key>\\n<loader source: n
bytes><zlib(agent source): k bytes><request JSON: m bytes>``, read by length: stdin stays open
after them, so a resident agent (watch mode) hears the controller's keep-alives on it and sees
it close. ``key`` is the agent source's hash: the loader (remote/loader.py) runs the host's
cached code object of that source when it has a trusted one, instead of compiling it (~40 ms);
``k`` is 0 when the controller leaves the source out for a host it saw cache it
(gpufleet.transport.knownagents).

The agent is several small standard-library modules here (``AGENT_PIECES``), joined at send
time into ONE source with ONE global namespace: each piece's imports of earlier pieces are
marked ``# joined`` and dropped, the rest is concatenated in dependency order. So a piece is a
real module that imports and tests on its own, and a host still gets one exec. The joined
source is sent compressed (about 118 KB -> 37 KB at zlib level 4, ~2 ms once per process;
level 9 saved 1.7 KB more for ~12 ms: bench/README.md).
"""
from __future__ import annotations

import functools
import json
import threading
import zlib
from pathlib import Path
from typing import Any, Callable, Generic, List, Mapping, Sequence, Tuple, TypeVar

#: The agent's pieces in dependency order: a piece imports only pieces before it (its
#: default arguments are evaluated when the joined source runs, top to bottom).
AGENT_PIECES = ("parse", "jobs", "procfs", "owners", "nvml", "kmsg", "mps", "snapshot", "settle",
                "lock", "audit", "signals", "pidfd", "units", "memwait", "shm", "reset",
                "survivors", "clean", "watch", "main")
#: The comment that marks an import of another piece; the joiner drops those statements.
JOINED_MARK = "# joined"

#: How every program sent to a host is started (the agent, the wait_http probe): no site
#: import (-S: on a host with a large site-packages that alone is ~50 ms of a ~60 ms start, and
#: a sitecustomize / .pth there would run first), no PYTHON* variables (-E: PYTHONPATH,
#: PYTHONSTARTUP, PYTHONHOME of the login environment), no user site (-s). The programs are
#: standard library only, so nothing they need comes from site. All three exist since 2.x.
PYTHON_FLAGS = ("-S", "-E", "-s")

#: The first statement of every ``-c`` program sent to a host: with ``-c`` Python puts ``''``
#: (the working directory) first on sys.path, and ``-S -E -s`` do not remove it, so a
#: ``zlib.py`` dropped in a world-writable directory the operator runs from would be imported
#: by a root agent. Only absolute entries stay (the interpreter's own library directories);
#: ``-P`` and ``-I`` would do it too, but exist only on newer Pythons than the agent supports.
SAFE_PATH = 'import sys;sys.path[:]=[p for p in sys.path if p[:1]=="/"];'

#: The -c program of docs/DESIGN.md ("Running the agent"): drop the working directory from
#: sys.path (SAFE_PATH), read the header line ``n k m key`` and the loader (n bytes), run the
#: loader; it reads the rest by length (remote/loader.py).
BOOTSTRAP = SAFE_PATH + (
    'b=sys.stdin.buffer;h=b.readline().split();'
    'exec(compile(b.read(int(h[0])),"gpufleet-agent-loader","exec"),'
    '{"__name__":"gpufleet_loader","B":b,"H":h})'
)
#: The first stage sent before the agent (not one of AGENT_PIECES: it is not joined).
LOADER = "loader"
#: zlib level of the agent sent: 4 costs ~2 ms for 37 KB; 9 cost ~12 ms for 35 KB.
ZLIB_LEVEL = 4


def piece_source(name: str) -> str:
    """One piece's source text, read from the file beside this module (works installed too)."""
    filename = name + ".py"
    try:
        from importlib import resources

        return resources.files(__name__).joinpath(filename).read_text(encoding="utf-8")
    except (ImportError, AttributeError, FileNotFoundError):  # pragma: no cover - old Pythons
        return (Path(__file__).resolve().parent / filename).read_text(encoding="utf-8")


T = TypeVar("T")


class once(Generic[T]):  # noqa: N801 - used as a decorator, like functools.cache
    """``make()`` computed once per process, the first callers waiting for it: every host's
    thread asks for the agent at the start of a fan-out, and an ``lru_cache`` lets each of
    them join and hash the ~150 KB source itself (8 joins at ~7 ms of CPU each were seen at
    the start of a 32-host clean on 2 cores)."""

    def __init__(self, make: Callable[[], T]):
        self._make = make
        self._lock = threading.Lock()
        self._made: List[T] = []
        functools.update_wrapper(self, make)

    def __call__(self) -> T:
        if not self._made:
            with self._lock:
                if not self._made:
                    self._made.append(self._make())
        return self._made[0]

    @property
    def ready(self) -> bool:
        """Computed already (the CLI's prefetch warmed it)."""
        return bool(self._made)


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


@once
def agent_source() -> bytes:
    """The agent as a host runs it: the pieces joined in AGENT_PIECES order."""
    return join_pieces([(name, piece_source(name)) for name in AGENT_PIECES]).encode("utf-8")


def bootstrap_command(python: str = "python3", sudo: bool = False) -> List[str]:
    """argv that runs the agent: ``[sudo -n] PYTHON -S -E -s -c BOOTSTRAP`` (sudo never
    prompts; the flags: PYTHON_FLAGS)."""
    argv = ["sudo", "-n"] if sudo else []
    return argv + [python, *PYTHON_FLAGS, "-c", BOOTSTRAP]


@once
def compressed_agent() -> bytes:
    return zlib.compress(agent_source(), ZLIB_LEVEL)


@once
def loader_source() -> bytes:
    return piece_source(LOADER).encode("utf-8")


@once
def agent_key() -> str:
    """The agent source's hash, the host's cache key: BLAKE2b-128, hex (once per process)."""
    from hashlib import blake2b

    return blake2b(agent_source(), digest_size=16).hexdigest()


def encode_request(request: Mapping[str, Any], agent: bool = True) -> bytes:
    """The stdin payload: ``<n> <k> <m> <key>\\n<loader><zlib(agent source)><request JSON>``,
    n, k and m their lengths in bytes, key agent_key(); the request is data only. One-shot
    runs close stdin after it; watch mode keeps writing keep-alive lines after it
    (remote/watch.py). ``agent`` False leaves the source out (k 0) for a host known to have
    it cached: its loader runs the cache or answers ``{"agent_needed": ...}``
    (gpufleet.transport.knownagents)."""
    loader = loader_source()
    source = compressed_agent() if agent else b""
    payload = json.dumps(dict(request), separators=(",", ":")).encode("utf-8")
    head = b"%d %d %d %s\n" % (len(loader), len(source), len(payload), agent_key().encode())
    return head + loader + source + payload


def needs_agent(doc: Any) -> bool:
    """A loader's answer to a request without the agent, on a host whose cache lost it."""
    return isinstance(doc, dict) and "agent_needed" in doc and "facts" not in doc


#: Written on a conversation's stdin while the agent runs the clean request (the operator's
#: second Ctrl-C): send no further signal and report what was sent (remote/main.py CANCEL).
CANCEL_LINE = b"cancel\n"


def encode_next(request: Mapping[str, Any]) -> bytes:
    """A conversation's next request (the agent's stay mode, remote/main.py): ``<m>\\n`` and
    the request JSON (m bytes), written on the stdin the first request left open."""
    payload = json.dumps(dict(request), separators=(",", ":")).encode("utf-8")
    return b"%d\n" % len(payload) + payload
