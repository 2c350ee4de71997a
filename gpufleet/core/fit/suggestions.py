"""What would fit on a GPU instead, when nothing does at any --util (pure).

Each alternative is replayed with the same arithmetic (gpufleet.core.fit.arithmetic): the
same model at 8-bit or 4-bit, a model half the size, freeing the fewest holders, a wider
tensor-parallel group.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

from gpufleet.core.fit.arithmetic import (
    MIB_PER_GIB,
    FitResult,
    HolderUse,
    ModelNeed,
    default_context_mib,
    format_params,
    gib_text,
    kv_cache,
    range_text,
    util_window,
)


def _alt_text(label: str, total: float, free: float, non_kv: float, util: float) -> Optional[str]:
    window = util_window(total, free, non_kv)
    lo, hi = window.min_util, window.max_util
    if not window.feasible or lo is None or hi is None:  # a feasible window has both ends
        return None
    at = util if lo <= util <= hi else hi
    return f"{label}: fits with {range_text(window)} (KV cache {gib_text(kv_cache(at, total, non_kv))} GiB at {at:g})"


def _bpp_name(bytes_per_param: float) -> str:
    names = {4.0: "fp32", 2.0: "16-bit", 1.0: "8-bit", 0.5: "4-bit"}
    return names.get(bytes_per_param, f"{bytes_per_param:g} byte/param")


def _holders_text(chosen: Sequence[HolderUse]) -> str:
    return ", ".join(f"{h.name} {h.pid} ({h.used_mib:.0f} MiB)" for h in chosen)


def suggest_alternatives(
    result: FitResult,
    need: ModelNeed,
    holders: Iterable[HolderUse] = (),
    context_mib: Optional[float] = None,
) -> list[str]:
    """What would fit on this GPU instead: the same model at 8-bit or 4-bit, a model half the
    size, freeing the fewest listed holders (largest first), or a wider tensor-parallel group."""
    out = _smaller_models(result, need)
    if not result.capacity_limited:
        out.extend(_free_holders(result, holders))
    out.extend(_wider_tp(result, need, context_mib))
    if not out:
        out.append("nothing smaller tried here fits this GPU")
    return out


def _smaller_models(result: FitResult, need: ModelNeed) -> list[str]:
    total, free, util = result.total_gib, result.free_gib, result.util
    rest = need.activations_gib + need.non_torch_gib
    out: list[str] = []
    # Scale the weights actually given (27.57 GiB for a nominal "14B" at fp16 is 14.8e9
    # parameters in truth), not the nominal count; the count only names the smaller model.
    for bpp, label in ((1.0, "8-bit (1 byte/param)"), (0.5, "4-bit (0.5 byte/param)")):
        if need.bytes_per_param > bpp:
            weights = need.weights_per_gpu_gib * bpp / need.bytes_per_param
            text = _alt_text(f"same model at {label}, {gib_text(weights)} GiB weights per GPU",
                             total, free, weights + rest, util)
            if text:
                out.append(text)
    weights = need.weights_per_gpu_gib / 2
    text = _alt_text(f"a {format_params(need.param_count / 2)} model at {_bpp_name(need.bytes_per_param)}, "
                     f"{gib_text(weights)} GiB weights per GPU", total, free, weights + rest, util)
    if text:
        out.append(text)
    return out


def _free_holders(result: FitResult, holders: Iterable[HolderUse]) -> list[str]:
    """The fewest listed holders (largest first) whose memory would make the model fit."""
    total, free, util = result.total_gib, result.free_gib, result.util
    known = sorted(((h.used_mib, h) for h in holders if h.used_mib is not None and h.used_mib > 0),
                   key=lambda uh: (-uh[0], uh[1].pid))
    if not known:
        return []
    freed, chosen = 0.0, []
    for used_mib, holder in known:
        chosen.append(holder)
        freed += used_mib / MIB_PER_GIB
        text = _alt_text(f"free {len(chosen)} holder{'s' if len(chosen) > 1 else ''}: "
                         f"{_holders_text(chosen)}", total, min(total, free + freed),
                         result.non_kv_gib, util)
        if text:
            return [text]
    return [f"freeing all {len(chosen)} listed holders ({freed:.2f} GiB) is not enough"]


def _wider_tp(result: FitResult, need: ModelNeed, context_mib: Optional[float]) -> list[str]:
    """The narrowest wider tensor-parallel group (2, 4, 8) that fits GPUs like this one."""
    rest = need.activations_gib + need.non_torch_gib
    for tp in (2, 4, 8):
        if tp <= need.tp:
            continue
        context = default_context_mib(tp) if context_mib is None else context_mib
        wider_free = max(0.0, result.free_host_gib - context / MIB_PER_GIB)
        weights = need.weights_gib / tp
        text = _alt_text(f"--tp {tp} ({gib_text(weights)} GiB weights per GPU) on GPUs like this one",
                         result.total_gib, wider_free, weights + rest, result.util)
        if text:
            return [text]
    return []


__all__ = ["suggest_alternatives"]
