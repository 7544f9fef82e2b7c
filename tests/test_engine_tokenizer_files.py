"""An engine folder's tokenizer: part of one (a partial copy) is refused at the load, none at all serves token ids."""

from __future__ import annotations

import logging
import shutil
from types import SimpleNamespace

import pytest

from kiln.pipeline.serve_command import ServeTarget
from kiln.pipeline.stages import BuildStage
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.errors import EngineFormatError, KilnError
from kiln.runtime.options import RuntimeOptions
from tests.test_server_support import tiny_engine


def test_a_build_whose_checkpoint_tokenizer_makes_no_tokenizer_json_is_refused_before_it_is_published(tmp_path):
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "out"
    checkpoint.mkdir()
    out.mkdir()
    (checkpoint / "tokenizer_config.json").write_text("{}")  # a slow tokenizer's, say, that transformers cannot load
    ctx = SimpleNamespace(quantized_key=None, checkpoint_dir=checkpoint, model_dir=checkpoint)

    def build(tmp):  # what the builders copy (runtime.tokenizer_files.copy_tokenizer_files)
        shutil.copyfile(checkpoint / "tokenizer_config.json", tmp / "tokenizer_config.json")
        return {}

    with pytest.raises(KilnError, match=r"tokenizer_config\.json but no tokenizer\.json.*save_pretrained"):
        BuildStage._holding_checkpoint(ctx, build)(out)


@pytest.mark.parametrize("kept", ["tokenizer_config.json", "chat_template.jinja"])
def test_an_engine_copied_without_its_tokenizer_json_is_refused_naming_it(tmp_path, kept):
    engine = shutil.copytree(tiny_engine(), tmp_path / "engine")
    (engine / "tokenizer.json").unlink()
    (engine / "tokenizer_config.json").unlink()
    (engine / kept).write_text("{}")
    with pytest.raises(EngineFormatError, match=rf"tokenizer\.json: missing.*\({kept}\).*incomplete copy"):
        LLM.load(engine)


def test_an_engine_without_any_tokenizer_loads_and_serve_warns_it_takes_token_ids_only(tmp_path, caplog):
    engine = shutil.copytree(tiny_engine(), tmp_path / "engine")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (engine / name).unlink()
    target = ServeTarget(engine_dir=engine, model_name="tiny")
    with caplog.at_level(logging.INFO, logger="kiln"):
        llm = target.loader(RuntimeOptions(), target.settings())()
    try:
        assert llm.tokenizer is None and llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    finally:
        llm.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(engine) in w and "only prompts of token ids can be served" in w for w in warnings)
