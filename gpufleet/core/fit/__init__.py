"""`gpufleet fit` (pure): vLLM's start-up arithmetic (arithmetic), what would fit instead
(suggestions), and per-host results / JSON document / exit code (report)."""
from __future__ import annotations

from gpufleet.core.fit.arithmetic import (
    DEFAULT_CONTEXT_MIB,
    DEFAULT_NCCL_MIB,
    DEFAULT_UTIL,
    DTYPE_BYTES,
    FitResult,
    GpuMemory,
    HolderUse,
    ModelNeed,
    check_tp,
    default_context_mib,
    dtype_bytes,
    exit_code,
    format_params,
    max_util_startup,
    min_util_kv,
    parse_params,
    replay,
    validate_need,
    validate_util,
    vllm_startup_error,
    weights_gib_from_params,
)
from gpufleet.core.fit.report import (
    FitReport,
    HostFit,
    check_fit,
    check_fleet,
    fit_host,
    fit_report,
    gpus_from_snapshot,
    holder_uses,
    need_from_options,
    parse_gpus,
    result_dict,
)
from gpufleet.core.fit.suggestions import suggest_alternatives

__all__ = [
    "DEFAULT_CONTEXT_MIB", "DEFAULT_NCCL_MIB", "DEFAULT_UTIL", "DTYPE_BYTES",
    "FitReport", "FitResult", "GpuMemory", "HolderUse", "HostFit", "ModelNeed",
    "check_fit", "check_fleet", "check_tp", "default_context_mib", "dtype_bytes", "exit_code",
    "fit_host", "fit_report", "format_params", "gpus_from_snapshot", "holder_uses",
    "max_util_startup", "min_util_kv", "need_from_options", "parse_gpus", "parse_params",
    "replay", "result_dict", "suggest_alternatives", "validate_need", "validate_util",
    "vllm_startup_error", "weights_gib_from_params",
]
