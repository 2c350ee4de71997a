"""The inventory and runbooks are read by libyaml's parser when PyYAML has it
(config/yamlsource.FastLineLoader): the same values, key lines, item texts as PyYAML's own
parser; every error still comes from PyYAML's parser (same message, same line)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet.config import yamlsource
from gpufleet.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(yamlsource.FastLineLoader is None, reason="PyYAML without libyaml")

INVENTORY = """\
defaults: &d
  user: root
  connect_timeout: 5
hosts:
  yes: {connection: local, tags: [on, 2024, "x", 'y']}
  node01:
    <<: *d
    address: 10.0.0.1
    port: 10978
    protect: ["*jupyter*"]
  1.5: {connection: local}
groups:
  g: [yes, node01, 1.5, off]
  empty: []
  nothing:
"""


def shape(value: Any) -> Any:
    """Values plus what LineMap/LineSeq remember."""
    if isinstance(value, yamlsource.LineMap):
        return ("map", value.line, dict(value.lines), {k: shape(v) for k, v in value.items()})
    if isinstance(value, yamlsource.LineSeq):
        return ("seq", value.line, list(value.lines), list(getattr(value, "texts", [])),
                [shape(v) for v in value])
    return value


def pure(text: str) -> Any:
    return shape(yamlsource._load_pure(text, "f.yaml"))


@pytest.mark.parametrize("text", [INVENTORY] + [p.read_text() for p in sorted((REPO / "playbooks").glob("*.yaml"))])
def test_the_fast_parser_reads_what_the_pure_one_reads(text: str) -> None:
    fast = yamlsource.FastLineLoader(text)
    try:
        assert shape(fast.get_single_data()) == pure(text)
    finally:
        fast.dispose()
    assert shape(yamlsource.load_yaml(text, "f.yaml")) == pure(text)


@pytest.mark.parametrize("text", [
    "hosts:\n  a: {address: x\n",                 # a flow mapping never closed
    "hosts:\n  a: 1\n  a: 2\n",                   # a duplicate key
    "hosts:\n  a:\n    when: 2020-13-45\n",       # a bad date
    "hosts:\n\ta: 1\n",                           # a tab
    "hosts:\n  a: \x07\n",                        # a character YAML does not allow
    "a: *nowhere\n",                              # an unknown alias
])
def test_errors_are_pyyaml_s_own(text: str) -> None:
    with pytest.raises(UsageError) as fast:
        yamlsource.load_yaml(text, "f.yaml")
    with pytest.raises(UsageError) as slow:
        yamlsource._load_pure(text, "f.yaml")
    assert str(fast.value) == str(slow.value)
    assert str(fast.value).startswith("f.yaml")


def test_the_fast_loader_is_libyaml_s() -> None:
    assert issubclass(yamlsource.FastLineLoader, yaml.CSafeLoader)
