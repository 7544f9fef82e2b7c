"""The tools in tools/ that docs/performance.md tells users to run still import against the code they measure (a
renamed function broke one unnoticed): each is imported as ``python tools/NAME.py`` imports it, its main not run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.mark.parametrize("path", sorted(TOOLS.glob("*.py")), ids=lambda path: path.stem)
def test_a_tool_imports_as_its_script_would(path, monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))  # as for a script: its own folder first
    spec = importlib.util.spec_from_file_location(f"_tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # an ImportError names what the tool asks for that is gone


@pytest.mark.parametrize("tool, args, expected", [
    pytest.param("serve_ceiling", ["--clients", "2", "--requests", "4", "--output-len", "4", "--step-ms", "1"],
                 "served_engine_process", id="serve_ceiling"),  # its scripted engine once lacked methods LLM calls
    pytest.param("remote_throughput", ["--gb", "0.001"], "cp (one file, same disk)",
                 id="remote_throughput"),  # its fake entry once held no engine, which a pull refuses
])
def test_a_cpu_tool_the_docs_name_runs_to_its_table(tool, args, expected):
    import subprocess

    from tests.subprocess_env import REPO, repo_env

    out = subprocess.run([sys.executable, str(TOOLS / f"{tool}.py"), *args], capture_output=True, text=True,
                         cwd=REPO, env=repo_env(), timeout=300)
    assert out.returncode == 0 and expected in out.stdout, out.stderr[-2000:]
