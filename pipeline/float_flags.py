"""The settings of a float flag of any command: a finite number within its bounds, checked as the flag is parsed."""

from __future__ import annotations

import math
from typing import Any

import typer


def finite_float(low: float | None = None, high: float | None = None) -> dict[str, Any]:
    """A float flag's ``typer.Option`` settings: its bounds (``min``, ``max``, which its help shows) and a parser that
    refuses inf and nan as "not a finite number" before it checks them (typer's own check of the bounds would call
    nan out of range and let inf past an open side, to crash or mean nothing once the command runs)."""

    def parse(text: str | float) -> float:
        try:
            value = float(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise typer.BadParameter(f"{text} is not a finite number")
        if low is not None and value < low:
            raise typer.BadParameter(f"Input should be greater than or equal to {low:g}")
        if high is not None and value > high:
            raise typer.BadParameter(f"Input should be less than or equal to {high:g}")
        return value

    return {"min": low, "max": high, "parser": parse}
