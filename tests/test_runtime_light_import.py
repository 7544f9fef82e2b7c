"""`import runtime` stays cheap for services that embed it: no transformers, modelopt or server stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ["transformers", "modelopt", "fastapi", "uvicorn", "prometheus_client", "engines", "pipeline", "calibration"]


def modules_after(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    return {name.split(".")[0] for name in json.loads(result.stdout)}


def test_import_runtime_loads_neither_torch_nor_heavy_packages():
    loaded = modules_after("import runtime, runtime.cache_layout")
    assert "torch" not in loaded
    assert loaded.isdisjoint(HEAVY)


def test_public_api_imports_without_transformers_modelopt_or_the_server():
    loaded = modules_after("from runtime import LLM, SamplingParams, RequestOutput, StreamDelta, KilnError")
    assert "torch" in loaded
    assert loaded.isdisjoint(HEAVY)
