"""The pure core reads as steps (a reviewer can check each against the rule it implements): no function under gpufleet/core/ is longer than 60
lines (decorators and docstrings included)."""
from __future__ import annotations

import ast
from pathlib import Path

import gpufleet.core

LIMIT = 60


def test_no_core_function_is_longer_than_the_limit() -> None:
    core = Path(gpufleet.core.__file__).resolve().parent
    long = []
    for path in sorted(core.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                size = (node.end_lineno or node.lineno) - first + 1
                if size > LIMIT:
                    long.append(f"{path.relative_to(core)}:{node.lineno} {node.name} ({size})")
    assert not long, long
