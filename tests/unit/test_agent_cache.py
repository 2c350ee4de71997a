"""The host's cache of the compiled agent (gpufleet/remote/loader.py): a hit after a miss, every
refusal (the directory or the file not the euid's own, writable by others, a symlink; a corrupt,
truncated or foreign entry; another interpreter) compiles instead and never crashes; pruning.

The loader's functions run here in-process on real directories and files (root: chown to
another uid is real); the end-to-end tests run the real bootstrap (docs/DESIGN.md) with a real
interpreter, as the controller does, and read the document's facts.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import pytest

from gpufleet.remote import agent_key, bootstrap_command, compressed_agent, encode_request, needs_agent
from gpufleet.remote import loader

OTHER_UID = 54321
BLOB = compressed_agent()
KEY = agent_key()
NAME = loader.entry_name(KEY)
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def load(where: Path, raw: bytes = b"{}") -> tuple[Any, dict[str, Any]]:
    return loader.load(BLOB, KEY, raw, str(where))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A cache directory holding a good entry for this agent and interpreter."""
    where = tmp_path / "cache"
    code, facts = load(where)
    assert facts == {"state": "miss", "reason": "absent"}
    assert code.co_filename == "gpufleet-agent"
    return where


@pytest.fixture
def no_compile(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts compiles of the agent (the real compile still runs)."""
    calls: list[int] = []
    real = loader.compile_agent

    def counting(blob: bytes) -> Any:
        calls.append(1)
        return real(blob)

    monkeypatch.setattr(loader, "compile_agent", counting)
    return calls


def test_a_miss_stores_an_entry_and_the_next_run_loads_it_without_compiling(cache, no_compile):
    entry = cache / NAME
    assert entry.is_file() and oct(cache.stat().st_mode & 0o777) == "0o700"
    assert oct(entry.stat().st_mode & 0o777) == "0o600"
    assert entry.read_bytes().startswith(b"gpufleet-agent-code 1 " + NAME.encode() + b" ")
    code, facts = load(cache)
    assert facts == {"state": "hit", "reason": None} and no_compile == []
    ns: dict[str, Any] = {"__name__": "not-run"}
    exec(code, ns)  # the whole agent: every piece's names, as a compile would give
    assert callable(ns["main"]) and callable(ns["snapshot"]) and ns["AGENT_VERSION"] == 1
    assert NAME.startswith("agent-" + KEY + "-" + sys.implementation.cache_tag + "-")


def test_off_reads_and_writes_nothing(tmp_path, no_compile):
    where = tmp_path / "cache"
    _, facts = load(where, b'{"mode": "snapshot", "agent_cache": false}')
    assert facts == {"state": "off", "reason": "inventory"} and no_compile == [1]
    assert not where.exists()


@ROOT_ONLY
def test_a_directory_owned_by_another_uid_is_not_used(cache, no_compile):
    os.chown(cache, OTHER_UID, OTHER_UID)
    _, facts = load(cache)
    assert facts == {"state": "unusable", "reason": "dir-owner"} and no_compile == [1]


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_directory_others_may_write_is_not_used(cache, no_compile, mode):
    cache.chmod(mode)
    _, facts = load(cache)
    assert facts == {"state": "unusable", "reason": "dir-mode"} and no_compile == [1]
    assert sorted(os.listdir(cache)) == [NAME]  # nothing written there either


def test_a_directory_that_is_a_symlink_is_not_followed(cache, tmp_path, no_compile):
    link = tmp_path / "link"
    link.symlink_to(cache)
    _, facts = load(link)
    assert facts == {"state": "unusable", "reason": "dir-symlink"} and no_compile == [1]


def test_an_entry_that_is_a_symlink_is_not_followed_and_is_replaced(cache, tmp_path, no_compile):
    good = tmp_path / "elsewhere.code"
    shutil.copy2(cache / NAME, good)
    (cache / NAME).unlink()
    (cache / NAME).symlink_to(good)
    _, facts = load(cache)
    assert facts == {"state": "miss", "reason": "file-symlink"} and no_compile == [1]
    assert not (cache / NAME).is_symlink() and (cache / NAME).is_file()  # renamed over it
    assert load(cache)[1]["state"] == "hit"


@ROOT_ONLY
def test_an_entry_owned_by_another_uid_is_not_loaded(cache, no_compile):
    os.chown(cache / NAME, OTHER_UID, OTHER_UID)
    _, facts = load(cache)
    assert facts == {"state": "miss", "reason": "file-owner"} and no_compile == [1]
    assert (cache / NAME).stat().st_uid == os.geteuid()  # replaced by our own


@pytest.mark.parametrize("mode", [0o620, 0o602])
def test_an_entry_others_may_write_is_not_loaded(cache, no_compile, mode):
    (cache / NAME).chmod(mode)
    _, facts = load(cache)
    assert facts == {"state": "miss", "reason": "file-mode"} and no_compile == [1]


def test_an_entry_that_is_not_a_regular_file_is_not_read(cache, no_compile):
    (cache / NAME).unlink()
    os.mkfifo(cache / NAME, 0o600)  # O_NONBLOCK: opening it does not wait for a writer
    _, facts = load(cache)
    assert facts == {"state": "miss", "reason": "file-not-regular"} and no_compile == [1]


def _rewrite(entry: Path, change: Any) -> None:
    entry.write_bytes(change(entry.read_bytes()))


@pytest.mark.parametrize("change", [
    lambda d: d[: len(d) // 2],  # truncated (a writer killed mid-way, a full disk)
    lambda d: d[:-1],
    lambda d: d[:-100] + bytes([d[-100] ^ 0xFF]) + d[-99:],  # one flipped byte
    lambda d: b"",
    lambda d: b"not a cache file at all\n" + d,
    lambda d: d.split(b"\n", 1)[1],  # no header
], ids=["half", "last-byte", "flipped", "empty", "garbage-header", "no-header"])
def test_a_corrupt_or_truncated_entry_is_compiled_again(cache, no_compile, change):
    _rewrite(cache / NAME, change)
    code, facts = load(cache)
    assert facts == {"state": "miss", "reason": "corrupt"} and no_compile == [1]
    assert code.co_filename == "gpufleet-agent"
    assert load(cache)[1]["state"] == "hit"  # the bad entry was replaced


def test_a_body_that_does_not_unmarshal_is_corrupt_even_with_a_matching_crc(cache, no_compile):
    body = b"\xff\x00garbage that is not marshal data"
    (cache / NAME).write_bytes(b"%s %s %d %d\n" % (loader.MAGIC, NAME.encode(), len(body),
                                                   zlib.crc32(body)) + body)
    assert load(cache)[1] == {"state": "miss", "reason": "corrupt"} and no_compile == [1]


def test_an_entry_of_another_agent_or_interpreter_under_this_name_is_foreign(cache, no_compile):
    other = NAME.replace(sys.implementation.cache_tag, "cpython-36")
    data = (cache / NAME).read_bytes().replace(NAME.encode(), other.encode(), 1)
    (cache / NAME).write_bytes(data)
    assert load(cache)[1] == {"state": "miss", "reason": "foreign"} and no_compile == [1]


def test_a_bad_key_or_an_unwritable_place_means_no_cache_and_no_crash(tmp_path, no_compile):
    assert loader.load(BLOB, "", b"{}", str(tmp_path / "c"))[1] == \
        {"state": "unusable", "reason": "no-key"}
    assert loader.load(BLOB, "../../etc/x" * 2, b"{}", str(tmp_path / "c"))[1]["state"] == \
        "unusable"
    (tmp_path / "file").write_text("x")
    assert load(tmp_path / "file")[1] == {"state": "unusable", "reason": "dir-not-dir"}
    code, facts = load(Path("/proc/gpufleet-no-such-cache"))  # mkdir fails there
    assert facts["state"] == "unusable" and facts["reason"].startswith("dir-create-")
    assert code.co_filename == "gpufleet-agent" and len(no_compile) == 4
    assert not (tmp_path / "c").exists()


def test_prune_keeps_the_newest_entries_and_drops_stale_temporary_files(cache):
    now = (cache / NAME).stat().st_mtime
    for i in range(6):  # older entries of other agent versions
        old = cache / ("agent-%032x-%s.code" % (i, sys.implementation.cache_tag))
        old.write_bytes(b"x")
        os.utime(old, (now - 100 - i, now - 100 - i))
    stale, fresh = cache / ".tmp-1-deadbeef", cache / ".tmp-2-cafe0000"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (now - 3600, now - 3600))
    (cache / NAME).unlink()  # this agent misses, is stored, then the directory is pruned
    assert load(cache)[1] == {"state": "miss", "reason": "absent"}
    names = sorted(os.listdir(cache))
    kept_old = ["agent-%032x-%s.code" % (i, sys.implementation.cache_tag) for i in range(3)]
    assert names == sorted([NAME, fresh.name] + kept_old)


def test_a_hit_refreshes_its_entry_so_pruning_keeps_it(cache):
    os.utime(cache / NAME, (1000, 1000))
    assert load(cache)[1]["state"] == "hit"
    assert (cache / NAME).stat().st_mtime > 1000


def test_the_cache_options_are_read_from_the_request():
    assert loader.cache_options(b"") == (True, None)
    assert loader.cache_options(b'{"agent_cache": false}') == (False, None)
    assert loader.cache_options(b'{"agent_cache": true, "agent_cache_dir": "/x"}') == (True, "/x")
    assert loader.cache_options(b"[1]") == (True, None)
    assert loader.cache_options(b"{not json") == (True, None)  # the agent reports it


# ---- end to end: the real bootstrap and interpreter, as the controller runs them

def _other_python() -> str | None:
    """Another CPython minor version on this machine (another cache_tag), or None."""
    for minor in (6, 12, 10, 13, 9, 8, 7):
        if minor == sys.version_info[1]:
            continue
        found = [shutil.which("python3.%d" % minor)]
        found += [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.%d*/bin/python3"
                                                          % minor))]
        for cand in found:
            if cand and subprocess.run([cand, "-c", "pass"], capture_output=True,
                                       timeout=60).returncode == 0:
                return cand
    return None


def agent(python: str, request: dict[str, Any], **popen: Any) -> dict[str, Any]:
    out = subprocess.run(bootstrap_command(python), input=encode_request(request),
                         capture_output=True, timeout=60, **popen)
    assert out.returncode == 0, out.stderr.decode()
    return json.loads(out.stdout)


def test_snapshot_documents_say_miss_then_hit(tmp_path):
    req = {"mode": "snapshot", "deadline_s": 20, "agent_cache_dir": str(tmp_path / "c")}
    first, second = agent(sys.executable, req), agent(sys.executable, req)
    assert (first["facts"]["agent_cache"], first["facts"]["agent_cache_reason"]) == \
        ("miss", "absent")
    assert (second["facts"]["agent_cache"], second["facts"]["agent_cache_reason"]) == \
        ("hit", None)
    assert os.listdir(tmp_path / "c") == [NAME]
    off = agent(sys.executable, dict(req, agent_cache=False))
    assert off["facts"]["agent_cache"] == "off"


def test_another_interpreter_compiles_its_own_entry(tmp_path):
    other = _other_python()
    if other is None:
        pytest.skip("no second CPython version on this machine")
    req = {"mode": "snapshot", "deadline_s": 20, "agent_cache_dir": str(tmp_path / "c")}
    states = [agent(py, req)["facts"]["agent_cache"]
              for py in (sys.executable, other, sys.executable, other)]
    assert states == ["miss", "miss", "hit", "hit"]
    assert len(os.listdir(tmp_path / "c")) == 2


@pytest.fixture
def nobody_home() -> Any:
    """A home directory the nobody user owns, under a path it can reach (pytest's is 0700)."""
    top = Path(tempfile.mkdtemp(prefix="gpufleet-cache-test-"))
    try:
        top.chmod(0o755)
        home = top / "home"
        home.mkdir()
        os.chown(home, 65534, 65534)
        yield home
    finally:
        shutil.rmtree(top)


@ROOT_ONLY
def test_a_user_agent_caches_in_its_own_home(nobody_home):
    """Not root: ``$HOME/.cache/gpufleet`` (no XDG_CACHE_HOME), made 0700 and owned by that
    user."""
    system_python = "/usr/bin/python3"
    if not os.access(system_python, os.X_OK):
        pytest.skip("needs /usr/bin/python3 (a python the nobody user can run)")
    home = nobody_home
    popen = {"user": 65534, "group": 65534, "extra_groups": [], "cwd": "/tmp",
             "env": {"PATH": "/usr/bin:/bin", "HOME": str(home)}}
    req = {"mode": "snapshot", "deadline_s": 20}
    states = [(doc["facts"]["agent_cache"], doc["facts"]["agent_cache_reason"])
              for doc in (agent(system_python, req, **popen) for _ in range(2))]
    assert states == [("miss", "absent"), ("hit", None)]
    where = home / ".cache" / "gpufleet"
    st = where.stat()
    assert (st.st_uid, oct(st.st_mode & 0o777)) == (65534, "0o700")
    assert [n for n in os.listdir(where) if n.startswith("agent-")]


def test_the_agents_start_loads_no_module_a_snapshot_does_not_need():
    """Module-level work before the snapshot (paid by every agent start): the joined agent's
    top level, run as a host runs it (``-S -E -s``), imports neither the process, socket and
    traceback modules nor the clean's fcntl/select (each loaded where it is used); it imports
    the plain standard library it reads with (json, re, signal, threading) and compiles its
    regular expressions once, at module level."""
    from gpufleet.remote import agent_source

    probe = ("import sys; src = sys.stdin.buffer.read(); ns = {'__name__': 'probe'}; "
             "exec(compile(src, 'gpufleet-agent', 'exec'), ns); "
             "import re; pats = [k for k, v in ns.items() if isinstance(v, re.Pattern)]; "
             "ok = ns['INVALID_FIELD_RE'].search('Field \"x\" is not a valid field to query'); "
             "print(' '.join(sorted(m for m in ('subprocess', 'socket', 'traceback', 'fcntl', "
             "'select') if m in sys.modules)) + '|' + "
             "' '.join(m for m in ('json', 're', 'signal', 'threading') if m in sys.modules) "
             "+ '|' + str(len(pats)) + '|' + ok.group(1))")
    out = subprocess.run([sys.executable, "-S", "-E", "-s", "-c", probe], input=agent_source(),
                         capture_output=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr.decode()
    loaded, plain, patterns, group = out.stdout.decode().strip().split("|")
    assert loaded == "" and plain == "json re signal threading"
    assert int(patterns) >= 15 and group == "x"


# ---- the agent left out (k 0) for a host whose cache holds it (transport/knownagents.py)

def lean(python: str, request: dict[str, Any]) -> tuple[bytes, Any]:
    out = subprocess.run(bootstrap_command(python), input=encode_request(request, agent=False),
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout, json.loads(out.stdout)


def test_a_request_without_the_agent_runs_the_hosts_cached_entry(tmp_path):
    req = {"mode": "snapshot", "deadline_s": 20, "agent_cache_dir": str(tmp_path / "c")}
    full = agent(sys.executable, req)
    assert (full["facts"]["agent_cache"], full["facts"]["agent_sent"]) == ("miss", True)
    _, doc = lean(sys.executable, req)
    assert (doc["facts"]["agent_cache"], doc["facts"]["agent_sent"]) == ("hit", False)
    assert doc["mode"] == "snapshot" and not needs_agent(doc)
    assert len(encode_request(req, agent=False)) < len(encode_request(req)) - len(BLOB) + 100


@pytest.mark.parametrize("spoil", ["empty", "other-mode", "off"])
def test_without_the_agent_and_no_trusted_entry_nothing_runs_and_the_agent_is_asked_for(
        tmp_path, spoil):
    """One line naming the key and why; no document, nothing compiled or written."""
    where = tmp_path / "c"
    req: dict[str, Any] = {"mode": "snapshot", "deadline_s": 20, "agent_cache_dir": str(where)}
    if spoil == "other-mode":
        agent(sys.executable, req)
        os.chmod(where / NAME, 0o666)
    if spoil == "off":
        req["agent_cache"] = False
    before = sorted(os.listdir(where)) if where.exists() else []
    text, doc = lean(sys.executable, req)
    reason = {"empty": "absent", "other-mode": "file-mode", "off": "inventory"}[spoil]
    assert doc == {"agent_needed": KEY, "reason": reason}
    assert text.count(b"\n") == 1 and needs_agent(doc)
    assert (sorted(os.listdir(where)) if where.exists() else []) == before
