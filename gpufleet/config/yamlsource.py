"""YAML that remembers where things were written: one-line errors name the file and line.

Shared by the inventory (fleet.yaml) and runbooks (playbooks/*.yaml): operator input whose
mistakes must come back as ``file:line: key: message`` (UsageError, exit 2), never a
traceback. Duplicate keys, which PyYAML silently collapses, are errors here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from gpufleet.errors import LoadError, UsageError, one_line


class LineMap(dict):
    """A mapping that remembers the line of each key (and of itself)."""

    line = 0
    lines: dict

    def key_line(self, key: str) -> int:
        return getattr(self, "lines", {}).get(key, self.line)


class LineSeq(list):
    """A sequence that remembers the line of each item."""

    line = 0
    lines: list

    def item_line(self, i: int) -> int:
        lines = getattr(self, "lines", [])
        return lines[i] if i < len(lines) else self.line

    def item_text(self, i: int) -> Any:
        """A name as written: a plain ``yes`` or ``123`` item is the name "yes"/"123"."""
        item = self[i]
        texts = getattr(self, "texts", [])
        if not isinstance(item, str) and i < len(texts) and texts[i]:
            if item is None or isinstance(item, (bool, int, float)):
                return texts[i]
        return item


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _LineConstructor:
    """What LineLoader adds to a safe loader: line numbers, no duplicate keys, keys as text.

    Keys are taken as their source text (``yes:`` or ``123:`` is a host named "yes"/"123",
    not True/123); merge keys (``<<: *anchor``) keep YAML's meaning: the mapping's own keys
    win over merged ones.
    """

    def _pairs(self, node: MappingNode, active: frozenset) -> list:
        if id(node) in active:
            raise LoadError(node.start_mark.line + 1, "recursive merge ('<<')")
        active = active | {id(node)}
        own: dict = {}
        merged: dict = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == _MERGE_TAG:
                sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
                for src in sources:
                    if not isinstance(src, MappingNode):
                        raise LoadError(line, "'<<' (merge) needs a mapping or a list of mappings")
                    for key, pair in self._pairs(src, active):
                        merged.setdefault(key, pair)
                continue
            if not isinstance(key_node, ScalarNode):
                raise LoadError(line, "a key must be a plain name, not a list or mapping")
            key = key_node.value
            if key in own:
                first = own[key][0].start_mark.line + 1
                raise LoadError(line, f"duplicate key {key!r} (first on line {first})")
            own[key] = (key_node, value_node)
        out = [(k, p) for k, p in merged.items() if k not in own]
        out.extend(own.items())
        return out

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, MappingNode):
            raise LoadError(node.start_mark.line + 1, "expected a mapping")
        result = LineMap()
        result.line = node.start_mark.line + 1
        result.lines = {}
        for key, (key_node, value_node) in self._pairs(node, frozenset()):
            result[key] = self.construct_object(value_node, deep=deep)
            result.lines[key] = key_node.start_mark.line + 1
        return result

    def construct_yaml_map(self, node):
        data = LineMap()
        data.line = node.start_mark.line + 1
        data.lines = {}
        yield data
        value = self.construct_mapping(node)
        data.update(value)
        data.lines = value.lines

    def construct_yaml_seq(self, node):
        data = LineSeq()
        data.line = node.start_mark.line + 1
        data.lines = [n.start_mark.line + 1 for n in node.value]
        data.texts = [
            # a plain scalar's style: None from PyYAML's parser, "" from libyaml's
            n.value if isinstance(n, ScalarNode) and not n.style else None for n in node.value
        ]
        yield data
        data.extend(self.construct_sequence(node))


class LineLoader(_LineConstructor, yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader that records line numbers, refuses duplicate keys and keeps keys as text."""


#: The same loader on libyaml's parser (PyYAML's wheels include it): a 128-host inventory
#: parses in ~12 ms instead of ~75. Only documents it reads without error: every error is
#: re-read by LineLoader, so messages and lines stay PyYAML's own.
FastLineLoader: Any = None
if getattr(yaml, "__with_libyaml__", False):
    class FastLineLoader(_LineConstructor, yaml.CSafeLoader):  # type: ignore[misc,no-redef]
        """LineLoader on libyaml's C parser."""

for _loader in (LineLoader, FastLineLoader):
    if _loader is not None:
        _loader.add_constructor("tag:yaml.org,2002:map", _loader.construct_yaml_map)
        _loader.add_constructor("tag:yaml.org,2002:seq", _loader.construct_yaml_seq)


def yaml_error_line(exc: yaml.YAMLError, text: str) -> int:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        return mark.line + 1
    position = getattr(exc, "position", None)  # ReaderError (a non-printable character)
    if isinstance(position, int):
        return text[:position].count("\n") + 1
    return 0


def check_duplicates(node: Any, where: str, seen: set) -> None:
    """Refuse duplicate keys (PyYAML silently keeps the last), naming where they are."""
    if id(node) in seen:  # aliases: visit each node once
        return
    seen.add(id(node))
    if isinstance(node, MappingNode):
        first: dict = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, ScalarNode) and key_node.tag != _MERGE_TAG:
                key = key_node.value
                line = key_node.start_mark.line + 1
                if key in first:
                    prefix = f"{where}: " if where else ""
                    raise LoadError(line, f"{prefix}duplicate key {key!r} "
                                           f"(first on line {first[key]})")
                first[key] = line
                child = f"{where}.{key}" if where else key
            else:
                child = where
            check_duplicates(value_node, child, seen)
    elif isinstance(node, SequenceNode):
        for i, item in enumerate(node.value):
            check_duplicates(item, f"{where}[{i}]", seen)


def load_yaml(text: str, source: str) -> Any:
    """The document, or one UsageError line ``source:line: message``."""
    if FastLineLoader is not None and not yaml.reader.Reader.NON_PRINTABLE.search(text):
        fast = FastLineLoader(text)
        try:
            node = fast.get_single_node()
            if node is not None:
                check_duplicates(node, "", set())
                return fast.construct_document(node)
            return None
        except Exception:
            pass  # an error: the pure loader below reads it again and says what it is
        finally:
            fast.dispose()
    return _load_pure(text, source)


def _load_pure(text: str, source: str) -> Any:
    loader = None
    try:
        loader = LineLoader(text)  # the reader already refuses non-printable characters
        node = loader.get_single_node()
        if node is None:
            return None
        check_duplicates(node, "", set())
        return loader.construct_document(node)
    except LoadError as exc:
        raise UsageError(f"{source}:{exc.line}: {exc.message}") from None
    except yaml.YAMLError as exc:
        line = yaml_error_line(exc, text)
        problem = getattr(exc, "problem", None)
        context = getattr(exc, "context", None)
        if problem and context:
            detail = f"{context}, {problem}"
        else:
            detail = problem or context or str(exc)
        if isinstance(exc, yaml.reader.ReaderError):
            detail = f"character U+{int(exc.character):04X} is not allowed in YAML"
        loc = f"{source}:{line}" if line else source
        raise UsageError(one_line(f"{loc}: YAML syntax error: {detail}")) from None
    except RecursionError:
        raise UsageError(f"{source}: YAML nested too deeply") from None
    except (ValueError, TypeError, OverflowError) as exc:
        # PyYAML's own constructors raise these for e.g. `2020-13-45` (read as a date).
        raise UsageError(one_line(f"{source}: invalid YAML value: {exc}")) from None
    finally:
        if loader is not None:
            loader.dispose()




def read_source(path: Path, source: str, what: str, max_bytes: int) -> str:
    """The text of an operator's YAML file, or one UsageError line saying why not."""
    a_what = ("an " if what[:1] in "aeiou" else "a ") + what
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except FileNotFoundError:
        raise UsageError(f"{source}: {what} not found") from None
    except IsADirectoryError:
        raise UsageError(f"{source}: is a directory, not {a_what}") from None
    except OSError as exc:
        raise UsageError(f"{source}: cannot read {what}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise UsageError(f"{source}: larger than {max_bytes} bytes; not {a_what}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UsageError(f"{source}:{line}: not valid UTF-8") from None
