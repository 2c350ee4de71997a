"""Runbook field values only runbooks have: the `fit` step's dtype, parameter count, GiB and
tensor-parallel size; a rolling run's `serial` and `max_fail_percentage`; a `local_http`
step's method, headers, JSON body and statuses (pure).

Every other value type (seconds, MiB, GPU lists, units, URLs, argv, ...) is validated by the
family shared with the inventory, gpufleet.config.validators; gpufleet.runbook.kinds wires
each step field to its validator.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Union

from gpufleet.config.validators import Fail, describe, did_you_mean, has_control, number, plain_string
from gpufleet.errors import UsageError

__all__ = ["HTTP_METHODS", "MAX_SERIAL_ITEMS", "Fail", "v_dtype", "v_gib", "v_headers",
           "v_http_method", "v_http_statuses", "v_json_body", "v_params", "v_percentage",
           "v_positive_int", "v_serial"]

MAX_SERIAL_ITEMS = 100
MAX_BATCH = 1_000_000
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
MAX_BODY_BYTES = 64 * 1024
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")  # RFC 9110 token
_DIGITS = re.compile(r"[0-9]+\Z")


def v_dtype(value: Any, fail: Fail) -> str:
    from gpufleet.core.fit import DTYPE_BYTES

    text = plain_string(value, fail, "a dtype").strip().lower()
    if text not in DTYPE_BYTES:
        fail(f"unknown dtype {value!r}{did_you_mean(text, sorted(DTYPE_BYTES))} "
             f"(known: {', '.join(sorted(DTYPE_BYTES))})")
    return text


def v_params(value: Any, fail: Fail) -> float:
    """A parameter count as `gpufleet fit --params` reads it: 14B, 7b, 500M, 14e9."""
    from gpufleet.core.fit import parse_params

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        fail(f"expected a parameter count like 14B, 7b or 14e9, got {describe(value)}")
    try:
        return parse_params(str(value))
    except UsageError as exc:
        fail(str(exc).replace("--params ", "", 1))


def v_gib(value: Any, fail: Fail) -> float:
    v = number(value, fail, "a number of GiB >= 0")
    if not 0 <= v <= 1e6:
        fail(f"expected a number of GiB >= 0, got {value!r}")
    return float(v)


def v_positive_int(value: Any, fail: Fail) -> int:
    v = number(value, fail, "a whole number >= 1", integer=True)
    if v < 1 or v > 1024:
        fail(f"expected a whole number 1-1024, got {value!r}")
    return int(v)


# --------------------------------------------------------------------------- rolling runs


def _serial_item(item: Any, fail: Fail) -> Union[int, str]:
    """One `serial` entry as Ansible reads it: a host count (0: every host left) or "N%"."""
    what = "a host count (0: all the rest) or a percentage like '25%'"
    if isinstance(item, str):
        text = item.strip()
        if text.endswith("%"):
            digits = text[:-1].strip()
            if not _DIGITS.match(digits) or not 1 <= int(digits) <= 100:
                fail(f"expected a whole percentage 1%-100% of the hosts, got {item!r}")
            return f"{int(digits)}%"
        if not _DIGITS.match(text):
            fail(f"expected {what}, got {describe(item)}")
        item = int(text)
    v = number(item, fail, what, integer=True)
    if not 0 <= v <= MAX_BATCH:
        fail(f"expected {what}, got {item!r}")
    return int(v)


def v_serial(value: Any, fail: Fail) -> tuple[Union[int, str], ...]:
    """Ansible's `serial`: a count, a percentage of all hosts, or a list that ramps up (the
    last entry repeats); the --serial flag writes the list as ``1,2,25%``."""
    if isinstance(value, str) and "," in value:
        value = value.split(",")
    items = list(value) if isinstance(value, list) else [value]
    if not items or len(items) > MAX_SERIAL_ITEMS:
        fail(f"expected a host count, a percentage like '25%' or a list of 1-{MAX_SERIAL_ITEMS} of them, "
             f"got {describe(value)}")
    return tuple(_serial_item(item, fail) for item in items)


def v_percentage(value: Any, fail: Fail) -> float:
    """0-100, written 25, 12.5 or '25%' (Ansible's `max_fail_percentage`)."""
    what = "a percentage 0-100 (25 or '25%')"
    if isinstance(value, str):
        text = value.strip().removesuffix("%").strip()
        try:
            value = float(text)
        except ValueError:
            fail(f"expected {what}, got {describe(value)}")
    v = number(value, fail, what)
    if not 0 <= v <= 100:
        fail(f"expected {what}, got {v:g}")
    return float(v)


# --------------------------------------------------------------------------- local_http


def v_http_method(value: Any, fail: Fail) -> str:
    text = plain_string(value, fail, "an HTTP method").strip().upper()
    if text not in HTTP_METHODS:
        fail(f"unknown HTTP method {value!r}{did_you_mean(text, HTTP_METHODS)} "
             f"(methods: {', '.join(HTTP_METHODS)})")
    return text


def v_http_statuses(value: Any, fail: Fail) -> tuple[int, ...]:
    """The status a request must answer: one code or a list, 100-599."""
    items = value if isinstance(value, list) else [value]
    if not items:
        fail("expected an HTTP status code or a list of them")
    out = []
    for item in items:
        v = number(item, fail, "an HTTP status code 100-599 (or a list of them)", integer=True)
        if not 100 <= v <= 599:
            fail(f"expected an HTTP status code 100-599, got {item!r}")
        out.append(int(v))
    return tuple(sorted(set(out)))


def v_headers(value: Any, fail: Fail) -> dict[str, str]:
    """Request headers NAME: VALUE (a token name; a value of printable text, no CR/LF)."""
    if not isinstance(value, dict):
        fail(f"expected a mapping of header names to values, got {describe(value)}")
    out: dict[str, str] = {}
    for name, raw in value.items():
        if not isinstance(name, str) or not _HEADER_NAME.match(name):
            fail(f"invalid header name {name!r}")
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            raw = str(raw)
        if not isinstance(raw, str) or has_control(raw.replace("\t", " ")):
            fail(f"header {name}: expected text without control characters, got {describe(raw)}")
        out[name] = str(raw)
    return out


def _json_value(value: Any, fail: Fail, depth: int = 0) -> Any:
    if depth > 32:
        fail("the JSON body is nested too deep")
    if value is None or isinstance(value, (bool, int, str)):
        return str(value) if isinstance(value, str) else value
    if isinstance(value, float):
        if not math.isfinite(value):
            fail(f"expected a finite number in the JSON body, got {value!r}")
        return value
    if isinstance(value, list):
        return [_json_value(v, fail, depth + 1) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                fail(f"JSON body keys must be text, got {describe(k)}")
            out[str(k)] = _json_value(v, fail, depth + 1)
        return out
    fail(f"expected JSON data (mappings, lists, text, numbers, booleans, null), got {describe(value)}")


def v_json_body(value: Any, fail: Fail) -> Any:
    """A request's JSON body: YAML data sent as JSON (variables in it are data, never code)."""
    body = _json_value(value, fail)
    if len(json.dumps(body).encode()) > MAX_BODY_BYTES:
        fail(f"the JSON body is larger than {MAX_BODY_BYTES} bytes")
    return body
