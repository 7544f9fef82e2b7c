"""Reading the JSON object files of checkpoints and engines, with one-line errors that name the file, and telling
JSON's numbers from its other values."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def read_json_object(path: Path, error: type[Exception], fix: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``error`` naming the file, the problem and ``fix`` (what to do about it) when the
    file is unreadable or holds something other than an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: unreadable JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object; {fix}")
    return data


def is_number(value: object) -> bool:
    """Whether ``value`` is a finite int or float of JSON (not a bool, a string or null)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
