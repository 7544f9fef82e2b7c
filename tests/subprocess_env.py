"""The environment of a subprocess that runs Kiln from this checkout."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_env(*paths: str, **extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``, then ``paths``; what was already there
    stays after them (packages installed with ``--target``, as on the GPU machine), then ``extra``."""
    path = os.pathsep.join(p for p in (str(REPO), *paths, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
