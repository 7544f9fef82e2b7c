"""Load YAML while remembering the line of every key, so errors can name ``file:line``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kiln.runtime.errors import KilnError


class ConfigError(KilnError):
    """A config file that is missing, unreadable or invalid."""


def load_yaml_with_lines(path: Path) -> tuple[Any, dict[tuple[str, ...], int]]:
    """Parse ``path``; return the data and a map from key path (``("build", "max_seq_len")``) to 1-based line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found; give a path or a name under configs/") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    lines: dict[tuple[str, ...], int] = {}
    if node is not None:
        _collect_lines(node, (), lines)
    return data, lines


def _collect_lines(node: yaml.Node, prefix: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> None:
    lines[prefix] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = (*prefix, str(key_node.value))
            _collect_lines(value_node, key, lines)
            lines[key] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _collect_lines(item, (*prefix, str(index)), lines)


def line_of(lines: dict[tuple[str, ...], int], loc: tuple[str, ...]) -> int | None:
    """The line of the deepest part of ``loc`` that exists in the file (a missing field points at its section)."""
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None
