"""CLI-level fuzzing: `gpufleet -i FUZZED hosts` (and runbook files through `run --dry-run`),
in-process through gpufleet.cli.main, with a bounded number of examples.

tests/unit/test_inventory.py fuzzes the loader; here the whole command runs -- file reading
(bytes, encodings), the loader, selection options, rendering and main()'s error handling --
and the contract is the operator's: exit 0 with a table, or exit 2 with exactly one line on
stderr starting 'gpufleet: error:'. Never a traceback, never another exit code, never an
exception out of main(). No host is ever contacted (`hosts` and `--dry-run` connect to
nothing). GPUFLEET_FUZZ_EXAMPLES raises the number of examples for a long run.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faultkit import LEDGER

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = (REPO / "fleet.yaml.example").read_text()
PLAYBOOK = (REPO / "playbooks" / "model-swap.yaml").read_text()
EXAMPLES = int(os.environ.get("GPUFLEET_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

WORK = Path(tempfile.mkdtemp(prefix="gf-fuzz-"))  # HOME and cwd of every in-process run


def gpufleet(*argv: str) -> tuple:
    """(exit code, stdout, stderr) of main(argv), in-process; HOME and cwd are WORK."""
    from gpufleet.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: Any = "no exit"
    old_home, old_cwd = os.environ.get("HOME"), os.getcwd()
    os.environ["HOME"] = str(WORK)
    os.chdir(WORK)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(argv))
            except SystemExit as exc:
                code = exc.code
    finally:
        os.chdir(old_cwd)
        if old_home is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = old_home
    return code, out.getvalue(), err.getvalue()


def check_contract(code: Any, out: str, err: str, what: Any) -> None:
    LEDGER.hostile("fuzzed file", 1)
    assert "Traceback" not in out + err, (what, out, err)
    assert code in (0, 2), (code, what, out, err)
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("gpufleet: error: "), (what, err)


def write(data: Any, name: str = "fleet.yaml") -> Path:
    path = WORK / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass"))
    return path


def run_hosts(data: Any, *options: str) -> tuple:
    path = write(data)
    code, out, err = gpufleet("-i", str(path), "hosts", *options)
    check_contract(code, out, err, (data, options))
    if code == 0:
        if "--json" in options:
            doc = json.loads(out)
            assert isinstance(doc["hosts"], list) and doc["hosts"]
        else:
            assert out.startswith("NAME"), out
    return code, out, err


KEYS = ["defaults", "hosts", "groups", "address", "port", "user", "identity_file",
        "known_hosts_file", "host_key_policy", "connect_timeout", "command_timeout",
        "connection", "sudo", "python", "nvidia_smi", "unattributed_mib", "protect", "tags",
        "adress", "<<", ""]
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=10)
           | st.sampled_from(["local", "ssh", "strict", "accept-new", "127.0.0.1", "root",
                              "$(touch x)", "a;b", "`id`", "2020-13-45", "~", "/x/../y"]))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=5),
    max_leaves=25)
SHAPED = st.dictionaries(
    st.sampled_from(["defaults", "hosts", "groups"]),
    st.dictionaries(st.sampled_from(["a", "b", "train-01"]) | st.sampled_from(KEYS),
                    st.none() | st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6)
                    | st.lists(st.sampled_from(["a", "b", "c"]), max_size=3), max_size=4),
    max_size=3)
PIECES = ["\n", " ", "  ", ":", "-", "[", "]", "{", "}", "'", '"', "&a", "*a", "<<", "#", "\t",
          "!!python/object:os.system", "!!binary", "~", "null", "0", "99999", "?", "|", ">",
          "%YAML 1.1", "---", "...", "\x00", "\ufeff", "\u2028", "$(touch x)", "`id`", ";"]
SELECT = st.sampled_from([(), ("--all",), ("--json",), ("--host", "train-*"), ("-g", "training"),
                          ("--tag", "ada"), ("--host", "nope"), ("--host", "$(id)"),
                          ("--host", ""), ("-g", "a,,b"), ("--tag", "\n")])


@st.composite
def mutated(draw: Any, text: str) -> str:
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["delete", "insert", "replace", "dup", "drop", "swap",
                                     "indent", "truncate"]))
        pos = draw(st.integers(0, len(text)))
        if kind == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 60)):]
        elif kind == "insert":
            text = text[:pos] + draw(st.sampled_from(PIECES) | st.text(max_size=6)) + text[pos:]
        elif kind == "replace":
            text = text[:pos] + draw(st.sampled_from(PIECES)) + text[pos + 1:]
        elif kind == "truncate":
            text = text[:pos]
        else:
            lines = text.split("\n")
            i, j = (draw(st.integers(0, len(lines) - 1)) for _ in range(2))
            if kind == "dup":
                lines.insert(j, lines[i])
            elif kind == "drop":
                del lines[i]
            elif kind == "indent":
                lines[i] = draw(st.sampled_from(["", " ", "    ", "\t"])) + lines[i].lstrip()
            else:
                lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
    return text


@FUZZ
@given(VALUES, SELECT)
def test_fuzz_random_yaml_documents(value: Any, options: tuple) -> None:
    run_hosts(yaml.safe_dump(value, allow_unicode=True), *options)


@FUZZ
@given(SHAPED, SELECT)
def test_fuzz_inventory_shaped_documents(value: Any, options: tuple) -> None:
    run_hosts(yaml.safe_dump(value), *options)


@FUZZ
@given(mutated(EXAMPLE), SELECT)
def test_fuzz_mutations_of_fleet_yaml_example(text: str, options: tuple) -> None:
    run_hosts(text, *options)


@FUZZ
@given(st.binary(max_size=300)
       | st.builds(lambda head, tail: head + tail,
                   st.sampled_from([b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff",
                                    b"hosts:\n  a: {address: \xff}\n", b""]),
                   st.binary(max_size=80)))
def test_fuzz_raw_bytes(data: bytes) -> None:
    run_hosts(data)


def test_the_example_itself_lists_its_hosts() -> None:
    """The fuzz baseline: the unmutated example loads (so mutations start from a valid file)."""
    code, out, err = run_hosts(EXAMPLE)
    assert code == 0 and [ln.split()[0] for ln in out.splitlines()[2:]] == [
        "bigmama", "train-01", "train-02", "infer-01", "infer-02", "workstation"], out


LOCAL = WORK / "local.yaml"
LOCAL.write_text("hosts:\n  box:\n    connection: local\n")


@FUZZ
@given(mutated(PLAYBOOK))
def test_fuzz_mutated_runbooks_dry_run(text: str) -> None:
    """`run BOOK --dry-run` validates and prints the plan, connecting to nothing."""
    book = write(text, "book.yaml")
    code, out, err = gpufleet("-i", str(LOCAL), "run", str(book), "--all", "--dry-run",
                              "-e", "OLD_UNIT=old", "-e", "NEW_UNIT=new")
    check_contract(code, out, err, text)
