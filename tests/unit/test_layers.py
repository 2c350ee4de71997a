"""The layers of docs/DESIGN.md, checked from the source (ast, nothing imported):

* gpufleet/core/ is pure: no transport, CLI, YAML, SSH, subprocess or socket, and none of the
  layers above it;
* gpufleet/render/ never reaches a host (no transport, no ops);
* only gpufleet/cli/ imports gpufleet.cli;
* what runs ON a host (gpufleet/remote/ programs) is Python 3.6 and the standard library.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gpufleet"

CORE_FORBIDDEN = ("transport", "click", "yaml", "paramiko", "fabric", "subprocess", "socket",
                  "gpufleet.config", "gpufleet.transport", "gpufleet.ops", "gpufleet.runbook.load",
                  "gpufleet.render.status", "gpufleet.cli")
RENDER_FORBIDDEN = ("gpufleet.transport", "gpufleet.ops")
# Programs sent to a host: the agent and the wait_http probe (remote/__init__.py is the
# controller's side: it reads and frames them).
REMOTE_PROGRAMS = ("agent.py", "wait_http.py")


def _modules(under: str, root: Path = PACKAGE) -> list[Path]:
    return sorted((root / under).rglob("*.py"))


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = PACKAGE) -> list[str]:
    """Every module a file imports (absolute names; relative imports resolved), at any depth,
    including imports inside functions and under TYPE_CHECKING."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append(module)
            out.extend(f"{module}.{alias.name}" for alias in node.names)
    return out


def _hits(name: str, forbidden: tuple[str, ...]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in forbidden)


def _violations(under: str, forbidden: tuple[str, ...], root: Path = PACKAGE) -> list[str]:
    return [f"{p.relative_to(root.parent)} imports {name}"
            for p in _modules(under, root) for name in imports(p, root) if _hits(name, forbidden)]


def test_the_checker_sees_imports_at_any_depth(tmp_path: Path) -> None:
    sample = tmp_path / "gpufleet" / "core" / "x.py"
    sample.parent.mkdir(parents=True)
    sample.write_text("import os\nif 1:\n    def f():\n        import subprocess\n"
                      "        from gpufleet.cli import main\n        from . import plan\n")
    root = tmp_path / "gpufleet"
    names = imports(sample, root)
    assert {"os", "subprocess", "gpufleet.cli", "gpufleet.cli.main", "gpufleet.core.plan"} <= set(names)
    assert len(_violations("core", CORE_FORBIDDEN, root)) == 3  # subprocess, gpufleet.cli, .main


def test_core_is_pure() -> None:
    assert _modules("core"), "no gpufleet/core/ modules found"
    assert _violations("core", CORE_FORBIDDEN) == []


def test_render_never_reaches_a_host() -> None:
    assert _violations("render", RENDER_FORBIDDEN) == []


def test_only_the_cli_imports_the_cli() -> None:
    # gpufleet/__main__.py is `python -m gpufleet`: the CLI's entry point, not a layer
    outside = [p for p in PACKAGE.rglob("*.py")
               if "cli" not in p.relative_to(PACKAGE).parts and p.name != "__main__.py"]
    bad = [f"{p.relative_to(PACKAGE.parent)} imports {name}"
           for p in outside for name in imports(p) if _hits(name, ("gpufleet.cli",))]
    assert bad == []


@pytest.mark.parametrize("name", REMOTE_PROGRAMS)
def test_remote_programs_are_python36_stdlib(name: str) -> None:
    path = PACKAGE / "remote" / name
    ast.parse(path.read_text(encoding="utf-8"), name, feature_version=(3, 6))
    top = {n.split(".")[0] for n in imports(path)}
    assert top and top <= set(sys.stdlib_module_names), sorted(top - set(sys.stdlib_module_names))


def test_wait_http_is_sent_from_its_file() -> None:
    from gpufleet.runbook.steps import wait_http_source

    source = wait_http_source()
    assert source == (PACKAGE / "remote" / "wait_http.py").read_text(encoding="utf-8")
    # `python -c` runs it as __main__; importing it (as the test above does not) runs nothing
    assert 'if __name__ == "__main__":' in source
