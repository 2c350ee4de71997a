"""Runbooks: read, validate and substitute a YAML list of steps into a ``Runbook`` (pure: no
I/O but reading the file).

A runbook is operator input that later stops units, signals processes and runs commands, so
everything is checked before anything runs, and every mistake is ONE line naming the file, the
line and the step (``model-swap.yaml:14: step 2 'clean' (clean): unknown key 'grase' (did you
mean 'grace'?)``), raised as ``UsageError`` (exit 2).

Variables are ``{{ NAME }}`` (NAME = letters, digits, ``_``), given by ``vars:`` and ``-e
NAME=VALUE`` (``-e`` wins); an undefined variable is a validation error. How they are
substituted (as DATA) is gpufleet.runbook.load.template. The step kinds (their fields, rules and
``describe``) live in gpufleet.runbook.kinds, the model in gpufleet.runbook.load.model. The format
is documented in docs/runbooks.md.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, NoReturn, Optional

from gpufleet.config import validators
from gpufleet.config.validators import Fail, did_you_mean, plain_string
from gpufleet.config.validators import describe as describe_value
from gpufleet.config.yamlsource import LineMap, LineSeq, load_yaml, read_source
from gpufleet.errors import UsageError, one_line
from gpufleet.runbook.kinds import (DEFAULT_TIMEOUT_S, GATE_KINDS, KIND_FIELDS, KINDS, LOCAL_KINDS,
                                    _check_step, _v_conditions)
from gpufleet.runbook.model import Rolling, Runbook, Step
from gpufleet.runbook.template import (PER_HOST, REF, SAMPLE_HOST, VAR_NAME, PerHostField, has_per_host,
                                       references, render_per_host, substitute, substitute_per_host,
                                       substitute_shell)
from gpufleet.runbook.values import v_percentage, v_serial

__all__ = ["COMMON_KEYS", "MAX_FILE_BYTES", "MAX_STEPS", "SHIPPED_DIR", "TOP_LEVEL_KEYS", "find_runbook",
           "load_runbook", "parse_runbook", "shipped_runbooks"]

MAX_FILE_BYTES = 1 << 20
MAX_STEPS = 500
TOP_LEVEL_KEYS = ("name", "description", "vars", "steps", "serial", "max_fail_percentage", "pause_s", "gate")
ROLLING_KEYS = ("serial", "max_fail_percentage", "pause_s", "gate")
COMMON_KEYS = ("name", "kind", "timeout", "continue_on_failure")



_PER_HOST_NAME = ("HOST and HOST_ADDRESS are set by gpufleet for each host (in local_http and "
                  "local_command steps): choose another name")

# --------------------------------------------------------------------------- helpers


def _line(container: Any, key: Any = None) -> int:
    if key is not None and isinstance(container, LineMap):
        return container.key_line(key)
    return getattr(container, "line", 0)


# --------------------------------------------------------------------------- parsing


def _scalar_text(value: Any) -> Optional[str]:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return None


#: The runbooks installed with the package (package data; the checkout's playbooks/ links here).
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "playbooks"


def shipped_runbooks() -> list[str]:
    """The shipped runbooks' names (``model-swap``, ...)."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def find_runbook(name: str) -> Path:
    """The runbook ``gpufleet run NAME`` means: the file when it exists (or NAME has a ``/``),
    else the shipped one of that name (``model-swap`` or ``model-swap.yaml``): an installed
    gpufleet has no playbooks/ folder beside it to give a path to."""
    path = Path(name)
    if path.exists() or "/" in name:
        return path
    stem = name[:-5] if name.endswith(".yaml") else name
    if stem in shipped_runbooks():
        return SHIPPED_DIR / f"{stem}.yaml"
    raise UsageError(f"{name}: runbook not found: not a file, nor a shipped runbook "
                     f"({', '.join(shipped_runbooks()) or 'none installed'})")


def load_runbook(path: str | Path, extra_vars: Optional[Mapping[str, str]] = None,
                 display: Optional[str] = None) -> Runbook:
    """Read, validate and substitute one runbook file. ``display`` names it in messages."""
    path = Path(path)
    source = display if display is not None else str(path)
    text = read_source(path, source, "runbook", MAX_FILE_BYTES)
    return parse_runbook(text, source=source, extra_vars=extra_vars,
                         default_name=path.stem)


def parse_runbook(text: str, source: str = "<string>",
                  extra_vars: Optional[Mapping[str, str]] = None,
                  default_name: str = "runbook") -> Runbook:
    """Validate runbook YAML text; ``extra_vars`` (from ``-e``) win over ``vars:``."""
    fail_at = _fail_at(source)
    doc, steps_raw = _top_level(text, source, fail_at)
    name = doc.get("name", default_name)
    plain_string(name, fail_at(_line(doc, "name"), "name"), "a runbook name")
    description = doc.get("description") or ""
    if not isinstance(description, str):
        fail_at(_line(doc, "description"), "description")(f"expected text, got {describe_value(description)}")
    declared = _declared_vars(doc, fail_at)
    extra = dict(extra_vars or {})
    if not isinstance(steps_raw, list) or not steps_raw:
        fail_at(_line(doc, "steps"), "steps")(f"expected a non-empty list of steps, got {describe_value(steps_raw)}")
    if len(steps_raw) > MAX_STEPS:
        fail_at(_line(doc, "steps"), "steps")(f"more than {MAX_STEPS} steps")
    variables = _variables(declared, extra, [steps_raw] + [doc.get(k) for k in ROLLING_KEYS], doc,
                           source, fail_at)
    steps = _parse_steps(steps_raw, variables, fail_at)
    return Runbook(source=source, name=name, description=description.strip(),
                   vars=MappingProxyType(variables), steps=tuple(steps),
                   rolling=_parse_rolling(doc, variables, fail_at))


def _parse_rolling(doc: Any, variables: Mapping[str, str], fail_at: Callable[..., Fail]) -> Rolling:
    """serial, max_fail_percentage, pause_s and the gate's steps (Ansible's play keywords)."""
    def value(key: str, check: Callable[[Any, Fail], Any]) -> Any:
        kfail = fail_at(_line(doc, key), key)
        for ref in references(doc[key]):
            if ref not in variables:
                kfail(f"undefined variable {ref!r}{did_you_mean(ref, list(variables))}")
        return check(substitute(doc[key], variables), kfail)

    serial = value("serial", v_serial) if "serial" in doc else ()
    budget = value("max_fail_percentage", v_percentage) if "max_fail_percentage" in doc else None
    pause = value("pause_s", validators.seconds) if "pause_s" in doc else 0.0
    gate: list[Step] = []
    if "gate" in doc:
        raw = doc["gate"]
        if not isinstance(raw, list) or not raw:
            fail_at(_line(doc, "gate"), "gate")(f"expected a list of {' or '.join(GATE_KINDS)} steps, "
                                                f"got {describe_value(raw)}")

        def gate_fail_at(line: int, where: str = "") -> Fail:
            return fail_at(line, f"gate: {where}" if where else "gate")

        gate = _parse_steps(raw, variables, gate_fail_at)
        for step in gate:
            if step.kind not in GATE_KINDS:
                gate_fail_at(step.line, step.label)(
                    f"a gate only looks: its steps are {' or '.join(GATE_KINDS)}")
    return Rolling(serial=serial, max_fail_percentage=budget, pause_s=pause, gate=tuple(gate))


def _fail_at(source: str) -> Callable[..., Fail]:
    """``fail_at(line, where)(message)`` raises the one-line ``source:line: where: message``."""

    def fail_at(line: int, where: str = "") -> Fail:
        def fail(message: str) -> NoReturn:
            loc = f"{source}:{line}" if line else source
            raise UsageError(one_line(f"{loc}: {where}: {message}" if where else f"{loc}: {message}"))

        return fail

    return fail_at


def _top_level(text: str, source: str, fail_at: Callable[..., Fail]) -> tuple[Any, Any]:
    """The YAML document (a bare list of steps gets an empty mapping) and its raw steps."""
    if "\0" in text:
        fail_at(text[: text.index("\0")].count("\n") + 1)("NUL character in file")
    doc = load_yaml(text, source)
    if doc is None:
        fail_at(0)(f"empty runbook: it needs a 'steps:' list (examples: {SHIPPED_DIR})")
    if isinstance(doc, list):
        steps_raw, doc = doc, LineMap()
        doc.line, doc.lines = 1, {}
    elif isinstance(doc, dict):
        for key in doc:
            if key not in TOP_LEVEL_KEYS:
                fail_at(_line(doc, key))(f"unknown top-level key {key!r}"
                                         f"{did_you_mean(str(key), TOP_LEVEL_KEYS)}")
        if "steps" not in doc:
            fail_at(_line(doc))(f"no 'steps:' list (examples: {SHIPPED_DIR})")
        steps_raw = doc["steps"]
    else:
        fail_at(_line(doc) or 1)(f"a runbook is a mapping with 'steps:', got {describe_value(doc)}")
    return doc, steps_raw


def _declared_vars(doc: Any, fail_at: Callable[..., Fail]) -> dict[str, Optional[str]]:
    """The ``vars:`` block as text values; None = must be given with -e."""
    declared: dict[str, Optional[str]] = {}
    vars_raw = doc.get("vars")
    if vars_raw is not None:
        if not isinstance(vars_raw, dict):
            fail_at(_line(doc, "vars"), "vars")(f"expected a mapping NAME: value, got {describe_value(vars_raw)}")
        for key, value in vars_raw.items():
            vfail = fail_at(_line(vars_raw, key), f"vars.{key}")
            if not isinstance(key, str) or not VAR_NAME.match(key):
                vfail("invalid variable name (letters, digits and '_', not starting with a digit)")
            if key in PER_HOST:
                vfail(_PER_HOST_NAME)
            if value is None:
                declared[key] = None
                continue
            text_value = _scalar_text(value)
            if text_value is None:
                vfail(f"expected a plain value (text or number), got {describe_value(value)}")
            if REF.search(text_value):
                vfail("a variable's value cannot refer to other variables")
            declared[key] = text_value
    return declared


def _variables(declared: Mapping[str, Optional[str]], extra: Mapping[str, str], steps_raw: Any,
               doc: Any, source: str, fail_at: Callable[..., Fail]) -> dict[str, str]:
    """``vars:`` with ``-e`` on top; an ``-e`` the runbook never uses, or a variable left
    without a value, is an error."""
    used = set(references(steps_raw))
    for key in extra:
        if key in PER_HOST:
            raise UsageError(f"-e {key}: {_PER_HOST_NAME}")
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
    return variables


def _parse_steps(steps_raw: Any, variables: Mapping[str, str],
                 fail_at: Callable[..., Fail]) -> list[Step]:
    """Every step, with unique names (an unnamed repeat becomes ``kind-index``)."""
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
    return steps


def _parse_step(index: int, raw: Any, line: int, variables: Mapping[str, str],
                fail_at: Callable[..., Fail]) -> Step:
    kind, name = _step_kind_name(index, raw, line, variables, fail_at)
    where = f"step {index} {name!r} ({kind})"

    def key_fail(key: str) -> Fail:
        return fail_at(_line(raw, key), f"{where}: {key}" if key else where)

    _check_step_keys(raw, kind, variables, where, fail_at, key_fail)
    params = _step_params(raw, kind, line, variables, where, fail_at, key_fail)
    timeout = DEFAULT_TIMEOUT_S[kind]
    if "timeout" in raw:
        timeout = validators.timeout(substitute(raw["timeout"], variables), key_fail("timeout"))
    go_on = False
    if "continue_on_failure" in raw:
        go_on = validators.boolean(substitute(raw["continue_on_failure"], variables), key_fail("continue_on_failure"))
    _check_step(kind, params, timeout, fail_at(line, where))
    return Step(index=index, name=name, kind=kind, timeout=timeout, line=line,
                params=MappingProxyType(params), continue_on_failure=go_on)


def _step_kind_name(index: int, raw: Any, line: int, variables: Mapping[str, str],
                    fail_at: Callable[..., Fail]) -> tuple[str, str]:
    """A step's kind (checked) and name (its kind unless given)."""
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
        name = plain_string(str(substitute(raw["name"], variables)) if isinstance(raw["name"], str)
                             else raw["name"], fail_at(_line(raw, "name"), where), "a step name")
    else:
        name = kind
    return kind, name


def _check_step_keys(raw: Any, kind: str, variables: Mapping[str, str], where: str,
                     fail_at: Callable[..., Fail], key_fail: Callable[[str], Fail]) -> None:
    """Only the keys of this kind, and no undefined variable in any of them."""
    allowed = COMMON_KEYS + tuple(KIND_FIELDS[kind])
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
            if ref in PER_HOST and kind in LOCAL_KINDS:
                continue
            if ref in PER_HOST:
                key_fail(key)(f"{{{{ {ref} }}}} is filled in for each host only in local_http and "
                              "local_command steps (they run on the controller)")
            if ref not in variables:
                key_fail(key)(f"undefined variable {ref!r}{did_you_mean(ref, list(variables))} "
                              "(define it under vars: or pass -e " + ref + "=...)")


def _step_params(raw: Any, kind: str, line: int, variables: Mapping[str, str], where: str,
                 fail_at: Callable[..., Fail], key_fail: Callable[[str], Fail]) -> dict[str, Any]:
    """The kind's fields, substituted and checked (a shell command's variables are quoted)."""
    params: dict[str, Any] = {}
    for key, spec in KIND_FIELDS[kind].items():
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
        if kind in LOCAL_KINDS:
            params[key] = _local_field(value, variables, spec.check, key_fail(key))
            continue
        params[key] = spec.check(substitute(value, variables), key_fail(key))
    return params


def _local_field(value: Any, variables: Mapping[str, str], check: Callable[[Any, Fail], Any],
                 fail: Fail) -> Any:
    """A local step's field: checked now (with a sample host when it names the host), and kept
    as a ``PerHostField`` to be filled in and checked again for each host."""
    deferred = substitute_per_host(value, variables)
    checked = check(render_per_host(deferred, SAMPLE_HOST), fail)
    return PerHostField(deferred, check) if has_per_host(deferred) else checked
