"""vLLM's own start-up memory arithmetic, replayed on a GPU's live numbers (pure, no I/O).

`gpufleet fit` must say what vLLM will say, so this module copies vLLM's formula rather than
estimating one. Source read: vllm-project/vllm at commit 35d5cda123ec (a recent main: it
has ``vllm.utils.mem_utils`` and the VLLM_USE_V2_MODEL_RUNNER switch; release tag not checked):

* ``vllm/v1/worker/gpu_worker.py`` ``Worker.init_device``: CUDA context, then
  ``init_worker_distributed_environment`` (NCCL), then ``init_snapshot = MemorySnapshot()``
  (``torch.cuda.mem_get_info``: free and total as the process sees them), then
  ``requested_memory = init_snapshot.total_memory * gpu_memory_utilization`` and, when
  ``init_snapshot.free_memory < requested_memory``, ``ValueError("Free memory on device
  (F/T GiB) on startup is less than desired GPU memory utilization (U, R GiB). ...")``.
* ``Worker.determine_available_memory``: ``available_kv_cache_memory_bytes =
  requested_memory - profile_result.non_kv_cache_memory``.
* ``vllm/utils/mem_utils.py`` ``memory_profiling``: ``non_kv_cache_memory =
  weights_memory + torch_peak_increase + non_torch_increase``, where ``non_torch_increase``
  is the growth of non-torch memory (cudaMemGetInfo used minus torch's reserved) from the
  init snapshot to after the profile run: cuBLAS/cuBLASLt workspaces and kernels loaded
  lazily during the dummy forward, NCCL/custom all-reduce buffers made after start-up,
  attention-backend buffers outside torch's allocator.
* ``vllm/config/cache.py`` ``CacheConfig.gpu_memory_utilization = Field(default=0.9, gt=0,
  le=1)``: the default and the valid range (0, 1] used here.

Consequences that this module keeps: ``total`` is cudaMemGetInfo's total, which on bare metal
is nvidia-smi ``memory.total - memory.reserved`` (measured below); the CUDA context and the
NCCL communicators exist *before* the snapshot, so they lower the free memory vLLM sees but
are not part of ``non_torch`` and are not taken out of ``requested``. An older V1 worker
(commit 0012cf6) had no start-up check and counted all non-torch memory in the peak instead.

Units: GiB = 2**30 bytes (vLLM's ``GiB_bytes``); inputs from nvidia-smi are MiB.

Defaults and where they come from (all measured, torch 2.11.0+cu130, driver 580.159.04,
NVIDIA H200, 2026-11-30, one process per GPU, ``torch.cuda.set_device`` then a 1-element
tensor; nvidia-smi free before/after and ``mem_get_info`` minus ``memory_reserved``):

* ``DEFAULT_CONTEXT_MIB = 620``: free memory dropped 143156 -> 142536 MiB when the CUDA
  context was created (non-torch 619 MiB in-process, nvidia-smi used 621 MiB). The older
  probe in tests/fixtures/recorded/logs/h200-single-gpu.log shows ~518 MiB per process (20998 MiB
  attributed to a 20 GiB tensor), so contexts differ by driver/torch build: pass
  ``context_mib`` when you know yours.
* ``DEFAULT_NCCL_MIB = 840``: with two ranks, ``init_process_group("nccl")`` + a barrier
  raised non-torch memory from 619 to 1459 MiB per GPU (a 256 MiB all_reduce added nothing).
  vLLM initialises NCCL before its snapshot, so with ``tp > 1`` the default context is
  620 + 840 MiB. vLLM's own PyNccl communicator and custom all-reduce buffers come on top and
  were not measured: for tp > 1 the default is a lower bound.
* ``non_torch_gib`` defaults to 0: the forward pass's non-torch growth we measured on one H200
  (a bf16/fp16 matmul, SDPA, layer norm, softmax) was 74 MiB (619 -> 693), and the seed case
  below (from a real vLLM start) is only reproduced with 0 on top of its activations. So
  ``activations_gib`` means vLLM's "Total non KV cache memory" minus "weights memory" from its
  profiling log line (torch peak increase + non-torch forward increase); pass
  ``non_torch_gib`` separately if you only have the torch peak.

The seed case, resolved: an RTX 5090 under WSL2 reported total 31.84 GiB and free 30.20 GiB,
util 0.945 -> requested 30.09 GiB, start-up passes; weights 27.57 + activations 2.7 leave a
KV cache of 30.09 - 30.27 = -0.18 GiB, which fails. 31.84 - 30.20 = 1.64 GiB is exactly the
reservation, leaving no room for a CUDA context inside those numbers, and with any measured
context (>= 0.5 GiB) taken off 30.20 the start-up check would fail instead of passing. So those
two figures are what vLLM measured *inside its own process* (its log/error line prints them
that way), i.e. already after its context: replay them with ``context_mib=0``. Numbers read
from nvidia-smi on the host are taken before vLLM exists, so the default context applies.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Optional

from gpufleet.errors import UsageError

MIB_PER_GIB = 1024.0
BYTES_PER_GIB = float(1 << 30)

DEFAULT_UTIL = 0.9  # vllm/config/cache.py CacheConfig.gpu_memory_utilization
DEFAULT_CONTEXT_MIB = 620.0  # measured, see the module docstring
DEFAULT_NCCL_MIB = 840.0  # measured per GPU for tp > 1, see the module docstring
UTIL_STEPS = 1000  # --util values are searched on a 0.001 grid (what an operator types)

DTYPE_BYTES = {
    "fp32": 4.0, "float32": 4.0,
    "fp16": 2.0, "float16": 2.0, "half": 2.0, "bf16": 2.0, "bfloat16": 2.0,
    "fp8": 1.0, "float8": 1.0, "int8": 1.0,
    "int4": 0.5, "fp4": 0.5, "nvfp4": 0.5, "mxfp4": 0.5,
}

_PARAMS = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")
_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


@dataclass(frozen=True)
class GpuMemory:
    """One GPU as nvidia-smi reports it (MiB). ``reserved_mib`` is outside CUDA's total."""

    index: int
    total_mib: float
    free_mib: float
    reserved_mib: float = 0.0


@dataclass(frozen=True)
class ModelNeed:
    """What one vLLM instance needs. ``weights_gib`` is the whole model (split over ``tp``);
    ``activations_gib`` and ``non_torch_gib`` are per GPU, as vLLM's per-worker log gives them.
    ``params``/``bytes_per_param`` only feed the suggestions (8-bit, 4-bit, smaller model)."""

    weights_gib: float
    activations_gib: float = 0.0
    non_torch_gib: float = 0.0
    tp: int = 1
    params: Optional[float] = None
    bytes_per_param: float = 2.0
    dtype: Optional[str] = None  # as named, or assumed (``dtype_assumed``): the report says so
    dtype_assumed: bool = False

    @property
    def weights_per_gpu_gib(self) -> float:
        return self.weights_gib / self.tp

    @property
    def non_kv_gib(self) -> float:
        """vLLM's non_kv_cache_memory on one GPU: weights share + activation peak + non-torch."""
        return self.weights_per_gpu_gib + self.activations_gib + self.non_torch_gib

    @property
    def param_count(self) -> float:
        if self.params is not None:
            return self.params
        return self.weights_gib * BYTES_PER_GIB / self.bytes_per_param


@dataclass(frozen=True)
class HolderUse:
    """A process holding memory on the GPU (from nvidia-smi compute-apps)."""

    pid: int
    name: str
    used_mib: Optional[float]


@dataclass(frozen=True)
class FitResult:
    index: int
    total_gib: float  # CUDA's total: nvidia-smi total - reserved
    free_host_gib: float  # nvidia-smi memory.free now
    context_gib: float  # taken off free_host_gib: vLLM's own CUDA context (+ NCCL for tp > 1)
    free_gib: float  # free as vLLM will measure it at start-up
    util: float
    requested_gib: float
    startup_ok: bool
    weights_gib: float  # this GPU's share
    activations_gib: float
    non_torch_gib: float
    non_kv_gib: float
    kv_cache_gib: float
    ok: bool  # start-up passes and the KV cache is positive at ``util``
    max_util_startup: Optional[float]  # highest --util passing the start-up check
    min_util_kv: Optional[float]  # lowest --util leaving a positive KV cache
    feasible: bool  # some --util passes both
    shortfall_gib: Optional[float]  # when infeasible: GiB more needed
    capacity_limited: bool  # infeasible even with the whole GPU free (util 1.0)
    verdict: str
    vllm_error: Optional[str] = None  # vLLM's start-up ValueError text, when it would raise
    suggestions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------- validation and parsing


def _finite(value: float, what: str, *, allow_zero: bool = True) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{what} must be a number, got {value!r}") from None
    if math.isnan(number) or math.isinf(number):
        raise UsageError(f"{what} must be a finite number, got {value!r}")
    if number < 0 or (number == 0 and not allow_zero):
        raise UsageError(f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return number


def validate_util(util: float) -> float:
    """vLLM accepts 0 < util <= 1 (CacheConfig: Field(gt=0, le=1)); so do we."""
    number = _finite(util, "--util", allow_zero=False)
    if number > 1:
        raise UsageError(f"--util must be in (0, 1], got {util!r}")
    return number


def validate_need(need: ModelNeed) -> ModelNeed:
    _finite(need.weights_gib, "--weights-gib")
    _finite(need.activations_gib, "--activations-gib")
    _finite(need.non_torch_gib, "--non-torch-gib")
    _finite(need.bytes_per_param, "bytes per parameter", allow_zero=False)
    if need.params is not None:
        _finite(need.params, "--params", allow_zero=False)
    if isinstance(need.tp, bool) or not isinstance(need.tp, int) or need.tp < 1:
        raise UsageError(f"--tp must be a whole number >= 1, got {need.tp!r}")
    return need


def validate_gpu(gpu: GpuMemory) -> GpuMemory:
    total = _finite(gpu.total_mib, f"GPU {gpu.index} memory total", allow_zero=False)
    _finite(gpu.free_mib, f"GPU {gpu.index} memory free")
    reserved = _finite(gpu.reserved_mib, f"GPU {gpu.index} memory reserved")
    if reserved >= total:
        raise UsageError(f"GPU {gpu.index}: reserved {reserved} MiB >= total {total} MiB")
    return gpu


def dtype_bytes(dtype: str) -> float:
    """Bytes per parameter: fp32 4, fp16/bf16 2, fp8/int8 1, int4/fp4 0.5."""
    key = str(dtype).strip().lower()
    if key not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise UsageError(f"unknown --dtype {dtype!r} (known: {known})")
    return DTYPE_BYTES[key]


def parse_params(text: str) -> float:
    """'14e9', '14B', '7b', '70B', '1.5B', '500M' -> parameter count. A bare number below a
    million is refused: '14' almost certainly meant 14B."""
    match = _PARAMS.match(str(text))
    if not match:
        raise UsageError(f"--params {text!r}: write a count like 14e9, 14B, 7b or 500M")
    value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"--params {text!r} must be a positive count")
    if not match.group(2) and value < 1e6:
        raise UsageError(f"--params {text!r} is under a million parameters; did you mean {text}B?")
    return value


def weights_gib_from_params(params: float, dtype: str) -> float:
    """Weights in GiB for ``params`` parameters stored as ``dtype``."""
    count = _finite(params, "--params", allow_zero=False)
    return count * dtype_bytes(dtype) / BYTES_PER_GIB


def format_params(params: float) -> str:
    """14e9 -> '14B', 1.5e9 -> '1.5B', 5e8 -> '500M'."""
    if params >= 1e9:
        return f"{params / 1e9:.3g}B"
    return f"{params / 1e6:.3g}M"


def default_context_mib(tp: int) -> float:
    """What vLLM's process holds before its snapshot: CUDA context, plus NCCL when tp > 1."""
    return DEFAULT_CONTEXT_MIB + (DEFAULT_NCCL_MIB if tp > 1 else 0.0)


def check_tp(gpu_count: int, tp: int) -> None:
    """A tensor-parallel group needs ``tp`` GPUs; the selection must split evenly into groups."""
    if gpu_count < tp:
        raise UsageError(f"--tp {tp} needs {tp} GPUs, only {gpu_count} selected")
    if gpu_count % tp:
        raise UsageError(f"--tp {tp} does not divide the {gpu_count} selected GPUs")


# ---------------------------------------------------------------- the arithmetic


def _requested(util: float, total_gib: float) -> float:
    # vllm/v1/worker/gpu_worker.py Worker.init_device (35d5cda):
    #   requested_memory = init_snapshot.total_memory * cache_config.gpu_memory_utilization
    return util * total_gib


def _startup_ok(util: float, total_gib: float, free_gib: float) -> bool:
    # Worker.init_device raises ValueError when init_snapshot.free_memory < requested_memory.
    return not free_gib < _requested(util, total_gib)


def kv_cache(util: float, total_gib: float, non_kv_gib: float) -> float:
    # Worker.determine_available_memory (35d5cda):
    #   available_kv_cache_memory_bytes = requested_memory - profile_result.non_kv_cache_memory
    # vllm/utils/mem_utils.py memory_profiling:
    #   non_kv_cache_memory = non_torch_increase + torch_peak_increase + weights_memory
    return _requested(util, total_gib) - non_kv_gib


def _grid(k: int) -> float:
    return k / UTIL_STEPS


def max_util_startup(total_gib: float, free_gib: float) -> Optional[float]:
    """Highest --util on the 0.001 grid that passes the start-up check; None if none does."""
    k = min(UTIL_STEPS, math.floor(free_gib / total_gib * UTIL_STEPS)) if free_gib > 0 else 0
    while k > 0 and not _startup_ok(_grid(k), total_gib, free_gib):
        k -= 1
    while k < UTIL_STEPS and _startup_ok(_grid(k + 1), total_gib, free_gib):
        k += 1
    return _grid(k) if k > 0 else None


def _min_k_kv(total_gib: float, non_kv_gib: float) -> int:
    """Smallest grid step k >= 1 (possibly > UTIL_STEPS) with a positive KV cache at k/1000."""
    k = max(1, math.floor(non_kv_gib / total_gib * UTIL_STEPS))
    while k > 1 and kv_cache(_grid(k - 1), total_gib, non_kv_gib) > 0:
        k -= 1
    while not kv_cache(_grid(k), total_gib, non_kv_gib) > 0:
        k += 1
    return k


def min_util_kv(total_gib: float, non_kv_gib: float) -> Optional[float]:
    """Lowest --util on the 0.001 grid leaving a positive KV cache; None above 1.0."""
    k = _min_k_kv(total_gib, non_kv_gib)
    return _grid(k) if k <= UTIL_STEPS else None


@dataclass(frozen=True)
class UtilWindow:
    max_util: Optional[float]
    min_util: Optional[float]
    feasible: bool
    shortfall_gib: Optional[float]
    capacity_limited: bool


def util_window(total_gib: float, free_gib: float, non_kv_gib: float) -> UtilWindow:
    hi = max_util_startup(total_gib, free_gib)
    k = _min_k_kv(total_gib, non_kv_gib)
    lo = _grid(k) if k <= UTIL_STEPS else None
    feasible = hi is not None and lo is not None and lo <= hi
    if feasible:
        return UtilWindow(hi, lo, True, None, False)
    if lo is None:
        # Even util 1.0 leaves no KV cache: the GPU itself is too small.
        return UtilWindow(hi, None, False, non_kv_gib - total_gib, True)
    # Free memory is the limit: the lowest util with a KV cache must also pass start-up.
    return UtilWindow(hi, lo, False, _requested(lo, total_gib) - free_gib, False)


def gib_text(value: float) -> str:
    return f"{value:.2f}"


def vllm_startup_error(free_gib: float, total_gib: float, util: float) -> str:
    """The ValueError text vLLM raises (gpu_worker.py Worker.init_device, 35d5cda)."""
    requested = _requested(util, total_gib)
    return (
        f"Free memory on device ({round(free_gib, 2)}/{round(total_gib, 2)} GiB) on startup "
        f"is less than desired GPU memory utilization ({util}, {round(requested, 2)} GiB). "
        "Decrease GPU memory utilization or reduce GPU memory used by other processes."
    )


def range_text(window: UtilWindow) -> str:
    return f"--util {window.min_util:.3f}..{window.max_util:.3f}"


# ---------------------------------------------------------------- one GPU


def replay(gpu: GpuMemory, need: ModelNeed, util: float = DEFAULT_UTIL,
           context_mib: Optional[float] = None) -> FitResult:
    """Replay vLLM's start-up on one GPU of a tensor-parallel group (see module docstring);
    the result has no suggestions yet (gpufleet.core.fit.suggestions adds them).

    ``context_mib`` None: the measured default for ``need.tp``; 0 when the numbers were
    measured inside vLLM's process already.
    """
    util = validate_util(util)
    validate_need(need)
    validate_gpu(gpu)
    context = default_context_mib(need.tp) if context_mib is None else _finite(context_mib, "--context-mib")

    total = (float(gpu.total_mib) - float(gpu.reserved_mib)) / MIB_PER_GIB
    free_host = float(gpu.free_mib) / MIB_PER_GIB
    free = max(0.0, free_host - context / MIB_PER_GIB)
    requested = _requested(util, total)
    startup = _startup_ok(util, total, free)
    non_kv = need.non_kv_gib
    kv = kv_cache(util, total, non_kv)
    ok = startup and kv > 0
    window = util_window(total, free, non_kv)
    return FitResult(
        index=gpu.index,
        total_gib=total,
        free_host_gib=free_host,
        context_gib=context / MIB_PER_GIB,
        free_gib=free,
        util=util,
        requested_gib=requested,
        startup_ok=startup,
        weights_gib=need.weights_per_gpu_gib,
        activations_gib=need.activations_gib,
        non_torch_gib=need.non_torch_gib,
        non_kv_gib=non_kv,
        kv_cache_gib=kv,
        ok=ok,
        max_util_startup=window.max_util,
        min_util_kv=window.min_util,
        feasible=window.feasible,
        shortfall_gib=window.shortfall_gib,
        capacity_limited=window.capacity_limited,
        verdict=_verdict(ok, startup, window, util, free, requested, kv, total, need),
        vllm_error=None if startup else vllm_startup_error(free, total, util),
        notes=_notes(need, context, context_mib),
    )


def _verdict(ok: bool, startup: bool, window: UtilWindow, util: float, free: float,
             requested: float, kv: float, total: float, need: ModelNeed) -> str:
    if ok:
        return f"fits: KV cache {gib_text(kv)} GiB at --util {util:g}"
    if window.feasible:
        why = (f"start-up fails (free {gib_text(free)} < requested {gib_text(requested)} GiB)" if not startup
               else f"no room for a KV cache ({gib_text(kv)} GiB)")
        return f"{why} at --util {util:g}; use {range_text(window)}"
    shortfall = window.shortfall_gib or 0.0  # always set when infeasible
    if window.capacity_limited:
        return (f"infeasible at any utilization: needs {gib_text(shortfall)} GiB more "
                f"than this GPU's {gib_text(total)} GiB (weights {gib_text(need.weights_per_gpu_gib)} + "
                f"activations {gib_text(need.activations_gib + need.non_torch_gib)} GiB)")
    return (f"infeasible at any utilization: needs {gib_text(shortfall)} GiB more free "
            f"memory (at --util {window.min_util:.3f}, free {gib_text(free)} GiB)")


def _notes(need: ModelNeed, context: float, context_mib: Optional[float]) -> tuple[str, ...]:
    notes = []
    if need.activations_gib == 0 and need.non_torch_gib == 0:
        notes.append("activations not given (0 GiB assumed): the KV cache figure is an upper bound")
    if context:
        what = "CUDA context and NCCL buffers" if need.tp > 1 and context_mib is None else "CUDA context"
        notes.append(f"vLLM sees the free memory nvidia-smi reports less its own {what} "
                     f"({context:.0f} MiB, --context-mib)")
    return tuple(notes)


def exit_code(results: Iterable[FitResult]) -> int:
    """0 when every GPU fits at the given util, 1 otherwise (2 is raised as UsageError)."""
    return 0 if all(r.ok for r in results) else 1


__all__ = [
    "BYTES_PER_GIB", "DEFAULT_CONTEXT_MIB", "DEFAULT_NCCL_MIB", "DEFAULT_UTIL", "DTYPE_BYTES",
    "MIB_PER_GIB", "FitResult", "GpuMemory", "HolderUse", "ModelNeed", "UtilWindow",
    "check_tp", "default_context_mib", "dtype_bytes", "exit_code", "format_params", "gib_text",
    "kv_cache", "max_util_startup", "min_util_kv", "parse_params", "range_text", "replay",
    "util_window", "validate_gpu", "validate_need", "validate_util", "vllm_startup_error",
    "weights_gib_from_params",
]
