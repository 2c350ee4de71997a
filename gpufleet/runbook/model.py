"""The runbook model: a validated ``Runbook`` of ``Step`` values (pure).

gpufleet.runbook.load builds them from YAML; gpufleet.runbook.run executes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from gpufleet.runbook.kinds import MUTATING


@dataclass(frozen=True)
class Step:
    """One validated step; ``params`` holds the kind's typed fields (variables substituted)."""

    index: int  # 1-based position in the runbook
    name: str
    kind: str
    timeout: float
    line: int
    params: Mapping[str, Any] = field(default_factory=dict)
    continue_on_failure: bool = False  # a failure is reported, the host goes on (preflights)

    @property
    def mutating(self) -> bool:
        return self.kind in MUTATING

    @property
    def label(self) -> str:
        return f"step {self.index} {self.name!r} ({self.kind})"


@dataclass(frozen=True)
class Runbook:
    source: str
    name: str
    description: str
    vars: Mapping[str, str]
    steps: tuple[Step, ...]

    @property
    def mutating(self) -> bool:
        return any(s.mutating for s in self.steps)


__all__ = ["Runbook", "Step"]
