"""What the launch-parameter sweeps (``tune_attention``, ``tune_gemv``, ``tune_fused_ops``) share: the grid of
configurations, a measurement that skips the ones the compiler refuses, the bandwidth they print and the JSON they
write."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

from bench_kernels import PEAK_BANDWIDTH


def sweep_parser(doc: str, rep_ms: int) -> argparse.ArgumentParser:
    """A sweep's argument parser (its description the first paragraph of ``doc``) with ``--rep`` and ``--json``;
    the sweep adds its own arguments."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--rep", type=int, default=rep_ms, help=f"timing per config in ms (default {rep_ms})")
    parser.add_argument("--json", help="also write the results to this file")
    return parser


def has_cuda(tool: str) -> bool:
    """Whether a CUDA GPU is present; if not, says so on stderr for ``tool``."""
    import torch

    if torch.cuda.is_available():
        return True
    print(f"{tool}: no CUDA GPU; run it on the GPU machine", file=sys.stderr)
    return False


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


def tb_per_s(nbytes: float, us: float) -> float:
    """Terabytes per second of moving ``nbytes`` in ``us`` microseconds."""
    return nbytes / us / 1e6


def bandwidth_text(tb: float) -> str:
    """``2.34 TB/s,  54%``: the rate and its share of the H200's ~4.3 TB/s."""
    return f"{tb:4.2f} TB/s, {tb * 1e14 / PEAK_BANDWIDTH:3.0f}%"


def write_results(path: str | None, results: list[dict]) -> None:
    """The sweep's rows as JSON, with the GPU's name, when ``path`` is given."""
    if path:
        import torch

        with open(path, "w", encoding="utf-8") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=2)
