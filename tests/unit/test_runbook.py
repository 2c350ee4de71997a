"""Runbook loading, validation and substitution (pure; no host is contacted)."""
from __future__ import annotations

import re
import time
import subprocess
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.errors import UsageError
from gpufleet.config.validators import unit_name
from gpufleet.runbook.kinds import KIND_FIELDS, KINDS, MUTATING, describe
from gpufleet.runbook.load import load_runbook, parse_runbook
from gpufleet.runbook.template import parse_extra_vars

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"


def _parse(text: str, **extra: str):
    return parse_runbook(textwrap.dedent(text), source="rb.yaml", extra_vars=extra)


def _error(text: str, **extra: str) -> str:
    with pytest.raises(UsageError) as info:
        _parse(text, **extra)
    assert info.value.exit_code == 2
    message = str(info.value)
    assert "\n" not in message
    return message


def _line_of(text: str, needle: str) -> int:
    for n, line in enumerate(textwrap.dedent(text).splitlines(), 1):
        if needle in line:
            return n
    raise AssertionError(needle)


# ----------------------------------------------------------------- the shipped runbooks


def test_model_swap_loads_with_the_documented_vars() -> None:
    rb = load_runbook(PLAYBOOKS / "model-swap.yaml",
                      {"OLD_UNIT": "vllm-minimax", "NEW_UNIT": "vllm-kimi"})
    kinds = [s.kind for s in rb.steps]
    assert kinds == ["health", "stop_units", "clean", "wait_free", "clear_shm", "fit", "start_unit",
                     "wait_http"]
    assert rb.steps[0].params["fail_on"] == "critical"
    assert rb.steps[1].params["units"] == ("vllm-minimax.service",)
    assert rb.steps[6].params["unit"] == "vllm-kimi.service"
    assert rb.steps[7].params["url"] == "http://127.0.0.1:8000/health"
    assert rb.steps[5].params["tp"] == 8 and rb.steps[5].params["params"] == 1e12
    assert rb.mutating


def test_model_swap_without_units_names_the_missing_vars() -> None:
    with pytest.raises(UsageError) as info:
        load_runbook(PLAYBOOKS / "model-swap.yaml", {"OLD_UNIT": "a"})
    assert "NEW_UNIT" in str(info.value) and "OLD_UNIT" not in str(info.value).split("no value")[1]
    assert "-e NEW_UNIT=" in str(info.value)


def test_model_swap_overrides_are_typed() -> None:
    rb = load_runbook(PLAYBOOKS / "model-swap.yaml",
                      {"OLD_UNIT": "a", "NEW_UNIT": "b@x", "GPUS": "0-1", "NEW_TP": "2",
                       "NEW_PARAMS": "7B", "NEW_DTYPE": "bf16", "START_TIMEOUT": "30"})
    fit = rb.steps[5]
    assert fit.params["gpus"] == (0, 1) and fit.params["tp"] == 2 and fit.params["params"] == 7e9
    assert rb.steps[0].params["gpus"] == (0, 1)  # the health gate
    assert rb.steps[2].params["gpus"] == (0, 1)
    assert rb.steps[6].params["unit"] == "b@x.service"
    assert rb.steps[7].timeout == 30.0
    with pytest.raises(UsageError, match="NEW_TP|tp"):
        load_runbook(PLAYBOOKS / "model-swap.yaml", {"OLD_UNIT": "a", "NEW_UNIT": "b", "NEW_TP": "two"})
    with pytest.raises(UsageError, match="new model fits"):
        load_runbook(PLAYBOOKS / "model-swap.yaml",
                     {"OLD_UNIT": "a", "NEW_UNIT": "b", "GPUS": "0-3", "NEW_TP": "8"})


def test_pre_train_cleans_0_3_and_guards_4_7() -> None:
    rb = load_runbook(PLAYBOOKS / "pre-train.yaml")
    clean = next(s for s in rb.steps if s.kind == "clean")
    assert clean.params["gpus"] == (0, 1, 2, 3)
    assert clean.params["stop_units"] is False
    asserts = [s.params["that"] for s in rb.steps if s.kind == "assert"]
    assert len(asserts) == 2
    assert asserts[-1]["sets"] == {"holders_alive_on": (4, 5, 6, 7)}
    assert asserts[0]["sets"] == {"no_holders_on": (0, 1, 2, 3)}
    assert asserts[0]["bounds"] == {"unexpected_unattributed_mib": (None, 0)}
    rb2 = load_runbook(PLAYBOOKS / "pre-train.yaml", {"STOP_UNITS": "true"})
    assert next(s for s in rb2.steps if s.kind == "clean").params["stop_units"] is True


def test_wsl2_preflight_is_read_only_and_keeps_going() -> None:
    rb = load_runbook(PLAYBOOKS / "wsl2-preflight.yaml")
    assert not rb.mutating
    assert [s.kind for s in rb.steps] == ["report", "fit", "fit"]
    fits = [s for s in rb.steps if s.kind == "fit"]
    assert [f.params["params"] for f in fits] == [14e9, 7e9]
    assert all(f.params["dtype"] == "fp16" and f.continue_on_failure for f in fits)


@pytest.mark.parametrize("path", sorted(PLAYBOOKS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_step_describes_itself(path: Path) -> None:
    extra = {"OLD_UNIT": "a", "NEW_UNIT": "b"} if "swap" in path.name else {}
    if "rolling" in path.name:
        extra["LB_URL"] = "http://127.0.0.1:9000"
    rb = load_runbook(path, extra)
    for step in rb.steps + rb.rolling.gate:
        text = describe(step)
        assert text and "\n" not in text and "None" not in text


# ----------------------------------------------------------------- validation messages


def test_unknown_kind_names_file_line_step_and_suggests() -> None:
    text = """\
        steps:
          - name: stop
            kind: stop_units
            units: [a]
          - name: free
            kind: claen
        """
    msg = _error(text)
    assert msg.startswith(f"rb.yaml:{_line_of(text, 'claen')}: step 2")
    assert "did you mean 'clean'?" in msg


def test_unknown_key_names_line_and_suggests() -> None:
    text = """\
        steps:
          - name: free
            kind: clean
            gpus: 0-3
            grase: 5
        """
    msg = _error(text)
    assert msg.startswith(f"rb.yaml:{_line_of(text, 'grase')}: step 1 'free' (clean)")
    assert "did you mean 'grace'?" in msg


def test_key_of_another_kind_says_which() -> None:
    msg = _error("steps:\n  - {kind: clean, url: 'http://x/'}\n")
    assert "'url' belongs to wait_http" in msg


@pytest.mark.parametrize("step, fragment", [
    ("{kind: clean, timeout: soon}", "seconds"),
    ("{kind: clean, timeout: 0}", "positive"),
    ("{kind: clean, grace: -1}", "seconds"),
    ("{kind: clean, grace: 30, timeout: 20}", "grace (30s) is longer than the timeout (20s)"),
    ("{kind: clean, disable_units: true}", "disable_units needs stop_units"),
    ("{kind: clean, shm: 'yes please'}", "true or false"),
    ("{kind: clean, gpus: true}", "GPU list"),
    ("{kind: clean, gpus: 3-1}", "reversed range"),
    ("{kind: clean, gpus: 'zero'}", "invalid GPU list"),
    ("{kind: clean, gpus: 99999}", "too large"),
    ("{kind: wait_free, min_free_mib: 1.5}", "whole number"),
    ("{kind: wait_free}", "exactly one of min_free_mib or min_free_fraction"),
    ("{kind: wait_free, min_free_mib: 1, min_free_fraction: 0.5}", "exactly one"),
    ("{kind: wait_free, min_free_fraction: 1.5}", "fraction"),
    ("{kind: stop_units, units: ['vllm;reboot']}", "invalid unit name"),
    ("{kind: stop_units, units: ['-H']}", "invalid unit name"),
    ("{kind: stop_units, units: []}", "list of unit names"),
    ("{kind: stop_units}", "missing 'units'"),
    ("{kind: start_unit, unit: 'a b'}", "invalid unit name"),
    ("{kind: wait_http, url: 'ftp://x/'}", "http"),
    ("{kind: wait_http, url: 'http://'}", "http"),
    ("{kind: wait_http, url: 'http://x:99999/'}", "port"),
    ("{kind: wait_http, url: 'http://x/', status: 99}", "status"),
    ("{kind: shell}", "exactly one of command"),
    ("{kind: shell, command: 'true', argv: ['true']}", "exactly one of command"),
    ("{kind: shell, command: 'true', expect_exit: 256}", "exit code"),
    ("{kind: shell, argv: 'true'}", "list of arguments"),
    ("{kind: fit}", "weights_gib, or params"),
    ("{kind: fit, params: 14}", "did you mean 14B"),
    ("{kind: fit, params: 7B, weights_gib: 13}", "weights_gib or params, not both"),
    ("{kind: fit, params: 7B, dtype: fp61}", "did you mean 'fp16'"),
    ("{kind: fit, params: 7B, util: 1.2}", "fraction"),
    ("{kind: fit, params: 7B, tp: 3, gpus: 0-3}", "tp 3"),
    ("{kind: assert}", "missing 'that'"),
    ("{kind: assert, that: {}}", "mapping of conditions"),
    ("{kind: assert, that: {free_mib_mni: 3}}", "did you mean 'free_mib_min'"),
    ("{kind: assert, that: {free_mib: {min: 5, max: 3}}}", "min 5 is above max 3"),
    ("{kind: assert, that: {free_mib: {least: 5}}}", "unknown bound"),
    ("{kind: assert, that: {no_holders_on: all}}", "name the GPUs"),
    ("{kind: assert, that: {gpus: 0-3}}", "no condition"),
    ("{kind: assert, that: {free_mib_min: 1, free_mib: {min: 2}}}", "given twice"),
    ("{kind: report, continue_on_failure: 1}", "true or false"),
    ("{kind: clear_shm, gpus: 0}", "unknown key 'gpus'"),
])
def test_bad_step_fields(step: str, fragment: str) -> None:
    msg = _error(f"steps:\n  - {step}\n")
    assert msg.startswith("rb.yaml:2: step 1")
    assert fragment in msg


@pytest.mark.parametrize("text, fragment", [
    ("", "empty runbook"),
    ("steps: []\n", "non-empty list"),
    ("steps: {a: 1}\n", "non-empty list"),
    ("name: x\n", "no 'steps:'"),
    ("stesp: []\n", "did you mean 'steps'"),
    ("- 3\n", "expected a mapping with 'kind:'"),
    ("steps:\n  - {name: x}\n", "missing 'kind:'"),
    ("steps:\n  - {kind: clean\n", "YAML syntax error"),
    ("steps:\n  - {kind: clean, kind: report}\n", "duplicate key"),
    ("vars: [a]\nsteps:\n  - {kind: report}\n", "vars"),
    ("vars: {1x: a}\nsteps:\n  - {kind: report}\n", "invalid variable name"),
    ("vars: {X: [a]}\nsteps:\n  - {kind: report}\n", "plain value"),
    ("vars: {X: '{{ Y }}', Y: a}\nsteps:\n  - {kind: report}\n", "cannot refer"),
    ("steps:\n  - {kind: report, name: a}\n  - {kind: report, name: a}\n", "duplicate step name"),
    ("description: [1]\nsteps:\n  - {kind: report}\n", "expected text"),
])
def test_bad_documents(text: str, fragment: str) -> None:
    assert fragment in _error(text)


def test_default_step_names_are_unique() -> None:
    rb = _parse("steps:\n  - {kind: report}\n  - {kind: report}\n  - {kind: clear_shm}\n")
    assert [s.name for s in rb.steps] == ["report", "report-2", "clear_shm"]


def test_undefined_variable_names_the_step_and_suggests() -> None:
    text = """\
        vars:
          NEW_UNIT: vllm-kimi
        steps:
          - name: start
            kind: start_unit
            unit: "{{ NEW_UINT }}"
        """
    msg = _error(text)
    assert msg.startswith(f"rb.yaml:{_line_of(text, 'NEW_UINT')}: step 1 'start' (start_unit): unit:")
    assert "undefined variable 'NEW_UINT'" in msg and "did you mean 'NEW_UNIT'" in msg


def test_unknown_extra_var_is_refused_with_a_suggestion() -> None:
    text = "vars: {OLD_UNIT: null}\nsteps:\n  - {kind: stop_units, units: ['{{ OLD_UNIT }}']}\n"
    msg = _error(text, OLD_UNIT="a", OLD_UINT="b")
    assert "-e OLD_UINT" in msg and "did you mean 'OLD_UNIT'" in msg


def test_extra_var_may_define_an_undeclared_reference() -> None:
    rb = _parse("steps:\n  - {kind: start_unit, unit: '{{ U }}'}\n", U="vllm")
    assert rb.steps[0].params["unit"] == "vllm.service"


def test_extra_vars_win_over_vars_block() -> None:
    rb = _parse("vars: {U: a}\nsteps:\n  - {kind: start_unit, unit: '{{U}}'}\n", U="b")
    assert rb.steps[0].params["unit"] == "b.service" and rb.vars["U"] == "b"


@pytest.mark.parametrize("pair, fragment", [
    ("NOEQUALS", "KEY=VALUE"), ("1A=b", "invalid variable name"), ("=b", "invalid variable name"),
    ("A-B=c", "invalid variable name"), ("A=b\0", "NUL"),
])
def test_parse_extra_vars_errors(pair: str, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        parse_extra_vars([pair])


def test_parse_extra_vars_keeps_equals_in_values() -> None:
    assert parse_extra_vars(["A=b=c", "B=", "A=x"]) == {"A": "x", "B": ""}


# ----------------------------------------------------------------- substitution is data


def test_a_value_is_never_re_expanded() -> None:
    rb = _parse("vars: {X: null, Y: secret}\nsteps:\n  - {kind: shell, argv: [echo, '{{ X }}']}\n",
                X="{{ Y }}")
    assert rb.steps[0].params["argv"] == ("echo", "{{ Y }}")


def test_argv_substitution_stays_one_argument() -> None:
    rb = _parse("steps:\n  - {kind: shell, argv: [ls, '--', '{{ P }}', 'x{{ P }}y']}\n", P="a b;c")
    assert rb.steps[0].params["argv"] == ("ls", "--", "a b;c", "xa b;cy")


def test_non_variable_braces_are_left_alone() -> None:
    rb = _parse("steps:\n  - kind: shell\n    command: docker ps --format '{{.Names}}'\n")
    assert rb.steps[0].params["command"] == "docker ps --format '{{.Names}}'"


@pytest.mark.parametrize("command", [
    "echo '{{ X }}'", 'echo "{{ X }}"', "echo \"a $(b) {{ X }}\"", "echo 'it''s {{X}}'",
])
def test_reference_inside_quotes_is_refused(command: str) -> None:
    text = f"vars: {{X: a}}\nsteps:\n  - kind: shell\n    command: |\n      {command}\n"
    msg = _error(text)
    assert "is inside" in msg and "quotes" in msg and "write it bare" in msg


def test_reference_after_closed_quotes_is_fine() -> None:
    text = "vars: {X: a}\nsteps:\n  - kind: shell\n    command: |\n      echo 'x' \"y\" \\' {{ X }}\n"
    rb = _parse(text)
    assert rb.steps[0].params["command"].strip() == "echo 'x' \"y\" \\' a"


def _shell_echo(value: str) -> str:
    text = "vars: {V: null}\nsteps:\n  - kind: shell\n    command: printf %s {{ V }}\n"
    command = _parse(text, V=value).steps[0].params["command"]
    out = subprocess.run(["sh", "-c", command], capture_output=True, check=True)
    return out.stdout.decode("utf-8", "surrogateescape")


@pytest.mark.parametrize("value", [
    "", "plain", "a b", "'; touch /tmp/gpufleet-pwned; '", "$(id)", "`id`", "\"", "\\", "*",
    "--help", "line\nbreak", "x{{ V }}",
])
def test_shell_values_arrive_as_one_word_of_data(value: str) -> None:
    assert _shell_echo(value) == value


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
               max_size=40))
def test_shell_quoting_property(value: str) -> None:
    assert _shell_echo(value) == value


def test_typed_fields_accept_variables_only_when_they_parse() -> None:
    text = "vars: {T: '5'}\nsteps:\n  - {kind: clean, timeout: '{{ T }}', grace: '{{ T }}', shm: '{{ B }}'}\n"
    rb = _parse(text, B="true")
    assert rb.steps[0].timeout == 5.0 and rb.steps[0].params["grace"] == 5.0
    assert rb.steps[0].params["shm"] is True
    assert "seconds" in _error(text, T="5s", B="true")
    assert "true or false" in _error(text, B="maybe")


def test_a_literal_string_is_not_a_number() -> None:
    assert "seconds" in _error("steps:\n  - {kind: clean, timeout: '5'}\n")


def test_gpu_list_forms() -> None:
    rb = _parse("steps:\n"
                "  - {kind: clean, gpus: 2}\n"
                "  - {kind: clean, gpus: [3, 1]}\n"
                "  - {kind: clean, gpus: '0-1,5'}\n"
                "  - {kind: clean, gpus: all}\n"
                "  - {kind: clean}\n")
    assert [s.params["gpus"] for s in rb.steps] == [(2,), (1, 3), (0, 1, 5), None, None]


# ----------------------------------------------------------------- units, kinds


@pytest.mark.parametrize("given_name, expected", [
    ("vllm-kimi", "vllm-kimi.service"), ("vllm@kimi", "vllm@kimi.service"),
    ("vllm.service", "vllm.service"), ("a.target", "a.target"), ("v1.2", "v1.2.service"),
    ("user-1000.slice", "user-1000.slice"),
])
def test_unit_names(given_name: str, expected: str) -> None:
    assert unit_name(given_name) == expected


@pytest.mark.parametrize("bad", ["", "-x", "a b", "a;b", "a/b", "$(x)", "a\nb", ".service"])
def test_bad_unit_names(bad: str) -> None:
    with pytest.raises(ValueError):
        unit_name(bad)


def test_stop_units_takes_a_string_of_names() -> None:
    rb = _parse("steps:\n  - {kind: stop_units, units: '{{ U }}'}\n", U="vllm-a, vllm-b vllm-a")
    assert rb.steps[0].params["units"] == ("vllm-a.service", "vllm-b.service")
    assert "list of unit names" in _error("steps:\n  - {kind: stop_units, units: '{{ U }}'}\n", U=" ")


def test_mutating_kinds_are_exactly_the_ones_that_change_hosts() -> None:
    assert MUTATING == {"stop_units", "clean", "clear_shm", "start_unit", "shell", "local_command"}
    assert set(KIND_FIELDS) == set(KINDS)
    read_only = _parse("steps:\n  - {kind: report}\n  - {kind: wait_free, min_free_mib: 1}\n"
                       "  - {kind: wait_http, url: 'http://127.0.0.1/'}\n"
                       "  - {kind: assert, that: {free_mib_min: 1}}\n  - {kind: fit, params: 7B}\n")
    assert not read_only.mutating
    assert _parse("steps:\n  - {kind: report}\n  - {kind: shell, argv: ['true']}\n").mutating


def test_bare_list_document_is_a_runbook() -> None:
    rb = parse_runbook("- {kind: report}\n", source="x.yaml", default_name="x")
    assert rb.name == "x" and rb.steps[0].kind == "report"


def test_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="runbook not found"):
        load_runbook(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_bytes(b"steps:\n  - {kind: report}\n\xff\n")
    with pytest.raises(UsageError, match=r"bad.yaml:3: not valid UTF-8"):
        load_runbook(tmp_path / "bad.yaml")


def test_describe_shows_what_would_happen() -> None:
    rb = _parse("""\
        steps:
          - {kind: stop_units, units: [a, b.service], disable: true}
          - {kind: clean, gpus: 0-3, stop_units: true, shm: true, grace: 7, protect: '*train*'}
          - {kind: wait_free, gpus: 1, min_free_mib: 40000}
          - {kind: shell, command: 'systemctl status x', expect_exit: [0, 3]}
          - {kind: assert, that: {free_mib_min: 10, gpus: 4-7, holders_alive_on: 4-7}}
        """)
    texts = [describe(s) for s in rb.steps]
    assert texts[0] == "stop and disable a.service, b.service"
    assert "GPUs 0-3" in texts[1] and "7s grace" in texts[1] and "systemd units" in texts[1] \
        and "/dev/shm" in texts[1] and "*train*" in texts[1]
    assert texts[2] == "wait until GPU 1 each have >= 40000 MiB free (poll 1s)"
    assert "systemctl status x" in texts[3] and "0,3" in texts[3]
    assert "free_mib >= 10 on GPUs 4-7" in texts[4] and "alive on GPUs 4-7" in texts[4]
    assert re.search(r"\bNone\b", " ".join(texts)) is None


# ----------------------------------------------------------------- runner: conditions (pure)

from gpufleet.config.inventory import Host  # noqa: E402
from gpufleet.core.model import parse_snapshot  # noqa: E402
from gpufleet.runbook import run as runner  # noqa: E402


def _snap(gpus, apps=(), holders=(), procs=None, wsl2=False, facts=None, mapped=None):
    """A snapshot document as the agent prints it: gpus as (index, used, total, free);
    ``mapped``: {pid: mapped device files} (omitted = not available, like older agents)."""
    doc = {
        "agent_version": 1,
        "facts": dict({"hostname": "h", "wsl2": wsl2}, **(facts or {})),
        "nvidia_smi": {"ok": True},
        "gpus": [{"index": i, "uuid": f"GPU-{i}", "name": "Fake", "minor": i,
                  "memory_used_mib": used, "memory_total_mib": total, "memory_free_mib": free,
                  "memory_reserved_mib": None if wsl2 else 616}
                 for i, used, total, free in gpus],
        "compute_apps": [{"pid": pid, "process_name": "python3", "used_mib": mib, "gpu_uuid": f"GPU-{i}"}
                         for pid, i, mib in apps],
        "holders": [dict({"pid": pid, "devices": list(devs)},
                         **({"mapped": mapped[pid]} if pid in (mapped or {}) else {}))
                    for pid, devs in holders],
        "processes": {str(pid): dict({"pid": pid, "ppid": 1, "starttime": 100 + pid, "comm": f"p{pid}",
                                      "cmdline": f"p{pid}"}, **extra)
                      for pid, extra in (procs or {}).items()},
    }
    return parse_snapshot(doc)


def _that(text: str):
    return _parse(f"steps:\n  - {{kind: assert, that: {text}}}\n").steps[0].params["that"]


ALL_DEVS = [f"/dev/nvidia{i}" for i in range(8)] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
EIGHT_FREE = [(i, 0, 49140, 48524) for i in range(8)]


def _held(found):
    return [ok for ok, _ in found]


def test_free_and_fraction_bounds() -> None:
    snap = _snap([(0, 1000, 49140, 47524), (1, 30000, 49140, 18524)])
    assert _held(runner.check_conditions(_that("{free_mib_min: 40000, gpus: 0}"), snap, None)) == [True]
    found = runner.check_conditions(_that("{free_mib_min: 40000}"), snap, None)
    assert _held(found) == [False] and "GPU 1 18524 MiB" in found[0][1] and "GPU 0" not in found[0][1]
    assert _held(runner.check_conditions(_that("{free_fraction: {min: 0.9}, gpus: 0}"), snap, None)) == [True]
    assert _held(runner.check_conditions(_that("{used_mib_max: 1000, gpus: 0-1}"), snap, None)) == [False]


def test_missing_gpu_and_missing_numbers_never_pass() -> None:
    snap = _snap([(0, None, 49140, None)])
    found = runner.check_conditions(_that("{free_mib_min: 1, gpus: 0-1}"), snap, None)
    assert not all(_held(found))
    assert any("no GPU 1" in line for _, line in found)
    assert any("GPU 0 n/a" in line for _, line in found)


def test_unexpected_unattributed_counts_the_hosts_expectation() -> None:
    snap = _snap([(0, 1700, 32607, 30907)])
    that = _that("{unexpected_unattributed_mib: {max: 0}}")
    assert _held(runner.check_conditions(that, snap, None, expected_unattributed_mib=1680)) == [False]
    assert _held(runner.check_conditions(that, snap, None, expected_unattributed_mib=1700)) == [True]
    assert _held(runner.check_conditions(_that("{unexpected_unattributed_mib: {max: 20}}"), snap, None,
                                         expected_unattributed_mib=1680)) == [True]


def test_no_holders_ignores_fds_of_processes_listed_elsewhere() -> None:
    # The trainer (pid 50) has memory on 4-7 and, like any CUDA process, fds on every GPU.
    snap = _snap(EIGHT_FREE, apps=[(50, 4, 30000)], holders=[(50, ALL_DEVS)], procs={50: {}})
    assert _held(runner.check_conditions(_that("{no_holders_on: 0-3}"), snap, None)) == [True]
    assert _held(runner.check_conditions(_that("{no_holders_on: 4}"), snap, None)) == [False]


def test_no_holders_counts_listed_memory_and_unlisted_device_holders() -> None:
    listed = _snap(EIGHT_FREE, apps=[(7, 2, 500)], procs={7: {}})
    found = runner.check_conditions(_that("{no_holders_on: 0-3}"), listed, None)
    assert _held(found) == [False] and "GPU 2: p7 7" in found[0][1]
    # Nobody lists pid 9 (another PID namespace: the agent runs in a container), but it holds
    # /dev/nvidia1, where 30000 MiB are used that no listed process explains.
    gpus = [(i, 30000 if i == 1 else 0, 49140, 18524 if i == 1 else 48524) for i in range(8)]
    unlisted = _snap(gpus, holders=[(9, ["/dev/nvidia1", "/dev/nvidiactl"])], procs={9: {}},
                     facts={"in_container": True})
    assert _held(runner.check_conditions(_that("{no_holders_on: 0-3}"), unlisted, None)) == [False]
    assert _held(runner.check_conditions(_that("{no_holders_on: 4-7}"), unlisted, None)) == [True]
    # The agent itself (and its ancestors) are never holders.
    me = _snap(EIGHT_FREE, holders=[(3, ALL_DEVS)], procs={3: {"relation": "self"}})
    assert _held(runner.check_conditions(_that("{no_holders_on: 0-7}"), me, None)) == [True]


def test_no_holders_does_not_count_gpu_clients() -> None:
    """GPU clients: a monitor (NVML client: every device file open, nothing mapped), an
    nvidia-smi run (nvidiactl mapped) and a cuInit-only process (nvidia0 + nvidiactl mapped,
    recorded probe3) hold no GPU memory: a runbook's no_holders_on must not fail on them."""
    clients = {8: [], 10: ["/dev/nvidiactl"], 11: ["/dev/nvidia0", "/dev/nvidiactl"]}
    snap = _snap(EIGHT_FREE, holders=[(p, ALL_DEVS) for p in clients], procs={p: {} for p in clients},
                 mapped=clients)
    found = runner.check_conditions(_that("{no_holders_on: 0-7}"), snap, None)
    assert _held(found) == [True], found
    # a CUDA context (nvidia-uvm mapped) with memory nobody lists, on a host that cannot list
    # every process: a holder, and the condition fails
    gpus = [(i, 9000 if i == 0 else 0, 49140, 39524 if i == 0 else 48524) for i in range(8)]
    cuda = _snap(gpus, holders=[(12, ALL_DEVS)], procs={12: {}}, facts={"in_container": True},
                 mapped={12: ["/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"]})
    found = runner.check_conditions(_that("{no_holders_on: 0}"), cuda, None)
    assert _held(found) == [False] and "GPU 0: p12 12" in found[0][1]


def test_holders_alive_needs_the_same_identity() -> None:
    before = _snap(EIGHT_FREE, apps=[(50, 4, 30000), (51, 5, 30000)], procs={50: {}, 51: {}})
    that = _that("{holders_alive_on: 4-7}")
    found = runner.check_conditions(that, before, before)
    assert _held(found) == [True] and "p50 50, p51 51" in found[0][1]
    # pid 51 exited and the number was reused by another process: a different start time.
    reused = _snap(EIGHT_FREE, apps=[(50, 4, 30000)], procs={50: {}, 51: {"starttime": 999}})
    found = runner.check_conditions(that, reused, before)
    assert _held(found) == [False] and "p51 51" in found[0][1] and "p50" not in found[0][1]
    # Nothing held them at the start: nothing can have been lost (it used to fail).
    empty = _snap(EIGHT_FREE)
    found = runner.check_conditions(that, empty, empty)
    assert _held(found) == [True] and "ok (nothing held these GPUs at the start)" in found[0][1]
    # ... also when something holds them now: only the start's holders are guarded
    assert _held(runner.check_conditions(that, before, empty)) == [True]
    assert _held(runner.check_conditions(that, before, None)) == [False]


def test_report_names_the_wsl2_reservation() -> None:
    snap = _snap([(0, 1680, 32607, 30927)], wsl2=True)
    (line,) = runner.report_lines(snap, None, 1680, wsl2=True)
    assert line == ("GPU 0: used 1680 MiB of 32607 MiB, free 30927 MiB, reserved n/a, "
                    "reservation (unattributed) 1680 MiB (expected 1680)")
    (line,) = runner.report_lines(snap, [0], 0, wsl2=False)
    assert line.endswith("unattributed 1680 MiB (expected 0; if this is normal here, set "
                         "unattributed_mib: 1680 for this host)")
    with pytest.raises(runner.StepFailed, match="no GPU 3"):
        runner.report_lines(snap, [3], 0, wsl2=True)


def test_dry_run_plan_connects_nowhere_and_says_sudo() -> None:
    rb = load_runbook(PLAYBOOKS / "model-swap.yaml", {"OLD_UNIT": "a", "NEW_UNIT": "b"})
    run = runner.plan_host(rb, Host(name="blackwell", address="203.0.113.1", sudo=True))
    assert [s.outcome for s in run.steps] == ["planned"] * 8
    assert run.steps[0].detail.startswith("health gate on all GPUs")
    assert run.steps[1].detail == "stop a.service (sudo -n)"
    doc = runner.document(rb, [run], dry_run=True)
    assert set(doc) >= {"runbook", "hosts"} and doc["runbook"] == "model-swap"
    assert set(doc["hosts"][0]) >= {"host", "ok", "error", "steps"}
    assert set(doc["hosts"][0]["steps"][0]) == {"name", "kind", "outcome", "seconds", "detail"}
    assert "nothing was done" in runner.table([run])


# ----------------------------------------------------------------- runner: steps, through a local session


LOCAL = Host(name="here", connection="local", command_timeout=20)


def _run_local(text: str, **extra: str):
    return runner.run_host(_parse(text, **extra), LOCAL)


def test_a_failed_step_skips_the_rest() -> None:
    run = _run_local("""\
        steps:
          - {name: one, kind: shell, command: 'true'}
          - {name: two, kind: shell, command: 'exit 3'}
          - {name: three, kind: shell, command: 'true'}
        """)
    assert [s.outcome for s in run.steps] == ["ok", "failed", "skipped"]
    assert run.steps[1].detail == "exit 3 (expected 0)"
    assert not run.ok and "two" in run.error


def test_continue_on_failure_and_expected_exit_codes() -> None:
    run = _run_local("""\
        steps:
          - {name: one, kind: shell, command: 'exit 3', continue_on_failure: true}
          - {name: two, kind: shell, argv: [sh, -c, 'echo out; exit 3'], expect_exit: [0, 3]}
        """)
    assert [s.outcome for s in run.steps] == ["failed", "ok"]
    assert run.steps[1].detail == "exit 3: out"
    assert not run.ok  # a failure is still a failure


def test_a_step_is_bounded_by_its_timeout() -> None:
    started = time.monotonic()
    run = _run_local("steps:\n  - {kind: shell, command: 'sleep 30', timeout: 1}\n")
    assert run.steps[0].outcome == "failed" and "timed out" in run.steps[0].detail
    assert time.monotonic() - started < 10


def test_shell_step_gets_values_as_data(tmp_path: Path) -> None:
    target = tmp_path / "out"
    run = _run_local("steps:\n  - kind: shell\n    command: printf %s {{ V }} > {{ F }}\n",
                     V="$(touch pwned); `id`", F=str(target))
    assert run.ok, run.steps[0].detail
    assert target.read_text() == "$(touch pwned); `id`"
    assert not (Path.cwd() / "pwned").exists()


def test_wait_http_polls_until_the_status(tmp_path: Path) -> None:
    import http.server
    import threading

    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            hits.append(self.path)
            self.send_response(200 if len(hits) >= 3 else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        run = _run_local(f"steps:\n  - {{kind: wait_http, url: '{url}', interval: 0.2, timeout: 20}}\n")
        assert run.ok, run.steps[0].detail
        assert "answered HTTP 200" in run.steps[0].detail and "(3 attempt(s))" in run.steps[0].detail
        assert hits == ["/health"] * 3
        run = _run_local(f"steps:\n  - {{kind: wait_http, url: '{url}', status: 204, interval: 0.2, timeout: 6}}\n")
        assert run.steps[0].outcome == "failed" and "last: HTTP 200" in run.steps[0].detail
    finally:
        server.shutdown()
