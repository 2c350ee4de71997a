"""`gpufleet fit` without click or rendering: snapshots in, per-host results, detail lines, the
JSON document and the exit code out (pure).

The CLI (gpufleet.cli.fit_cmd) collects one snapshot per host, builds a ``ModelNeed``
(``need_from_options``) and calls ``fit_report``; gpufleet.render.status.fit draws the table. The
per-GPU arithmetic is in gpufleet.core.fit.arithmetic, the alternatives in .suggestions.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Optional, Sequence

from gpufleet.core.fit.arithmetic import (
    DEFAULT_UTIL,
    FitResult,
    GpuMemory,
    HolderUse,
    ModelNeed,
    check_tp,
    dtype_bytes,
    exit_code,
    format_params,
    parse_params,
    replay,
    validate_need,
    validate_util,
    weights_gib_from_params,
)
from gpufleet.core.fit.suggestions import suggest_alternatives
from gpufleet.core.gpus import check_available, parse_gpu_list
from gpufleet.core.model import HostResult, Snapshot
from gpufleet.core.results import HostOutcome
from gpufleet.errors import AGENT, COMMAND, EXIT_FAILED, EXIT_OK, USAGE, UsageError


DEFAULT_DTYPE = "fp16"  # --params without --dtype (vLLM's "auto" on a 16-bit checkpoint)


def check_fit(
    gpu: GpuMemory,
    need: ModelNeed,
    util: float = DEFAULT_UTIL,
    context_mib: Optional[float] = None,
    holders: Iterable[HolderUse] = (),
) -> FitResult:
    """``replay`` on one GPU, plus what would fit instead when nothing does at any --util.
    ``holders`` feed the "free N holders" suggestion."""
    result = replay(gpu, need, util, context_mib)
    if not result.feasible:
        result = replace(result, suggestions=tuple(suggest_alternatives(result, need, holders, context_mib)))
    return result


def check_fleet(
    gpus: Sequence[GpuMemory],
    need: ModelNeed,
    util: float = DEFAULT_UTIL,
    context_mib: Optional[float] = None,
    holders_by_index: Optional[Mapping[int, Sequence[HolderUse]]] = None,
) -> tuple[FitResult, ...]:
    """check_fit on each selected GPU of one host, after checking the tp grouping."""
    validate_need(need)
    check_tp(len(gpus), need.tp)
    holders_by_index = holders_by_index or {}
    return tuple(
        check_fit(gpu, need, util, context_mib, holders_by_index.get(gpu.index, ()))
        for gpu in gpus
    )


def parse_gpus(spec: Optional[str]) -> Optional[tuple[int, ...]]:
    """'all' or None -> None (every GPU); otherwise the shared --gpus syntax (0-3, 0,2,5)."""
    if spec is None:
        return None
    return parse_gpu_list(str(spec))


def need_from_options(
    weights_gib: Optional[float] = None,
    params: Optional[str] = None,
    dtype: Optional[str] = None,
    activations_gib: float = 0.0,
    non_torch_gib: float = 0.0,
    tp: int = 1,
) -> ModelNeed:
    """--weights-gib, or --params with --dtype (fp16 when not given, and the report says it was
    assumed). Both --weights-gib and --params is an error: two answers to one question, and
    which one the arithmetic used would be a guess. --dtype with --weights-gib says what the
    weights are in (the 8-bit and 4-bit suggestions)."""
    if weights_gib is not None and params is not None:
        raise UsageError("give --weights-gib or --params (with --dtype), not both: each says "
                         "how big the weights are")
    count = parse_params(params) if params is not None else None
    bpp = dtype_bytes(dtype) if dtype is not None else 2.0
    assumed = count is not None and dtype is None
    if weights_gib is None:
        if count is None:
            raise UsageError("give --weights-gib, or --params (with --dtype)")
        weights_gib = weights_gib_from_params(count, dtype or DEFAULT_DTYPE)
    return validate_need(ModelNeed(weights_gib=weights_gib, activations_gib=activations_gib,
                                   non_torch_gib=non_torch_gib, tp=tp, params=count,
                                   bytes_per_param=bpp,
                                   dtype=DEFAULT_DTYPE if assumed else dtype, dtype_assumed=assumed))


def holder_uses(snapshot: Snapshot, index: int) -> list[HolderUse]:
    """Processes nvidia-smi attributes memory to on GPU ``index``, named as operators know them."""
    out = []
    for app in snapshot.apps_on(index):
        proc = snapshot.processes.get(app.pid)
        name = proc.name if proc is not None else (app.process_name or "?")
        out.append(HolderUse(pid=app.pid, name=name, used_mib=app.used_mib))
    return out


def gpus_from_snapshot(snapshot: Snapshot, indices: Optional[Sequence[int]]) -> list[GpuMemory]:
    """The selected GPUs as GpuMemory; a missing index or n/a memory raises ValueError (a host
    problem, reported on that host's row)."""
    by_index = {g.index: g for g in snapshot.gpus}
    wanted = sorted(by_index) if indices is None else list(indices)
    missing = [i for i in wanted if i not in by_index]
    if missing:
        raise ValueError(f"no GPU {', '.join(map(str, missing))} on this host "
                         f"(it has {', '.join(map(str, sorted(by_index))) or 'none'})")
    if not wanted:
        raise ValueError("no GPUs on this host")
    out = []
    for i in wanted:
        gpu = by_index[i]
        if gpu.memory_total_mib is None or gpu.memory_free_mib is None:
            raise ValueError(f"GPU {i}: memory total/free n/a, cannot check")
        out.append(GpuMemory(index=i, total_mib=gpu.memory_total_mib, free_mib=gpu.memory_free_mib,
                             reserved_mib=gpu.memory_reserved_mib or 0))
    return out


@dataclass(frozen=True)
class HostFit(HostOutcome):
    """One host's fit, or why it could not be checked (``error``, ``error_kind``)."""

    host: str
    results: tuple[FitResult, ...] = ()
    error: Optional[str] = None
    error_kind: Optional[str] = None
    seconds: float = 0.0  # the snapshot's

    @property
    def ok(self) -> bool:
        return self.error is None and exit_code(self.results) == EXIT_OK


@dataclass(frozen=True)
class FitReport:
    """Every host's results; ``details``: vLLM errors, suggestions, then notes (once each),
    the lines under the table."""

    hosts: tuple[HostFit, ...]
    details: list[str]  # vLLM errors, suggestions, then notes (once each), under the table
    document: dict[str, Any]
    exit_code: int = EXIT_OK


def _g(value: Optional[float], digits: int = 2) -> Optional[float]:
    return None if value is None else round(value, digits)


def result_dict(r: FitResult) -> dict[str, Any]:
    """One GPU of the JSON document; GiB rounded to 3 decimals, utils on the 0.001 grid."""
    return {
        "index": r.index,
        "total_gib": _g(r.total_gib, 3),
        "free_gib": _g(r.free_host_gib, 3),
        "context_gib": _g(r.context_gib, 3),
        "vllm_free_gib": _g(r.free_gib, 3),
        "util": r.util,
        "requested_gib": _g(r.requested_gib, 3),
        "startup_ok": r.startup_ok,
        "weights_gib": _g(r.weights_gib, 3),
        "activations_gib": _g(r.activations_gib, 3),
        "non_torch_gib": _g(r.non_torch_gib, 3),
        "non_kv_gib": _g(r.non_kv_gib, 3),
        "kv_cache_gib": _g(r.kv_cache_gib, 3),
        "ok": r.ok,
        "max_util_startup": r.max_util_startup,
        "min_util_kv": r.min_util_kv,
        "feasible": r.feasible,
        "shortfall_gib": _g(r.shortfall_gib, 3),
        "capacity_limited": r.capacity_limited,
        "verdict": r.verdict,
        "vllm_error": r.vllm_error,
        "suggestions": list(r.suggestions),
        "notes": list(r.notes),
    }


def fit_host(
    result: HostResult,
    need: ModelNeed,
    util: float = DEFAULT_UTIL,
    context_mib: Optional[float] = None,
    gpus: Optional[Sequence[int]] = None,
) -> HostFit:
    """One host: an unreachable host, unusable numbers, or too few selected GPUs for --tp (a
    1-GPU host in a fleet of 8-GPU ones) are that host's error row (exit 1); --gpus naming a
    GPU the host lacks is a UsageError naming the host (exit 2), as in `clean`."""
    if not result.ok or result.snapshot is None:
        return HostFit(result.host, error=result.error or "no snapshot",
                       error_kind=result.error_kind or AGENT, seconds=result.seconds)
    snapshot = result.snapshot
    if not snapshot.nvidia_smi_ok:
        return HostFit(result.host, error=f"{snapshot.gpu_reader} failed: {snapshot.nvidia_smi_error or 'unknown error'}",
                       error_kind=COMMAND, seconds=result.seconds)
    if gpus is not None:
        check_available(gpus, {g.index for g in snapshot.gpus}, result.host)
    try:
        memories = gpus_from_snapshot(snapshot, gpus)
    except ValueError as exc:
        return HostFit(result.host, error=str(exc), error_kind=AGENT, seconds=result.seconds)
    holders = {m.index: holder_uses(snapshot, m.index) for m in memories}
    try:
        check_tp(len(memories), need.tp)
    except UsageError as exc:  # this host's GPUs, not the command line: its own row
        return HostFit(result.host, error=str(exc), error_kind=USAGE, seconds=result.seconds)
    results = check_fleet(memories, need, util, context_mib, holders)
    return HostFit(result.host, results=results, seconds=result.seconds)


def fit_report(
    host_results: Sequence[HostResult],
    need: ModelNeed,
    util: float = DEFAULT_UTIL,
    context_mib: Optional[float] = None,
    gpus: Optional[Sequence[int]] = None,
) -> FitReport:
    """Per-host results, detail lines, the JSON document and the exit code (0 fits everywhere,
    1 not); gpufleet.render.status.fit makes the table from it."""
    util = validate_util(util)
    validate_need(need)
    fits: list[HostFit] = []
    wrong: list[str] = []
    for res in host_results:  # --gpus naming a GPU a host lacks: every such host in one line
        try:
            fits.append(fit_host(res, need, util, context_mib, gpus))
        except UsageError as exc:
            wrong.append(str(exc))
    if wrong:
        raise UsageError("; ".join(wrong))
    details: list[str] = []
    notes: list[str] = []
    for hf in fits:
        for r in hf.results:
            prefix = f"{hf.host} GPU {r.index}"
            if r.vllm_error:
                details.append(f"{prefix}: vLLM would say: {r.vllm_error}")
            for s in r.suggestions:
                details.append(f"{prefix}: instead: {s}")
            notes.extend(n for n in r.notes if n not in notes)
    if need.dtype_assumed and need.params is not None:
        notes.insert(0, f"--dtype not given: {need.dtype} assumed ({need.bytes_per_param:g} bytes "
                        f"per parameter): {format_params(need.params)} parameters are "
                        f"{need.weights_gib:.2f} GiB of weights")
    details.extend(f"note: {n}" for n in notes)
    code = EXIT_OK if fits and all(hf.ok for hf in fits) else EXIT_FAILED
    return FitReport(hosts=tuple(fits), details=details,
                     document=_document(fits, need, util, context_mib, code),
                     exit_code=code)


def _document(fits: Sequence[HostFit], need: ModelNeed, util: float, context_mib: Optional[float],
              code: int) -> dict[str, Any]:
    """The JSON document of `gpufleet fit --json` (docs: README, "fit")."""
    return {
        "command": "fit",
        "util": util,
        "context_mib": context_mib,
        "need": {
            "weights_gib": _g(need.weights_gib, 3),
            "weights_per_gpu_gib": _g(need.weights_per_gpu_gib, 3),
            "activations_gib": _g(need.activations_gib, 3),
            "non_torch_gib": _g(need.non_torch_gib, 3),
            "tp": need.tp,
            "params": need.params,
            "bytes_per_param": need.bytes_per_param,
            "dtype": need.dtype,
            "dtype_assumed": need.dtype_assumed,
        },
        "hosts": [
            {"host": hf.host, "ok": hf.ok, "error": hf.error, **hf.error_kind_field(),
             "gpus": [result_dict(r) for r in hf.results]}
            for hf in fits
        ],
        "ok": code == EXIT_OK,
        "exit_code": code,
    }


__all__ = ["FitReport", "HostFit", "check_fit", "check_fleet", "fit_host", "fit_report",
           "gpus_from_snapshot", "holder_uses", "need_from_options", "parse_gpus", "result_dict"]
