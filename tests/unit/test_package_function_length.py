"""No function in gpufleet/ (outside gpufleet/remote/) is longer than 80 lines.

Long functions hide the interplay of their parts (the Ctrl-C handling of the fan-out, the
checks of a runbook); keeping each one short keeps each part reviewable on its own. The
remote agent is exempt: it is shipped as one standard-library file to old Pythons.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpufleet"
MAX_LINES = 80


def _long_functions() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        if rel.parts[1] == "remote":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_package_found() -> None:
    assert (PACKAGE / "ops" / "fanout.py").is_file()


def test_no_function_longer_than_limit() -> None:
    assert _long_functions() == []
