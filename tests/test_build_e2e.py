"""``kiln build`` end to end on the tiny bundled model, through the real CLI in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.engines.cache import engine_key
from kiln.engines.cache.layout import entry_path
from kiln.engines.cache.manifest import read_manifest
from tests.calibration_factories import quick_fp8_config
from tests.subprocess_env import REPO, repo_env

TINY = REPO / "models" / "tiny-llama"


def kiln_env(cache: Path, **extra: str) -> dict:
    """The environment of a ``python -m kiln`` subprocess using the cache at ``cache``."""
    return repo_env(KILN_CACHE=str(cache), **extra)


def kiln(*args: str, cache: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, cwd=REPO,
                          env=kiln_env(cache, **(env or {})), timeout=600)


def build_json(config: str, cache: Path, *extra: str) -> dict:
    proc = kiln("build", config, "--json", *extra, cache=cache)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kiln-cache")


@pytest.mark.slow
def test_dry_run_prints_plan_key_and_material_without_running(cache):
    proc = kiln("build", "configs/tiny-llama-fp8.yaml", "--dry-run", "--json", cache=cache)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert [s["name"] for s in plan["stages"]] == ["quantize", "build", "publish", "smoke"]
    assert all(s["action"] in ("run", "skip") and s["reason"] for s in plan["stages"])
    assert plan["engine_key"] == engine_key(plan["key_material"])  # the key is the hash of the material it prints
    assert plan["backend"] == "native"
    material = plan["key_material"]
    assert material["checkpoint"] and material["build"]["max_seq_len"] == 512
    assert material["hardware"]["device"] in ("cpu", "cuda")
    assert not (cache / "v1" / "entries").exists() or not any((cache / "v1" / "entries").iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tiny config builds for CUDA, whose settings apply")
def test_a_cuda_setting_on_a_cpu_build_is_refused_by_the_dry_run_before_anything_is_built(tmp_path):
    proc = kiln("build", "configs/tiny-llama-bf16.yaml", "--dry-run", cache=tmp_path / "cache",
                env={"KILN_GPU_MEMORY_UTILIZATION": "0.9"})
    assert proc.returncode == 2 and "gpu_memory_utilization=0.9: CUDA settings" in proc.stderr
    assert not (tmp_path / "cache" / "v1" / "entries").exists()


def test_a_dry_run_refuses_an_architecture_of_no_supported_family_naming_the_supported_ones(tmp_path):
    import shutil

    model = shutil.copytree(TINY, tmp_path / "gpt2")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "gpt2.yaml").write_text(f"model:\n  path: {model}\nquantize:\n  format: none\n")
    proc = kiln("build", str(tmp_path / "gpt2.yaml"), "--dry-run", cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert "'GPT2LMHeadModel' is not supported by the native backend (supported: LlamaForCausalLM, " \
           "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, Phi3ForCausalLM)" in proc.stderr


def test_the_plan_says_when_another_process_is_building_the_engine(tmp_path):
    from filelock import FileLock

    from kiln.engines.cache import EngineCache

    store = EngineCache.open(tmp_path / "cache").entries
    first = json.loads(kiln("build", "configs/tiny-llama-bf16.yaml", "--dry-run", "--json", cache=tmp_path / "cache")
                       .stdout)
    with FileLock(store.lock_path(first["engine_key"])):  # another builder of this key, mid-build
        proc = kiln("build", "configs/tiny-llama-bf16.yaml", "--dry-run", "--json", cache=tmp_path / "cache")
    reasons = {stage["name"]: stage["reason"] for stage in json.loads(proc.stdout)["stages"]}
    assert "another process is building it now: this build will wait and reuse it" in reasons["build"]
    assert "another process" not in {stage["name"]: stage["reason"] for stage in first["stages"]}["build"]


@pytest.mark.slow
def test_dry_run_works_without_model_files(tmp_path):
    config = tmp_path / "absent.yaml"
    config.write_text("model:\n  path: ./no-such-model\nquantize:\n  format: fp8\n")
    proc = kiln("build", str(config), "--dry-run", "--json", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["engine_key"] is None
    assert "not found" in plan["stages"][1]["reason"]


@pytest.mark.slow
def test_kiln_quantize_json_has_the_rounds_the_gate_and_a_stable_checkpoint_hash(cache):
    first = kiln("quantize", "configs/tiny-llama-fp8.yaml", "--json", cache=cache)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["action"] == "run" and report["format"] == "fp8"
    assert report["converged"] is True and report["fallback_from"] is None
    assert report["rounds"] and {"samples", "max_rel_change", "kl", "top1_agreement"} <= set(report["rounds"][0])
    assert {"passed", "ppl_increase", "kl", "top1_agreement"} <= set(report["gate"]) and report["gate"]["passed"]
    again = json.loads(kiln("quantize", "configs/tiny-llama-fp8.yaml", "--json", cache=cache).stdout)
    assert again["action"] == "skip" and again["checkpoint_hash"] == report["checkpoint_hash"]
    assert len(report["checkpoint_hash"]) == 64


@pytest.mark.slow
def test_a_checkpoint_the_chain_fell_back_to_is_listed_and_planned_under_its_own_format(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    config = tmp_path / "strict.yaml"
    config.write_text(f"model:\n  path: {TINY}\nquantize:\n  format: fp8\n  num_samples: 4\n  round_samples: 4\n"
                      "  on_failure: warn\n  seq_len: 32\n  heldout_samples: 4\n  gate:\n    max_kl: 0.0\n"
                      "  fallback: [none]\n")  # one small round: the gate, not the calibration, is what counts
    report = json.loads(kiln("quantize", str(config), "--json", cache=tmp_path / "cache").stdout)
    assert report["format"] == "none" and report["fallback_from"] == "fp8"
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    [entry] = json.loads(CliRunner().invoke(app, ["cache", "ls", "--json"]).stdout)
    assert entry["format"] == "none" and entry["backend"] is entry["gpu"] is None  # not an engine: null, not "-"
    plan = json.loads(CliRunner().invoke(app, ["build", str(config), "--dry-run", "--json"]).stdout)
    assert plan["stages"][0]["reason"].endswith("is in the cache (fell back from fp8)")


@pytest.mark.slow
def test_fp8_build_after_kiln_quantize_runs_every_later_stage_then_hits_the_cache(cache):
    """`kiln quantize` then `kiln build`, as a user who checks the calibration first: the build reuses the
    checkpoint the test above calibrated (one calibration for both tests: it is most of their time)."""
    first = build_json("configs/tiny-llama-fp8.yaml", cache)
    assert Path(first["engine_dir"]).is_absolute() and (Path(first["engine_dir"]) / "engine.json").is_file()
    assert first["cache"]["hit"] is False
    assert {s["name"]: s["action"] for s in first["stages"]} == {"quantize": "skip", "build": "run",
                                                                 "publish": "run", "smoke": "run"}
    assert first["quantization"]["format"] == "fp8" and first["quantization"]["gate"]["passed"]
    assert first["sample"]["tokens"] > 0 and first["load_ms"] > 0

    proc = kiln("build", "configs/tiny-llama-fp8.yaml", "--json", cache=cache)
    second = json.loads(proc.stdout)
    assert "build     skipped" in proc.stderr.splitlines() and "build     done" not in proc.stderr
    actions = {s["name"]: s["action"] for s in second["stages"]}
    assert actions == {"quantize": "skip", "build": "skip", "publish": "skip", "smoke": "run"}
    assert second["cache"] == {"hit": True, "reason": "hit"}
    assert second["engine_key"] == first["engine_key"] and second["load_ms"] > 0
    assert second["sample"]["text"] == first["sample"]["text"]
    # the calibration the checkpoint took counts as saved too, once: the engine's recorded build time includes it
    calibration = read_manifest(entry_path(cache, "quantized", first["quantized_key"]))["build_seconds"]
    assert second["build_seconds_saved"] == second["build_seconds"] == first["build_seconds"] > calibration > 0


@pytest.mark.slow
def test_bf16_engine_generates_what_transformers_generates(cache):
    from kiln.runtime import LLM, SamplingParams

    result = build_json("configs/tiny-llama-bf16.yaml", cache)
    assert {s["name"]: s["action"] for s in result["stages"]}["quantize"] == "skip"
    prompt = "Monday, Tuesday,"
    llm = LLM.load(result["engine_dir"])  # on the device it was built for
    try:
        ours = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0].token_ids
    finally:
        llm.close()
    assert ours == _transformers_greedy(prompt, 24, result["device"])


def _transformers_greedy(prompt: str, max_new_tokens: int, device: str) -> list[int]:
    """transformers' eager greedy tokens: float32 on the CPU, bf16 (the engine's dtype) on a GPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=dtype, attn_implementation="eager").to(device).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id)
    generated = out[0, ids.shape[1]:].tolist()
    eos = tokenizer.eos_token_id
    return generated[: generated.index(eos) + 1] if eos in generated else generated


@pytest.mark.slow
def test_missing_model_fails_fast_with_one_clear_line_and_writes_nothing(tmp_path):
    cache = tmp_path / "cache"
    proc = kiln("build", "llama3-8b-fp8.yaml", cache=cache, env={"HF_HOME": str(tmp_path / "hf"),
                                                                  "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "meta-llama/Meta-Llama-3-8B-Instruct" in proc.stderr and "not on disk" in proc.stderr
    assert not cache.exists()
    explain = kiln("cache", "explain", "llama3-8b-fp8.yaml", cache=cache, env={"HF_HOME": str(tmp_path / "hf"),
                                                                               "HF_HUB_OFFLINE": "1"})
    assert explain.returncode == 2 and "Traceback" not in explain.stderr
    assert "model files not found" in explain.stderr


@pytest.mark.slow
def test_config_errors_exit_non_zero_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: ../models/tiny-llama\nbuild:\n  max_batch_size: many\n")
    proc = kiln("build", str(bad), cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert "bad.yaml:4: build.max_batch_size" in proc.stderr and "Traceback" not in proc.stderr
    missing = kiln("build", "no-such-config.yaml", cache=tmp_path / "cache")
    assert missing.returncode == 2 and "config file not found" in missing.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_four_builds_started_together_build_once_and_three_hit(tmp_path):
    cache, config = tmp_path / "cache", quick_fp8_config(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-m", "kiln", "build", str(config), "--json"],
                              cwd=REPO, env=kiln_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert sorted(r["cache"]["hit"] for r in results) == [False, True, True, True]
    assert len({r["engine_key"] for r in results}) == 1 and len({r["engine_dir"] for r in results}) == 1
    stats = json.loads(kiln("cache", "stats", "--json", cache=cache).stdout)
    assert (stats["lookups"], stats["hits"], stats["misses"], stats["entries"]) == (4, 3, 1, 2)
    assert stats["load_ms"]["count"] == 4


@pytest.mark.slow
def test_an_engine_loaded_through_the_runtime_is_never_evicted(cache):
    from kiln.engines.cache import EngineCache, is_held
    from kiln.runtime import LLM

    result = build_json("configs/tiny-llama-fp8.yaml", cache)
    entry = Path(result["engine_dir"]).parent
    llm = LLM.load(result["engine_dir"])
    try:
        assert is_held(entry)
        report = EngineCache.open(cache, max_entries=1).evict()
        assert entry.is_dir() and (entry / "manifest.json").is_file(), report
    finally:
        llm.close()
    assert not is_held(entry)


@pytest.mark.slow
def test_cache_explain_names_the_fields_that_differ_from_the_nearest_entry(cache):
    build_json("configs/tiny-llama-fp8.yaml", cache)
    same = json.loads(kiln("cache", "explain", "configs/tiny-llama-fp8.yaml", "--json", cache=cache).stdout)
    assert same["nearest_key"] and same["differences"] == []
    other = json.loads(kiln("cache", "explain", "configs/tiny-llama-int4-awq.yaml", "--json", cache=cache).stdout)
    fields = {d["field"]: d for d in other["differences"]}
    assert fields["quantization.recipe.format"]["config"] == "int4_awq"
    assert "build.max_seq_len" not in fields


@pytest.mark.slow
def test_a_budget_too_small_to_converge_fails_naming_the_unsettled_quantizers(tmp_path):
    """Through the CLI: exit 4, no traceback, nothing cached (``on_failure: warn`` is tested in-process, in
    test_calibration_convergence)."""
    config = tmp_path / "small-budget.yaml"
    config.write_text(f"model:\n  path: {TINY}\nquantize:\n  format: fp8\n  num_samples: 24\n  round_samples: 8\n"
                      "  tolerance: 0.0001\nbuild:\n  max_input_len: 256\n  max_seq_len: 512\n")
    proc = kiln("build", str(config), cache=tmp_path / "cache")
    assert proc.returncode == 4 and "Traceback" not in proc.stderr
    assert "did not converge" in proc.stderr and "quantizer" in proc.stderr
    assert not list((tmp_path / "cache" / "v1" / "entries").glob("*/*"))


@pytest.mark.slow
def test_a_plan_the_model_cannot_hold_fails_before_any_stage_runs(tmp_path):
    config = tmp_path / "too-long.yaml"
    config.write_text(f"model:\n  path: {TINY}\nquantize:\n  format: fp8\nbuild:\n  max_seq_len: 4096\n")
    proc = kiln("build", str(config), cache=tmp_path / "cache")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "max_seq_len (4096) exceeds the model's max_position_embeddings (512)" in proc.stderr
    assert not (tmp_path / "cache").exists()
