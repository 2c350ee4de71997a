"""One host of a live fleet (`gpufleet top`, `status --watch`) as a value: pure.

gpufleet.ops.live keeps one persistent session per host and publishes these; the renderers
read them. A host is *up* while its snapshots arrive, *stale* when the latest one is older
than ``stale_after_s`` or its session dropped after it had one (the last numbers are still
shown, with their age), *down* when it never answered (its failure says why), *connecting*
before its first answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from gpufleet.core.results import Failure
from gpufleet.errors import TIMEOUT

if TYPE_CHECKING:  # the model (~20 ms of imports) loads while the first sessions connect
    from gpufleet.core.model import HostResult

UP, STALE, DOWN, CONNECTING = "up", "stale", "down", "connecting"


@dataclass(frozen=True)
class LiveHost:
    """The latest of one host: ``result`` (its last snapshot, kept while it is away),
    ``received_at`` (monotonic seconds), ``failure`` (why the session is down now, None
    while it streams), ``reconnects`` (sessions opened after the first), ``retry_at``."""

    host: str
    result: Optional[HostResult] = None
    received_at: Optional[float] = None
    failure: Optional[Failure] = None
    reconnects: int = 0
    retry_at: Optional[float] = None
    stale_after_s: float = 5.0

    def age_s(self, now: float) -> Optional[float]:
        """Seconds since the latest snapshot; None before the first."""
        return None if self.received_at is None else max(0.0, now - self.received_at)

    def state(self, now: float) -> str:
        if self.result is None:
            return DOWN if self.failure is not None else CONNECTING
        age = self.age_s(now)
        if self.failure is not None or (age is not None and age > self.stale_after_s):
            return STALE
        return UP

    def as_result(self) -> HostResult:
        """A HostResult for the status renderers: the latest snapshot, or the failure."""
        if self.result is not None:
            return self.result
        from gpufleet.core.model import HostResult

        failure = self.failure or Failure(TIMEOUT, "no answer yet")
        return HostResult(host=self.host, ok=False, error=failure.message,
                          error_kind=failure.kind)


def stale_after(interval_s: float) -> float:
    """A host is stale once two intervals (and a second of slack) pass without a snapshot."""
    return 2.0 * interval_s + 1.0
