"""Load YAML while remembering the line of every key, so errors can name ``file:line``; refuse what a config never
needs and would only hide a mistake: a key given twice (the last would win) and aliases (an alias bomb expands a
few lines into gigabytes)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kiln.runtime.errors import KilnError


class ConfigError(KilnError):
    """A config file that is missing, unreadable or invalid."""


class _Refused(yaml.MarkedYAMLError):
    """Valid YAML that a Kiln config does not take."""


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing aliases (``*name``)."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(problem=f"YAML alias *{event.anchor}: a Kiln config takes no aliases; write the value out",
                           problem_mark=event.start_mark)
        return super().compose_node(parent, index)


def _construct_int(loader: _ConfigLoader, node: yaml.ScalarNode) -> int:
    """An integer as YAML 1.2 reads it: decimal, ``0o17`` octal or ``0x1f`` hexadecimal; ``016`` is refused rather
    than read as octal 14 (YAML 1.1)."""
    text = str(node.value)
    digits = text.lstrip("+-")
    if len(digits) > 1 and digits.startswith("0") and digits[1].isdigit():
        raise _Refused(problem=f"{node.value}: a number with a leading zero is ambiguous (YAML 1.1 reads 016 as octal "
                               f"14); write {int(digits, 10)}", problem_mark=node.start_mark)
    return int(text, 0)


# numbers as YAML 1.2's core schema reads them, in place of PyYAML's YAML 1.1 rules: no sexagesimal 1:30 (90 in YAML
# 1.1) and no 1_000 (both strings, which a number field refuses), 0o17 octal, and floats without a dot (1e-2)
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBER_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                    list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))


def load_yaml_with_lines(path: Path) -> tuple[Any, dict[tuple[str, ...], int]]:
    """Parse ``path``; return the data and a map from key path (``("build", "max_seq_len")``) to 1-based line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found; give a path or a name under configs/") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x}); save the "
                          f"config as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    lines: dict[tuple[str, ...], int] = {}
    try:
        loader = _ConfigLoader(text)  # refuses a control character (NUL, ESC, ...) here, before the try below
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(f"{path}:{line}: control character U+{exc.character:04X} is not allowed in YAML; remove "
                          "it") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None, lines
        _collect_lines(node, (), lines)
        return loader.construct_document(node), lines
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: {problem}" if isinstance(exc, _Refused)
                          else f"{where}: not valid YAML ({problem})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a Kiln config (sections of keys and short lists)") from None
    finally:
        loader.dispose()


_STR = "tag:yaml.org,2002:str"
_KINDS = {"bool": "a boolean", "null": "null", "int": "a number", "float": "a number", "timestamp": "a date"}


def _collect_lines(node: yaml.Node, prefix: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> None:
    """Record the line of every key under ``node``; a key given twice in one mapping, or one that YAML reads as no
    string (``null:``, ``true:``, ``8:``), is refused."""
    lines[prefix] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if key_node.tag != _STR:  # refused here, at its own line: pydantic's error would point at the section
                raise _Refused(problem=_not_a_name(key_node, prefix), problem_mark=key_node.start_mark)
            key = (*prefix, str(key_node.value))
            if key in lines:
                raise _Refused(problem=f"{'.'.join(key)} is given twice (first on line {lines[key]}); keep one",
                               problem_mark=key_node.start_mark)
            _collect_lines(value_node, key, lines)
            lines[key] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _collect_lines(item, (*prefix, str(index)), lines)


def _not_a_name(key_node: yaml.Node, prefix: tuple[str, ...]) -> str:
    """Why a key that YAML reads as no string (``null:``, ``true:``, ``8:``, a list) is refused."""
    where = ".".join(prefix) or "the top level"
    if not isinstance(key_node, yaml.ScalarNode):
        return f"{where}: a key is a {'list' if isinstance(key_node, yaml.SequenceNode) else 'mapping'}, and a " \
               f"config's keys are names"
    kind = _KINDS.get(key_node.tag.rsplit(":", 1)[-1], "no string")
    return (f"{where}: key {key_node.value or '(empty)'} is read as {kind}, and a config's keys are names; quote it "
            f"(\"{key_node.value}\") if it is one")


def line_of(lines: dict[tuple[str, ...], int], loc: tuple[str, ...]) -> int | None:
    """The line of the deepest part of ``loc`` that exists in the file (a missing field points at its section)."""
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None
