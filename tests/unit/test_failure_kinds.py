"""Failures are values with a kind: the kind, never the message's words, decides verdicts."""
from __future__ import annotations

import socket
from typing import Any

import paramiko
import pytest

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.ops.clean import CleanOptions, plan_host
from gpufleet.ops.collect import result_from_reply
from gpufleet.transport import AgentReply, transport_error


class ReplySession:
    """A session whose agent run gives one fixed reply (no host is reached)."""

    def __init__(self, reply: AgentReply):
        self.reply = reply

    def run_agent(self, request: Any, timeout: Any = None) -> AgentReply:
        return self.reply


def planned(error: str, kind: str) -> Any:
    host = Host(name="h1", address="203.0.113.9")
    return plan_host(host, ReplySession(AgentReply(False, error=error, error_kind=kind)),
                     CleanOptions())


def test_unreachable_is_chosen_from_the_kind_not_the_words() -> None:
    out = planned("the far end said nothing we know", errors.REFUSED)
    assert (out.verdict, out.error, out.error_kind) == (
        "unreachable", "the far end said nothing we know", "refused")


def test_words_of_the_old_search_no_longer_decide() -> None:
    # an auth failure whose text mentions "connection refused" (say, a key's file name)
    out = planned("authentication failed (tried ~/keys/connection-refused)", errors.AUTH)
    assert out.verdict == "error" and out.error_kind == "auth"


@pytest.mark.parametrize("kind", sorted(errors.UNREACHABLE_KINDS))
def test_every_unreachable_kind_is_unreachable(kind: str) -> None:
    assert planned("x", kind).verdict == "unreachable"


@pytest.mark.parametrize("exc, kind", [
    (ConnectionRefusedError(111, "Connection refused"), errors.REFUSED),
    (socket.timeout("timed out"), errors.TIMEOUT),
    (EOFError(), errors.CLOSED),
    (paramiko.SSHException("Error reading SSH protocol banner"), errors.BANNER),
    (paramiko.AuthenticationException("no"), errors.AUTH),
    (OSError(113, "No route to host"), errors.NETWORK),
    (RuntimeError("a bug"), errors.INTERNAL),
])
def test_transport_error_classifies_what_a_connect_raises(exc: BaseException, kind: str) -> None:
    assert transport_error(exc).kind == kind


def test_json_rows_add_error_kind_only_for_failures() -> None:
    host = Host(name="h1", address="203.0.113.9")
    failed = result_from_reply(host, AgentReply(False, error="e", error_kind="dns"), 0.0)
    ok = result_from_reply(host, AgentReply(True, doc=None), 0.0)
    assert failed.error_kind_field() == {"error_kind": "dns"}
    assert failed.unreachable
    assert ok.error_kind_field() == {"error_kind": "agent"}  # ok but no document: a failure


def test_describe_is_one_line() -> None:
    assert errors.describe(RuntimeError("boom\nsecond")) == "RuntimeError: boom"
    assert errors.describe(errors.UsageError("bad --gpus\nmore")) == "bad --gpus"
    assert errors.lines(errors.UsageError("a", more=["b"], notes=["n"])) == [
        "gpufleet: error: a", "gpufleet: error: b", "gpufleet: n"]
