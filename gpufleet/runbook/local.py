"""The steps that run on the controller, for one host: ``local_http`` (a load balancer's API)
and ``local_command`` (its CLI), e.g. to take a host out of rotation before its model swap and
put it back after.

Internal to gpufleet.runbook.run (its EXECUTORS). Nothing becomes shell text: a command is an
argv run without a shell, a request's URL, headers and JSON body are values; ``{{ HOST }}`` and
``{{ HOST_ADDRESS }}`` were kept apart at load time and are filled in here, once, as data
(``Step.for_host``). Both are bounded by the step's ``end``: a command's whole process group is
killed at its timeout (the group this step started, by its PID), a request's socket times out.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any, Mapping, Optional, Protocol

from gpufleet.config.inventory import Host
from gpufleet.errors import StepFailed, one_line
from gpufleet.runbook.model import Step


class _HostRun(Protocol):
    """What a controller step uses of its host's run (gpufleet.runbook.steps._HostRun, which
    imports this module: named here by shape, not imported)."""

    host: Host

OUTPUT_MAX = 200  # characters of a response or an output line kept in the step's detail
READ_MAX = 4096  # bytes of a response body read


def host_values(host: Host) -> dict[str, str]:
    """The per-host values: the inventory name and the address gpufleet connects to (the
    name when the inventory gives no address: an ssh_config alias)."""
    return {"HOST": host.name, "HOST_ADDRESS": host.address or host.name}


def _remaining(end: float) -> float:
    return max(0.1, end - time.monotonic())


def _short(text: str) -> str:
    line = one_line(text)
    return line if len(line) <= OUTPUT_MAX else line[: OUTPUT_MAX - 1] + "…"


# --------------------------------------------------------------------------- local_command


def run_bounded(argv: list[str], env: Mapping[str, str], timeout: float) -> tuple[int, str, str]:
    """Run ``argv`` (no shell) in its own session; at ``timeout`` its whole process group is
    killed (the group this call created, by the PID it started) and the step fails."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=dict(env), start_new_session=True)
    except OSError as exc:
        raise StepFailed(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.communicate(timeout=2.0)
        except subprocess.TimeoutExpired:  # a grandchild left the group and kept the pipes
            pass
        raise StepFailed(f"{argv[0]} timed out after {timeout:.0f}s (its process group was killed)") from None
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def _last_line(*texts: str) -> str:
    for text in texts:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if lines:
            return lines[-1]
    return ""


def step_local_command(ctx: "_HostRun", step: Step, end: float) -> str:
    values = host_values(ctx.host)
    p = step.for_host(values).params
    argv = list(p["argv"])
    env = dict(os.environ, GPUFLEET_HOST=values["HOST"], GPUFLEET_HOST_ADDRESS=values["HOST_ADDRESS"])
    code, out, err = run_bounded(argv, env, _remaining(end))
    last = _last_line(out, err)
    text = f"exit {code}" + (f": {_short(last)}" if last else "")
    if code not in p["expect_exit"]:
        raise StepFailed(f"{text} (expected {', '.join(str(c) for c in p['expect_exit'])})")
    return text


# --------------------------------------------------------------------------- local_http


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx is the answer: following it could turn a POST into a GET elsewhere."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())


def http_request(method: str, url: str, headers: Mapping[str, str], body: Optional[bytes],
                 timeout: float) -> tuple[Optional[int], str]:
    """(status, first bytes of the body), or (None, why) when no answer came (refused,
    timed out, TLS). No proxies from the environment, no redirects followed."""
    req = urllib.request.Request(url, data=body, headers=dict(headers), method=method)
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return int(resp.status), resp.read(READ_MAX).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        try:
            text = exc.read(READ_MAX).decode("utf-8", "replace")
        except OSError:
            text = ""
        return int(exc.code), text
    except urllib.error.URLError as exc:
        return None, str(exc.reason)
    except (OSError, ValueError) as exc:  # a timeout while reading, a malformed answer
        return None, str(exc) or type(exc).__name__


def _wanted(status: Optional[int], statuses: Optional[tuple[int, ...]]) -> bool:
    if status is None:
        return False
    return 200 <= status < 300 if statuses is None else status in statuses


def step_local_http(ctx: "_HostRun", step: Step, end: float) -> str:
    p = step.for_host(host_values(ctx.host)).params
    body = None if p["json"] is None else json.dumps(p["json"]).encode()
    headers = {"User-Agent": "gpufleet", **({"Content-Type": "application/json"} if body else {}),
               **p["headers"]}
    what = f"{p['method']} {p['url']}"
    want = "2xx" if p["status"] is None else "/".join(str(c) for c in p["status"])
    started, attempts = time.monotonic(), 0
    while True:
        attempts += 1
        status, text = http_request(p["method"], p["url"], headers, body, _remaining(end))
        answer = f"HTTP {status}" if status is not None else _short(text)
        if _wanted(status, p["status"]):
            first = _short(text) if text.strip() else ""
            return f"{what}: {answer} ({attempts} attempt(s))" + (f": {first}" if first else "")
        if p["interval"] is None or end - time.monotonic() <= p["interval"]:
            raise StepFailed(f"{what}: {answer}, expected HTTP {want} "
                             f"({attempts} attempt(s) in {time.monotonic() - started:.1f}s)")
        time.sleep(p["interval"])


__all__ = ["host_values", "http_request", "run_bounded", "step_local_command", "step_local_http"]
