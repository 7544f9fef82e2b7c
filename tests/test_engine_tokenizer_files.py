"""An engine folder's tokenizer: part of one (a partial copy) is refused at the load, none at all serves token ids."""

from __future__ import annotations

import json
import logging
import re
import shutil
from types import SimpleNamespace

import pytest

from kiln.pipeline.serve_command import ServeTarget
from kiln.pipeline.stages import BuildStage
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.errors import EngineFormatError, InvalidRequestError, KilnError
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


def test_a_tokenizer_making_ids_past_the_models_vocabulary_refuses_those_prompts_and_the_engine_serves_on(
        tmp_path, caplog):
    from fastapi.testclient import TestClient

    from kiln.runtime.server import ServerSettings, create_app

    engine = shutil.copytree(tiny_engine(), tmp_path / "engine")  # the tiny model's vocabulary: 1,024 tokens
    tokenizer = json.loads((engine / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 1024, "content": "<x>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (engine / "tokenizer.json").write_text(json.dumps(tokenizer))
    refused = r"tokenizer makes token id 1024, outside the model's vocabulary \[0, 1024\): the tokenizer does not"
    with caplog.at_level(logging.WARNING, logger="kiln"), LLM.load(engine) as llm:
        assert "makes token ids up to 1024, outside the model's vocabulary of 1024" in caplog.text
        for prompt in ("hello <x> world", [5, 1024]):  # before: an IndexError in the embedding stopped the engine
            with pytest.raises(InvalidRequestError, match=refused):
                llm.generate(prompt, SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError, match=refused):
            llm.chat([{"role": "user", "content": "hi <x>"}], SamplingParams(max_tokens=2))
        with TestClient(create_app(llm, engine, ServerSettings(model_name="tiny"))) as http:
            answer = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi <x>", "max_tokens": 2})
        assert answer.status_code == 400 and re.search(refused, answer.json()["error"]["message"])
        assert llm.generate("hello world", SamplingParams(max_tokens=2))[0].token_ids
