"""What the launch-parameter sweeps (``tune_attention``, ``tune_gemv``, ``tune_fused_ops``) share: the grid of
configurations, a measurement that skips the ones the compiler refuses, and the JSON they write."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from typing import Any


def grid(spec: dict[str, list]) -> list[dict]:
    """Every combination of the candidates in ``spec`` (parameter -> values), as keyword dicts."""
    return [dict(zip(spec, values, strict=True)) for values in itertools.product(*spec.values())]


def measure_or_skip(measure: Callable[[dict], Any], cfg: dict, failed: Any = None) -> Any:
    """``measure(cfg)``; ``failed``, and a line on stderr, when the configuration does not compile or run."""
    try:
        return measure(cfg)
    except Exception as e:  # noqa: BLE001 - a config the compiler refuses (e.g. out of shared memory)
        print(f"  skip {cfg}: {type(e).__name__}", file=sys.stderr)
        return failed


def write_results(path: str | None, results: list[dict]) -> None:
    """The sweep's rows as JSON, with the GPU's name, when ``path`` is given."""
    if path:
        import torch

        with open(path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=2)
