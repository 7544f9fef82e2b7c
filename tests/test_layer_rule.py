"""The layer rule: pipeline → calibration, engines → runtime; runtime stays light; every import of Kiln's own code
goes through the installed ``kiln`` namespace."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "engines", "calibration", "pipeline")
FOLDERS = (*LAYERS, "tests", "tools", "examples")

# layer -> what it must never import (at any depth, including inside functions): other layers and heavy packages
FORBIDDEN = {
    "runtime": {"pipeline", "calibration", "engines", "transformers", "modelopt"},
    "engines": {"pipeline", "calibration", "transformers", "modelopt"},
    "calibration": {"pipeline", "engines", "runtime"},
}
SERVER_ONLY = {"fastapi", "uvicorn", "prometheus_client", "starlette"}
RELATIVE = "a relative import"


def imported_modules(source: str) -> set[str]:
    """What a source file imports (``import_module("...")`` of a literal name included): a Kiln layer by its name
    (``kiln.runtime.llm`` is ``runtime``), anything else by its top-level name; a Kiln layer imported without the
    ``kiln.`` prefix shows as ``<layer> (outside kiln.)``, and a relative import, which hides which layer it reaches,
    as ``a relative import``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            names.add(RELATIVE)
            continue
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif _imports_by_name(node):
            modules = [node.args[0].value]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "kiln" and len(parts) > 1:
                names.add(parts[1])
            elif parts[0] in LAYERS:
                names.add(f"{parts[0]} (outside kiln.)")
            else:
                names.add(parts[0])
    return names


def _imports_by_name(node: ast.AST) -> bool:
    """Whether ``node`` is ``import_module("<a literal name>")`` (``importlib.`` or not)."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    return called == "import_module" and isinstance(node.args[0].value, str)


def violations(root: Path) -> list[str]:
    """Every import under ``root`` that breaks the layer rule, or reaches Kiln's code outside ``kiln.``, as
    ``file: imports module``."""
    found = []
    for path in sorted(root.glob("*.py")) + sorted(p for top in FOLDERS for p in (root / top).rglob("*.py")):
        relative = path.relative_to(root)
        imported = imported_modules(path.read_text())
        banned = {name for name in imported if name.endswith("(outside kiln.)") or name == RELATIVE}
        layer = relative.parts[0]
        if layer in FORBIDDEN:
            banned |= imported & FORBIDDEN[layer]
            if layer == "runtime" and "server" not in relative.parts:
                banned |= imported & SERVER_ONLY
        found += [f"{relative}: imports {module}" for module in sorted(banned)]
    return found


def test_repository_follows_the_layer_rule():
    assert violations(REPO) == []


def test_layer_check_catches_an_upward_import(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "bad.py").write_text("def f():\n    from kiln.pipeline.config import load_config\n")
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "bad.py").write_text("import kiln.engines.cache\n")
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "ok.py").write_text("from kiln.runtime.errors import KilnError\n")
    (tmp_path / "runtime" / "hidden.py").write_text("import importlib\nimportlib.import_module('kiln.engines.cache')\n")
    (tmp_path / "runtime" / "relative.py").write_text("from ..pipeline import config\n")
    assert violations(tmp_path) == ["calibration/bad.py: imports engines", "runtime/bad.py: imports pipeline",
                                    "runtime/hidden.py: imports engines",
                                    "runtime/relative.py: imports a relative import"]


def test_kiln_code_is_imported_through_the_kiln_namespace(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "bad.py").write_text("from runtime.errors import KilnError\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_bad.py").write_text("import engines.cache\n")
    assert violations(tmp_path) == ["pipeline/bad.py: imports runtime (outside kiln.)",
                                    "tests/test_bad.py: imports engines (outside kiln.)"]


def test_runtime_core_may_not_import_the_server_stack(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "llm.py").write_text("import fastapi\n")
    (tmp_path / "runtime" / "server").mkdir()
    (tmp_path / "runtime" / "server" / "app.py").write_text("import fastapi\n")
    assert violations(tmp_path) == ["runtime/llm.py: imports fastapi"]
