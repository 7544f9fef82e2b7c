"""The layer rule: pipeline → calibration, engines → runtime; runtime stays light."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# package -> top-level modules it must never import (at any depth, including inside functions)
FORBIDDEN = {
    "runtime": {"pipeline", "calibration", "engines", "transformers", "modelopt"},
    "engines": {"pipeline", "calibration", "transformers", "modelopt"},
    "calibration": {"pipeline", "engines", "runtime"},
}
SERVER_ONLY = {"fastapi", "uvicorn", "prometheus_client", "starlette"}


def imported_modules(source: str) -> set[str]:
    """Top-level names of every module a source file imports."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def violations(root: Path) -> list[str]:
    """Every import in ``root``'s packages that breaks the layer rule, as ``file: module``."""
    found = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            banned = set(forbidden)
            if package == "runtime" and "server" not in relative.parts and not path.stem.startswith("server"):
                banned |= SERVER_ONLY
            for module in sorted(imported_modules(path.read_text()) & banned):
                found.append(f"{relative}: imports {module}")
    return found


def test_repository_follows_the_layer_rule():
    assert violations(REPO) == []


def test_layer_check_catches_an_upward_import(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "bad.py").write_text("def f():\n    from pipeline.config import load_config\n")
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "bad.py").write_text("import engines.cache\n")
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "ok.py").write_text("from runtime.errors import KilnError\n")
    assert violations(tmp_path) == ["runtime/bad.py: imports pipeline", "calibration/bad.py: imports engines"]


def test_runtime_core_may_not_import_the_server_stack(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "llm.py").write_text("import fastapi\n")
    (tmp_path / "runtime" / "server").mkdir()
    (tmp_path / "runtime" / "server" / "app.py").write_text("import fastapi\n")
    assert violations(tmp_path) == ["runtime/llm.py: imports fastapi"]
