"""The layers of docs/DESIGN.md, checked from the source (ast, nothing imported):

* gpufleet/core/ is pure: no transport, CLI, YAML, SSH, subprocess or socket, and none of the
  layers above it;
* gpufleet/render/ never reaches a host (no transport, no ops);
* only gpufleet/cli/ imports gpufleet.cli;
* what runs ON a host (gpufleet/remote/ programs: the agent's pieces, joined into one payload
  at send time, and the wait_http probe) is Python 3.6 and the standard library, and the
  pieces import each other only in the one way the joiner understands.
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
REMOTE = PACKAGE / "remote"


def _agent_pieces() -> tuple[str, ...]:
    """AGENT_PIECES of gpufleet/remote/__init__.py, read from its source (nothing imported)."""
    tree = ast.parse((REMOTE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == \
                ["AGENT_PIECES"]:
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("AGENT_PIECES not found in gpufleet/remote/__init__.py")


# Programs sent to a host: the agent's pieces (joined into one payload at send time), the
# loader sent before them (remote/loader.py) and the wait_http probe. remote/__init__.py is the controller's side (it joins and frames them);
# remote/agent.py is the joined payload executed as a module, for tests and debugging.
AGENT_PIECES = _agent_pieces()
REMOTE_PROGRAMS = tuple(name + ".py" for name in AGENT_PIECES + ("loader", "wait_http"))
CONTROLLER_SIDE = ("__init__.py", "agent.py")
JOINED_MARK = "# joined"


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


def py36_violations(tree: ast.AST) -> list[str]:
    """What ast.parse(feature_version=(3, 6)) lets through but a host's Python 3.6 (or the
    3.5 that must still get the agent's "python too old" document) cannot compile:

    * f-strings at all: an `=` specifier is 3.8, and on Python 3.12+ feature_version no longer
      sees it; f-strings themselves are 3.6, so a 3.5 host would get a SyntaxError instead
      of the python_too_old document (the agent uses % formatting);
    * variable annotations (3.6; type comments, `x = []  # type: list`, instead), for 3.5;
    * the walrus, positional-only parameters, `from __future__ import annotations` (3.7+).
    """
    out = []
    for node in ast.walk(tree):
        where = "line %s: " % getattr(node, "lineno", "?")
        if isinstance(node, ast.JoinedStr):
            out.append(where + "f-string")
        elif isinstance(node, ast.AnnAssign):
            out.append(where + "variable annotation")
        elif isinstance(node, ast.NamedExpr):
            out.append(where + "assignment expression (:=)")
        elif isinstance(node, ast.arguments) and node.posonlyargs:
            out.append(where + "positional-only parameters")
        elif isinstance(node, ast.ImportFrom) and node.module == "__future__" and \
                any(a.name == "annotations" for a in node.names):
            out.append(where + "from __future__ import annotations")
    return out


@pytest.mark.parametrize("snippet, found", [
    ('x = f"{y=}"', "f-string"),
    ('x = f"{y}"', "f-string"),
    ("x: list = []", "variable annotation"),
    ("if (n := 1):\n    pass", "assignment expression"),
    ("def f(a, /):\n    pass", "positional-only"),
    ("from __future__ import annotations", "__future__"),
])
def test_the_py36_checker_sees(snippet: str, found: str) -> None:
    (violation,) = py36_violations(ast.parse(snippet))
    assert found in violation
    assert py36_violations(ast.parse("x = '%s' % (y,)  # type: str\ndef f(a, *b, c=1): pass")) == []


def test_every_remote_file_is_checked() -> None:
    on_disk = {p.name for p in REMOTE.glob("*.py")}
    assert on_disk == set(REMOTE_PROGRAMS) | set(CONTROLLER_SIDE)
    assert not [p for p in REMOTE.iterdir() if p.is_dir() and p.name != "__pycache__"]


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a piece defines at its top level: functions, classes, assignments."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _piece_tree(name: str) -> tuple[ast.Module, list[str]]:
    text = (REMOTE / (name + ".py")).read_text(encoding="utf-8")
    return ast.parse(text, name + ".py", feature_version=(3, 6)), text.splitlines()


@pytest.mark.parametrize("name", REMOTE_PROGRAMS)
def test_remote_programs_are_python36_stdlib(name: str) -> None:
    piece = name[: -len(".py")]
    tree, lines = _piece_tree(piece)
    assert py36_violations(tree) == []
    absolute = [n for n in ast.walk(tree) if isinstance(n, ast.Import)
                or (isinstance(n, ast.ImportFrom) and not n.level)]
    top = {a.name.split(".")[0] for n in absolute if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in absolute if isinstance(n, ast.ImportFrom) and n.module}
    assert top <= set(sys.stdlib_module_names), sorted(top - set(sys.stdlib_module_names))
    # Another piece only as `from .piece import name  # joined` (the mark on its first line),
    # at the top level, of a piece joined BEFORE this one, naming what that piece defines: the
    # joiner drops exactly these lines, and the joined source (one namespace) then has every
    # name it needs, in time.
    earlier = AGENT_PIECES[: AGENT_PIECES.index(piece)] if piece in AGENT_PIECES else ()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        assert node in tree.body and JOINED_MARK in lines[node.lineno - 1], \
            "%s line %d: not a top-level import marked %r" % (name, node.lineno, JOINED_MARK)
        assert node.level == 1 and node.module in earlier, \
            "%s line %d: imports %s, not a piece joined before it" % (
                name, node.lineno, node.module)
        defined = _top_level_names(_piece_tree(node.module)[0])
        missing = [a.name for a in node.names if a.name not in defined]
        assert not missing, "%s imports %s from %s, which does not define them" % (
            name, missing, node.module)


def test_the_pieces_share_one_namespace_without_clashes() -> None:
    """Joined, the pieces are ONE namespace: a name two pieces define (or one defines and
    another binds by import) would silently shadow the other on a host."""
    owner: dict[str, str] = {}
    clashes = []
    for piece in AGENT_PIECES:
        tree = _piece_tree(piece)[0]
        for name in _top_level_names(tree):
            if name in owner:
                clashes.append("%s: %s and %s" % (name, owner[name], piece))
            owner[name] = piece
    for piece in AGENT_PIECES:
        for node in _piece_tree(piece)[0].body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                for alias in node.names:
                    bound = (alias.asname or alias.name).split(".")[0]
                    if bound in owner:
                        clashes.append("%s: defined in %s, imported in %s" % (
                            bound, owner[bound], piece))
    assert clashes == []
    assert owner.get("first_line") == "parse"  # one definition of it in the agent


def test_wait_http_is_sent_from_its_file() -> None:
    from gpufleet.runbook.steps import wait_http_source

    from gpufleet.remote import SAFE_PATH

    source = wait_http_source()
    assert source == SAFE_PATH + "\n" + (PACKAGE / "remote" / "wait_http.py").read_text(
        encoding="utf-8")
    # `python -c` runs it as __main__; importing it (as the test above does not) runs nothing
    assert 'if __name__ == "__main__":' in source
