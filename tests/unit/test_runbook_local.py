"""The steps that run on the controller (local_http, local_command): validation, {{ HOST }}
filled in per host as data, bounds, and real requests to a server on 127.0.0.1."""
from __future__ import annotations

import http.server
import json
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpufleet.config.inventory import Host
from gpufleet.errors import UsageError
from gpufleet.runbook import run as runner
from gpufleet.runbook.kinds import describe
from gpufleet.runbook.load import parse_runbook


def _parse(text: str, **extra: str):
    return parse_runbook(textwrap.dedent(text), source="rb.yaml", extra_vars=extra)


def _error(text: str, **extra: str) -> str:
    with pytest.raises(UsageError) as info:
        _parse(text, **extra)
    assert "\n" not in str(info.value)
    return str(info.value)


HOST = Host(name="node-7", address="127.0.0.1", connection="local", command_timeout=20)


def _run(text: str, host: Host = HOST, **extra: str):
    return runner.run_host(_parse(text, **extra), host)


# ----------------------------------------------------------------- validation


@pytest.mark.parametrize("text, fragment", [
    ("steps:\n  - {kind: shell, argv: [echo, '{{ HOST }}']}\n",
     "{{ HOST }} is filled in for each host only in local_http and local_command"),
    ("vars: {HOST: x}\nsteps:\n  - {kind: report}\n", "vars.HOST: HOST and HOST_ADDRESS are set by gpufleet"),
    ("steps:\n  - {kind: local_http, url: 'http://127.0.0.1/', json: {a: 1}}\n", "a GET request has no body"),
    ("steps:\n  - {kind: local_http, url: 'ftp://x/'}\n", "invalid URL"),
    ("steps:\n  - {kind: local_http, url: 'http://{{ HOST }} x/'}\n", "url: invalid URL"),
    ("steps:\n  - {kind: local_http, url: 'http://x/', method: FETCH}\n", "unknown HTTP method"),
    ("steps:\n  - {kind: local_http, url: 'http://x/', headers: {'Bad Name': 1}}\n", "invalid header name"),
    ("steps:\n  - {kind: local_http, url: 'http://x/', headers: {X-A: \"a\\nb\"}}\n", "control characters"),
    ("steps:\n  - {kind: local_http, url: 'http://x/', status: 700}\n", "100-599"),
    ("steps:\n  - {kind: local_command, argv: []}\n", "non-empty list"),
    ("steps:\n  - {kind: local_command, command: 'echo hi'}\n", "unknown key 'command' for a local_command"),
    ("steps:\n  - {kind: local_command, argv: [echo, '{{ HOSTNAME }}']}\n", "undefined variable 'HOSTNAME'"),
])
def test_bad_local_steps(text: str, fragment: str) -> None:
    assert fragment in _error(text)


def test_host_cannot_be_given_with_e() -> None:
    assert "HOST and HOST_ADDRESS are set by gpufleet" in _error(
        "steps:\n  - {kind: local_command, argv: [echo, '{{ HOST }}']}\n", HOST="other")


def test_which_local_steps_need_yes() -> None:
    assert _parse("steps:\n  - {kind: local_command, argv: ['true']}\n").mutating
    assert _parse("steps:\n  - {kind: local_http, url: 'http://x/', method: post}\n").mutating
    assert not _parse("steps:\n  - {kind: local_http, url: 'http://x/'}\n").mutating
    assert not _parse("steps:\n  - {kind: local_http, url: 'http://x/', method: HEAD}\n").mutating


def test_host_is_filled_in_per_host_and_planned() -> None:
    rb = _parse("""\
        steps:
          - kind: local_http
            method: PUT
            url: "{{ LB }}/pool/{{ HOST }}"
            json: {addr: "{{ HOST_ADDRESS }}:8000", from: "{{ LB }}"}
        """, LB="http://127.0.0.1:9000")
    step = rb.steps[0]
    assert "PUT http://127.0.0.1:9000/pool/{{ HOST }}" in describe(step)
    bound = step.for_host({"HOST": "a", "HOST_ADDRESS": "10.0.0.1"})
    assert bound.params["url"] == "http://127.0.0.1:9000/pool/a"
    assert bound.params["json"] == {"addr": "10.0.0.1:8000", "from": "http://127.0.0.1:9000"}
    plan = runner.plan_host(rb, Host(name="b", address="10.0.0.2"))
    assert "PUT http://127.0.0.1:9000/pool/b with JSON" in plan.steps[0].detail


def test_a_value_holding_braces_is_not_expanded_per_host() -> None:
    rb = _parse("steps:\n  - {kind: local_command, argv: [echo, '{{ V }}', '{{ HOST }}']}\n", V="{{ HOST }}")
    bound = rb.steps[0].for_host({"HOST": "a", "HOST_ADDRESS": "a"})
    assert bound.params["argv"] == ("echo", "{{ HOST }}", "a")


# ----------------------------------------------------------------- local_command


def test_local_command_gets_values_as_data(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    prog = ("import json, os, sys; json.dump({'argv': sys.argv[1:], 'host': os.environ['GPUFLEET_HOST'], "
            "'address': os.environ['GPUFLEET_HOST_ADDRESS']}, open(sys.argv[1], 'w'))")
    run = _run(f"""\
        steps:
          - kind: local_command
            argv: [python3, -c, "{prog}", "{out}", "{{{{ V }}}}", "in {{{{ HOST }}}} now"]
        """, V="$(touch pwned); `id`")
    assert run.ok, run.steps[0].detail
    got = json.loads(out.read_text())
    assert got == {"argv": [str(out), "$(touch pwned); `id`", "in node-7 now"], "host": "node-7",
                   "address": "127.0.0.1"}
    assert not (Path.cwd() / "pwned").exists()


def test_local_command_exit_codes() -> None:
    run = _run("steps:\n  - {kind: local_command, argv: [sh, -c, 'echo nope >&2; exit 4']}\n")
    assert run.steps[0].outcome == "failed" and run.steps[0].detail == "exit 4: nope (expected 0)"
    run = _run("steps:\n  - {kind: local_command, argv: [sh, -c, 'exit 4'], expect_exit: [0, 4]}\n")
    assert run.ok
    run = _run("steps:\n  - {kind: local_command, argv: [/nonexistent/lbctl]}\n")
    assert run.steps[0].outcome == "failed" and "cannot run /nonexistent/lbctl" in run.steps[0].detail


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_local_command_timeout_kills_its_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    started = time.monotonic()
    run = _run(f"steps:\n  - {{kind: local_command, argv: [sh, -c, 'sleep 60 & echo $! > {pidfile}; wait'], timeout: 1}}\n")
    assert run.steps[0].outcome == "failed" and "timed out after 1s" in run.steps[0].detail
    assert time.monotonic() - started < 10
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


# ----------------------------------------------------------------- local_http, against 127.0.0.1


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[dict[str, Any]] = []
    answers: list[int] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        self.hits.append({"method": self.command, "path": self.path, "body": body,
                          "type": self.headers.get("Content-Type"), "token": self.headers.get("X-Token")})
        code = self.answers.pop(0) if self.answers else 200
        self.send_response(code)
        if code == 302:
            self.send_header("Location", "/elsewhere")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def lb() -> Iterator[tuple[str, type]]:
    handler = type("H", (_Recorder,), {"hits": [], "answers": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_local_http_sends_the_host_as_data(lb: tuple[str, type]) -> None:
    url, handler = lb
    run = _run("""\
        steps:
          - kind: local_http
            method: POST
            url: "{{ LB }}/backends/{{ HOST }}/drain"
            headers: {X-Token: "{{ TOKEN }}"}
            json: {backend: "{{ HOST }}", note: "{{ NOTE }}"}
        """, LB=url, TOKEN="s3cret", NOTE='"quoted"; $(x)')
    assert run.ok, run.steps[0].detail
    assert run.steps[0].detail == f"POST {url}/backends/node-7/drain: HTTP 200 (1 attempt(s)): ok"
    (hit,) = handler.hits
    assert hit["method"] == "POST" and hit["path"] == "/backends/node-7/drain"
    assert json.loads(hit["body"]) == {"backend": "node-7", "note": '"quoted"; $(x)'}
    assert hit["type"] == "application/json" and hit["token"] == "s3cret"


def test_local_http_status_retries_and_redirects(lb: tuple[str, type]) -> None:
    url, handler = lb
    handler.answers[:] = [503, 503, 200]
    run = _run(f"steps:\n  - {{kind: local_http, url: '{url}/ready', interval: 0.1, timeout: 10}}\n")
    assert run.ok and "(3 attempt(s))" in run.steps[0].detail
    handler.answers[:] = [503]
    run = _run(f"steps:\n  - {{kind: local_http, url: '{url}/ready'}}\n")
    assert run.steps[0].outcome == "failed"
    assert run.steps[0].detail.startswith(f"GET {url}/ready: HTTP 503, expected HTTP 2xx (1 attempt(s) in ")
    handler.answers[:] = [302]
    run = _run(f"steps:\n  - {{kind: local_http, url: '{url}/x', method: DELETE}}\n")
    assert run.steps[0].outcome == "failed" and "HTTP 302" in run.steps[0].detail
    assert [h["path"] for h in handler.hits][-1] == "/x"  # the redirect was not followed
    handler.answers[:] = [204]
    assert _run(f"steps:\n  - {{kind: local_http, url: '{url}/x', method: DELETE, status: [200, 204]}}\n").ok


def test_local_http_refused_is_a_failed_step() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # bound, never listening: refused at once
    port = s.getsockname()[1]
    try:
        run = _run(f"steps:\n  - {{kind: local_http, url: 'http://127.0.0.1:{port}/'}}\n")
    finally:
        s.close()
    assert run.steps[0].outcome == "failed" and "refused" in run.steps[0].detail.lower()
