"""The kept connections' pure parts: OpenSSH's mux messages as PROTOCOL.mux lays them out, the
environment a session sends (ssh's SendEnv/SetEnv), the private directory and the socket's
name (gpufleet/transport/mux.py, kept.py, openssh.py). Against a real master: the lab test
tests/integration/test_kept_connections_lab.py."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpufleet.transport import kept, mux
from gpufleet.transport.sshtarget import Target, session_env


def fields(data: bytes) -> tuple[int, bytes]:
    (n,) = struct.unpack(">I", data[:4])
    assert len(data) == 4 + n
    return struct.unpack(">I", data[4:8])[0], data[8:]


def test_a_session_request_is_laid_out_as_protocol_mux_says() -> None:
    kind, body = fields(mux.session_request(7, "python3 -S -c 'x'", ["LANG=C.UTF-8", "A=b c"]))
    assert kind == mux.C_NEW_SESSION == 0x10000002
    u32 = struct.Struct(">I")
    at = 0

    def take_u32() -> int:
        nonlocal at
        (v,) = u32.unpack_from(body, at)
        at += 4
        return v

    def take_string() -> bytes:
        nonlocal at
        n = take_u32()
        v = body[at:at + n]
        at += n
        return v

    assert take_u32() == 7  # request id
    assert take_string() == b""  # reserved
    assert [take_u32() for _ in range(4)] == [0, 0, 0, 0]  # tty, X11, agent, subsystem
    assert take_u32() == 0xFFFFFFFF  # no escape character
    assert take_string() == b""  # terminal type
    assert take_string() == b"python3 -S -c 'x'"
    assert [take_string(), take_string()] == [b"LANG=C.UTF-8", b"A=b c"]
    assert at == len(body)


@pytest.mark.parametrize("message, expected", [
    (mux.packet(mux.MSG_HELLO, struct.pack(">I", 4)), (mux.MSG_HELLO, [4], None)),
    (mux.packet(mux.S_SESSION_OPENED, struct.pack(">II", 1, 9)), (mux.S_SESSION_OPENED, [1, 9], None)),
    (mux.packet(mux.S_EXIT_MESSAGE, struct.pack(">II", 9, 3)), (mux.S_EXIT_MESSAGE, [9, 3], None)),
    (mux.packet(mux.S_ALIVE, struct.pack(">II", 1, 4242)), (mux.S_ALIVE, [1, 4242], None)),
    (mux.packet(mux.S_FAILURE, struct.pack(">II", 1, 5) + b"nope!"), (mux.S_FAILURE, [1], "nope!")),
    (mux.packet(mux.S_PERMISSION_DENIED, struct.pack(">II", 1, 6) + b"denied"),
     (mux.S_PERMISSION_DENIED, [1], "denied")),
])
def test_the_masters_messages_are_read(message: bytes, expected: tuple) -> None:
    assert mux.parse(message[4:]) == expected


@pytest.mark.parametrize("body", [b"", b"\x80\x00\x00\x04\x00", b"\x80\x00\x00\x03\x00\x00\x00\x01"])
def test_a_short_message_is_an_error_not_a_guess(body: bytes) -> None:
    with pytest.raises(ValueError):
        mux.parse(body)


def test_the_environment_is_sendenvs_matches_then_setenv() -> None:
    values = {"sendenv": ["LANG", "LC_*", "X?"], "setenv": ["FOO=bar baz"]}
    environ = {"HOME": "/root", "LANG": "C.UTF-8", "LC_TIME": "en_GB", "XY": "1", "XYZ": "2",
               "LANGUAGE": "en", "LC_ALL": "C"}
    assert session_env(values, environ) == (
        "LANG=C.UTF-8", "LC_TIME=en_GB", "XY=1", "LC_ALL=C", "FOO=bar baz")
    assert session_env({}, environ) == ()


def test_a_pattern_is_a_glob_of_star_and_question_mark_only() -> None:
    assert session_env({"sendenv": ["A.[B]"]}, {"A.[B]": "1", "AX[B]": "2", "A.B": "3"}) == ("A.[B]=1",)


def test_the_argv_starts_or_joins_the_kept_master_only_when_kept() -> None:
    base = Target(("ssh", "-T"), ("--", "h"), "h:22", "h", "root", 5.0, "strict", ())
    assert base.argv == ("ssh", "-T", "-o", "ControlMaster=no", "-o", "ControlPath=none", "--", "h")
    kept_one = Target(("ssh", "-T"), ("--", "h"), "h:22", "h", "root", 5.0, "strict", (),
                      kept="/run/gf/abc", persist_s=60)
    assert kept_one.argv == ("ssh", "-T", "-o", "ControlMaster=auto", "-o", "ControlPath=/run/gf/abc",
                             "-o", "ControlPersist=60", "--", "h")
    assert kept_one.alone == base.argv


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: Any) -> Iterator[Path]:
    short = Path(os.path.realpath("/tmp")) / ("gfu-%d" % os.getpid())
    short.mkdir(mode=0o700, exist_ok=True)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short))
    kept._warned.clear()
    yield short
    shutil.rmtree(short)  # a symlink inside is removed, never followed


def test_the_directory_is_made_private_and_names_differ_by_connection(runtime: Path) -> None:
    a = kept.socket_for(["ssh", "-p", "22", "--", "h", "h:22", "h", "root"])
    b = kept.socket_for(["ssh", "-p", "2222", "--", "h", "h:2222", "[h]:2222", "root"])
    assert a is not None and b is not None and a != b
    assert os.path.dirname(a) == str(runtime / "gpufleet-ssh")
    assert a == kept.socket_for(["ssh", "-p", "22", "--", "h", "h:22", "h", "root"])
    st = os.lstat(runtime / "gpufleet-ssh")
    assert st.st_mode & 0o777 == 0o700


@pytest.mark.parametrize("spoil, why", [
    (lambda d: os.chmod(d, 0o750), "is mode 0750, not 0700"),
    (lambda d: (os.rmdir(d), os.symlink("/tmp", d)), "is not a directory"),
])
def test_a_directory_that_is_not_private_keeps_nothing(runtime: Path, spoil: Any, why: str,
                                                       capsys: Any) -> None:
    where = runtime / "gpufleet-ssh"
    where.mkdir(mode=0o700)
    spoil(str(where))
    assert kept.socket_for(["ssh", "--", "h"]) is None
    assert kept.socket_for(["ssh", "--", "h2"]) is None
    err = capsys.readouterr().err
    assert err.count("gpufleet: warning: ssh_persist is off for this run") == 1
    assert why in err


def test_a_directory_too_long_for_a_socket_keeps_nothing(tmp_path: Path, monkeypatch: Any,
                                                         capsys: Any) -> None:
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    kept._warned.clear()
    assert kept.socket_for(["ssh", "--", "h"]) is None
    assert "too long for a socket path" in capsys.readouterr().err


def test_the_defaults_directory_too_long_keeps_nothing_quietly(tmp_path: Path, monkeypatch: Any,
                                                               capsys: Any) -> None:
    """ssh_persist left at its default (on): a HOME too deep for a socket path is no reason
    to warn on every command; nothing is kept, as with ``ssh_persist: 0``."""
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    kept._warned.clear()
    assert kept.socket_for(["ssh", "--", "h"], quiet_long=True) is None
    assert capsys.readouterr().err == ""


@contextlib.contextmanager
def listening(path: str) -> Iterator[None]:
    """A socket at ``path`` that accepts and never says anything."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    try:
        yield
    finally:
        listener.close()
        os.unlink(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_socket_of_another_user_is_never_joined(runtime: Path) -> None:
    path = str(runtime / "theirs")
    with listening(path):
        os.chown(path, 65534, 65534)
        with pytest.raises(mux.NoMaster) as caught:
            mux.Control(path, 1.0)
        assert caught.value.bypass and "not a socket of this user" in str(caught.value)
        assert mux.alive(path) is None


def test_a_stale_socket_is_no_master_and_is_removed(runtime: Path) -> None:
    path = str(runtime / "stale")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()
    with pytest.raises(mux.NoMaster) as caught:
        mux.Control(path, 1.0)
    assert not caught.value.bypass  # an ssh may become the master there
    assert not os.path.exists(path)


def test_a_listener_that_never_says_hello_is_passed_by(runtime: Path) -> None:
    path = str(runtime / "mute")
    with listening(path):
        with pytest.raises(mux.NoMaster) as caught:
            mux.Control(path, 0.3)
        assert caught.value.bypass  # an ssh joining it would wait as long: connect alone
