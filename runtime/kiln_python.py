"""How Kiln starts a Python process of its own: ``python -m kiln.<module>`` with this interpreter, importing as this
process does (an installed package, or a checkout on ``PYTHONPATH``): the same ``kiln``, and the same modules."""

from __future__ import annotations

import json
import os
import sys
from multiprocessing.process import ORIGINAL_DIR
from pathlib import Path

import kiln

SYS_PATH_VARIABLE = "KILN_SYS_PATH"
# Run in the child with -P (no working directory on the path), after its start-up: the path is set as
# multiprocessing's spawn sets it, once the standard library is imported, so that a module of the caller's folder
# named like one of it (types.py) cannot take its place; then the module runs as -m runs it.
_BOOTSTRAP = (f"import json, os, runpy, sys; sys.path[:] = json.loads(os.environ.pop({SYS_PATH_VARIABLE!r})); "
              "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def kiln_module_command(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run ``python -m module args...`` for a module of the ``kiln`` package, with
    this process's ``sys.path`` (its script's folder, a checkout it inserted), the folder it found ``kiln`` in first:
    a ``kiln`` folder in the working directory (another checkout) is never imported in its place."""
    # absolute, not resolved: a package reached through a symlink is found where this process found it
    package = Path(kiln.__file__).absolute().parent
    found_in = [str(package.parent)] if package.name == "kiln" else []  # else an editable install's finder finds it
    path = [os.path.join(ORIGINAL_DIR, entry) for entry in sys.path]  # "": where this process started, as spawn's
    environment = {**os.environ, SYS_PATH_VARIABLE: json.dumps([*found_in, *path])}
    return [sys.executable, "-P", "-c", _BOOTSTRAP, module, *args], environment
