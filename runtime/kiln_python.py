"""How Kiln starts a Python process of its own: ``python -m kiln.<module>`` with this interpreter, finding the same
``kiln`` package as this process (an installed package, or a checkout on ``PYTHONPATH``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import kiln


def kiln_module_command(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run ``python -m module args...`` for a module of the ``kiln`` package."""
    # absolute, not resolved: a package reached through a symlink is found where this process found it
    package_parent = str(Path(kiln.__file__).absolute().parents[1])
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_parent,
                                                                             os.environ.get("PYTHONPATH")]))}
    return [sys.executable, "-m", module, *args], environment
