"""Runbook step kinds: what each kind accepts, the rules between its fields, and its one-line plan.

``KIND_FIELDS`` is the schema the loader (gpufleet.runbook.load) checks every step against,
each field wired to a validator of gpufleet.config.validators (or gpufleet.runbook.values);
the ``assert`` vocabulary (metrics, bounds, GPU sets) is validated here into ``{gpus, bounds,
sets}``, the shape gpufleet.runbook.checks checks; ``describe`` is what ``gpufleet run
--dry-run`` prints for a step.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from gpufleet.config import validators
from gpufleet.config.validators import Fail, describe as describe_value, did_you_mean, sub_fail
from gpufleet.core.gpus import format_gpu_ranges
from gpufleet.core.policy import DEFAULT_TOLERANCE_MIB
from gpufleet.runbook.template import PerHostField, render_per_host
from gpufleet.runbook.values import (v_dtype, v_gib, v_headers, v_http_method, v_http_statuses,
                                     v_json_body, v_params, v_positive_int)

KINDS = ("stop_units", "clean", "wait_free", "fit", "health", "clear_shm", "start_unit",
         "wait_http", "shell", "assert", "report", "local_http", "local_command")
# Steps that change the host (or, local_*, something for it): they need --yes, like `gpufleet
# clean`. A local_http step changes things unless its method is GET or HEAD (changes_hosts).
MUTATING = frozenset({"stop_units", "clean", "clear_shm", "start_unit", "shell", "local_command"})
# Steps that run on the controller, for a host (a load balancer's API, its CLI): never on it.
LOCAL_KINDS = frozenset({"local_http", "local_command"})
READ_ONLY_METHODS = ("GET", "HEAD")
# Kinds a rolling run's `gate:` may use: they only look, on each host of a finished batch.
GATE_KINDS = ("health", "wait_http")
# Steps that take a GPU snapshot (their result is what a later `assert` may look at).
DEFAULT_TIMEOUT_S = {
    "stop_units": 120.0, "clean": 60.0, "wait_free": 300.0, "fit": 60.0, "health": 60.0,
    "clear_shm": 60.0,
    "start_unit": 120.0, "wait_http": 900.0, "shell": 60.0, "assert": 60.0, "report": 60.0,
    "local_http": 30.0, "local_command": 60.0,
}


def changes_hosts(kind: str, params: Mapping[str, Any]) -> bool:
    """Whether a step of this kind with these fields needs --yes."""
    if kind == "local_http":
        return params.get("method") not in READ_ONLY_METHODS
    return kind in MUTATING


# The health step's thresholds: the lowest severity that fails the step / is reported as a
# warning in its detail.
HEALTH_FAIL_ON = ("critical", "warn", "never")
HEALTH_WARN_ON = ("warn", "critical", "never")

# --------------------------------------------------------------------------- assert vocabulary

# Per-GPU metrics an `assert` may bound with {min: X, max: Y}; all are MiB but free_fraction.
METRICS = ("free_mib", "used_mib", "free_fraction", "unattributed_mib",
           "unexpected_unattributed_mib", "reserved_mib")
# Shorthands: `free_mib_min: 40000` == `free_mib: {min: 40000}`.
SHORTHANDS = {f"{m}_{b}": (m, b) for m in METRICS for b in ("min", "max")}
GPU_SETS = ("no_holders_on", "holders_alive_on")
ASSERT_KEYS = ("gpus",) + METRICS + tuple(SHORTHANDS) + GPU_SETS


def _v_bound(metric: str, value: Any, fail: Fail) -> float:
    if metric == "free_fraction":
        v = validators.number(value, fail, "a fraction between 0 and 1")
        if not 0 <= v <= 1:
            fail(f"expected a fraction 0 <= x <= 1, got {value!r}")
        return float(v)
    return validators.mib(value, fail)


def _v_conditions(raw: Any, fail: Fail, line_of: Callable[[Any], int],
                  fail_at: Callable[[int], Fail]) -> dict[str, Any]:
    """The `that:` mapping of an assert step -> {gpus, bounds: {metric: (min, max)}, sets}."""
    if not isinstance(raw, dict) or not raw:
        fail(f"expected a mapping of conditions (e.g. {{no_holders_on: 0-3}}), got {describe_value(raw)}")
    gpus = None
    bounds: dict[str, list] = {}
    sets: dict[str, tuple[int, ...]] = {}
    for key, value in raw.items():
        kfail = sub_fail(fail_at(line_of(key)), f"that.{key}")
        if key not in ASSERT_KEYS:
            fail_at(line_of(key))(f"unknown condition {key!r}{did_you_mean(str(key), ASSERT_KEYS)}"
                                  f" (conditions: {', '.join(METRICS + GPU_SETS)}, "
                                  "with {min: X, max: Y} or the _min/_max shorthands)")
        if key == "gpus":
            gpus = validators.gpu_list(value, kfail)
        elif key in GPU_SETS:
            chosen = validators.gpu_list(value, kfail)
            if chosen is None:
                kfail("name the GPUs (e.g. 4-7); 'all' is not allowed here")
            sets[key] = chosen
        elif key in SHORTHANDS:
            metric, which = SHORTHANDS[key]
            pair = bounds.setdefault(metric, [None, None])
            if pair[0 if which == "min" else 1] is not None:
                kfail(f"{metric} {which} given twice")
            pair[0 if which == "min" else 1] = _v_bound(metric, value, kfail)
        else:
            if not isinstance(value, dict) or not value:
                kfail(f"expected {{min: X}} and/or {{max: Y}}, got {describe_value(value)}")
            pair = bounds.setdefault(key, [None, None])
            for bkey, bval in value.items():
                if bkey not in ("min", "max"):
                    kfail(f"unknown bound {bkey!r}{did_you_mean(str(bkey), ('min', 'max'))} "
                          "(use min or max)")
                idx = 0 if bkey == "min" else 1
                if pair[idx] is not None:
                    kfail(f"{key} {bkey} given twice")
                pair[idx] = _v_bound(key, bval, kfail)
    for metric, (lo, hi) in bounds.items():
        if lo is not None and hi is not None and lo > hi:
            fail(f"that.{metric}: min {lo} is above max {hi}")
    if not bounds and not sets:
        fail("no condition to check (only 'gpus')")
    return {"gpus": gpus, "bounds": {k: tuple(v) for k, v in bounds.items()}, "sets": sets}


# --------------------------------------------------------------------------- step kinds

_Validator = Callable[[Any, Fail], Any]


@dataclass(frozen=True)
class _Field:
    check: _Validator
    required: bool = False
    default: Any = None


# Keys of each kind (besides name, kind, timeout). `clean` mirrors `gpufleet clean`'s options.
KIND_FIELDS: dict[str, dict[str, _Field]] = {
    "stop_units": {
        "units": _Field(validators.units, required=True),
        "disable": _Field(validators.boolean, default=False),
        "user": _Field(validators.boolean, default=False),
        "systemctl": _Field(validators.program, default="systemctl"),
    },
    "clean": {
        "gpus": _Field(validators.gpu_list, default=None),
        "grace": _Field(validators.seconds, default=10.0),
        "tolerance_mib": _Field(validators.mib, default=DEFAULT_TOLERANCE_MIB),
        "protect": _Field(validators.globs, default=()),
        "include_spanning": _Field(validators.boolean, default=False),
        "stop_units": _Field(validators.boolean, default=False),
        "disable_units": _Field(validators.boolean, default=False),
        "shm": _Field(validators.boolean, default=False),
        "reset": _Field(validators.boolean, default=False),
    },
    "wait_free": {
        "gpus": _Field(validators.gpu_list, default=None),
        "min_free_mib": _Field(validators.mib),
        "min_free_fraction": _Field(validators.fraction),
        "poll": _Field(validators.timeout, default=1.0),
    },
    # `gpufleet fit`'s options: weights_gib, or params (+ dtype); the measured extras.
    "fit": {
        "params": _Field(v_params),
        "dtype": _Field(v_dtype, default=None),
        "weights_gib": _Field(v_gib),
        "activations_gib": _Field(v_gib, default=0.0),
        "non_torch_gib": _Field(v_gib, default=0.0),
        "tp": _Field(v_positive_int, default=1),
        "util": _Field(validators.fraction, default=0.9),
        "context_mib": _Field(validators.mib, default=None),
        "gpus": _Field(validators.gpu_list, default=None),
    },
    # the health gate (gpufleet health): fail on CRITICAL (or on WARN too, or never), warn on
    # what does not fail; the inventory's `gpus:` is the expected GPU count
    "health": {
        "gpus": _Field(validators.gpu_list, default=None),
        "fail_on": _Field(validators.choice(HEALTH_FAIL_ON), default="critical"),
        "warn_on": _Field(validators.choice(HEALTH_WARN_ON), default="warn"),
    },
    "clear_shm": {},
    "start_unit": {
        "unit": _Field(validators.unit, required=True),
        "user": _Field(validators.boolean, default=False),
        "systemctl": _Field(validators.program, default="systemctl"),
    },
    "wait_http": {
        "url": _Field(validators.url, required=True),
        "status": _Field(validators.http_status, default=200),
        "interval": _Field(validators.timeout, default=2.0),
    },
    "shell": {
        "command": _Field(validators.shell_command),
        "argv": _Field(validators.argv),
        "expect_exit": _Field(validators.exit_codes, default=(0,)),
    },
    "assert": {
        "that": _Field(lambda v, f: v, required=True),  # validated by _v_conditions
    },
    "report": {
        "gpus": _Field(validators.gpu_list, default=None),
    },
    # On the controller: an HTTP request (a load balancer's API), `{{ HOST }}` filled per host.
    "local_http": {
        "url": _Field(validators.url, required=True),
        "method": _Field(v_http_method, default="GET"),
        "headers": _Field(v_headers, default={}),
        "json": _Field(v_json_body, default=None),
        "status": _Field(v_http_statuses, default=None),  # None: any 2xx
        "interval": _Field(validators.timeout, default=None),  # given: retry until the status
    },
    # On the controller: a program as an argv (never a shell), `{{ HOST }}` filled per host.
    "local_command": {
        "argv": _Field(validators.argv, required=True),
        "expect_exit": _Field(validators.exit_codes, default=(0,)),
    },
}


def _check_step(kind: str, params: dict[str, Any], timeout: float, fail: Fail) -> None:
    """Rules between fields of one step."""
    if kind == "clean":
        if params["grace"] > timeout:
            fail(f"grace ({params['grace']:g}s) is longer than the timeout ({timeout:g}s)")
        if params["disable_units"] and not params["stop_units"]:
            fail("disable_units needs stop_units: true")
    if kind == "wait_free":
        given = [k for k in ("min_free_mib", "min_free_fraction") if params.get(k) is not None]
        if len(given) != 1:
            fail("give exactly one of min_free_mib or min_free_fraction")
    if kind == "shell":
        given = [k for k in ("command", "argv") if params.get(k) is not None]
        if len(given) != 1:
            fail("give exactly one of command (a sh -c string) or argv (a list, no shell)")
    if kind == "local_http" and params.get("json") is not None and params["method"] in READ_ONLY_METHODS:
        fail(f"a {params['method']} request has no body: drop json, or use POST/PUT/PATCH/DELETE")
    if kind == "fit":
        if params.get("weights_gib") is None and params.get("params") is None:
            fail("give weights_gib, or params (with dtype, default fp16)")
        if params.get("weights_gib") is not None and params.get("params") is not None:
            fail("give weights_gib or params, not both: each says how big the weights are")
        if params.get("weights_gib") is not None and params["weights_gib"] <= 0:
            fail("weights_gib must be > 0")
        tp, gpus = params["tp"], params.get("gpus")
        if gpus is not None and (len(gpus) < tp or len(gpus) % tp):
            fail(f"tp {tp} does not divide the {len(gpus)} GPU(s) named")


# --------------------------------------------------------------------------- description


def _gpus_text(gpus: Optional[Sequence[int]]) -> str:
    return "all GPUs" if gpus is None else f"GPU {format_gpu_ranges(gpus)}" if len(gpus) == 1 \
        else f"GPUs {format_gpu_ranges(gpus)}"


def _conditions_text(that: Mapping[str, Any]) -> str:
    bounds = []
    for metric, (lo, hi) in that["bounds"].items():
        if lo is not None:
            bounds.append(f"{metric} >= {lo:g}")
        if hi is not None:
            bounds.append(f"{metric} <= {hi:g}")
    parts = [f"{' and '.join(bounds)} on {_gpus_text(that['gpus'])}"] if bounds else []
    for key, gpus in that["sets"].items():
        what = "no holders on" if key == "no_holders_on" else "the holders seen at start alive on"
        parts.append(f"{what} {_gpus_text(gpus)}")
    return "; ".join(parts)


def params_text(count: float) -> str:
    """14e9 -> '14B', 1e12 -> '1T', 5e8 -> '500M'."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if count >= div:
            return f"{count / div:.4g}{suffix}"
    return f"{count:.4g}"


_PLACEHOLDERS = {"HOST": "{{ HOST }}", "HOST_ADDRESS": "{{ HOST_ADDRESS }}"}


def _shown(value: Any) -> Any:
    """A field as the plan shows it: a per-host one with its ``{{ HOST }}`` left in."""
    return render_per_host(value.raw, _PLACEHOLDERS) if isinstance(value, PerHostField) else value


def _describe_local(k: str, p: Mapping[str, Any]) -> str:
    import json

    if k == "local_command":
        argv = [str(a) for a in _shown(p["argv"])]
        codes = ",".join(str(c) for c in p["expect_exit"])
        return f"on the controller: run {shlex.join(argv)} (expect exit {codes})"
    want = "2xx" if p["status"] is None else "/".join(str(c) for c in p["status"])
    body = _shown(p["json"])
    text = f"on the controller: {p['method']} {_shown(p['url'])}"
    if body is not None:
        text += f" with JSON {json.dumps(body, separators=(',', ':'))}"
    again = f", every {p['interval']:g}s until it does" if p["interval"] else ""
    return f"{text}; expect HTTP {want}{again}"


class _Step(Protocol):
    """What describe reads of a step (gpufleet.runbook.model.Step, which imports this module:
    named here by shape, not imported)."""

    @property
    def kind(self) -> str: ...

    @property
    def params(self) -> Mapping[str, Any]: ...

    @property
    def timeout(self) -> float: ...


def describe(step: _Step) -> str:
    """What a step would do, in one line (the --dry-run plan)."""
    if step.kind in LOCAL_KINDS:
        return _describe_local(step.kind, step.params)
    return _describe_on_host(step)


def _describe_on_host(step: _Step) -> str:
    p = step.params
    k = step.kind
    if k == "stop_units":
        verb = "stop and disable" if p["disable"] else "stop"
        scope = " (--user)" if p["user"] else ""
        via = "" if p["systemctl"] == "systemctl" else f" with {p['systemctl']}"
        return f"{verb} {', '.join(p['units'])}{scope}{via}"
    if k == "clean":
        extra = []
        if p["stop_units"]:
            extra.append("stopping (and disabling)" if p["disable_units"] else "stopping")
            extra[-1] += " the systemd units of the holders"
        if p["protect"]:
            extra.append(f"protecting {', '.join(p['protect'])}")
        if p["include_spanning"]:
            extra.append("including processes that span other GPUs")
        if p["shm"]:
            extra.append("clearing /dev/shm")
        if p["reset"]:
            extra.append("resetting the GPUs")
        more = f"; {', '.join(extra)}" if extra else ""
        return (f"clean {_gpus_text(p['gpus'])} by GPU evidence: TERM, {p['grace']:g}s grace, KILL; "
                f"wait up to {step.timeout:g}s for the memory (tolerance {p['tolerance_mib']} MiB){more}")
    if k == "wait_free":
        want = (f"{p['min_free_mib']} MiB" if p["min_free_mib"] is not None
                else f"{p['min_free_fraction']:.0%}")
        return f"wait until {_gpus_text(p['gpus'])} each have >= {want} free (poll {p['poll']:g}s)"
    if k == "fit":
        if p["weights_gib"] is not None:
            model = f"{p['weights_gib']:g} GiB of weights"
        else:
            model = f"{params_text(p['params'])} {p['dtype'] or 'fp16'}"
        activations = f" + {p['activations_gib']:g} GiB activations" if p["activations_gib"] else ""
        tp = f", tp {p['tp']}" if p["tp"] > 1 else ""
        return (f"vLLM fit check: {model}{activations} on {_gpus_text(p['gpus'])} at util "
                f"{p['util']:g}{tp}")
    if k == "health":
        fail = "never fail" if p["fail_on"] == "never" else f"fail on {p['fail_on'].upper()}"
        return (f"health gate on {_gpus_text(p['gpus'])}: ECC, remapped rows, Xid, lost GPUs, "
                f"GPU count, throttling, PCIe; {fail}")
    if k == "clear_shm":
        return "remove leftover /dev/shm files (nccl-, psm_, torch_, vllm) no live process holds"
    if k == "start_unit":
        via = "" if p["systemctl"] == "systemctl" else f" with {p['systemctl']}"
        return f"start {p['unit']}{' (--user)' if p['user'] else ''}{via}"
    if k == "wait_http":
        return f"poll {p['url']} on the host every {p['interval']:g}s until HTTP {p['status']}"
    if k == "shell":
        codes = ",".join(str(c) for c in p["expect_exit"])
        if p["command"] is not None:
            return f"sh -c: {p['command']} (expect exit {codes})"
        return f"run {shlex.join(p['argv'])} (expect exit {codes})"
    if k == "assert":
        return f"assert {_conditions_text(p['that'])}"
    if k == "report":
        return f"report memory of {_gpus_text(p['gpus'])} (used, reserved, unattributed)"
    return k
