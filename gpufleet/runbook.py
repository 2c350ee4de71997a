"""Runbooks: load, validate and substitute a YAML list of steps (pure: no I/O but reading the file).

A runbook is operator input that later stops units, signals processes and runs commands, so
everything is checked before anything runs, and every mistake is ONE line naming the file, the
line and the step (``model-swap.yaml:14: step 2 'clean' (clean): unknown key 'grase' (did you
mean 'grace'?)``), raised as ``UsageError`` (exit 2).

Variables are ``{{ NAME }}`` (NAME = letters, digits, ``_``), given by ``vars:`` and ``-e
NAME=VALUE`` (``-e`` wins). They are substituted as DATA: into plain fields as text, then
validated like any typed value (a unit name stays a unit name, a GPU list a GPU list); into a
``shell`` step's ``command`` (run by ``sh -c``) as ONE shlex-quoted word, and a reference
inside quotes there is refused (``'{{ X }}'`` would unquote the value). An undefined variable
is a validation error. The format is documented in docs/runbooks.md.
"""
from __future__ import annotations

import math
import re
import shlex
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, NoReturn, Optional, Sequence

from .errors import UsageError
from .yamlsource import LineMap, LineSeq, did_you_mean, load_yaml
from .yamlsource import describe as describe_value
from .selection import format_gpu_list, parse_gpu_list

MAX_FILE_BYTES = 1 << 20
MAX_STEPS = 500
MAX_TIMEOUT_S = 86400.0

KINDS = ("stop_units", "clean", "wait_free", "fit", "clear_shm", "start_unit", "wait_http",
         "shell", "assert", "report")
# Steps that change the host: they need --yes, like `gpufleet clean`.
MUTATING = frozenset({"stop_units", "clean", "clear_shm", "start_unit", "shell"})
# Steps that take a GPU snapshot (their result is what a later `assert` may look at).
DEFAULT_TIMEOUT_S = {
    "stop_units": 120.0, "clean": 60.0, "wait_free": 300.0, "fit": 60.0, "clear_shm": 60.0,
    "start_unit": 120.0, "wait_http": 900.0, "shell": 60.0, "assert": 60.0, "report": 60.0,
}
TOP_LEVEL_KEYS = ("name", "description", "vars", "steps")
COMMON_KEYS = ("name", "kind", "timeout", "continue_on_failure")

VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_REF = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# systemd unit names: letters, digits, ":-_.\@"; an instance `name@inst.service` is fine.
_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]+\Z")
UNIT_SUFFIXES = ("service", "scope", "target", "socket", "timer", "mount", "slice", "path")


# --------------------------------------------------------------------------- model


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


# --------------------------------------------------------------------------- helpers

Fail = Callable[[str], NoReturn]


class _Templated(str):
    """A string that came (wholly) from a variable: numbers may then be written as text."""


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def _line(container: Any, key: Any = None) -> int:
    if key is not None and isinstance(container, LineMap):
        return container.key_line(key)
    return getattr(container, "line", 0)


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _plain_string(value: Any, fail: Fail, what: str = "a string") -> str:
    if not isinstance(value, str):
        fail(f"expected {what}, got {describe_value(value)}")
    if value == "":
        fail(f"expected {what}, got an empty string")
    if _has_control(value):
        fail(f"control characters (NUL, newline, ...) are not allowed: {value!r}")
    return value


def _number(value: Any, fail: Fail, what: str, integer: bool = False) -> float:
    if isinstance(value, _Templated):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            fail(f"expected {what}, got {describe_value(str(value))}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        integer and not isinstance(value, int)
    ):
        fail(f"expected {what}, got {describe_value(value)}")
    if not math.isfinite(value):
        fail(f"expected {what}, got {describe_value(value)}")
    return value


def _v_timeout(value: Any, fail: Fail) -> float:
    v = _number(value, fail, "a positive number of seconds")
    if not 0 < v <= MAX_TIMEOUT_S:
        fail(f"expected a positive number of seconds (at most {int(MAX_TIMEOUT_S)}), got {value!r}")
    return float(v)


def _v_seconds(value: Any, fail: Fail) -> float:
    v = _number(value, fail, "a number of seconds >= 0")
    if not 0 <= v <= MAX_TIMEOUT_S:
        fail(f"expected a number of seconds >= 0 (at most {int(MAX_TIMEOUT_S)}), got {value!r}")
    return float(v)


def _v_mib(value: Any, fail: Fail) -> int:
    v = _number(value, fail, "a whole number of MiB >= 0", integer=True)
    if not 0 <= v <= (1 << 30):
        fail(f"expected a whole number of MiB >= 0, got {value!r}")
    return int(v)


def _v_fraction(value: Any, fail: Fail) -> float:
    v = _number(value, fail, "a fraction between 0 and 1")
    if not 0 < v <= 1:
        fail(f"expected a fraction 0 < x <= 1, got {value!r}")
    return float(v)


def _v_bool(value: Any, fail: Fail) -> bool:
    if isinstance(value, _Templated) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        fail(f"expected true or false, got {describe_value(value)}")
    return value


def _v_gpus(value: Any, fail: Fail) -> Optional[tuple[int, ...]]:
    """``all`` (None), ``0-3``, ``0,2,5``, an index, or a list of indices."""
    if isinstance(value, bool):
        fail(f"expected a GPU list like 0-3, 0,2,5 or all, got {describe_value(value)}")
    if isinstance(value, int):
        value = str(value)
    if isinstance(value, list):
        if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            fail("expected a GPU list like 0-3, 0,2,5, all, or a list of indices like [0, 1]")
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        fail(f"expected a GPU list like 0-3, 0,2,5 or all, got {describe_value(value)}")
    try:
        return parse_gpu_list(value)
    except UsageError as exc:
        fail(str(exc).replace("--gpus: ", "", 1))


def unit_name(text: str) -> str:
    """``vllm-kimi`` -> ``vllm-kimi.service``; raises ValueError for anything else than a unit."""
    if not text or len(text) > 255 or text.startswith("-") or not _UNIT.match(text):
        raise ValueError(f"invalid unit name {text!r}: letters, digits and ':-_.\\@' "
                         "(not starting with '-')")
    base, dot, suffix = text.rpartition(".")
    if not dot or suffix not in UNIT_SUFFIXES:
        return text + ".service"
    if not base:
        raise ValueError(f"invalid unit name {text!r}")
    return text


def _v_unit(value: Any, fail: Fail) -> str:
    text = _plain_string(value, fail, "a systemd unit name")
    try:
        return unit_name(text)
    except ValueError as exc:
        fail(str(exc))


def _v_units(value: Any, fail: Fail, allow_empty: bool = False) -> tuple[str, ...]:
    """A list of unit names, or one string of names separated by commas or spaces (so one
    variable can carry several, or none: ``-e UNITS=``)."""
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value) if v]
    if not isinstance(value, list) or (not value and not allow_empty):
        fail(f"expected a list of unit names (e.g. [vllm-minimax]), got {describe_value(value)}")
    out: dict[str, None] = {}
    for i, item in enumerate(value):
        out.setdefault(_v_unit(item, _sub_fail(fail, f"[{i}]")), None)
    return tuple(out)


def _v_globs(value: Any, fail: Fail) -> tuple[str, ...]:
    """Command-line globs never to signal, added to the host's `protect`."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        fail(f"expected a list of glob strings, got {describe_value(value)}")
    return tuple(dict.fromkeys(_plain_string(v, _sub_fail(fail, f"[{i}]"), "a glob string")
                               for i, v in enumerate(value)))


_PROGRAM = re.compile(r"[A-Za-z0-9_./+][A-Za-z0-9_./+-]*\Z")


def _v_program(value: Any, fail: Fail) -> str:
    """A command name or absolute path on the host (one argv word, never shell text)."""
    text = _plain_string(value, fail, "a program name or absolute path")
    if len(text) > 4096 or not _PROGRAM.match(text) or ("/" in text and not text.startswith("/")):
        fail(f"invalid program {text!r}: a command name or an absolute path "
             "(letters, digits, '/', '.', '_', '+', '-')")
    return text


def _v_url(value: Any, fail: Fail) -> str:
    text = _plain_string(value, fail, "an http:// or https:// URL")
    if any(c.isspace() for c in text):
        fail(f"invalid URL {text!r}: no spaces")
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        fail(f"invalid URL {text!r}: expected http://HOST[:PORT]/PATH (fetched on the host)")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        fail(f"invalid URL {text!r}: bad port")
    return text


def _v_status(value: Any, fail: Fail) -> int:
    v = _number(value, fail, "an HTTP status code", integer=True)
    if not 100 <= v <= 599:
        fail(f"expected an HTTP status code 100-599, got {value!r}")
    return int(v)


def _v_exit_codes(value: Any, fail: Fail) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    if not items:
        fail("expected an exit code or a list of exit codes")
    out = []
    for item in items:
        v = _number(item, fail, "an exit code 0-255 (or a list of them)", integer=True)
        if not 0 <= v <= 255:
            fail(f"expected an exit code 0-255, got {item!r}")
        out.append(int(v))
    return tuple(sorted(set(out)))


def _v_argv(value: Any, fail: Fail) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        fail(f"expected a non-empty list of arguments, got {describe_value(value)}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)
        if not isinstance(item, str):
            fail(f"[{i}]: expected a string argument, got {describe_value(item)}")
        if "\0" in item:
            fail(f"[{i}]: NUL character in argument")
        out.append(str(item))
    if not out[0]:
        fail("the program (first argument) is empty")
    return tuple(out)


def _v_command(value: Any, fail: Fail) -> str:
    if not isinstance(value, str) or not value.strip():
        fail(f"expected a shell command string, got {describe_value(value)}")
    if "\0" in value:
        fail("NUL character in command")
    return value


def _v_dtype(value: Any, fail: Fail) -> str:
    from .fit import DTYPE_BYTES

    text = _plain_string(value, fail, "a dtype").strip().lower()
    if text not in DTYPE_BYTES:
        fail(f"unknown dtype {value!r}{did_you_mean(text, sorted(DTYPE_BYTES))} "
             f"(known: {', '.join(sorted(DTYPE_BYTES))})")
    return text


def _v_params(value: Any, fail: Fail) -> float:
    """A parameter count as `gpufleet fit --params` reads it: 14B, 7b, 500M, 14e9."""
    from .fit import parse_params

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        fail(f"expected a parameter count like 14B, 7b or 14e9, got {describe_value(value)}")
    try:
        return parse_params(str(value))
    except UsageError as exc:
        fail(str(exc).replace("--params ", "", 1))


def _v_gib(value: Any, fail: Fail) -> float:
    v = _number(value, fail, "a number of GiB >= 0")
    if not 0 <= v <= 1e6:
        fail(f"expected a number of GiB >= 0, got {value!r}")
    return float(v)


def _v_positive_int(value: Any, fail: Fail) -> int:
    v = _number(value, fail, "a whole number >= 1", integer=True)
    if v < 1 or v > 1024:
        fail(f"expected a whole number 1-1024, got {value!r}")
    return int(v)


def _sub_fail(fail: Fail, where: str) -> Fail:
    def inner(message: str) -> NoReturn:
        fail(f"{where}: {message}")

    return inner


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
        v = _number(value, fail, "a fraction between 0 and 1")
        if not 0 <= v <= 1:
            fail(f"expected a fraction 0 <= x <= 1, got {value!r}")
        return float(v)
    return _v_mib(value, fail)


def _v_conditions(raw: Any, fail: Fail, line_of: Callable[[Any], int],
                  fail_at: Callable[[int], Fail]) -> dict[str, Any]:
    """The `that:` mapping of an assert step -> {gpus, bounds: {metric: (min, max)}, sets}."""
    if not isinstance(raw, dict) or not raw:
        fail(f"expected a mapping of conditions (e.g. {{no_holders_on: 0-3}}), got {describe_value(raw)}")
    gpus = None
    bounds: dict[str, list] = {}
    sets: dict[str, tuple[int, ...]] = {}
    for key, value in raw.items():
        kfail = _sub_fail(fail_at(line_of(key)), f"that.{key}")
        if key not in ASSERT_KEYS:
            fail_at(line_of(key))(f"unknown condition {key!r}{did_you_mean(str(key), ASSERT_KEYS)}"
                                  f" (conditions: {', '.join(METRICS + GPU_SETS)}, "
                                  "with {min: X, max: Y} or the _min/_max shorthands)")
        if key == "gpus":
            gpus = _v_gpus(value, kfail)
        elif key in GPU_SETS:
            chosen = _v_gpus(value, kfail)
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
        "units": _Field(_v_units, required=True),
        "disable": _Field(_v_bool, default=False),
        "user": _Field(_v_bool, default=False),
        "systemctl": _Field(_v_program, default="systemctl"),
    },
    "clean": {
        "gpus": _Field(_v_gpus, default=None),
        "grace": _Field(_v_seconds, default=10.0),
        "tolerance_mib": _Field(_v_mib, default=64),
        "protect": _Field(_v_globs, default=()),
        "include_spanning": _Field(_v_bool, default=False),
        "stop_units": _Field(_v_bool, default=False),
        "disable_units": _Field(_v_bool, default=False),
        "shm": _Field(_v_bool, default=False),
        "reset": _Field(_v_bool, default=False),
    },
    "wait_free": {
        "gpus": _Field(_v_gpus, default=None),
        "min_free_mib": _Field(_v_mib),
        "min_free_fraction": _Field(_v_fraction),
        "poll": _Field(_v_timeout, default=1.0),
    },
    # `gpufleet fit`'s options: weights_gib, or params (+ dtype); the measured extras.
    "fit": {
        "params": _Field(_v_params),
        "dtype": _Field(_v_dtype, default=None),
        "weights_gib": _Field(_v_gib),
        "activations_gib": _Field(_v_gib, default=0.0),
        "non_torch_gib": _Field(_v_gib, default=0.0),
        "tp": _Field(_v_positive_int, default=1),
        "util": _Field(_v_fraction, default=0.9),
        "context_mib": _Field(_v_mib, default=None),
        "gpus": _Field(_v_gpus, default=None),
    },
    "clear_shm": {},
    "start_unit": {
        "unit": _Field(_v_unit, required=True),
        "user": _Field(_v_bool, default=False),
        "systemctl": _Field(_v_program, default="systemctl"),
    },
    "wait_http": {
        "url": _Field(_v_url, required=True),
        "status": _Field(_v_status, default=200),
        "interval": _Field(_v_timeout, default=2.0),
    },
    "shell": {
        "command": _Field(_v_command),
        "argv": _Field(_v_argv),
        "expect_exit": _Field(_v_exit_codes, default=(0,)),
    },
    "assert": {
        "that": _Field(lambda v, f: v, required=True),  # validated by _v_conditions
    },
    "report": {
        "gpus": _Field(_v_gpus, default=None),
    },
}


# --------------------------------------------------------------------------- substitution


def references(value: Any) -> list[str]:
    """Every variable name referenced in a (nested) value, in order."""
    if isinstance(value, str):
        return _REF.findall(value)
    if isinstance(value, dict):
        return [n for v in value.values() for n in references(v)]
    if isinstance(value, list):
        return [n for v in value for n in references(v)]
    return []


def substitute(value: Any, variables: Mapping[str, str]) -> Any:
    """Replace ``{{ NAME }}`` with the value's text, once (a value is never re-expanded).

    A string that is exactly one reference becomes a ``_Templated`` string, so typed fields
    (numbers, booleans) may come from variables. Missing names raise KeyError.
    """
    if isinstance(value, str):
        whole = _REF.fullmatch(value.strip()) if value.strip() == value else None
        if whole:
            return _Templated(variables[whole.group(1)])
        return _REF.sub(lambda m: variables[m.group(1)], value)
    if isinstance(value, dict):
        out = LineMap({k: substitute(v, variables) for k, v in value.items()})
        out.line = getattr(value, "line", 0)
        out.lines = getattr(value, "lines", {})
        return out
    if isinstance(value, list):
        seq = LineSeq(substitute(v, variables) for v in value)
        seq.line = getattr(value, "line", 0)
        seq.lines = getattr(value, "lines", [])
        return seq
    return value


def _quote_context(command: str) -> list[tuple[int, str, str]]:
    """(offset, name, quoting) of each reference in shell text; quoting is '', "'" or '"'.

    A small POSIX sh scanner: enough to know whether a reference sits inside quotes, where a
    shlex-quoted value would come OUT of its quotes.
    """
    refs = {m.start(): m for m in _REF.finditer(command)}
    out = []
    state = ""
    i = 0
    while i < len(command):
        if i in refs:
            m = refs[i]
            out.append((i, m.group(1), state))
            i = m.end()
            continue
        c = command[i]
        if state == "'":
            if c == "'":
                state = ""
        elif c == "\\":
            i += 1
        elif state == '"':
            if c == '"':
                state = ""
        elif c in "'\"":
            state = c
        i += 1
    return out


def substitute_shell(command: str, variables: Mapping[str, str], fail: Fail) -> str:
    """``{{ X }}`` -> ``shlex.quote(value)``: always exactly one word of data, never code."""
    for _, name, quoting in _quote_context(command):
        if quoting:
            fail(f"command: {{{{ {name} }}}} is inside {quoting}quotes{quoting}: write it bare, "
                 "it is quoted for you (a quoted value would be unquoted)")
        if name not in variables:
            fail(f"command: undefined variable {name!r}{did_you_mean(name, list(variables))}")
    return _REF.sub(lambda m: shlex.quote(variables[m.group(1)]), command)


# --------------------------------------------------------------------------- parsing


def parse_extra_vars(pairs: Sequence[str]) -> dict[str, str]:
    """``-e KEY=VALUE`` (repeatable) -> dict; the last one for a key wins."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise UsageError(f"-e {pair!r}: expected KEY=VALUE")
        if not VAR_NAME.match(key):
            raise UsageError(f"-e {pair!r}: invalid variable name {key!r} "
                             "(letters, digits and '_', not starting with a digit)")
        if "\0" in value:
            raise UsageError(f"-e {key}: NUL character in value")
        out[key] = value
    return out


def _scalar_text(value: Any) -> Optional[str]:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return None


def load_runbook(path: str | Path, extra_vars: Optional[Mapping[str, str]] = None,
                 display: Optional[str] = None) -> Runbook:
    """Read, validate and substitute one runbook file. ``display`` names it in messages."""
    path = Path(path)
    source = display if display is not None else str(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise UsageError(f"{source}: runbook not found") from None
    except IsADirectoryError:
        raise UsageError(f"{source}: is a directory, not a runbook") from None
    except OSError as exc:
        raise UsageError(f"{source}: cannot read runbook: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"{source}: larger than {MAX_FILE_BYTES} bytes; not a runbook")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UsageError(f"{source}:{line}: not valid UTF-8") from None
    return parse_runbook(text, source=source, extra_vars=extra_vars,
                         default_name=path.stem)


def parse_runbook(text: str, source: str = "<string>",
                  extra_vars: Optional[Mapping[str, str]] = None,
                  default_name: str = "runbook") -> Runbook:
    """Validate runbook YAML text; ``extra_vars`` (from ``-e``) win over ``vars:``."""

    def fail_at(line: int, where: str = "") -> Fail:
        def fail(message: str) -> NoReturn:
            loc = f"{source}:{line}" if line else source
            raise UsageError(one_line(f"{loc}: {where}: {message}" if where else f"{loc}: {message}"))

        return fail

    if "\0" in text:
        fail_at(text[: text.index("\0")].count("\n") + 1)("NUL character in file")
    doc = load_yaml(text, source)
    if doc is None:
        fail_at(0)("empty runbook: it needs a 'steps:' list (see docs/runbooks.md)")
    if isinstance(doc, list):
        steps_raw, doc = doc, LineMap()
        doc.line, doc.lines = 1, {}
    elif isinstance(doc, dict):
        for key in doc:
            if key not in TOP_LEVEL_KEYS:
                fail_at(_line(doc, key))(f"unknown top-level key {key!r}"
                                         f"{did_you_mean(str(key), TOP_LEVEL_KEYS)}")
        if "steps" not in doc:
            fail_at(_line(doc))("no 'steps:' list (see docs/runbooks.md)")
        steps_raw = doc["steps"]
    else:
        fail_at(_line(doc) or 1)(f"a runbook is a mapping with 'steps:', got {describe_value(doc)}")

    name = doc.get("name", default_name)
    _plain_string(name, fail_at(_line(doc, "name"), "name"), "a runbook name")
    description = doc.get("description") or ""
    if not isinstance(description, str):
        fail_at(_line(doc, "description"), "description")(f"expected text, got {describe_value(description)}")

    # Variables: vars: block (null = must be given with -e), then -e on top.
    declared: dict[str, Optional[str]] = {}
    vars_raw = doc.get("vars")
    if vars_raw is not None:
        if not isinstance(vars_raw, dict):
            fail_at(_line(doc, "vars"), "vars")(f"expected a mapping NAME: value, got {describe_value(vars_raw)}")
        for key, value in vars_raw.items():
            vfail = fail_at(_line(vars_raw, key), f"vars.{key}")
            if not isinstance(key, str) or not VAR_NAME.match(key):
                vfail("invalid variable name (letters, digits and '_', not starting with a digit)")
            if value is None:
                declared[key] = None
                continue
            text_value = _scalar_text(value)
            if text_value is None:
                vfail(f"expected a plain value (text or number), got {describe_value(value)}")
            if _REF.search(text_value):
                vfail("a variable's value cannot refer to other variables")
            declared[key] = text_value
    extra = dict(extra_vars or {})
    if not isinstance(steps_raw, list) or not steps_raw:
        fail_at(_line(doc, "steps"), "steps")(f"expected a non-empty list of steps, got {describe_value(steps_raw)}")
    if len(steps_raw) > MAX_STEPS:
        fail_at(_line(doc, "steps"), "steps")(f"more than {MAX_STEPS} steps")
    used = set(references(steps_raw))
    for key in extra:
        if key not in declared and key not in used:
            known = sorted(set(declared) | used)
            raise UsageError(f"-e {key}: {source} has no variable {key!r}{did_you_mean(key, known)}"
                             + (f" (its variables: {', '.join(known)})" if known else " (it has none)"))
    variables: dict[str, str] = {k: v for k, v in declared.items() if v is not None}
    variables.update(extra)
    missing = sorted(k for k, v in declared.items() if v is None and k not in extra)
    if missing:
        fail_at(_line(doc, "vars"), "vars")(
            f"no value for {', '.join(missing)}: give {' '.join(f'-e {k}=...' for k in missing)}")

    steps: list[Step] = []
    seen_names: dict[str, int] = {}
    for i, raw in enumerate(steps_raw):
        line = steps_raw.item_line(i) if isinstance(steps_raw, LineSeq) else 0
        step = _parse_step(i + 1, raw, line, variables, fail_at)
        if step.name in seen_names and isinstance(raw, dict) and "name" not in raw:
            step = replace(step, name=f"{step.kind}-{step.index}")
        if step.name in seen_names:
            fail_at(line, step.label)(f"duplicate step name (first is step {seen_names[step.name]})")
        seen_names[step.name] = step.index
        steps.append(step)
    return Runbook(source=source, name=name, description=description.strip(),
                   vars=MappingProxyType(variables), steps=tuple(steps))


def _parse_step(index: int, raw: Any, line: int, variables: Mapping[str, str],
                fail_at: Callable[..., Fail]) -> Step:
    where = f"step {index}"
    if not isinstance(raw, dict):
        fail_at(line, where)(f"expected a mapping with 'kind:', got {describe_value(raw)}")
    kind = raw.get("kind")
    if kind is None:
        fail_at(line, where)(f"missing 'kind:' (one of {', '.join(KINDS)})")
    if not isinstance(kind, str) or kind not in KINDS:
        fail_at(_line(raw, "kind"), where)(
            f"unknown step kind {kind!r}{did_you_mean(str(kind), KINDS)} (kinds: {', '.join(KINDS)})")
    if "name" in raw:
        name = _plain_string(str(substitute(raw["name"], variables)) if isinstance(raw["name"], str)
                             else raw["name"], fail_at(_line(raw, "name"), where), "a step name")
    else:
        name = kind
    where = f"step {index} {name!r} ({kind})"
    fields = KIND_FIELDS[kind]
    allowed = COMMON_KEYS + tuple(fields)

    def key_fail(key: str) -> Fail:
        return fail_at(_line(raw, key), f"{where}: {key}" if key else where)

    for key in raw:
        if key not in allowed:
            hint = did_you_mean(str(key), allowed)
            if not hint:
                other = [k for k, f in KIND_FIELDS.items() if key in f]
                hint = f" ({key!r} belongs to {' / '.join(other)})" if other else ""
            fail_at(_line(raw, key), where)(f"unknown key {key!r} for a {kind} step{hint} "
                                            f"(keys: {', '.join(allowed)})")
    # Variables: every reference must be defined, whatever the field.
    for key, value in raw.items():
        for ref in references(value):
            if ref not in variables:
                key_fail(key)(f"undefined variable {ref!r}{did_you_mean(ref, list(variables))} "
                              "(define it under vars: or pass -e " + ref + "=...)")
    params: dict[str, Any] = {}
    for key, spec in fields.items():
        if key not in raw:
            if spec.required:
                fail_at(line, where)(f"missing {key!r}")
            params[key] = spec.default
            continue
        value = raw[key]
        if kind == "shell" and key == "command":
            if isinstance(value, str):
                value = substitute_shell(value, variables, key_fail(""))
            params[key] = spec.check(value, key_fail(key))
            continue
        if kind == "assert" and key == "that":
            def line_of(k: Any, _v: Any = value) -> int:
                return _line(_v, k) if isinstance(_v, dict) else _line(raw, "that")
            params[key] = _v_conditions(substitute(value, variables), key_fail(key), line_of,
                                        lambda ln: fail_at(ln, where))
            continue
        params[key] = spec.check(substitute(value, variables), key_fail(key))
    timeout = DEFAULT_TIMEOUT_S[kind]
    if "timeout" in raw:
        timeout = _v_timeout(substitute(raw["timeout"], variables), key_fail("timeout"))
    go_on = False
    if "continue_on_failure" in raw:
        go_on = _v_bool(substitute(raw["continue_on_failure"], variables), key_fail("continue_on_failure"))
    _check_step(kind, params, timeout, fail_at(line, where))
    return Step(index=index, name=name, kind=kind, timeout=timeout, line=line,
                params=MappingProxyType(params), continue_on_failure=go_on)


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
    if kind == "fit":
        if params.get("weights_gib") is None and params.get("params") is None:
            fail("give weights_gib, or params (with dtype, default fp16)")
        if params.get("weights_gib") is not None and params["weights_gib"] <= 0:
            fail("weights_gib must be > 0")
        tp, gpus = params["tp"], params.get("gpus")
        if gpus is not None and (len(gpus) < tp or len(gpus) % tp):
            fail(f"tp {tp} does not divide the {len(gpus)} GPU(s) named")


# --------------------------------------------------------------------------- description


def _gpus_text(gpus: Optional[Sequence[int]]) -> str:
    return "all GPUs" if gpus is None else f"GPU {format_gpu_list(gpus)}" if len(gpus) == 1 \
        else f"GPUs {format_gpu_list(gpus)}"


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


def describe(step: Step) -> str:
    """What a step would do, in one line (the --dry-run plan)."""
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
        extra = f" + {p['activations_gib']:g} GiB activations" if p["activations_gib"] else ""
        tp = f", tp {p['tp']}" if p["tp"] > 1 else ""
        return (f"vLLM fit check: {model}{extra} on {_gpus_text(p['gpus'])} at util "
                f"{p['util']:g}{tp}")
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
