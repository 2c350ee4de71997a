"""Xid events from the kernel log: /dev/kmsg, else ``journalctl -k``, else ``dmesg --kernel``.

A piece of the remote agent, for the health gate (`gpufleet health`). Why: the NVIDIA driver reports GPU faults as Xid lines
in the kernel log (``NVRM: Xid (PCI:0000:18:00): 79, pid=..., GPU has fallen off the bus.``);
NVML has no call that lists them. Read once per snapshot, bounded in time and size, and folded
into one entry per (GPU bus id, Xid code) with a count and the last time, so the document
stays small however chatty the driver was.

Only kernel records count: /dev/kmsg's priority field carries the facility (0 = kernel; a
line a process writes to /dev/kmsg has facility 1, user), ``journalctl -k`` and ``dmesg
--kernel`` keep kernel records only. And only a record whose message STARTS with ``NVRM: Xid``
is an Xid: a process name quoted inside one (``name=...``) cannot make a second one.
"""
import errno
import os
import re
import stat
import time

from .jobs import run_cmd, which  # joined

KMSG = "/dev/kmsg"
XID_MARK = b"NVRM: Xid"
#: Bounds of one read of the ring buffer (the kernel's is 128 KiB - 32 MiB).
KMSG_MAX_BYTES = 16 << 20
KMSG_MAX_SECONDS = 0.5
LOG_CMD_TIMEOUT_S = 3.0
MESSAGE_MAX = 300
#: NVIDIA's format, from the driver's nvErrorLog: "NVRM: Xid (PCI:0000:18:00): 79, ..."; with
#: MIG "(PCI:0000:01:00 GPU-I:05)"; drivers before R450 print no "PCI:" ("(0000:03:00)").
XID_RE = re.compile(r"^NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})"
                r"(?:\.[0-9A-Fa-f])?(?: [^)]*)?\): ([0-9]+)\b,?\s*(.*)$")
#: ``dmesg``: "[12345.678901] message"; ``journalctl -o short-monotonic``:
#: "[  123.456789] host kernel: message".
DMESG_RE = re.compile(r"^\[\s*([0-9]+\.[0-9]+)\] (.*)$")
JOURNAL_RE = re.compile(r"^\[\s*([0-9]+\.[0-9]+)\] \S+ kernel: (.*)$")


def kmsg_records(data):
    """/dev/kmsg bytes -> [(facility, seconds since boot, message)]: records are
    ``pri,seq,usec,flags[,...];message`` lines; continuation lines (`` KEY=value``) are
    skipped; a record that does not parse is skipped, not fatal."""
    out = []
    for raw in data.split(b"\n"):
        if not raw or raw[:1] == b" ":
            continue
        head, sep, msg = raw.partition(b";")
        if not sep:
            continue
        fields = head.split(b",")
        try:
            pri = int(fields[0])
            usec = int(fields[2])
        except (ValueError, IndexError):
            continue
        out.append((pri >> 3, usec / 1e6, msg.decode("utf-8", "replace")))
    return out


def read_kmsg(path=KMSG, max_bytes=KMSG_MAX_BYTES, max_seconds=KMSG_MAX_SECONDS, mark=XID_MARK):
    """(records holding ``mark``, bytes read, truncated, error): the ring buffer from its
    oldest record, read without blocking (each read of /dev/kmsg returns one record; EAGAIN =
    read to the end; EPIPE = a record was overwritten meanwhile, reading goes on); only the
    records that can be Xid lines are kept. A regular file (the lab's fake) is read whole, up
    to max_bytes. error is None, or why it could not be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return b"", 0, False, "%s: %s" % (path, exc.strerror or exc)
    chunks = []
    size = 0
    count = 0
    truncated = False
    end = time.monotonic() + max_seconds
    read = os.read
    try:
        bufsize = max_bytes if stat.S_ISREG(os.fstat(fd).st_mode) else 8192
        while True:
            try:
                chunk = read(fd, bufsize)
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    break
                return b"".join(chunks), size, truncated, "%s: %s" % (path, exc.strerror or exc)
            if not chunk:
                break
            size += len(chunk)
            if mark in chunk:
                chunks.append(chunk if chunk.endswith(b"\n") else chunk + b"\n")
            count += 1
            if size >= max_bytes or (count & 255 == 0 and time.monotonic() > end):
                truncated = True
                break
    finally:
        os.close(fd)
    return b"".join(chunks), size, truncated, None


def text_records(text, line_re):
    """dmesg / journalctl text -> [(0, seconds since boot, message)] (kernel records only)."""
    out = []
    for line in text.splitlines():
        m = line_re.match(line)
        if m:
            out.append((0, float(m.group(1)), m.group(2)))
    return out


def fold_xids(records):
    """[(facility, seconds, message)] -> one entry per (bus id, code): count, first and last
    time (seconds since boot) and the last message (bounded), in first-seen order."""
    found = {}
    order = []
    for facility, secs, msg in records:
        if facility != 0:
            continue  # not the kernel's: a process wrote it
        m = XID_RE.match(msg)
        if not m:
            continue
        key = (m.group(1).lower(), int(m.group(2)))
        entry = found.get(key)
        if entry is None:
            entry = found[key] = {"pci": short_bus(m.group(1)), "code": key[1], "count": 0,
                                  "first_s": secs}
            order.append(key)
        entry["count"] += 1
        entry["last_s"] = secs
        entry["message"] = msg[:MESSAGE_MAX]
    return [found[k] for k in order]


def short_bus(text):
    """0000:18:00 (the Xid line's domain:bus:device), domain 4 hex digits, lower case."""
    domain, bus, dev = text.split(":")
    return "%04x:%s:%s" % (int(domain, 16), bus.lower(), dev.lower())


def uptime_s(proc="/proc"):
    try:
        with open(proc + "/uptime") as f:
            return float(f.read().split()[0])
    except (OSError, IOError, ValueError, IndexError):
        return None


def kernel_log(deadline, kmsg=KMSG, proc="/proc"):
    """The document's ``kernel_log``: {source, error, bytes, truncated, seconds, xid: [...]}:
    /dev/kmsg first; when it cannot be opened (a container, kernel.dmesg_restrict for a
    non-root agent), ``journalctl -k -b``, then ``dmesg --kernel``. Each Xid entry gets
    ``last_epoch`` (wall-clock seconds, from /proc/uptime) when the boot time is known."""
    t0 = time.monotonic()
    doc = {"source": None, "error": None, "bytes": 0, "truncated": False, "xid": []}
    data, size, truncated, why = read_kmsg(kmsg)
    if why is None:
        doc.update(source=kmsg, bytes=size, truncated=truncated)
        records = kmsg_records(data)
    else:
        records, errors = _log_commands(deadline, [why])
        doc["source"] = records and records[0] or None
        records = records[1] if records else []
        doc["error"] = None if doc["source"] else "; ".join(errors)
    doc["xid"] = fold_xids(records)
    up = uptime_s(proc)
    if up is not None:
        boot = time.time() - up
        for entry in doc["xid"]:
            entry["last_epoch"] = round(boot + entry["last_s"], 3)
    doc["seconds"] = round(time.monotonic() - t0, 3)
    return doc


def _log_commands(deadline, errors):
    """((source, records) or None, errors): journalctl -k, else dmesg --kernel, bounded."""
    tries = (("journalctl", ["-k", "-b", "-q", "--no-pager", "-o", "short-monotonic"],
              JOURNAL_RE),
             ("dmesg", ["--kernel"], DMESG_RE))
    for name, args, line_re in tries:
        path = which(name, ("/usr/bin/" + name, "/bin/" + name))
        if path is None:
            errors.append("%s not found" % name)
            continue
        res = run_cmd([path] + args, min(LOG_CMD_TIMEOUT_S, max(0.1, deadline.remaining())),
                      deadline, name)
        if res.error or res.rc != 0:
            first = (res.err or res.out or "").strip().splitlines()
            errors.append("%s: %s" % (name, res.error or (first[0] if first else
                                                           "exit %s" % res.rc)))
            continue
        records = text_records(res.out[-KMSG_MAX_BYTES:], line_re)
        if not records:  # no journald here (a container): its journal is empty
            errors.append("%s: no kernel records" % name)
            continue
        return (name, records), errors
    return None, errors
