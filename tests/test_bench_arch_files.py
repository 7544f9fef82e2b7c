"""`kiln bench ARCH.json`: a bad or unsupported architecture file is refused in one line naming the file and the
field, before any random weights are written; the CPU-size refusal and the text header describe what would run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kiln.pipeline.bench import target
from kiln.pipeline.bench.command import bench
from kiln.pipeline.bench.report import print_report

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 128, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2}
DROP = object()  # an override that removes the field


def write_architecture(path: Path, **overrides: object) -> Path:
    arch = {key: value for key, value in {**TINY, **overrides}.items() if value is not DROP}
    path.write_text(json.dumps(arch))
    return path


def run_bench(arch: Path) -> tuple[int, str, str]:
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command()(bench)
    app.command("noop")(lambda: None)  # a second command keeps `bench` a subcommand, as under `kiln`
    result = CliRunner().invoke(app, ["bench", str(arch), "--prompts", "2", "--input-len", "8", "--output-len", "4",
                                      "--json"])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(("overrides", "named"), [
    ({"model_type": "foobar"}, "model_type"),
    ({"model_type": DROP}, "model_type"),
    ({"num_attention_heads": 3, "num_key_value_heads": DROP}, "attention heads (3)"),
    ({"rope_theta": "abc"}, "rope_theta"),
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),  # a family the native engine does not run
    ({"num_key_value_heads": 3}, "num_key_value_heads (3)"),  # 4 heads: the engine cannot group them
    ({"eos_token_id": 600}, "eos_token_id 600"),  # outside the vocabulary, named in the file itself
], ids=["unknown-model-type", "no-model-type", "heads-not-dividing-hidden", "rope-theta-string", "gpt2",
        "kv-heads-not-dividing", "eos-outside-the-vocabulary"])
def test_a_bad_architecture_file_is_refused_naming_it_before_random_weights_are_written(tmp_path, monkeypatch,
                                                                                       overrides, named):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE", str(cache))
    arch = write_architecture(tmp_path / "arch.json", **overrides)
    code, out, err = run_bench(arch)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and str(arch) in lines[0] and named in lines[0], err
    assert named in json.loads(out)["error"]["message"]
    assert not (cache / "v1" / "checkpoints").exists()  # before: the random checkpoint was written, then refused


def test_a_large_random_quantized_architecture_on_a_cpu_is_refused_by_its_fp8_size(tmp_path, monkeypatch):
    monkeypatch.setattr(target, "CPU_MAX_PARAMS", 0)  # the tiny architecture stands in for a large one
    arch = write_architecture(tmp_path / "arch.json", vocab_size=2**17)  # 16.8M bf16 parameters in embedding + head
    cfg = target.read_architecture_file(arch)
    with pytest.raises(target.BenchTargetError, match="of random FP8 weights") as fp8:
        target.check_fits_machine(arch, cfg, cuda=False, allow_large=False, fp8=True)
    assert "bf16 weights" not in str(fp8.value)
    with pytest.raises(target.BenchTargetError, match="of random bf16 weights"):
        target.check_fits_machine(arch, cfg, cuda=False, allow_large=False)


def report(*, batch_1_only: bool) -> dict:
    """A bench report with what ``print_report`` reads."""
    kiln = {"quantization": "bfloat16, unquantized", "output_tokens_per_s": None if batch_1_only else 50.0,
            "decode_tokens_per_s_batch1": 10.0, "ttft_ms": 5.0, "load_ms": 100.0, "engine_key": "ab" * 32,
            "cache_hit": True}
    floor = {"bytes_per_step": 10**6, "bandwidth_gbs": 100.0, "bandwidth_source": "measured", "tp_size": 1}
    return {"kiln": kiln, "peer": None, "speedups": {}, "floor": floor, "floor_tokens_per_s_batch1": 100.0,
            "floor_fraction_batch1": 0.1, "target": "arch.json", "gpu": None, "tp_size": 1, "cpu_threads": 2,
            "prompts": 64, "input_len": 8, "output_len": 4, "batch_1_only": batch_1_only, "config": "bench.yaml"}


def test_the_text_header_of_a_batch_1_run_describes_single_requests_not_the_offline_prompts(capsys):
    print_report(report(batch_1_only=True))
    header = capsys.readouterr().out.splitlines()[0]
    assert "batch-1 only (no offline run): one request at a time, prompts of 8 tokens" in header
    assert "64 prompts" not in header
    print_report(report(batch_1_only=False))
    assert "64 prompts of 8 tokens, 4 new tokens each" in capsys.readouterr().out.splitlines()[0]
