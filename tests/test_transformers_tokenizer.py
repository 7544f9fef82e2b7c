"""An engine's tokenizer.json is transformers' reading of the checkpoint's, so it tokenizes as transformers does."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from kiln.engines.native.builder import build_native_engine
from kiln.pipeline.tokenizer_files import write_transformers_tokenizer
from kiln.runtime.tokenizer import Tokenizer
from tests.model_factories import (
    make_hf_checkpoint,
    tiny_plan,
    write_gpt2_style_tokenizer,
    write_sentencepiece_style_tokenizer,
)

TEXTS = ["<|im_start|>user\nhi<|im_end|>", " leading space", "Hello world", "naïve 😀"]


@pytest.fixture(scope="module")
def llama_2_style(tmp_path_factory):
    """A tiny checkpoint with a Llama-2-style SentencePiece tokenizer.json (the legacy '▁' normalizer)."""
    checkpoint = make_hf_checkpoint(tmp_path_factory.mktemp("sp"), vocab_size=512, hidden_size=32, num_heads=2,
                                    num_kv_heads=1, num_layers=1)
    write_sentencepiece_style_tokenizer(checkpoint)
    return checkpoint


def copied_engine(checkpoint, tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    build_native_engine(checkpoint, engine, tiny_plan(), "float32")  # the builder copies the checkpoint's files
    return engine


def test_a_llama_2_style_tokenizer_is_rewritten_to_tokenize_as_transformers_does(llama_2_style, tmp_path):
    from transformers import AutoTokenizer

    engine = copied_engine(llama_2_style, tmp_path)
    assert Tokenizer.from_dir(engine).encode(" x") == Tokenizer.from_dir(llama_2_style).encode(" x")
    write_transformers_tokenizer(llama_2_style, engine)
    reference, rewritten = AutoTokenizer.from_pretrained(llama_2_style), Tokenizer.from_dir(engine)
    for text in TEXTS:
        assert rewritten.encode(text) == reference(text)["input_ids"], text
    assert rewritten.encode(" x") != Tokenizer.from_dir(llama_2_style).encode(" x")  # the file alone: '▁▁x'


def test_a_tokenizer_transformers_cannot_load_is_kept_as_the_checkpoint_has_it(llama_2_style, tmp_path, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise ValueError("this tokenizer needs trust_remote_code=True")

    engine = copied_engine(llama_2_style, tmp_path)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    write_transformers_tokenizer(llama_2_style, engine)
    assert (engine / "tokenizer.json").read_bytes() == (llama_2_style / "tokenizer.json").read_bytes()


def test_kiln_build_serves_the_transformers_tokenizer(llama_2_style, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from kiln.pipeline.cli import app

    model = shutil.copytree(llama_2_style, tmp_path / "model")
    config = tmp_path / "sp.yaml"
    config.write_text(f"model:\n  path: {model}\n  dtype: float32\nquantize:\n  format: none\nbuild:\n"
                      f"  max_seq_len: 128\n  max_input_len: 64\ncache:\n  dir: {tmp_path / 'cache'}\n")
    result = CliRunner().invoke(app, ["build", str(config), "--json"])
    assert result.exit_code == 0, result.output
    engine = Tokenizer.from_dir(json.loads(result.stdout[result.stdout.index("{"):])["engine_dir"])
    assert engine.encode(TEXTS[0]) == AutoTokenizer.from_pretrained(model)(TEXTS[0])["input_ids"]


@pytest.fixture(scope="module")
def gpt2_style(tmp_path_factory):
    """A tiny checkpoint whose tokenizer is vocab.json + merges.txt (GPT2Tokenizer), with no tokenizer.json."""
    checkpoint = make_hf_checkpoint(tmp_path_factory.mktemp("gpt2"), vocab_size=320, hidden_size=32, num_heads=2,
                                    num_kv_heads=1, num_layers=1)
    (checkpoint / "tokenizer.json").unlink()
    write_gpt2_style_tokenizer(checkpoint)
    return checkpoint


def build_config(model, tmp_path):
    config = tmp_path / "kiln.yaml"
    config.write_text(f"model:\n  path: {model}\n  dtype: float32\nquantize:\n  format: none\nbuild:\n"
                      f"  max_seq_len: 128\n  max_input_len: 64\ncache:\n  dir: {tmp_path / 'cache'}\n")
    return config


def test_kiln_build_makes_the_tokenizer_json_of_a_checkpoint_with_vocab_json_and_merges_txt(gpt2_style, tmp_path):
    from transformers import AutoTokenizer

    from kiln.pipeline.cli import app

    result = CliRunner().invoke(app, ["build", str(build_config(gpt2_style, tmp_path)), "--json"])
    assert result.exit_code == 0, result.output
    engine = Tokenizer.from_dir(json.loads(result.stdout[result.stdout.index("{"):])["engine_dir"])
    text = "Hello world, the lazy fox"
    assert engine.encode(text) == AutoTokenizer.from_pretrained(gpt2_style)(text)["input_ids"]


def test_vocab_json_and_merges_txt_transformers_makes_no_tokenizer_json_from_are_named_not_smoke_prompt(
        gpt2_style, tmp_path, monkeypatch):
    import transformers

    from kiln.pipeline.cli import app

    def refuse(*args, **kwargs):
        raise ValueError("this tokenizer needs trust_remote_code=True")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    result = CliRunner().invoke(app, ["build", str(build_config(gpt2_style, tmp_path)), "--dry-run", "--json"])
    assert result.exit_code == 2
    message = json.loads(result.stdout)["error"]["message"]
    assert message.startswith(f"{gpt2_style} has vocab.json and merges.txt but no tokenizer.json, and transformers "
                              "makes none from them (ValueError: this tokenizer needs trust_remote_code=True)")
    assert "smoke.prompt" not in message
