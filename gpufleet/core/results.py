"""The one per-host outcome base: every command's per-host row has the same failure fields.

``HostResult`` (status, snapshots), ``HostClean`` (clean), ``HostRun`` (runbooks) and
``HostFit`` (fit) are dataclasses of their own (some frozen, some filled in step by step), so
the base is a plain class: it names the fields each declares (host, ok, error, error_kind,
seconds) and derives the rest from them. A failure is a value: ``error`` is the one line the
operator sees, ``error_kind`` (gpufleet.errors kinds) is what verdicts and exit codes read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from gpufleet.errors import INTERNAL, UNREACHABLE_KINDS


@dataclass(frozen=True)
class Failure:
    """Why a host failed: its kind (decisions) and its one-line message (people)."""

    kind: str
    message: str

    @property
    def unreachable(self) -> bool:
        """The host could not be reached at all (refused, timed out, no such name, ...)."""
        return self.kind in UNREACHABLE_KINDS


class HostOutcome:
    """What every per-host outcome has; subclasses declare these as dataclass fields."""

    host: str
    error: Optional[str]
    error_kind: Optional[str]
    seconds: float

    @property
    def failure(self) -> Optional[Failure]:
        """The failure as a value, None when there is none (a kind-less error is INTERNAL)."""
        if self.error is None and self.error_kind is None:
            return None
        return Failure(self.error_kind or INTERNAL, self.error or "failed")

    @property
    def unreachable(self) -> bool:
        failure = self.failure
        return failure is not None and failure.unreachable

    def error_kind_field(self) -> dict[str, Any]:
        """``{"error_kind": kind}`` for a failed host's JSON object, else nothing (the key is
        only added: every documented key stays as it was)."""
        return {"error_kind": self.error_kind} if self.error_kind else {}
