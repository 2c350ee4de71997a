"""The first stage on a host: reads the agent and its request, runs the agent's code object.

Sent before the agent (docs/DESIGN.md, "Running the agent"): the bootstrap compiles this small
program (a few KB) and runs it with globals ``{"__name__": "gpufleet_loader", "B": stdin's
buffer, "H": the header line's fields}``. It reads the compressed agent and the request by
length (stdin stays open after them: watch mode's keep-alives) and execs the agent. Compiling
the ~120 KB joined agent costs ~40 ms per exec, so the compiled code object is cached on the
host (marshal), keyed by the agent's hash (computed by the controller, sent in the header) and
this interpreter (``sys.implementation.cache_tag``, ``sys.hexversion``, ``marshal.version``).

A root agent must never run a file someone else could write, so a cache entry is loaded only
from a directory opened without following a symlink (O_NOFOLLOW), owned by the euid and not
group/other writable, and only from a regular file (O_NOFOLLOW) with the same owner and modes;
its header names the key and the body's length and CRC-32, so a truncated, corrupt or foreign
file is a miss, compiled as before. Entries are written to a temporary file in the directory
and renamed into place (atomic); the newest ``KEEP`` stay. Nothing here ever crashes the run:
any failure means "compile", and the document's ``facts.agent_cache`` (hit | miss | off |
unusable) and ``facts.agent_cache_reason`` say what happened.

Request keys read here (data, like the rest of the request): ``agent_cache`` (false: neither
read nor write; the inventory's ``agent_cache: false``) and ``agent_cache_dir`` (a directory
instead of the default, for tests and odd hosts). Standard library only, Python 3.6 grammar
(and it must run on 3.5 far enough for the agent's "Python too old" document).
"""
import errno
import json
import marshal
import os
import stat
import sys
import time
import zlib

#: Where a root agent caches: FHS's place for an application's cache data (persists across
#: reboots, safe to delete, root-only parents). Others: $XDG_CACHE_HOME or ~/.cache.
ROOT_CACHE_DIR = "/var/cache/gpufleet"
#: Entries kept (newest by mtime; a hit refreshes its mtime): a few agent versions side by
#: side (two controllers of different versions, a rollback) without growing forever.
KEEP = 4
MAGIC = b"gpufleet-agent-code 1"
#: A cache file larger than this is not read (the agent's code object is ~180 KB).
MAX_BYTES = 16 * 1024 * 1024
#: A temporary file older than this is a leftover of a killed writer (pruned).
TMP_MAX_AGE_S = 600.0
_FLAGS = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def cache_options(raw):
    """(enabled, directory or None) from the request bytes; a request that is not a JSON
    object leaves the cache on (the agent reports the bad request itself)."""
    try:
        req = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except ValueError:
        return True, None
    if not isinstance(req, dict):
        return True, None
    where = req.get("agent_cache_dir")
    return req.get("agent_cache", True) is not False, where if isinstance(where, str) else None


def default_dir():
    """The cache directory for this euid (None: no home to put it in)."""
    if os.geteuid() == 0:
        return ROOT_CACHE_DIR
    base = os.environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):
        home = os.environ.get("HOME") or ""
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "gpufleet")


def entry_name(key):
    """The file name of this agent's entry for this interpreter (None: no usable key)."""
    tag = getattr(sys.implementation, "cache_tag", None)
    if not tag or not key or not 16 <= len(key) <= 64:
        return None
    name = "agent-%s-%s-%x-m%d.code" % (key, tag, sys.hexversion, marshal.version)
    return name if set(name) <= _NAME_CHARS else None


def _refusal(st, euid, kind):
    """Why an lstat/fstat result may not be trusted, or None."""
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        return "dir-not-dir"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return "file-not-regular"
    if st.st_uid != euid:
        return kind + "-owner"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return kind + "-mode"
    return None


def open_dir(path):
    """(fd, None) of the cache directory, created 0700 when missing, or (None, reason)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _FLAGS
    for attempt in (0, 1):
        try:
            fd = os.open(path, flags)
            break
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # Linux: ENOTDIR for a link
                return None, "dir-symlink" if os.path.islink(path) else "dir-not-dir"
            if exc.errno != errno.ENOENT or attempt:
                return None, "dir-" + errno.errorcode.get(exc.errno, "error")
        try:
            os.makedirs(os.path.dirname(path) or "/", 0o700, True)
            os.mkdir(path, 0o700)
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                return None, "dir-create-" + errno.errorcode.get(exc.errno, "error")
    why = _refusal(os.fstat(fd), os.geteuid(), "dir")
    if why is not None:
        os.close(fd)
        return None, why
    return fd, None


def read_entry(dfd, name):
    """(code object, None) from the entry, or (None, why it is a miss)."""
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _FLAGS, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return None, "absent"
        return None, "file-symlink" if exc.errno == errno.ELOOP else "file-unreadable"
    try:
        st = os.fstat(fd)
        why = _refusal(st, os.geteuid(), "file")
        if why is None and st.st_size > MAX_BYTES:
            why = "file-size"
        if why is not None:
            return None, why
        chunks = []
        left = st.st_size + 1  # one more: a file that grew is not what was checked
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        try:
            os.utime(fd)  # the newest stay when pruning
        except (OSError, NotImplementedError, TypeError):
            pass
    finally:
        os.close(fd)
    return decode_entry(data, name)


def decode_entry(data, name):
    """(code object, None) if ``data`` is a whole entry for ``name``, else (None, reason)."""
    head, sep, body = data.partition(b"\n")
    fields = head.split(b" ")
    if not sep or len(fields) != 5 or b" ".join(fields[:2]) != MAGIC:
        return None, "corrupt"
    if fields[2] != name.encode("ascii"):
        return None, "foreign"
    try:
        length, crc = int(fields[3]), int(fields[4])
    except ValueError:
        return None, "corrupt"
    if length != len(body) or crc != zlib.crc32(body) & 0xFFFFFFFF:
        return None, "corrupt"
    try:
        code = marshal.loads(body)
    except (ValueError, EOFError, TypeError):
        return None, "corrupt"
    if type(code) is not type(decode_entry.__code__):
        return None, "corrupt"
    return code, None


def write_entry(dfd, name, code):
    """Store the entry atomically (temp file + rename); None, or why it could not be."""
    body = marshal.dumps(code)
    data = b"%s %s %d %d\n" % (MAGIC, name.encode("ascii"), len(body),
                               zlib.crc32(body) & 0xFFFFFFFF) + body
    tmp = ".tmp-%d-%s" % (os.getpid(), "".join("%02x" % c for c in bytearray(os.urandom(4))))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS, 0o600, dir_fd=dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as exc:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        return "write-" + errno.errorcode.get(exc.errno, "error")
    return None


def prune(dfd, keep=KEEP, now=None):
    """Keep the ``keep`` newest entries; remove older ones and stale temporary files."""
    now = time.time() if now is None else now
    entries, stale = [], []
    for name in os.listdir(dfd):
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        if name.startswith("agent-") and name.endswith(".code"):
            entries.append((st.st_mtime, name))
        elif name.startswith(".tmp-") and now - st.st_mtime > TMP_MAX_AGE_S:
            stale.append(name)
    entries.sort(reverse=True)
    for name in [n for _, n in entries[keep:]] + stale:
        try:
            os.unlink(name, dir_fd=dfd)
        except OSError:
            pass


def compile_agent(blob):
    return compile(zlib.decompress(blob), "gpufleet-agent", "exec")


def cached_code(blob, key, raw, where=None):
    """(code object, {"state", "reason"}): from the cache when it has a trusted entry, else
    compiled (and stored). ``where`` overrides the directory (tests)."""
    enabled, asked = cache_options(raw)
    if not enabled:
        return compile_agent(blob), {"state": "off", "reason": "inventory"}
    name = entry_name(key)
    path = where or asked or default_dir()
    why = "no-key" if name is None else None if path else "no-home"
    if sys.version_info < (3, 6):
        why = "python-too-old"
    dfd = None
    if why is None:
        dfd, why = open_dir(os.path.abspath(path))
    if dfd is None:
        return compile_agent(blob), {"state": "unusable", "reason": why}
    try:
        code, why = read_entry(dfd, name)
        if code is not None:
            return code, {"state": "hit", "reason": None}
        code = compile_agent(blob)
        failed = write_entry(dfd, name, code)
        if failed is not None:
            return code, {"state": "unusable", "reason": failed}
        prune(dfd)
        return code, {"state": "miss", "reason": why}
    finally:
        os.close(dfd)


def load(blob, key, raw, where=None):
    """cached_code, except that nothing it hits can stop the agent from running."""
    try:
        return cached_code(blob, key, raw, where)
    except Exception as exc:  # a bug or an odd host: compile, as without a cache
        return compile_agent(blob), {"state": "unusable", "reason": "error-" + type(exc).__name__}


def needed(key, raw, why):
    """The one line sent instead of running anything when the controller left the agent out
    (``k`` 0: it had seen this host cache it) and this host has no trusted entry: the
    controller sends the whole agent again (gpufleet.transport.session). Nothing runs."""
    sys.stdout.write('{"agent_needed": "%s", "reason": "%s"}\n' % (
        "".join(c for c in key if c in _NAME_CHARS)[:64], why))
    sys.stdout.flush()


def cached_only(key, raw, where=None):
    """(code object or None, {"state", "reason"}) when the agent was not sent: only a
    trusted cache entry can run."""
    enabled, asked = cache_options(raw)
    if not enabled:
        return None, {"state": "off", "reason": "inventory"}
    name = entry_name(key)
    path = where or asked or default_dir()
    why = "no-key" if name is None else None if path else "no-home"
    if why is not None or sys.version_info < (3, 6):
        return None, {"state": "unusable", "reason": why or "python-too-old"}
    try:
        dfd, why = open_dir(os.path.abspath(path))
        if dfd is None:
            return None, {"state": "unusable", "reason": why}
        try:
            code, why = read_entry(dfd, name)
        finally:
            os.close(dfd)
    except Exception as exc:  # a bug or an odd host: ask for the agent
        return None, {"state": "unusable", "reason": "error-" + type(exc).__name__}
    return code, {"state": "hit" if code is not None else "miss", "reason": why}


def run(stdin, header):
    """Read the agent and the request by their lengths (header ``n k m key``), run the agent.
    ``k`` 0: the agent was left out, run from the cache or ask for it (``needed``). The agent
    runs from ``/``: a working directory is where the session started (a user's home under
    sudo, a world-writable directory), and nothing the agent starts or opens may depend on it."""
    try:
        os.chdir("/")
    except OSError:  # pragma: no cover - "/" is always there
        pass
    k, m = int(header[1]), int(header[2])
    key = header[3].decode("ascii", "replace") if len(header) > 3 else ""
    blob = stdin.read(k)
    raw = stdin.read(m)
    if k == 0:
        code, facts = cached_only(key, raw)
        if code is None:
            needed(key, raw, facts["reason"] or facts["state"])
            return
    else:
        code, facts = load(blob, key, raw)
    del blob
    facts["sent"] = k > 0
    exec(code, {"__name__": "gpufleet_agent", "REQUEST": raw, "AGENT_CACHE": facts})


if __name__ == "gpufleet_loader":
    run(globals()["B"], globals()["H"])  # injected by the bootstrap
