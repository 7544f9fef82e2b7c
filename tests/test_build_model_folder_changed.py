"""A model folder that changes while what it keys is built: nothing is cached under the key of the folder as it was
(a chat template edited mid-build would be served for the original folder's key, to a remote cache's peers too)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from kiln.engines.cache import EngineCache
from kiln.pipeline import runner, stages
from kiln.pipeline.key_material import checkpoint_state
from kiln.runtime.errors import KilnError
from kiln.runtime.options import RuntimeOptions
from tests.calibration_factories import TINY_MODEL, quick_fp8_config

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture
def model(tmp_path: Path, monkeypatch) -> Path:
    """A copy of the tiny model to edit, built into a cache of its own."""
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KILN_CACHE_REMOTE", "")
    return shutil.copytree(TINY_MODEL, tmp_path / "model")


def plan(config: Path) -> tuple[runner.BuildContext, runner.Plan]:
    ctx = runner.prepare(config, backend=None, force=False, dry_run=False, options=RuntimeOptions())
    return ctx, runner.decide(ctx, smoke=False)


def test_an_engine_whose_model_folder_changed_mid_build_is_refused_and_nothing_is_cached(model, tmp_path,
                                                                                         monkeypatch):
    config = tmp_path / "none.yaml"
    config.write_text(f"model:\n  path: {model}\n  dtype: float32\nquantize:\n  format: none\nbuild:\n"
                      f"  device: cpu\n  max_seq_len: 64\n  max_input_len: 32\n")
    copy_tokenizer = stages.write_transformers_tokenizer

    def edited_meanwhile(checkpoint: Path, engine: Path) -> None:
        (model / "chat_template.jinja").write_text(TEMPLATE)  # as a user might while the engine builds
        copy_tokenizer(checkpoint, engine)

    monkeypatch.setattr(stages, "write_transformers_tokenizer", edited_meanwhile)
    ctx, decisions = plan(config)
    with pytest.raises(KilnError, match=rf"^the model folder {re.escape(str(model))} changed while the engine was "
                                        r"built \(chat_template\.jinja\): nothing was cached; build again$"):
        runner.run(ctx, decisions)
    cache = EngineCache.open_configured(tmp_path / "cache")
    assert cache.entries.list_keys() == [] and list((cache.entries.v1 / "tmp").iterdir()) == []


def test_a_quantized_checkpoint_whose_model_folder_changed_mid_calibration_is_refused(model, tmp_path, monkeypatch):
    def calibrated_meanwhile(model_dir: Path, recipe, out: Path, **_) -> dict:
        (model_dir / "generation_config.json").write_text('{"temperature": 0.1}')
        (out / "calibration_report.json").write_text("{}")
        return {"format": "fp8", "kv_cache_dtype": "fp8"}

    monkeypatch.setattr("kiln.calibration.quantize.quantize_checkpoint", calibrated_meanwhile)
    ctx = runner.prepare(quick_fp8_config(tmp_path, **{str(TINY_MODEL): str(model)}), backend=None, force=False,
                         dry_run=False, options=RuntimeOptions())
    with pytest.raises(KilnError, match=r"changed while the quantized checkpoint was built "
                                        r"\(generation_config\.json\): nothing was cached"):
        runner.quantize_only(ctx)
    cache = EngineCache.open_configured(tmp_path / "cache")
    assert cache.quantized.list_keys() == [] and list((cache.quantized.v1 / "tmp").iterdir()) == []


def test_a_model_folder_is_changed_by_a_file_rewritten_even_to_its_bytes_added_or_removed(model):
    state = checkpoint_state(model)
    assert state.changed_files() == []
    shutil.copyfile(model / "tokenizer.json", model / "tokenizer.json.new")  # an edit undone, saved as editors do
    os.replace(model / "tokenizer.json.new", model / "tokenizer.json")
    (model / "chat_template.jinja").write_text(TEMPLATE)
    (model / "generation_config.json").unlink()
    assert state.changed_files() == ["chat_template.jinja", "generation_config.json", "tokenizer.json"]
