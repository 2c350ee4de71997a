"""The remote agent reads as steps: no function under gpufleet/remote/ (the agent's pieces, the
wait_http probe, the joiner) is longer than 60 lines, decorators and docstrings included, as
for gpufleet/core/ (tests/unit/test_core_functions.py). Read from the source, nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path

LIMIT = 60
REMOTE = Path(__file__).resolve().parents[2] / "gpufleet" / "remote"


def long_functions(path: Path, limit: int = LIMIT) -> list[str]:
    """`name:line function (size)` for each function (nested ones too) over limit lines."""
    long = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            size = (node.end_lineno or node.lineno) - first + 1
            if size > limit:
                long.append("%s:%d %s (%d)" % (path.name, node.lineno, node.name, size))
    return long


def test_the_length_checker_counts_decorators_and_nested_functions(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    body = "".join("    x = %d\n" % i for i in range(3))
    nested = "".join("    " + line for line in body.splitlines(keepends=True))
    sample.write_text("@dec\ndef f():\n" + body + "    def g():\n" + nested)
    assert long_functions(sample, limit=9) == []
    assert long_functions(sample, limit=8) == ["x.py:2 f (9)"]
    assert long_functions(sample, limit=3) == ["x.py:2 f (9)", "x.py:6 g (4)"]


def test_no_remote_function_is_longer_than_the_limit() -> None:
    paths = sorted(REMOTE.glob("*.py"))
    assert paths, "no gpufleet/remote/ modules found"
    long = [hit for path in paths for hit in long_functions(path)]
    assert not long, long
