"""How Kiln starts a Python process of its own: ``python -m kiln.<module>`` with this interpreter, finding the same
``kiln`` package, and the same modules, as this process (an installed package, or a checkout on ``PYTHONPATH``)."""

from __future__ import annotations

import os
import sys


def kiln_module_command(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run ``python -m module args...`` for a module of the ``kiln`` package, importing
    as this process does (as multiprocessing's spawn does): this process's ``sys.path`` (its script's folder, a
    checkout on ``PYTHONPATH``) on the child's ``PYTHONPATH``, and ``-P``, so that a ``kiln`` folder in the working
    directory (another checkout) is not imported in place of the one this process runs."""
    # absolute, not resolved: a package reached through a symlink is found where this process found it
    path = [os.path.abspath(entry) for entry in sys.path]  # "" (the working directory) included
    return [sys.executable, "-P", "-m", module, *args], {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
