"""A model folder's chat template or generation config, edited, builds a new engine from the cached quantized
checkpoint, never a new calibration, and that engine serves the new files; an edit of what calibration reads (a
weight, the tokenizer) recalibrates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kiln.pipeline import runner
from kiln.runtime.chat_template import ChatTemplate
from kiln.runtime.options import RuntimeOptions
from tests.calibration_factories import TINY_MODEL, quick_fp8_config

NEW_TEMPLATE = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def model(tmp_path: Path, monkeypatch) -> Path:
    """A copy of the tiny model to edit, built into a cache of its own."""
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KILN_CACHE_REMOTE", "")
    return shutil.copytree(TINY_MODEL, tmp_path / "model")


@pytest.fixture
def calibrations(monkeypatch) -> list[Path]:
    """The model folders calibrated, one per call of the quantize stage's calibration."""
    from kiln.calibration import quantize

    calls: list[Path] = []
    calibrate = quantize.quantize_checkpoint

    def counted(model_dir: Path, *args, **kwargs) -> dict:
        calls.append(model_dir)
        return calibrate(model_dir, *args, **kwargs)

    monkeypatch.setattr(quantize, "quantize_checkpoint", counted)
    return calls


def prepare(config: Path, *, dry_run: bool = False) -> runner.BuildContext:
    return runner.prepare(config, backend="native", force=False, dry_run=dry_run, options=RuntimeOptions())


def build(config: Path) -> runner.BuildContext:
    ctx = prepare(config)
    runner.run(ctx, runner.decide(ctx, smoke=False))
    return ctx


def edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=2))


def test_a_template_and_generation_config_edit_builds_an_engine_that_serves_them_without_recalibrating(
        model, tmp_path, calibrations):
    config = quick_fp8_config(tmp_path, **{str(TINY_MODEL): str(model)})
    first = build(config)
    assert len(calibrations) == 1
    edit_json(model / "tokenizer_config.json", chat_template=NEW_TEMPLATE)
    edit_json(model / "generation_config.json", eos_token_id=[1, 2])

    second = build(config)
    assert len(calibrations) == 1  # the cached quantized checkpoint built the new engine
    assert second.quantized_key == first.quantized_key and second.engine_key != first.engine_key
    assert ChatTemplate.from_dir(second.engine_dir).render(MESSAGES) == "<<user>>hi"
    assert json.loads((second.engine_dir / "generation_config.json").read_text())["eos_token_id"] == [1, 2]
    engine = json.loads((second.engine_dir / "engine.json").read_text())
    assert engine["architecture"]["eos_token_ids"] == [1, 2]  # the new generation config's, not the checkpoint's
    assert ChatTemplate.from_dir(first.engine_dir).render(MESSAGES) != "<<user>>hi"  # the first engine is kept

    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"]["add_prefix_space"] = True  # the calibration text tokenizes otherwise
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    third = build(config)
    assert len(calibrations) == 2 and third.quantized_key != first.quantized_key


def test_only_what_calibration_reads_keys_the_quantized_checkpoint_and_everything_keys_the_engine(model, tmp_path):
    config = quick_fp8_config(tmp_path, **{str(TINY_MODEL): str(model)})
    base = prepare(config, dry_run=True)
    quantized_keys, engine_keys = {base.quantized_key}, {base.engine_key}

    def keys_after(edit) -> str:
        """The quantized key after ``edit``, which must give another engine key: every file keys the engine."""
        edit()
        ctx = prepare(config, dry_run=True)
        assert ctx.engine_key not in engine_keys
        engine_keys.add(ctx.engine_key)
        return ctx.quantized_key

    templates = model / "additional_chat_templates"
    template_edits = [lambda: (model / "chat_template.jinja").write_text(NEW_TEMPLATE),
                      lambda: templates.mkdir() or (templates / "tool_use.jinja").write_text(NEW_TEMPLATE),
                      lambda: (model / "chat_template.json").write_text(json.dumps({"chat_template": NEW_TEMPLATE})),
                      lambda: edit_json(model / "tokenizer_config.json", chat_template=NEW_TEMPLATE),
                      lambda: edit_json(model / "generation_config.json", temperature=0.6)]
    for edit in template_edits:
        assert keys_after(edit) == base.quantized_key

    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    calibrated_edits = [lambda: edit_json(model / "tokenizer_config.json", add_bos_token=True),
                        lambda: weights.write_bytes(bytes(data))]
    for edit in calibrated_edits:
        quantized = keys_after(edit)
        assert quantized not in quantized_keys
        quantized_keys.add(quantized)
