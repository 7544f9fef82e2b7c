"""The trtllm-build subprocess path, exercised for real with the stand-in tests/fakes/trtllm-build."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from kiln.engines.cache import EngineCache, engine_key
from kiln.engines.trtllm.builder import build_trtllm_engine, plan_trtllm_build
from kiln.engines.trtllm.command import trtllm_build_command
from kiln.engines.trtllm.preflight import TrtllmPreflightError
from kiln.engines.trtllm.process import TrtllmBuildError
from kiln.pipeline.config import BuildSection
from kiln.pipeline.stages import trtllm_build_options
from kiln.runtime.plan import BuildPlan
from kiln.runtime.trtllm.engine_info import TrtllmEngineInfo, is_trtllm_engine
from tests.subprocess_env import repo_env

FAKE = Path(__file__).resolve().parent / "fakes" / "trtllm-build"
REPO = Path(__file__).resolve().parents[1]
H200 = {"device": "cuda", "gpu_name": "NVIDIA H200", "compute_capability": "9.0", "cuda": "12.9",
        "tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48"}
OPTIONS = trtllm_build_options(BuildSection(), BuildPlan(max_batch_size=8, max_input_len=256, max_seq_len=512,
                                                         max_num_tokens=512, tokens_per_block=32))


@pytest.fixture
def fake_trtllm_build(tmp_path: Path) -> str:
    """An executable that runs the stand-in with this interpreter (no reliance on file modes or PATH)."""
    wrapper = tmp_path / "bin" / "trtllm-build"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture
def checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    """An HF folder (config, generation config, tokenizer files) and a one-rank FP8 TensorRT-LLM checkpoint."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"vocab_size": 128, "eos_token_id": 2}))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (hf / "tokenizer.json").write_text("{}")
    (hf / "tokenizer_config.json").write_text("{}")
    trt = tmp_path / "trtllm"
    trt.mkdir()
    (trt / "config.json").write_text(json.dumps({
        "architecture": "LlamaForCausalLM", "dtype": "bfloat16", "max_position_embeddings": 8192,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    (trt / "rank0.safetensors").write_bytes(b"weights")
    return hf, trt


def build(out: Path, checkpoints, executable: str, tmp_path: Path, *, timeout_s: float = 60, env_extra=None,
          **kwargs) -> dict:
    hf, trt = checkpoints
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FAKE_TRTLLM_RECORD": str(tmp_path / "argv.json"), **(env_extra or {})}
    args = {"hf_dir": hf, "quant_format": "fp8", "kv_cache_dtype": "fp8", "model_dtype": "bfloat16",
            "timing_cache": tmp_path / "cache" / "v1" / "trtllm" / "timing.cache", "fingerprint": H200,
            "timeout_s": timeout_s, "trtllm_checkpoint_dir": trt, "executable": executable, "env": env, **kwargs}
    return build_trtllm_engine(out, OPTIONS, **args)


def test_a_build_writes_the_engine_records_the_subprocess_and_keeps_the_timing_cache(tmp_path, checkpoints,
                                                                                   fake_trtllm_build):
    out = tmp_path / "engine"
    record = build(out, checkpoints, fake_trtllm_build, tmp_path)
    expected = trtllm_build_command(checkpoints[1], out, OPTIONS, quant_format="fp8", kv_cache_dtype="fp8",
                                    timing_cache=tmp_path / "cache" / "v1" / "trtllm" / "timing.cache",
                                    executable=fake_trtllm_build)
    assert json.loads((tmp_path / "argv.json").read_text()) == expected[1:]
    assert record["build"]["argv"] == expected
    assert record["build"]["returncode"] == 0 and not record["build"]["timed_out"]
    assert "Total time of building all engines" in record["build"]["stdout_tail"]
    assert record["timing_cache"] == str(tmp_path / "cache" / "v1" / "trtllm" / "timing.cache")
    assert Path(record["timing_cache"]).read_bytes() == b"fake timing cache\n"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "kiln_trtllm.json",
                                                     "logs", "rank0.engine", "tokenizer.json", "tokenizer_config.json"]
    assert is_trtllm_engine(out)
    info = TrtllmEngineInfo.load(out)
    assert info.eos_token_ids == [2, 3] and info.vocab_size == 128
    assert info.fingerprint["tensorrt_llm"] == "1.2.1" and info.fingerprint["compute_capability"] == "9.0"
    assert info.plan.tokens_per_block == 32 and info.plan.kv_cache_dtype == "fp8" and info.build["argv"] == expected
    built = json.loads((out / "config.json").read_text())["build_config"]
    assert built["kv_cache_type"] == "paged" and built["plugin_config"]["use_fp8_context_fmha"] == "enable"


def test_a_failing_build_raises_with_the_stderr_tail_and_keeps_the_logs(tmp_path, checkpoints, fake_trtllm_build):
    with pytest.raises(TrtllmBuildError) as info:
        build(tmp_path / "engine", checkpoints, fake_trtllm_build, tmp_path, env_extra={"FAKE_TRTLLM_MODE": "fail"})
    message = str(info.value)
    assert "trtllm-build failed with exit status 1" in message
    assert "cudaMalloc: out of memory" in message
    assert info.value.record["returncode"] == 1
    kept = list((tmp_path / "cache" / "v1" / "trtllm" / "failed").glob("*-trtllm-build.stderr.log"))
    assert len(kept) == 1 and "RuntimeError" in kept[0].read_text()


def test_a_build_past_its_timeout_is_stopped_and_reported(tmp_path, checkpoints, fake_trtllm_build):
    start = time.monotonic()
    with pytest.raises(TrtllmBuildError) as info:
        build(tmp_path / "engine", checkpoints, fake_trtllm_build, tmp_path, timeout_s=1.5,
              env_extra={"FAKE_TRTLLM_MODE": "hang"})
    assert time.monotonic() - start < 15
    assert "did not finish within 2 s and was stopped; raise build.timeout_s" in str(info.value)
    assert info.value.record["timed_out"] is True


def test_a_build_that_exits_0_without_engines_is_an_error_naming_the_missing_rank(tmp_path, checkpoints,
                                                                                 fake_trtllm_build):
    with pytest.raises(TrtllmBuildError, match="did not write config.json, rank0.engine"):
        build(tmp_path / "engine", checkpoints, fake_trtllm_build, tmp_path,
              env_extra={"FAKE_TRTLLM_MODE": "no-engine"})


def test_a_missing_trtllm_build_says_how_to_install_it(tmp_path, checkpoints):
    with pytest.raises(TrtllmBuildError, match="could not be started .*install TensorRT-LLM 1.2.x"):
        build(tmp_path / "engine", checkpoints, str(tmp_path / "no" / "trtllm-build"), tmp_path)


def test_preflight_refuses_before_anything_runs(tmp_path, checkpoints, fake_trtllm_build):
    with pytest.raises(TrtllmPreflightError, match="needs compute capability 8.9"):
        build(tmp_path / "engine", checkpoints, fake_trtllm_build, tmp_path,
              fingerprint={**H200, "gpu_name": "NVIDIA A100", "compute_capability": "8.0"})
    assert not (tmp_path / "argv.json").exists()


def test_the_engine_is_published_into_the_cache_and_hits_afterwards(tmp_path, checkpoints, fake_trtllm_build):
    cache = EngineCache.open(tmp_path / "kiln-cache")
    material = {"backend": "trtllm", "toolchain": {"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48"}}
    key = engine_key(material)
    result = cache.entries.get_or_build(key, material, lambda tmp: build(tmp, checkpoints, fake_trtllm_build, tmp_path))
    assert not result.hit
    assert (result.payload_dir / "rank0.engine").is_file() and is_trtllm_engine(result.payload_dir)
    manifest = json.loads((result.entry_dir / "manifest.json").read_text())
    assert "rank0.engine" in json.dumps(manifest)
    assert cache.entries.lookup(key, material).hit


def test_format_none_converts_the_hf_checkpoint_first_with_the_tensorrt_llm_api(tmp_path, checkpoints,
                                                                              fake_trtllm_build):
    fake_pkg = _fake_tensorrt_llm_package(tmp_path / "fakepkg")
    env = repo_env(str(fake_pkg))
    out = tmp_path / "engine"
    record = build(out, checkpoints, fake_trtllm_build, tmp_path, quant_format="none", kv_cache_dtype="auto",
                   trtllm_checkpoint_dir=None, env_extra=env)
    convert = record["convert"]
    assert convert["returncode"] == 0
    assert convert["argv"][1:3] == ["-m", "kiln.engines.trtllm.convert"]
    assert "from_hugging_face dtype=bfloat16 rank=0/1" in convert["stdout_tail"]
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--checkpoint_dir") + 1] == str(out / ".kiln-scratch" / "checkpoint")
    assert argv[argv.index("--gemm_plugin") + 1] == "auto"
    assert not (out / ".kiln-scratch").exists()
    assert TrtllmEngineInfo.load(out).build["convert_argv"] == convert["argv"]


def test_the_dry_run_plan_shows_the_exact_argv_with_the_build_dir_named_at_build_time(tmp_path, checkpoints):
    hf, trt = checkpoints
    plan = plan_trtllm_build(OPTIONS, quant_format="fp8", kv_cache_dtype="fp8", model_dtype="bfloat16",
                             fingerprint=None, timing_cache=Path("/c/t.cache"), hf_dir=hf, trtllm_checkpoint_dir=trt)
    assert plan["command"] == trtllm_build_command(trt, Path("<build-dir>"), OPTIONS, quant_format="fp8",
                                                   kv_cache_dtype="fp8", timing_cache=Path("/c/t.cache"))
    assert plan["convert_command"] is None
    assert plan["preflight_warnings"] == [w for w in plan["preflight_warnings"] if "no GPU is visible" in w] != []
    none = plan_trtllm_build(OPTIONS, quant_format="none", kv_cache_dtype="auto", model_dtype="bfloat16",
                             fingerprint=None, timing_cache=Path("/c/t.cache"), hf_dir=hf, trtllm_checkpoint_dir=None)
    assert none["convert_command"][-6:] == ["--dtype", "bfloat16", "--tp_size", "1", "--pp_size", "1"]
    assert none["command"][none["command"].index("--checkpoint_dir") + 1] == "<build-dir>/.kiln-scratch/checkpoint"


FAKE_MAPPING = '''
class Mapping:
    def __init__(self, world_size=1, rank=0, tp_size=1, pp_size=1, cp_size=1, moe_tp_size=-1, moe_ep_size=-1):
        self.world_size, self.rank, self.tp_size, self.pp_size = world_size, rank, tp_size, pp_size
'''
FAKE_MODELS = '''
import json, pathlib
class LLaMAForCausalLM:
    @classmethod
    def from_hugging_face(cls, hf_model_or_dir, dtype="auto", mapping=None, quant_config=None, **kwargs):
        assert not kwargs, kwargs
        print(f"from_hugging_face dtype={dtype} rank={mapping.rank}/{mapping.world_size}", flush=True)
        model = cls()
        model.mapping = mapping
        return model
    def save_checkpoint(self, output_dir, save_config=True):
        out = pathlib.Path(output_dir)
        (out / f"rank{self.mapping.rank}.safetensors").write_bytes(b"w")
        if save_config:
            mapping = {"world_size": self.mapping.world_size, "tp_size": self.mapping.tp_size,
                       "pp_size": self.mapping.pp_size}
            (out / "config.json").write_text(json.dumps({"mapping": mapping}))
'''


def test_the_conversion_takes_the_rotary_settings_from_config_json_as_transformers_5_writes_them(tmp_path,
                                                                                                   monkeypatch):
    from kiln.engines.trtllm.convert import convert

    monkeypatch.syspath_prepend(str(_fake_tensorrt_llm_package(tmp_path / "fakepkg")))
    hf = tmp_path / "hf"
    hf.mkdir()
    rope = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    (hf / "config.json").write_text(json.dumps({"rope_parameters": rope}))  # no top-level rope_theta
    try:
        convert(hf, tmp_path / "out", "bfloat16", tp_size=1, pp_size=1)
    finally:  # the stand-in package leaves this process as it came
        for name in [name for name in sys.modules if name.partition(".")[0] == "tensorrt_llm"]:
            del sys.modules[name]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rotary_base"] == 500000.0 and config["mapping"]["tp_size"] == 1  # TensorRT-LLM's own would be 1e4
    assert config["rotary_scaling"] == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}


def _fake_tensorrt_llm_package(root: Path) -> Path:
    """A `tensorrt_llm` with only the recorded conversion API (Mapping, LLaMAForCausalLM), for the subprocess."""
    pkg = root / "tensorrt_llm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "1.2.1"\n')
    (pkg / "mapping.py").write_text(FAKE_MAPPING)
    (pkg / "models.py").write_text(FAKE_MODELS)
    return root


def test_an_unquantized_checkpoint_of_another_family_is_refused_and_a_missing_export_is_named(tmp_path, checkpoints):
    hf, trt = checkpoints
    (hf / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 128}))
    plan = dict(kv_cache_dtype="auto", model_dtype="bfloat16", fingerprint=None, timing_cache=Path("/c/t.cache"),
                hf_dir=hf)
    with pytest.raises(TrtllmBuildError, match="not Qwen3ForCausalLM; quantize it .* or use --backend native"):
        plan_trtllm_build(OPTIONS, quant_format="none", trtllm_checkpoint_dir=None, **plan)
    (trt / "config.json").unlink()  # modelopt wrote no TensorRT-LLM form (Phi-3)
    with pytest.raises(TrtllmBuildError, match="has no TensorRT-LLM form .* build it with --backend native"):
        build(tmp_path / "out", checkpoints, "trtllm-build", tmp_path)
