"""``kiln build --backend trtllm --dry-run`` on a machine without TensorRT-LLM: the plan, and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.subprocess_env import REPO, repo_env


def kiln(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = repo_env(KILN_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)


def test_dry_run_shows_every_inflight_batching_prerequisite(tmp_path):
    proc = kiln("build", "llama3-8b-fp8.yaml", "--backend", "trtllm", "--dry-run", "--json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert "TensorRT-LLM 1.2.x is not installed: a build here is refused" in plan["backend_reason"]
    build = plan["stages"][1]
    argv = " ".join(build["command"])
    assert build["command"][0] == "trtllm-build"
    for flag in ("--kv_cache_type paged", "--remove_input_padding enable", "--gpt_attention_plugin auto",
                 "--use_paged_context_fmha enable", "--max_num_tokens 8192", "--tokens_per_block 32"):
        assert flag in argv


def test_paged_kv_cache_off_is_refused_before_building_naming_inflight_batching(tmp_path):
    config = tmp_path / "continuous.yaml"
    original = (REPO / "configs" / "llama3-8b-fp8.yaml").read_text()
    config.write_text(original.replace("  tokens_per_block: 32\n",
                                       "  tokens_per_block: 32\n  trtllm:\n    kv_cache_type: continuous\n"))
    proc = kiln("build", str(config), "--backend", "trtllm", "--dry-run", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert "in-flight batching" in proc.stderr and "Traceback" not in proc.stderr


def test_real_build_without_tensorrt_llm_says_how_to_install_it(tmp_path):
    proc = kiln("build", "tiny-llama-fp8.yaml", "--backend", "trtllm", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert "TensorRT-LLM" in proc.stderr and "1.2" in proc.stderr and "pip install" in proc.stderr
    assert not (tmp_path / "cache").exists()


def test_auto_backend_picks_native_here_and_says_why(tmp_path):
    proc = kiln("build", "llama3-8b-fp8.yaml", "--dry-run", "--json", tmp_path=tmp_path)
    plan = json.loads(proc.stdout)
    assert plan["backend"] == "native" and "not installed" in plan["backend_reason"]


def test_a_gate_that_falls_back_to_format_none_builds_without_the_fp8_kv_cache_it_cannot_scale():
    from types import SimpleNamespace

    from kiln.pipeline.config import KilnConfig
    from kiln.pipeline.stages import _kv_dtype, _shipped_kv_cache_dtype

    config = KilnConfig.model_validate({"model": {"path": "m"}, "quantize": {
        "format": "fp8", "kv_cache_dtype": "fp8", "fallback": ["none"]}})
    shipped_fp8 = SimpleNamespace(config=config, calibration={"format": "fp8"})
    fell_back = SimpleNamespace(config=config, calibration={"format": "none"})
    assert (_shipped_kv_cache_dtype(shipped_fp8), _kv_dtype(shipped_fp8)) == ("fp8", "fp8")
    assert (_shipped_kv_cache_dtype(fell_back), _kv_dtype(fell_back)) == ("auto", config.model.dtype)


def test_a_tensorrt_llm_engine_of_several_ranks_is_built_and_not_loaded(tmp_path):
    """Kiln's runtime loads TensorRT-LLM engines of one rank: a tp 2 one is built for trtllm-serve, its smoke load
    skipped in the plan (it had failed after the build; `kiln serve CONFIG` refuses it before building)."""
    config = tmp_path / "tp2.yaml"
    original = (REPO / "configs" / "tiny-llama-bf16.yaml").read_text()
    config.write_text(original.replace("../models/tiny-llama", str(REPO / "models" / "tiny-llama"))
                      .replace("build:\n", "build:\n  tp_size: 2\n"))
    proc = kiln("build", str(config), "--backend", "trtllm", "--dry-run", "--json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    smoke = json.loads(proc.stdout)["stages"][-1]
    assert smoke["name"] == "smoke" and smoke["action"] == "skip" and "trtllm-serve" in smoke["reason"]
