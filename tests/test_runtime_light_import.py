"""`import kiln.runtime` stays cheap for services that embed it: no transformers, modelopt or server stack, and no
other layer of Kiln."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.subprocess_env import REPO, repo_env

HEAVY = ["transformers", "modelopt", "fastapi", "uvicorn", "prometheus_client", "kiln.engines", "kiln.pipeline",
         "kiln.calibration"]


def modules_after(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                            env=repo_env())
    return set(json.loads(result.stdout))


def loads_any(loaded: set[str], packages: list[str]) -> list[str]:
    return sorted(name for name in loaded for package in packages if name == package or name.startswith(package + "."))


def test_import_kiln_runtime_loads_neither_torch_nor_heavy_packages():
    loaded = modules_after("import kiln, kiln.runtime, kiln.runtime.errors")
    assert loads_any(loaded, ["torch", *HEAVY]) == []


def test_public_api_imports_without_torch_transformers_modelopt_or_the_server():
    loaded = modules_after("from kiln.runtime import *\nfrom kiln import LLM as Same, RuntimeOptions, SamplingError")
    assert loads_any(loaded, ["torch", *HEAVY]) == []  # torch loads with the first engine (each name resolves)


def test_the_names_loaded_on_first_use_are_seen_by_type_checkers_and_tab_completion():
    import ast

    import kiln
    import kiln.runtime

    tree = ast.parse((REPO / "runtime" / "__init__.py").read_text())
    checked = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {alias.name for node in checked.body for alias in node.names}  # what `if TYPE_CHECKING:` imports
    assert typed == set(kiln.runtime._LAZY)  # every lazy name, so `from kiln import LLM` is LLM, not object
    assert set(kiln.runtime.__all__) <= set(dir(kiln.runtime)) and set(kiln.runtime.__all__) <= set(dir(kiln))
    assert not {"TYPE_CHECKING", "annotations"} & set(dir(kiln))  # the module's own imports are no API


def test_kiln_has_the_installed_version_as_vllm_and_sglang_do():
    from importlib.metadata import version

    import kiln

    assert kiln.__version__ == version("kiln") and "__version__" in dir(kiln)
