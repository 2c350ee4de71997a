"""The runbook model: a validated ``Runbook`` of ``Step`` values (pure).

gpufleet.runbook.load builds them from YAML; gpufleet.runbook.run executes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping, NoReturn, Optional, Union

from gpufleet.errors import StepFailed
from gpufleet.runbook.kinds import changes_hosts
from gpufleet.runbook.template import PerHostField

# One `serial` entry: a host count (0: every host left) or a percentage of all hosts ("25%").
SerialItem = Union[int, str]


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
        return changes_hosts(self.kind, self.params)

    @property
    def label(self) -> str:
        return f"step {self.index} {self.name!r} ({self.kind})"

    def for_host(self, host_values: Mapping[str, str]) -> "Step":
        """This step with its ``{{ HOST }}`` fields filled in for one host (local_* steps);
        a field that is then invalid fails the step (``StepFailed``), nothing runs."""
        if not any(isinstance(v, PerHostField) for v in self.params.values()):
            return self
        params: dict[str, Any] = {}
        for key, value in self.params.items():
            if isinstance(value, PerHostField):
                def fail(message: str, _key: str = key) -> NoReturn:
                    raise StepFailed(f"{_key}: {message}")

                value = value.value_for(host_values, fail)
            params[key] = value
        return replace(self, params=MappingProxyType(params))


@dataclass(frozen=True)
class Rolling:
    """How the hosts are rolled: in batches (Ansible's ``serial``), stopping every later batch
    once a batch fails more than ``max_fail_percentage`` of its hosts; ``gate`` steps run on a
    batch's hosts after all of its steps are done, ``pause_s`` waits before the next batch."""

    serial: tuple[SerialItem, ...] = ()  # () = one batch of every host
    max_fail_percentage: Optional[float] = None
    pause_s: float = 0.0
    gate: tuple[Step, ...] = ()

    @property
    def given(self) -> bool:
        """Whether anything asks for a rolling run (else the plain one-batch run and output)."""
        return bool(self.serial) or self.max_fail_percentage is not None or bool(self.gate) \
            or self.pause_s > 0


@dataclass(frozen=True)
class Runbook:
    source: str
    name: str
    description: str
    vars: Mapping[str, str]
    steps: tuple[Step, ...]
    rolling: Rolling = Rolling()

    @property
    def mutating(self) -> bool:
        return any(s.mutating for s in self.steps)


__all__ = ["Rolling", "Runbook", "SerialItem", "Step"]
