"""gpufleet.core.fit: vLLM's start-up arithmetic and per-host report; gpufleet.render.status.fit's rows."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpufleet.core.fit import fit_report, need_from_options, parse_gpus
from gpufleet.render.fit import render_text, table_rows
from gpufleet.errors import UsageError
from gpufleet.core.fit import (
    DEFAULT_CONTEXT_MIB,
    DEFAULT_NCCL_MIB,
    GpuMemory,
    HolderUse,
    ModelNeed,
    check_fit,
    check_fleet,
    check_tp,
    dtype_bytes,
    exit_code,
    max_util_startup,
    min_util_kv,
    parse_params,
    vllm_startup_error,
    weights_gib_from_params,
)
from gpufleet.core.model import HostResult, parse_snapshot

GIB = 1024  # MiB


def gib_gpu(total_gib: float, free_gib: float, index: int = 0) -> GpuMemory:
    return GpuMemory(index=index, total_mib=total_gib * GIB, free_mib=free_gib * GIB)


# ---------------------------------------------------------------- the seed case

# RTX 5090 under WSL2, numbers as vLLM printed them from inside its process (so no context to
# take off: context_mib=0), 14B fp16 = 27.57 GiB weights, 2.7 GiB activations, util 0.945.
SEED_GPU = gib_gpu(31.84, 30.20)
SEED_NEED = ModelNeed(weights_gib=27.57, activations_gib=2.7, params=14e9, bytes_per_param=2)


def seed():
    return check_fit(SEED_GPU, SEED_NEED, util=0.945, context_mib=0)


def test_seed_startup_passes_and_kv_cache_is_minus_0_18():
    r = seed()
    assert round(r.total_gib, 2) == 31.84
    assert round(r.free_gib, 2) == 30.20
    assert round(r.requested_gib, 2) == 30.09
    assert r.startup_ok is True
    assert r.vllm_error is None
    assert round(r.kv_cache_gib, 2) == -0.18
    assert r.ok is False
    assert exit_code([r]) == 1


def test_seed_no_util_works_and_says_so_plainly():
    r = seed()
    assert r.feasible is False
    assert r.capacity_limited is False
    # highest util passing start-up: 30.20/31.84 = 0.94849 -> 0.948
    assert r.max_util_startup == 0.948
    # lowest util with a KV cache: 30.27/31.84 = 0.95069 -> 0.951
    assert r.min_util_kv == 0.951
    assert r.verdict.startswith("infeasible at any utilization: needs 0.08 GiB more")
    # 0.951 * 31.84 - 30.20, the free memory the lowest workable util would need
    assert r.shortfall_gib == pytest.approx(0.951 * 31.84 - 30.20)


def test_seed_suggests_8bit_4bit_and_the_7b_model():
    text = "\n".join(seed().suggestions)
    assert "8-bit (1 byte/param), 13.79 GiB weights per GPU: fits" in text
    assert "4-bit (0.5 byte/param), 6.89 GiB weights per GPU: fits" in text
    assert "a 7B model at 16-bit, 13.79 GiB weights per GPU: fits" in text
    # 8-bit: 0.945 * 31.84 - 27.57/2 - 2.7
    assert f"KV cache {0.945 * 31.84 - 27.57 / 2 - 2.7:.2f} GiB at 0.945" in text


def test_seed_from_host_numbers_applies_the_context():
    """The same 30.20 GiB read by nvidia-smi on the host (before vLLM's context exists) does not
    pass start-up; host free = vLLM's 30.20 + the default context reproduces the seed."""
    host = check_fit(SEED_GPU, SEED_NEED, util=0.945)
    assert host.startup_ok is False
    assert host.free_gib == pytest.approx(30.20 - DEFAULT_CONTEXT_MIB / GIB)
    shifted = GpuMemory(0, 31.84 * GIB, 30.20 * GIB + DEFAULT_CONTEXT_MIB)
    again = check_fit(shifted, SEED_NEED, util=0.945)
    assert again.startup_ok is True
    assert round(again.kv_cache_gib, 2) == -0.18


# ---------------------------------------------------------------- the formula, by hand


def test_formula_on_h200_numbers_with_reserved_memory():
    # nvidia-smi on an H200: total 143771, reserved 616, free 143156 MiB (recorded); CUDA's
    # total is total - reserved. 60 GiB weights + 5 activations + 1 non-torch, util 0.9.
    gpu = GpuMemory(0, total_mib=143771, free_mib=143156, reserved_mib=616)
    r = check_fit(gpu, ModelNeed(60, 5, 1), util=0.9, context_mib=620)
    total = (143771 - 616) / 1024
    assert r.total_gib == pytest.approx(total)
    assert r.free_gib == pytest.approx((143156 - 620) / 1024)
    assert r.requested_gib == pytest.approx(0.9 * total)
    assert r.kv_cache_gib == pytest.approx(0.9 * total - 66)
    assert r.ok and r.startup_ok
    assert r.verdict == f"fits: KV cache {0.9 * total - 66:.2f} GiB at --util 0.9"


def test_startup_failure_gives_a_window_when_one_exists():
    # 24 GiB card, 10 GiB free; model needs 6 GiB -> util 0.9 fails start-up, 0.251..0.416 works
    r = check_fit(gib_gpu(24, 10), ModelNeed(4, 2), util=0.9, context_mib=0)
    assert not r.startup_ok and not r.ok and r.feasible
    assert r.max_util_startup == 0.416  # 10/24 = 0.41666
    assert r.min_util_kv == 0.251  # 6/24 = 0.25 exactly -> KV 0 is not positive
    assert "use --util 0.251..0.416" in r.verdict
    assert r.suggestions == ()


def test_kv_cache_of_exactly_zero_fails():
    r = check_fit(gib_gpu(16, 16), ModelNeed(6, 2), util=0.5, context_mib=0)
    assert r.startup_ok and r.kv_cache_gib == 0 and not r.ok
    assert "no room for a KV cache" in r.verdict


def test_capacity_limited_when_the_whole_gpu_is_too_small():
    r = check_fit(gib_gpu(24, 24), ModelNeed(30, 1), util=0.9, context_mib=0)
    assert r.capacity_limited and not r.feasible and r.min_util_kv is None
    assert r.shortfall_gib == pytest.approx(31 - 24)
    assert r.verdict.startswith("infeasible at any utilization: needs 7.00 GiB more than this GPU's")


@pytest.mark.parametrize("free,total,util,expected", [
    # verbatim vLLM messages quoted in public reports
    (3.25, 23.43, 0.96, "Free memory on device (3.25/23.43 GiB) on startup is less than desired "
     "GPU memory utilization (0.96, 22.49 GiB). Decrease GPU memory utilization or reduce GPU "
     "memory used by other processes."),
    (2.6, 121.63, 0.08, "Free memory on device (2.6/121.63 GiB) on startup is less than desired "
     "GPU memory utilization (0.08, 9.73 GiB). Decrease GPU memory utilization or reduce GPU "
     "memory used by other processes."),
])
def test_vllm_error_text(free, total, util, expected):
    assert vllm_startup_error(free, total, util) == expected
    r = check_fit(gib_gpu(total, free), ModelNeed(1), util=util, context_mib=0)
    assert r.vllm_error == expected


# ---------------------------------------------------------------- boundaries (properties)

sizes = st.floats(min_value=1.0, max_value=200.0, allow_nan=False)
fractions = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


def brute(total, free, non_kv, k):
    u = k / 1000
    return (not free < u * total), (u * total - non_kv > 0)


@settings(max_examples=200, deadline=None)
@given(total=sizes, free_frac=fractions)
def test_max_util_startup_is_the_boundary(total, free_frac):
    free = total * free_frac
    u = max_util_startup(total, free)
    if u is None:
        assert free < 0.001 * total
        return
    k = round(u * 1000)
    assert brute(total, free, 0, k)[0]
    if k < 1000:
        assert not brute(total, free, 0, k + 1)[0]


@settings(max_examples=200, deadline=None)
@given(total=sizes, need_frac=st.floats(min_value=0.0, max_value=1.5, allow_nan=False))
def test_min_util_kv_is_the_boundary(total, need_frac):
    non_kv = total * need_frac
    u = min_util_kv(total, non_kv)
    if u is None:
        assert not brute(total, total, non_kv, 1000)[1]
        return
    k = round(u * 1000)
    assert brute(total, total, non_kv, k)[1]
    if k > 1:
        assert not brute(total, total, non_kv, k - 1)[1]


@settings(max_examples=60, deadline=None)
@given(total=sizes, free_frac=fractions, need_frac=st.floats(min_value=0.0, max_value=1.2),
       k=st.integers(min_value=1, max_value=1000))
def test_check_fit_agrees_with_brute_force(total, free_frac, need_frac, k):
    free, non_kv, util = total * free_frac, total * need_frac, k / 1000
    r = check_fit(gib_gpu(total, free), ModelNeed(non_kv), util=util, context_mib=0)
    start, kv = brute(r.total_gib, r.free_gib, non_kv, k)
    assert (r.startup_ok, r.kv_cache_gib > 0, r.ok) == (start, kv, start and kv)
    workable = [j for j in range(1, 1001) if all(brute(r.total_gib, r.free_gib, non_kv, j))]
    assert r.feasible == bool(workable)
    if workable:
        assert (r.min_util_kv, r.max_util_startup) == (workable[0] / 1000, workable[-1] / 1000)
    else:
        assert r.verdict.startswith("infeasible at any utilization: needs ")


@settings(max_examples=100, deadline=None)
@given(total=sizes, free_frac=fractions, need_frac=st.floats(min_value=0.0, max_value=0.99))
def test_shortfall_is_what_is_missing(total, free_frac, need_frac):
    free, non_kv = total * free_frac, total * need_frac
    r = check_fit(gib_gpu(total, free), ModelNeed(non_kv), util=0.5, context_mib=0)
    assume(not r.feasible and not r.capacity_limited)
    assert r.shortfall_gib > 0
    more = check_fit(gib_gpu(total, free + r.shortfall_gib + 1e-9), ModelNeed(non_kv), util=0.5,
                     context_mib=0)
    assert more.feasible
    less = check_fit(gib_gpu(total, free + r.shortfall_gib - 0.001 * total), ModelNeed(non_kv),
                     util=0.5, context_mib=0)
    assert not less.feasible


# ---------------------------------------------------------------- tensor parallel


def test_weights_split_evenly_across_tp():
    need = ModelNeed(weights_gib=547, activations_gib=4, tp=8)
    gpus = [GpuMemory(i, 143771, 143156, 616) for i in range(8)]
    results = check_fleet(gpus, need, util=0.9)
    assert [r.index for r in results] == list(range(8))
    for r in results:
        assert r.weights_gib == pytest.approx(547 / 8)
        assert r.non_kv_gib == pytest.approx(547 / 8 + 4)
        # default context for tp > 1 includes NCCL's buffers
        assert r.context_gib == pytest.approx((DEFAULT_CONTEXT_MIB + DEFAULT_NCCL_MIB) / 1024)
        assert r.kv_cache_gib == pytest.approx(0.9 * (143771 - 616) / 1024 - 547 / 8 - 4)
        assert r.ok
    assert exit_code(results) == 0


def test_same_model_without_tp_does_not_fit_and_suggests_tp():
    r = check_fit(GpuMemory(0, 143771, 143156, 616), ModelNeed(547, 4), util=0.9)
    assert r.capacity_limited and not r.ok
    assert any(s.startswith("--tp 8 (68.38 GiB weights per GPU)") for s in r.suggestions)
    assert not any("holder" in s for s in r.suggestions)


@pytest.mark.parametrize("count,tp,message", [
    (4, 8, "--tp 8 needs 8 GPUs, only 4 selected"),
    (6, 4, "--tp 4 does not divide the 6 selected GPUs"),
])
def test_tp_against_gpu_count(count, tp, message):
    with pytest.raises(UsageError, match=message):
        check_tp(count, tp)
    with pytest.raises(UsageError):
        check_fleet([gib_gpu(80, 80, i) for i in range(count)], ModelNeed(10, tp=tp))


# ---------------------------------------------------------------- suggestions: holders


def holders():
    return [HolderUse(11, "trainer", 3000), HolderUse(12, "VLLM::Worker", 8000),
            HolderUse(13, "python3", 700), HolderUse(14, "ghost", None)]


def test_free_the_one_largest_holder():
    # 24 GiB, 12 free; needs 18 -> freeing VLLM::Worker (7.8 GiB) is enough
    r = check_fit(gib_gpu(24, 12), ModelNeed(16, 2), util=0.9, context_mib=0, holders=holders())
    assert not r.feasible
    assert any(s.startswith("free 1 holder: VLLM::Worker 12 (8000 MiB): fits") for s in r.suggestions)


def test_free_two_holders():
    r = check_fit(gib_gpu(24, 10), ModelNeed(18, 2), util=0.9, context_mib=0, holders=holders())
    assert any(s.startswith("free 2 holders: VLLM::Worker 12 (8000 MiB), trainer 11 (3000 MiB): fits")
               for s in r.suggestions)


def test_freeing_everything_listed_is_not_enough():
    r = check_fit(gib_gpu(24, 5), ModelNeed(19.5, 2), util=0.95, context_mib=0, holders=holders())
    assert "freeing all 3 listed holders (11.43 GiB) is not enough" in r.suggestions


def test_suggestions_only_when_no_util_works():
    assert seed().suggestions
    assert check_fit(gib_gpu(24, 10), ModelNeed(4, 2), util=0.9, holders=holders()).suggestions == ()


# ---------------------------------------------------------------- input checking


@pytest.mark.parametrize("util", [0, -0.1, 1.0001, 2, float("nan"), float("inf"), "x"])
def test_bad_util(util):
    with pytest.raises(UsageError, match="--util"):
        check_fit(gib_gpu(24, 24), ModelNeed(1), util=util)


def test_util_of_one_is_allowed():
    assert check_fit(gib_gpu(24, 24), ModelNeed(1), util=1, context_mib=0).ok


@pytest.mark.parametrize("need,match", [
    (ModelNeed(-1), "--weights-gib"),
    (ModelNeed(1, activations_gib=-2), "--activations-gib"),
    (ModelNeed(1, non_torch_gib=float("nan")), "--non-torch-gib"),
    (ModelNeed(1, tp=0), "--tp"),
    (ModelNeed(1, tp=1.5), "--tp"),
])
def test_bad_need(need, match):
    with pytest.raises(UsageError, match=match):
        check_fit(gib_gpu(24, 24), need)


def test_bad_context_and_gpu():
    with pytest.raises(UsageError, match="--context-mib"):
        check_fit(gib_gpu(24, 24), ModelNeed(1), context_mib=-5)
    with pytest.raises(UsageError, match="reserved"):
        check_fit(GpuMemory(0, 100, 50, 100), ModelNeed(1))


@pytest.mark.parametrize("text,value", [
    ("14e9", 14e9), ("14B", 14e9), ("7b", 7e9), ("70B", 70e9), ("1.5B", 1.5e9),
    ("500M", 5e8), (" 8 B ", 8e9), ("14000000000", 14e9), ("0.5T", 5e11),
])
def test_parse_params(text, value):
    assert parse_params(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["14", "abc", "-7B", "0B", "7X", "", "1e400"])
def test_parse_params_refuses(text):
    with pytest.raises(UsageError, match="--params"):
        parse_params(text)


@pytest.mark.parametrize("dtype,size", [("fp32", 4), ("FP16", 2), ("bf16", 2), ("fp8", 1),
                                        ("int8", 1), ("int4", 0.5), ("fp4", 0.5)])
def test_weights_from_params(dtype, size):
    assert dtype_bytes(dtype) == size
    assert weights_gib_from_params(14e9, dtype) == pytest.approx(14e9 * size / 2**30)


def test_unknown_dtype():
    with pytest.raises(UsageError, match="unknown --dtype 'fp12'"):
        weights_gib_from_params(14e9, "fp12")


# ---------------------------------------------------------------- fit_cmd: rows, JSON, exit code


def snapshot_doc(gpus, apps=(), processes=None):
    return {
        "agent_version": 1,
        "facts": {"hostname": "h"},
        "nvidia_smi": {"ok": True},
        "gpus": [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA H200", "memory_total_mib": t,
                  "memory_free_mib": f, "memory_reserved_mib": r} for i, t, f, r in gpus],
        "compute_apps": [{"pid": p, "process_name": "python3", "used_mib": u, "gpu_uuid": f"GPU-{i}"}
                         for p, u, i in apps],
        "processes": processes or {},
    }


def host(name, doc):
    return HostResult(host=name, ok=True, snapshot=parse_snapshot(doc))


def test_report_rows_document_and_exit_code():
    idle = host("idle", snapshot_doc([(0, 143771, 143156, 616), (1, 143771, 143156, 616)]))
    busy = host("busy", snapshot_doc(
        [(0, 143771, 20000, 616)], apps=[(4321, 122000, 0)],
        processes={"4321": {"pid": 4321, "comm": "VLLM::Worker", "cmdline": "python3 -m vllm"}}))
    down = HostResult(host="down", ok=False, error="ssh: connection refused")
    need = need_from_options(params="14B", dtype="bf16", activations_gib=3)
    report = fit_report([idle, busy, down], need, util=0.9, gpus=parse_gpus("0"))
    assert report.exit_code == 1
    assert [row[0] for row in table_rows(report)] == ["idle", "busy", "down"]
    idle_row, busy_row, down_row = table_rows(report)
    assert idle_row[1] == 0 and idle_row[6] == "pass" and idle_row[10].startswith("fits")
    assert busy_row[6] == "FAIL" and busy_row[10].startswith("infeasible at any utilization")
    assert idle_row[7] == f"{0.9 * (143771 - 616) / 1024 - 14e9 * 2 / 2**30 - 3:.2f}"
    assert busy_row[7] == f"({0.9 * (143771 - 616) / 1024 - 14e9 * 2 / 2**30 - 3:.2f})"  # not reached
    notes = [d for d in report.details if d.startswith("note:")]
    assert notes == [f"note: vLLM sees the free memory nvidia-smi reports less its own CUDA context "
                     f"({DEFAULT_CONTEXT_MIB:.0f} MiB, --context-mib)"]
    assert down_row[-1] == "error: ssh: connection refused"
    assert any("free 1 holder: VLLM::Worker 4321 (122000 MiB): fits" in d for d in report.details)
    assert any("vLLM would say: Free memory on device" in d for d in report.details)
    doc = json.loads(json.dumps(report.document))
    assert doc["exit_code"] == 1 and doc["ok"] is False
    assert [h["ok"] for h in doc["hosts"]] == [True, False, False]
    g = doc["hosts"][0]["gpus"][0]
    assert g["weights_gib"] == round(14e9 * 2 / 2**30, 3)
    assert g["kv_cache_gib"] == round(0.9 * (143771 - 616) / 1024 - 14e9 * 2 / 2**30 - 3, 3)
    assert "busy" in render_text(report)

    only_idle = fit_report([idle], need, util=0.9)
    assert only_idle.exit_code == 0 and len(table_rows(only_idle)) == 2


def test_report_host_problems():
    na = host("wsl", snapshot_doc([(0, 32607, None, None)]))
    report = fit_report([na], ModelNeed(1), gpus=[0])
    assert report.exit_code == 1 and "n/a" in table_rows(report)[0][-1]
    # --gpus naming GPUs a host lacks: the command line's mistake, exit 2, as in clean; every
    # such host in the one line
    with pytest.raises(UsageError, match=r"^GPU 3 does not exist on one \(has 0\); "
                                         r"GPU 3 does not exist on two \(has 0-1\)$"):
        fit_report([host("one", snapshot_doc([(0, 100, 100, 0)])),
                    host("two", snapshot_doc([(0, 100, 100, 0), (1, 100, 100, 0)]))],
                   ModelNeed(1), gpus=[3])


def test_a_host_with_too_few_gpus_for_tp_is_its_own_row_and_exit_1():
    """`fit --all --tp 8` over 8-GPU hosts and a 1-GPU one: the 8-GPU hosts are checked, the
    small one says why not (it used to stop the whole command with exit 2)."""
    eight = host("eight", snapshot_doc([(i, 143771, 143156, 616) for i in range(8)]))
    one = host("one", snapshot_doc([(0, 143771, 143156, 616)]))
    report = fit_report([eight, one], ModelNeed(547, tp=8))
    assert report.exit_code == 1
    rows = table_rows(report)
    assert [r[0] for r in rows] == ["eight"] * 8 + ["one"]
    assert all(r[-1].startswith("fits") for r in rows[:8])
    assert rows[8][-1] == "error: --tp 8 needs 8 GPUs, only 1 selected"
    doc = report.document["hosts"][1]
    assert (doc["ok"], doc["error_kind"], doc["gpus"]) == (False, "usage", [])


@pytest.mark.parametrize("spec,expected", [("all", None), (None, None), ("0", (0,)),
                                           ("3,1", (1, 3)), ("0-3", (0, 1, 2, 3)),
                                           ("0,2-3", (0, 2, 3))])
def test_parse_gpus(spec, expected):
    assert parse_gpus(spec) == expected


@pytest.mark.parametrize("spec", ["x", "3-1", "-1", "0,,1"])
def test_parse_gpus_refuses(spec):
    with pytest.raises(UsageError, match="--gpus"):
        parse_gpus(spec)


def test_weights_and_params_together_are_refused():
    """Both say how big the weights are; the arithmetic used to take --weights-gib silently."""
    with pytest.raises(UsageError, match="^give --weights-gib or --params \\(with --dtype\\), not both"):
        need_from_options(weights_gib=27.57, params="14B")
    with pytest.raises(UsageError, match="not both"):
        need_from_options(weights_gib=27.57, params="14B", dtype="fp16")
    assert need_from_options(weights_gib=27.57, dtype="fp8").bytes_per_param == 1.0  # still fine


def test_params_without_dtype_says_fp16_was_assumed():
    need = need_from_options(params="70B")
    assert (need.dtype, need.dtype_assumed) == ("fp16", True)
    report = fit_report([host("h", snapshot_doc([(0, 143771, 143156, 616)]))], need)
    assert report.details[0] == ("note: --dtype not given: fp16 assumed (2 bytes per parameter): "
                                 "70B parameters are 130.39 GiB of weights")
    assert (report.document["need"]["dtype"], report.document["need"]["dtype_assumed"]) == ("fp16", True)
    given = need_from_options(params="70B", dtype="bf16")
    assert (given.dtype, given.dtype_assumed) == ("bf16", False)
    report = fit_report([host("h", snapshot_doc([(0, 143771, 143156, 616)]))], given)
    assert not any("assumed (2 bytes" in d for d in report.details)


def test_need_from_options():
    assert need_from_options(weights_gib=27.57).weights_gib == 27.57
    need = need_from_options(params="7b", dtype="int4")
    assert need.weights_gib == pytest.approx(7e9 * 0.5 / 2**30) and need.bytes_per_param == 0.5
    assert math.isclose(need_from_options(params="14e9").weights_gib, 14e9 * 2 / 2**30)
    with pytest.raises(UsageError, match="--weights-gib"):
        need_from_options()
