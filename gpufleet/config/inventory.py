"""Load and validate fleet.yaml into an immutable ``Inventory`` of ``Host`` values.

The inventory is operator input that later decides where gpufleet connects and what it may
signal, so every mistake becomes ONE line naming the file, the line and the key
(``fleet.yaml:12: hosts.train-node: unknown key 'adress' (did you mean 'address'?)``),
raised as ``InventoryError`` (a UsageError: exit 2), never a traceback. Values are data:
nothing here is ever pasted into shell text, but addresses, users and names are still held to
conservative syntax so a typo or a pasted shell fragment is caught here rather than at
connect time.

The format is documented (and kept stable) in docs/inventory.md.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NoReturn, Optional, Sequence

from gpufleet.config import validators
from gpufleet.config.validators import (MAX_NAME, PROGRAM_WORD, Fail, describe, did_you_mean, has_control,
                                        plain_string)
from gpufleet.config.yamlsource import LineMap, LineSeq, load_yaml, read_source
from gpufleet.errors import InventoryError, UsageError, one_line

ENV_VAR = "GPUFLEET_INVENTORY"
LOCAL_FILENAME = "fleet.yaml"
USER_CONFIG = Path(".config") / "gpufleet" / "fleet.yaml"  # under the home directory
IMPLICIT_HOST = "localhost"
IMPLICIT_SOURCE = "<implicit>"
MAX_FILE_BYTES = 1 << 20  # a fleet file this big is the wrong file

IMPLICIT_HINT = (
    "gpufleet: no inventory found, showing this machine only; to add hosts, run "
    "`gpufleet init` (a commented ./fleet.yaml; --from-ssh-config: your ~/.ssh/config's "
    "hosts), or pass -i PATH, or set GPUFLEET_INVENTORY"
)

HOST_KEY_POLICIES = ("strict", "accept-new")
CONNECTIONS = ("ssh", "local", "exec")
#: Where the agent reads GPUs (docs/inventory.md): NVML with nvidia-smi as the fallback, NVML
#: only (an error when it is missing), or nvidia-smi only.
GPU_SOURCES = ("auto", "nvml", "nvidia-smi")
SSH_CLIENTS = ("auto", "openssh", "paramiko")
TOP_LEVEL_KEYS = ("defaults", "hosts", "groups")

# Host names, group names and tags: they are typed on command lines and shown in tables.
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
# A DNS name, an IPv4/IPv6 literal (with an optional %zone) or an ssh_config Host alias.
_ADDRESS_RE = re.compile(r"[A-Za-z0-9_:][A-Za-z0-9._:%-]*\Z")
# POSIX portable user names (letters, digits, . _ -), not starting with '-'.
_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")


@dataclass(frozen=True)
class Host:
    """One inventory host with defaults applied.

    ``user``/``port``/``identity_file`` stay None when the inventory does not set them, so the
    transport can let ~/.ssh/config fill them; ``explicit`` names the keys the inventory set
    (in ``defaults:`` or on the host), which win over ssh_config.
    """

    name: str
    address: Optional[str] = None
    port: Optional[int] = None
    user: Optional[str] = None
    identity_file: Optional[str] = None
    known_hosts_file: Optional[str] = None
    host_key_policy: str = "strict"
    connect_timeout: float = 10.0
    command_timeout: float = 60.0
    connection: str = "ssh"
    #: connection: exec: the local argv that reaches the host's shell (docs/inventory.md)
    exec: tuple[str, ...] = ()
    sudo: bool = False
    python: str = "python3"
    nvidia_smi: Optional[str] = None
    gpu_source: str = "auto"
    ssh_client: str = "auto"
    agent_cache: bool = True  # false: the agent's compiled code is neither cached nor read
    ssh_persist: float = 60.0  # seconds an idle SSH connection is kept for the next command; 0: none
    unattributed_mib: int = 0
    gpus: Optional[int] = None  # GPUs the host should have (health: a missing GPU); None: any
    protect: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    explicit: frozenset[str] = frozenset()
    source: str = IMPLICIT_SOURCE
    line: int = 0

    @property
    def is_local(self) -> bool:
        return self.connection == "local"

    @property
    def where(self) -> str:
        """Where the host was defined, for messages: ``fleet.yaml:12``."""
        return f"{self.source}:{self.line}" if self.line else self.source


@dataclass(frozen=True)
class Inventory:
    """Hosts in file order, groups in file order (name -> member host names)."""

    hosts: tuple[Host, ...]
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    path: Optional[Path] = None
    implicit: bool = False

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.hosts)

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag used, in order of first appearance."""
        seen: dict[str, None] = {}
        for h in self.hosts:
            for t in h.tags:
                seen.setdefault(t, None)
        return tuple(seen)

    def get(self, name: str) -> Optional[Host]:
        for h in self.hosts:
            if h.name == name:
                return h
        return None


def implicit_inventory() -> Inventory:
    """What gpufleet works on with no fleet.yaml anywhere: this machine, without SSH."""
    host = Host(name=IMPLICIT_HOST, connection="local", source=IMPLICIT_SOURCE, line=0)
    return Inventory(hosts=(host,), groups={}, path=None, implicit=True)


# --------------------------------------------------------------------------- lookup


def _expand(raw: str, cwd: Path, home: Path) -> Path:
    if raw == "~":
        return home
    if raw.startswith("~/"):
        return home / raw[2:]
    p = Path(raw)
    return p if p.is_absolute() else cwd / p


def find_inventory(
    explicit_path: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[os.PathLike | str] = None,
    home: Optional[os.PathLike | str] = None,
) -> Optional[Path]:
    """The inventory file to use, or None for the implicit localhost.

    Order: ``-i PATH``, ``$GPUFLEET_INVENTORY``, ``./fleet.yaml``,
    ``~/.config/gpufleet/fleet.yaml``. A path the operator named (flag or variable) must
    exist: silently falling back to another fleet would act on the wrong machines.
    Pass the result to ``load_inventory`` (None gives ``implicit_inventory()``).
    """
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else Path(cwd)
    home = Path.home() if home is None else Path(home)
    for raw, what in ((explicit_path, "-i/--inventory"), (env.get(ENV_VAR), f"${ENV_VAR}")):
        if raw is None or raw == "":
            continue
        raw = os.fspath(raw)
        if "\0" in raw:
            raise InventoryError(f"{what}: invalid path {raw!r}")
        path = _expand(raw, cwd, home)
        if not path.exists():
            raise InventoryError(f"{raw}: inventory file not found (from {what})")
        if not path.is_file():
            raise InventoryError(f"{raw}: inventory is not a regular file (from {what})")
        return path
    for path in (cwd / LOCAL_FILENAME, home / USER_CONFIG):
        if path.is_file():
            why = untrusted_file(path)
            if why is not None:
                raise InventoryError(f"{path}: {why}; not read as the inventory (pass -i to "
                                     "use it anyway)")
            return path
    return None


def untrusted_file(path: Path) -> Optional[str]:
    """Why an inventory found by itself (``./fleet.yaml`` in a shared directory, say) may have
    been written by someone else, or None: it must belong to this user or root, be writable by
    no one else, and sit in a directory where no one else can swap it (not group/other
    writable, or sticky like /tmp). A file the operator names with -i is theirs to judge."""
    try:
        st = path.stat()
        parent = path.parent.stat()
    except OSError as exc:
        return f"cannot check who wrote it ({exc.strerror})"
    if st.st_uid not in (0, os.geteuid()):
        return f"owned by uid {st.st_uid}, not by you or root"
    if st.st_mode & 0o022:
        return "writable by group or others"
    if parent.st_mode & 0o022 and not parent.st_mode & 0o1000:
        return "in a directory others can write"
    return None


def resolve_inventory(
    explicit_path: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[os.PathLike | str] = None,
    home: Optional[os.PathLike | str] = None,
) -> Inventory:
    """``load_inventory(find_inventory(...))``: when ``implicit`` the CLI prints IMPLICIT_HINT."""
    return load_inventory(find_inventory(explicit_path, env, cwd, home))


def load_inventory(path: Optional[os.PathLike | str], display: Optional[str] = None) -> Inventory:
    """Read and validate one inventory file; None -> ``implicit_inventory()``.

    ``display`` is the file name used in messages (default: the path as given).
    """
    if path is None:
        return implicit_inventory()
    path = Path(path)
    source = display if display is not None else str(path)
    try:
        text = read_source(path, source, "inventory file", MAX_FILE_BYTES)
    except UsageError as exc:  # unreadable, too large, not UTF-8: the inventory's error
        raise InventoryError(str(exc)) from None
    return parse_inventory(text, source=source, base_dir=path.parent, path=path)


def _check_name(value: Any, fail: Fail, what: str) -> str:
    text = plain_string(value, fail, what)
    if len(text) > MAX_NAME or not _NAME_RE.match(text):
        fail(f"invalid {what} {text!r}: use letters, digits, '.', '_' and '-' "
             "(not starting with '.' or '-')")
    return text


def _v_address(value: Any, fail: Fail, ctx: "_Ctx") -> str:
    text = plain_string(value, fail, "a host name, IP address or ~/.ssh/config alias")
    if "@" in text:
        fail(f"address {text!r} contains '@': put the user in 'user:' instead")
    if text.count(":") == 1 and text.rsplit(":", 1)[1].isdigit():
        fail(f"address {text!r} looks like HOST:PORT: put the port in 'port:' instead")
    if len(text) > MAX_NAME or not _ADDRESS_RE.match(text):
        fail(f"invalid address {text!r}: a host name, IP address or ~/.ssh/config alias "
             "(no spaces, quotes or shell characters)")
    return text


def _v_port(value: Any, fail: Fail, ctx: "_Ctx") -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        fail(f"expected an integer port 1-65535, got {describe(value)}")
    return value


def _v_user(value: Any, fail: Fail, ctx: "_Ctx") -> Optional[str]:
    if value is None:
        return None
    text = plain_string(value, fail, "a user name")
    if len(text) > MAX_NAME or not _USER_RE.match(text) or text.isdigit():
        fail(f"invalid user name {text!r}: letters, digits, '.', '_' and '-' "
             "(not starting with '-' or '.', not all digits)")
    return text


def _v_local_path(value: Any, fail: Fail, ctx: "_Ctx") -> Optional[str]:
    """A file on THIS machine: '~' is kept for the transport; relative is to the inventory."""
    if value is None:
        return None
    text = plain_string(value, fail, "a file path")
    if text.startswith("~") or os.path.isabs(text) or ctx.base_dir is None:
        return text
    return str(ctx.base_dir / text)


def _v_remote_path(value: Any, fail: Fail, ctx: "_Ctx") -> Optional[str]:
    if value is None:
        return None
    text = plain_string(value, fail, "an absolute path")
    if not text.startswith("/"):
        fail(f"expected an absolute path on the host, got {text!r} "
             "(leave it unset to search PATH and the usual places)")
    return text


def _shared(check: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """A validator of gpufleet.config.validators, in this module's (value, fail, ctx) shape."""
    def adapted(value: Any, fail: Fail, ctx: "_Ctx") -> Any:
        return check(value, fail, **options)

    return adapted


def _v_python(value: Any, fail: Fail, ctx: "_Ctx") -> str:
    """The remote interpreter is shlex-quoted into the one constant command: one plain word."""
    text = plain_string(value, fail, "an interpreter name or path")
    if len(text) > 4096 or not PROGRAM_WORD.match(text):
        fail(f"invalid interpreter {text!r}: one command name or path "
             "(letters, digits, '/', '.', '_', '+', '-'; no spaces or arguments)")
    return text


def _list_of(
    item_check: Callable[[Any, Fail], str], what: str, names: bool = False
) -> Callable[..., tuple]:
    def check(value: Any, fail: Fail, ctx: "_Ctx") -> tuple:
        if not isinstance(value, list):
            fail(f"expected a list of {what} (e.g. [a, b]), got {describe(value)}")
        out: dict[str, None] = {}
        for i, item in enumerate(value):
            line = value.item_line(i) if isinstance(value, LineSeq) else 0
            if names and isinstance(value, LineSeq):
                item = value.item_text(i)
            item_fail = ctx.failer(line, f"{ctx.where}[{i}]")
            out.setdefault(item_check(item, item_fail), None)
        return tuple(out)

    return check


def _glob(value: Any, fail: Fail) -> str:
    return plain_string(value, fail, "a glob pattern string")


def _tag(value: Any, fail: Fail) -> str:
    return _check_name(value, fail, "tag")


_VALIDATORS: dict[str, Callable[..., Any]] = {
    "address": _v_address,
    "port": _v_port,
    "user": _v_user,
    "identity_file": _v_local_path,
    "known_hosts_file": _v_local_path,
    "host_key_policy": _shared(validators.choice(HOST_KEY_POLICIES)),
    "connect_timeout": _shared(validators.timeout, one_message=True),
    "command_timeout": _shared(validators.timeout, one_message=True),
    "connection": _shared(validators.choice(CONNECTIONS)),
    "exec": _shared(validators.exec_prefix),
    "sudo": _shared(validators.boolean),
    "python": _v_python,
    "nvidia_smi": _v_remote_path,
    "gpu_source": _shared(validators.choice(GPU_SOURCES)),
    "ssh_client": _shared(validators.choice(SSH_CLIENTS)),
    "agent_cache": _shared(validators.boolean),
    "ssh_persist": _shared(validators.seconds),
    "unattributed_mib": _shared(validators.mib, one_message=True),
    "gpus": _shared(validators.gpu_count),
    "protect": _list_of(_glob, "glob strings"),
    "tags": _list_of(_tag, "tags", names=True),
}

HOST_KEYS: tuple[str, ...] = tuple(_VALIDATORS)
DEFAULT_KEYS: tuple[str, ...] = tuple(k for k in HOST_KEYS if k != "address")
# Keys that accept null, meaning "unset here" (so ~/.ssh/config or a search fills them in).
_NULLABLE = frozenset(
    {"address", "port", "user", "identity_file", "known_hosts_file", "nvidia_smi", "gpus"}
)


class _Ctx:
    """Where we are in the document, to build one-line messages."""

    def __init__(self, source: str, base_dir: Optional[Path], where: str = ""):
        self.source = source
        self.base_dir = base_dir
        self.where = where

    def at(self, where: str) -> "_Ctx":
        return _Ctx(self.source, self.base_dir, where)

    def failer(self, line: int, where: Optional[str] = None) -> Fail:
        where = self.where if where is None else where

        def fail(message: str) -> NoReturn:
            loc = f"{self.source}:{line}" if line else self.source
            text = f"{loc}: {where}: {message}" if where else f"{loc}: {message}"
            raise InventoryError(one_line(text))

        return fail


def _line_of(container: Any, key: str) -> int:
    return container.key_line(key) if isinstance(container, LineMap) else 0


def _section(doc: Any, key: str, ctx: _Ctx, what: str) -> dict:
    """A mapping-valued section; missing or null is empty."""
    value = doc.get(key)
    if value is None:
        return LineMap()
    if not isinstance(value, dict):
        ctx.failer(_line_of(doc, key), key)(f"expected {what}, got {describe(value)}")
    return value


def _settings(raw: dict, allowed: Sequence[str], ctx: _Ctx) -> dict[str, Any]:
    """Validate one settings mapping (defaults or a host): key -> converted value."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        line = _line_of(raw, key)
        if key not in allowed:
            fail = ctx.failer(line)
            if key == "address":
                fail("'address' cannot be set in defaults (each host has its own)")
            if has_control(key):
                fail(f"invalid key {key!r}")
            fail(f"unknown key {key!r}{did_you_mean(key, allowed)}")
        if value is None and key in _NULLABLE:
            out[key] = None
            continue
        key_ctx = ctx.at(f"{ctx.where}.{key}")
        out[key] = _VALIDATORS[key](value, key_ctx.failer(line), key_ctx)
    return out


_BUILTIN: dict[str, Any] = {
    name: getattr(Host, name)
    for name in HOST_KEYS
    if name != "address"
}


def parse_inventory(
    text: str,
    source: str = "<string>",
    base_dir: Optional[Path] = None,
    path: Optional[Path] = None,
) -> Inventory:
    """Validate inventory YAML text. Relative key-file paths resolve against ``base_dir``."""
    if "\0" in text:
        raise InventoryError(f"{source}:{text[: text.index(chr(0))].count(chr(10)) + 1}: "
                             "NUL character in file")
    ctx = _Ctx(source, base_dir)
    doc = _top_level(text, source, ctx)

    defaults_raw = _section(doc, "defaults", ctx, "a mapping of settings")
    defaults = _settings(defaults_raw, DEFAULT_KEYS, ctx.at("defaults"))

    if "hosts" not in doc:
        raise InventoryError(f"{source}: no 'hosts:' section (`gpufleet init` writes a commented one)")
    hosts_raw = _section(doc, "hosts", ctx, "a mapping of host name to settings")
    if not hosts_raw:
        raise InventoryError(f"{source}:{_line_of(doc, 'hosts')}: hosts: no hosts defined")

    specs: list[tuple[str, dict[str, Any], int]] = []
    for name, body in hosts_raw.items():
        line = _line_of(hosts_raw, name)
        _check_name(name, ctx.failer(line, "hosts"), "host name")
        specs.append((name, _host_values(body, defaults, ctx.at(f"hosts.{name}"), line), line))

    groups = _groups(doc, hosts_raw, [s[0] for s in specs], ctx)
    hosts = []
    for name, values, line in specs:
        member_of = tuple(g for g, members in groups.items() if name in members)
        hosts.append(Host(name=name, groups=member_of, source=source, line=line, **values))
    return Inventory(hosts=tuple(hosts), groups=groups, path=path, implicit=False)


def _top_level(text: str, source: str, ctx: _Ctx) -> Any:
    """The YAML document: a mapping with only known top-level keys."""
    try:
        doc = load_yaml(text, source)
    except UsageError as exc:  # YAML that does not load: the inventory's error, one line
        raise InventoryError(str(exc)) from None
    if doc is None:
        raise InventoryError(f"{source}: empty inventory: it needs a 'hosts:' mapping "
                             "(`gpufleet init` writes a commented one)")
    if not isinstance(doc, dict):
        line = getattr(doc, "line", 1)
        raise InventoryError(f"{source}:{line}: the inventory must be a mapping with 'hosts:', "
                             f"got {describe(doc)}")
    for key in doc:
        if key not in TOP_LEVEL_KEYS:
            ctx.failer(_line_of(doc, key))(
                f"unknown top-level key {key!r}{did_you_mean(key, TOP_LEVEL_KEYS)}")
    return doc


def _host_values(body: Any, defaults: Mapping[str, Any], hctx: _Ctx, line: int) -> dict[str, Any]:
    """One host's Host fields: built-in defaults, then ``defaults:``, then its own settings."""
    if body is None:
        body = LineMap()
    if not isinstance(body, dict):
        hctx.failer(line)(f"expected a mapping of settings, got {describe(body)}")
    own = _settings(body, HOST_KEYS, hctx)
    merged = dict(_BUILTIN)
    merged.update(defaults)
    merged.update(own)
    if "protect" in defaults and "protect" in own:
        # A safety list never shrinks by accident: a host's protect adds to defaults'.
        merged["protect"] = tuple(dict.fromkeys(defaults["protect"] + own["protect"]))
    if merged["connection"] == "ssh" and not own.get("address"):
        hctx.failer(line)("missing 'address' (a host name, IP address or ~/.ssh/config "
                          "alias), or set 'connection: local'")
    if (merged["connection"] == "exec") != bool(merged["exec"]):
        hctx.failer(line)("'exec' (the argv that reaches the host, e.g. [docker, exec, -i, "
                          "CONTAINER]) goes with 'connection: exec', and only with it")
    explicit = frozenset(k for k in (set(defaults) | set(own)) if merged.get(k) is not None
                         or k not in _NULLABLE)
    return dict(merged, address=own.get("address"), explicit=explicit)


def _group_member_names(member: str, fail: Fail) -> list[str]:
    """A group member is a host name or a Slurm host range (``node[01-04,08]``)."""
    import re

    if not re.search(r"\[[0-9][0-9,-]*\]", member):
        return [member]
    from ClusterShell.NodeSet import NodeSet, NodeSetException  # type: ignore[import-untyped]

    try:
        return list(NodeSet(member))
    except (NodeSetException, ValueError) as exc:
        fail(f"bad host range {member!r}: {exc}")
    return []


def _groups(doc: Any, hosts_raw: Any, host_names: list[str], ctx: _Ctx) -> dict[str, tuple[str, ...]]:
    """The ``groups:`` section: each group's hosts, known and without repeats, in order."""
    groups: dict[str, tuple[str, ...]] = {}
    groups_raw = _section(doc, "groups", ctx, "a mapping of group name to a list of hosts")
    for gname, members in groups_raw.items():
        line = _line_of(groups_raw, gname)
        _check_name(gname, ctx.failer(line, "groups"), "group name")
        gctx = ctx.at(f"groups.{gname}")
        if gname in hosts_raw:
            gctx.failer(line)(f"group {gname!r} has the same name as a host; rename one")
        if members is None:
            members = LineSeq()
        if not isinstance(members, list):
            gctx.failer(line)(f"expected a list of host names, got {describe(members)}")
        out: dict[str, None] = {}
        for i, member in enumerate(members):
            mline = line
            if isinstance(members, LineSeq):
                mline, member = members.item_line(i), members.item_text(i)
            mfail = gctx.failer(mline, f"groups.{gname}[{i}]")
            plain_string(member, mfail, "a host name")
            for name in _group_member_names(member, mfail):
                if name not in hosts_raw:
                    mfail(f"unknown host {name!r}{did_you_mean(name, host_names)}"
                          + (f" (from {member!r})" if name != member else ""))
                out.setdefault(name, None)
        groups[gname] = tuple(out)
    return groups
