"""The installed distribution is one package, ``kiln``: every folder of Kiln's code is one of its subpackages."""

from __future__ import annotations

import tomllib

from tests.subprocess_env import REPO

LAYERS = ("runtime", "engines", "calibration", "pipeline")


def test_every_code_folder_is_a_listed_subpackage_of_kiln():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"kiln"} | {"kiln." + ".".join(init.parent.relative_to(REPO).parts)
                          for layer in LAYERS for init in (REPO / layer).rglob("__init__.py")}
    assert setuptools["package-dir"] == {"kiln": "."}
    assert sorted(setuptools["packages"]) == sorted(folders)


def test_bundled_configs_model_and_data_are_package_data():
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kiln"]
    shipped = {path.relative_to(REPO) for pattern in patterns for path in REPO.glob(pattern) if path.is_file()}
    for needed in ("configs/tiny-llama-fp8.yaml", "configs/models/llama3-8b.json",
                   "models/tiny-llama/model.safetensors", "models/tiny-llama/tokenizer.json",
                   "data/tiny/calibration.jsonl", "data/tiny/heldout.jsonl"):
        assert REPO / needed in {REPO / p for p in shipped}, needed
