"""The clean plan's values: what the planner decides, as frozen dataclasses (pure).

Kept apart from ``__init__`` so the planner's steps (evidence, families, notes, request) can
import them without importing the package that calls those steps.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from gpufleet.core.model import ProcessInfo
from gpufleet.core.policy import Owner

EVIDENCE_SMI = "nvidia-smi"  # listed, and it holds that GPU (policy.listing_check verified)
EVIDENCE_SMI_UNVERIFIED = "nvidia-smi (unverified)"  # listed; its device files not checkable
EVIDENCE_DEVICE = "device-file"
EVIDENCE_FAMILY = "family"  # device-file holder whose GPU processes below are all targets
EVIDENCE_OWNER = "owner"  # named by the operator (clean --owner): it restarts a target
EVIDENCE_MPS = "mps-client"  # unlisted CUDA MPS client a verified daemon lists (core/mps.py)

# Refusal kinds decided by the planner (policy's kinds are in gpufleet.core.policy).
SPANNING = "spanning"
AMBIGUOUS = "ambiguous"
NO_EVIDENCE = "no-evidence"
FAMILY = "family"
UNREADABLE = "unreadable"
UNTRUSTED_ROW = "untrusted-row"

INVISIBLE_REASON = "not visible from this PID namespace (container?)"


@dataclass(frozen=True)
class Target:
    """A process the agent will signal, identified by (pid, starttime) against PID reuse."""

    pid: int
    starttime: Optional[int]
    name: str
    cmdline: str
    gpus: tuple[int, ...]
    evidence: str
    wave: int
    family_root: int
    used_mib: Optional[int]
    user: Optional[str] = None
    unit: Optional[str] = None
    owner: Optional[Owner] = None
    evidence_reason: str = ""  # listed processes: policy.ListingCheck.evidence_reason


@dataclass(frozen=True)
class Refusal:
    """A process with GPU evidence (or a family tie) that will NOT be signalled, and why."""

    pid: int
    name: str
    reason: str
    kind: str = ""
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class UnitStop:
    unit: str
    disable: bool
    pids: tuple[int, ...]


@dataclass(frozen=True)
class Invisible:
    """A compute-app row whose PID does not exist in the agent's PID namespace."""

    pid: int
    gpu: int
    process_name: str
    used_mib: Optional[int]
    reason: str = INVISIBLE_REASON


@dataclass(frozen=True)
class Client:
    """A device-file holder with no evidence of GPU memory (a monitor, an exporter): shown,
    never signalled."""

    pid: int
    name: str
    gpus: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Plan:
    host: str
    scope: tuple[int, ...]
    full_scope: bool
    targets: tuple[Target, ...]
    refused: tuple[Refusal, ...]
    units_to_stop: tuple[UnitStop, ...]
    invisible: tuple[Invisible, ...]
    threshold_mib: Mapping[int, int]
    notes: tuple[str, ...] = ()
    clients: tuple[Client, ...] = ()
    settle_s: float = 0.0  # how long the clean watches for the GPU being retaken
    listed_pids: tuple[int, ...] = ()  # on scope GPUs before the clean: not a retake later
    scope_uuids: tuple[str, ...] = ()  # how nvidia-smi names the scope GPUs (by UUID)

    def target(self, pid: int) -> Optional[Target]:
        return next((t for t in self.targets if t.pid == pid), None)

    def refusal_of(self, pid: int) -> Optional[Refusal]:
        """The Refusal entry of ``pid`` in this plan, if it was refused."""
        return next((r for r in self.refused if r.pid == pid), None)

    @property
    def target_pids(self) -> frozenset[int]:
        return frozenset(t.pid for t in self.targets)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (threshold keys as strings, like the agent request)."""
        out = asdict(self)
        out["threshold_mib"] = {str(k): v for k, v in sorted(self.threshold_mib.items())}
        return out


@dataclass
class Candidate:
    """A process the evidence points at, before policy and families have their say."""

    proc: ProcessInfo
    evidence: str
    gpus: tuple[int, ...]
    used_mib: Optional[int]
    evidence_reason: str = ""


@dataclass(frozen=True)
class PlanScope:
    """The GPUs a clean covers: sorted indices, and whether that is every GPU of the host."""

    indices: tuple[int, ...]
    full: bool

    def covers(self, gpus: tuple[int, ...]) -> bool:
        return set(gpus) <= set(self.indices)

    def touches(self, gpus: tuple[int, ...]) -> bool:
        return bool(set(gpus) & set(self.indices))

    def outside(self, gpus: tuple[int, ...]) -> set[int]:
        return set(gpus) - set(self.indices)
