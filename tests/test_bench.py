"""`kiln bench`: Kiln against transformers and the bandwidth floor, on the tiny config and tiny random architectures."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import typer
from typer.testing import CliRunner

from kiln.engines.cache import EngineCache
from kiln.engines.cache.inspect import ls_entries
from kiln.pipeline.bench.command import bench
from kiln.pipeline.bench.floor import decode_step_bytes, known_bandwidth, tensor_bytes
from kiln.pipeline.config import load_config
from kiln.pipeline.targets import Target
from kiln.runtime import LLM, SamplingParams

FIGURES = ("output_tokens_per_s", "decode_tokens_per_s_batch1", "ttft_ms", "load_ms")
SMALL = ["--prompts", "4", "--input-len", "16", "--output-len", "6"]


def cli() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command()(bench)
    app.command("noop")(lambda: None)  # a second command keeps `bench` a subcommand, as under `kiln`
    return app


def run_bench(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli(), ["bench", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def bench_json(*args: str) -> dict:
    code, out, err = run_bench(*args, "--json")
    assert code == 0, err
    return json.loads(out)


def write_architecture(path: Path, **overrides) -> Path:
    arch = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", **overrides}
    path.write_text(json.dumps(arch))
    return path


@pytest.fixture(autouse=True)
def kiln_cache(tmp_path_factory, monkeypatch) -> Path:
    cache = tmp_path_factory.getbasetemp() / "bench-cache"  # shared by the module's tests: builds are cache hits
    monkeypatch.setenv("KILN_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def config_report(tmp_path_factory) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE", str(tmp_path_factory.getbasetemp() / "bench-cache"))
        return bench_json("tiny-llama-bf16.yaml", *SMALL, "--peer", "transformers", "--bandwidth-gbs", "20")


def test_json_reports_positive_kiln_and_peer_figures(config_report):
    for side in ("kiln", "peer"):
        for key in FIGURES:
            assert config_report[side][key] > 0, (side, key)
    assert config_report["kiln"]["output_tokens"] == config_report["peer"]["output_tokens"] == 4 * 6
    run = config_report["run"]  # what produced the figures, to read them next to
    assert run["torch"] and run["transformers"] and run["python"] and run["started_at"] and run["host"]
    assert run["command"].startswith("kiln") and "checkout" in run and "kiln" in run
    engine = config_report["kiln"]["offline_engine"]  # 4 prompts of 6 tokens: a prefill, then 5 decode steps at least
    assert engine["steps"] >= 6 and engine["preemptions"] == 0
    # each step's execute time is part of its wall time, so the medians are ordered too (no timing race)
    assert 0 < engine["last_steps_execute_ms_p50"] <= engine["last_steps_ms_p50"]
    assert engine["last_steps_batch_size_p50"] == 4  # the offline run's steps, none of the batch-1 phases'
    by_kind = engine["by_kind"]
    assert sum(k["steps"] for k in by_kind.values()) == engine["steps"] and by_kind["decode"]["steps"] >= 5
    assert all(0 < k["execute_s"] <= k["s"] for k in by_kind.values() if k["steps"]), by_kind
    on_gpu = config_report["device"] == "cuda"  # the peer runs bf16 on a GPU, fp32 on the CPU
    assert config_report["peer"]["dtype"] == ("bfloat16" if on_gpu else "float32")

    assert config_report["peer"]["attn_implementation"] == "sdpa"
    assert config_report["config"].endswith("configs/tiny-llama-bf16.yaml") and config_report["target_kind"] == "config"
    assert config_report["device"] in ("cpu", "cuda") and (config_report["gpu"] is not None) == on_gpu
    assert (config_report["prompts"], config_report["input_len"], config_report["output_len"]) == (4, 16, 6)

def test_json_reports_the_kv_pool_the_engine_allocated(config_report):
    pool = config_report["kiln"]["kv_pool"]
    blocks_per_seq = -(-512 // 16)  # tiny-llama-bf16.yaml: max_seq_len 512 in blocks of 16 tokens
    assert pool["tokens"] == 16 * pool["blocks"] and pool["full_length_sequences"] == pool["blocks"] // blocks_per_seq
    assert pool["max_batch_size"] == 8 and pool["full_length_sequences"] >= 1
    assert pool["bytes"] == pool["blocks"] * 2 * 4 * 16 * 2 * 32 * 2  # K and V, layers, tokens, KV heads, dims, bf16


def test_speedup_vs_peer_is_kiln_throughput_over_peer_throughput(config_report):
    kiln, peer = config_report["kiln"], config_report["peer"]
    assert config_report["speedup_basis"] == "output_tokens_per_s"
    assert config_report["speedup_vs_peer"] == pytest.approx(kiln["output_tokens_per_s"] / peer["output_tokens_per_s"],
                                                             rel=1e-3)
    assert config_report["speedups"]["ttft_ms"] == pytest.approx(peer["ttft_ms"] / kiln["ttft_ms"], rel=1e-3)


def test_floor_fraction_is_computed_from_the_stated_bandwidth(config_report):
    floor = config_report["floor"]
    assert floor["bandwidth_gbs"] == 20 and floor["bandwidth_source"] == "--bandwidth-gbs"
    engine_dir = Path(config_report["kiln"]["engine_dir"])
    sizes = tensor_bytes(engine_dir / "rank0.safetensors")
    assert floor["weight_bytes"] == sum(sizes.values()) - sizes["embed_tokens.weight"]
    # tiny Llama: 4 layers, 2 KV heads of 32, bf16 KV; mean decode context 16 + 6 / 2
    assert floor["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 2 and floor["mean_context_len"] == 19
    expected_floor = 20e9 / (floor["weight_bytes"] + floor["kv_bytes_per_token"] * 19)
    assert config_report["floor_tokens_per_s_batch1"] == pytest.approx(expected_floor, rel=1e-4)
    assert config_report["floor_fraction_batch1"] == pytest.approx(  # reported to 4 decimals
        config_report["kiln"]["decode_tokens_per_s_batch1"] / expected_floor, abs=5.01e-5)


def test_architecture_file_is_benchmarked_with_random_weights_and_cached(tmp_path, kiln_cache):
    arch = write_architecture(tmp_path / "tiny-arch.json")
    first = bench_json(str(arch), *SMALL, "--batch-1", "--peer", "transformers", "--bandwidth-gbs", "10")
    assert first["target_kind"] == "architecture" and first["batch_1_only"]
    assert Path(first["config"]).is_relative_to(kiln_cache / "bench")
    assert "random bf16 weights (seed 0)" in first["kiln"]["quantization"]
    assert first["kiln"]["output_tokens_per_s"] is None and first["peer"]["output_tokens_per_s"] is None
    assert {first["kiln"][key] for key in ("output_tokens", "offline_s", "offline_engine")} == {None}  # kept, null
    assert first["speedup_basis"] == "decode_tokens_per_s_batch1"
    assert first["speedup_vs_peer"] == pytest.approx(
        first["kiln"]["decode_tokens_per_s_batch1"] / first["peer"]["decode_tokens_per_s_batch1"], rel=1e-3)
    assert first["floor"]["embedding_bytes_excluded"] == 512 * 128 * 2
    again = bench_json(str(arch), *SMALL, "--batch-1", "--bandwidth-gbs", "10")
    assert again["kiln"]["cache_hit"] and again["kiln"]["engine_key"] == first["kiln"]["engine_key"]
    rows = ls_entries(EngineCache.open_configured(kiln_cache))  # the random weights are a cache entry of their own
    assert sorted((r["store"], r["format"]) for r in rows if r["model"] == "tiny-arch") == [
        ("checkpoints", "bf16 random"), ("entries", "none")]
    assert again["peer"] is None and again["speedup_vs_peer"] is None
    with LLM.load(Path(first["kiln"]["engine_dir"])) as llm:  # byte tokens: structured output runs on random weights
        output = llm.generate([[5, 6]], SamplingParams(max_tokens=8, structured_output={"choice": ["yes", "no"]}))[0]
    assert output.text in ("yes", "no") and output.finish_reason == "stop"


def test_lengths_an_architecture_cannot_hold_are_refused_before_its_random_weights_are_written(tmp_path, kiln_cache):
    arch = write_architecture(tmp_path / "tiny-arch.json")  # 256 positions
    checkpoints = kiln_cache / "v1" / "checkpoints"
    before = set(checkpoints.rglob("*")) if checkpoints.exists() else set()  # the module's other tests write some
    code, _, err = run_bench(str(arch), "--prompts", "2", "--input-len", "250", "--output-len", "100", "--seed", "7")
    assert code == 2 and "max_position_embeddings (256)" in err and "writing" not in err
    assert (set(checkpoints.rglob("*")) if checkpoints.exists() else set()) == before


@pytest.mark.slow
def test_fp8_architecture_builds_from_a_modelopt_max_calibrated_checkpoint(tmp_path):
    arch = write_architecture(tmp_path / "tiny-fp8.json", tie_word_embeddings=True)
    report = bench_json(str(arch), *SMALL, "--batch-1", "--format", "fp8", "--bandwidth-gbs", "10")
    assert report["kiln"]["quantization"].startswith("fp8") and "modelopt (max)" in report["kiln"]["quantization"]
    assert "one round, no accuracy gate" in report["kiln"]["quantization"]
    config = load_config(report["config"]).config  # generated from the config model, quantized by the pipeline
    assert (config.quantize.dataset, config.quantize.gate, config.quantize.format) == ("random", None, "fp8")
    step = decode_step_bytes(Path(report["kiln"]["engine_dir"]), 16, 6)
    assert step["embedding_bytes_excluded"] == 0  # tied: the embedding is the LM head, streamed every step
    fp8_kv = bench_json(str(arch), *SMALL, "--batch-1", "--format", "fp8", "--kv-cache-dtype", "fp8",
                        "--bandwidth-gbs", "10")
    assert "with an FP8 KV cache" in fp8_kv["kiln"]["quantization"]
    assert fp8_kv["kiln"]["engine_key"] != report["kiln"]["engine_key"]
    assert fp8_kv["floor"]["kv_bytes_per_token"] * 2 == report["floor"]["kv_bytes_per_token"]  # 1 byte, not 2


@pytest.mark.slow
def test_int4_architecture_builds_from_a_modelopt_awq_checkpoint(tmp_path):
    arch = write_architecture(tmp_path / "tiny-int4.json")  # 128 and 256 input features: whole INT4 blocks
    report = bench_json(str(arch), *SMALL, "--batch-1", "--format", "int4_awq", "--bandwidth-gbs", "10")
    assert report["kiln"]["quantization"].startswith("int4_awq") and "(awq_lite)" in report["kiln"]["quantization"]
    engine = json.loads((Path(report["kiln"]["engine_dir"]) / "engine.json").read_text())
    assert engine["quantization"]["format"] == "int4_awq" and engine["quantization"]["group_size"] == 128
    assert report["kiln"]["decode_tokens_per_s_batch1"] > 0


def test_human_output_is_a_table_with_the_peer_ratio_and_the_floor(config_report, capsys):
    from kiln.pipeline.bench.report import print_report

    print_report(config_report)
    out = capsys.readouterr().out
    assert "kiln advantage" in out and "batch-1 decode tokens/s" in out and "floor:" in out
    assert f"{config_report['floor_fraction_batch1']:.1%}" in out
    assert config_report["tp_size"] == 1 and f"on CPU, {config_report['cpu_threads']} torch threads:" in out


def test_human_output_names_the_tensor_parallel_ranks_and_whose_bytes_the_floor_counts(config_report, capsys):
    from kiln.pipeline.bench.report import print_report

    tp2 = {**config_report, "tp_size": 2, "floor": {**config_report["floor"], "tp_size": 2, "ranks_counted": 2}}
    print_report(tp2)
    print_report({**tp2, "gpu": "NVIDIA H100 80GB HBM3", "floor": {**tp2["floor"], "ranks_counted": 1}})
    out = capsys.readouterr().out
    assert f"on CPU, 2 ranks x {config_report['cpu_threads']} torch threads:" in out
    assert "MB per step of all 2 ranks at" in out
    assert "on NVIDIA H100 80GB HBM3, tp 2:" in out and "MB per step per rank at" in out


@pytest.mark.parametrize("target", ["no-such-config.yaml", "README.md"])
def test_bad_target_gives_one_line_and_exit_2(target):
    code, out, err = run_bench(target, "--json")
    assert code == 2 and json.loads(out)["error"]["message"] in err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_a_seed_torch_cannot_take_is_refused_before_any_work(monkeypatch):
    import kiln.pipeline.bench.run

    monkeypatch.setattr(kiln.pipeline.bench.run, "run_bench", lambda *a, **k: pytest.fail("the bench ran"))
    code, _, err = run_bench("configs/models/llama3-8b.json", "--seed", str(2**64))
    assert code == 2 and "--seed" in err and "18446744073709551614" in err, err


def test_file_without_architectures_is_refused(tmp_path):
    (tmp_path / "x.json").write_text('{"hidden_size": 8}')
    code, _, err = run_bench(str(tmp_path / "x.json"))
    assert code == 2 and "no 'architectures' entry" in err


def test_config_too_short_for_the_run_is_refused_naming_the_field():
    code, _, err = run_bench("tiny-llama-bf16.yaml", "--input-len", "300")
    assert code == 2 and "build.max_input_len (256)" in err


def test_8b_architecture_is_refused_on_a_cpu_only_machine(monkeypatch, kiln_cache):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_bench("configs/models/llama3-8b.json")
    assert code == 2 and "8.0B parameters is too big" in err and "--allow-large" in err
    assert "llama3-8b" not in {row["model"] for row in ls_entries(EngineCache.open_configured(kiln_cache))}


def test_known_bandwidth_is_each_form_factors_own_and_says_whether_it_was_measured():
    gbs = {name: known_bandwidth(name) for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
                                                    "NVIDIA H100 NVL", "NVIDIA H200 NVL")}
    assert [b.gbs for b in gbs.values()] == [4300, 3350, 2000, 3900, 4800]
    assert gbs["NVIDIA H200"].source.startswith("measured device-to-device copy rate of an H200")
    assert all(b.source.startswith("datasheet peak") for name, b in gbs.items() if name != "NVIDIA H200")
    assert known_bandwidth("NVIDIA GH200 480GB") is None and known_bandwidth("NVIDIA A10G") is None  # measured


def test_fp8_kv_cache_without_fp8_weights_is_a_usage_error():
    code, out, err = run_bench("configs/models/llama3-8b.json", "--kv-cache-dtype", "fp8")
    assert code == 2 and out == "" and "--kv-cache-dtype fp8 needs --format fp8 or int4_awq" in err
    code, out, err = run_bench("tiny-llama-fp8.yaml", "--kv-cache-dtype", "fp8")  # a config sets its own
    assert code == 2 and "a config's quantize.kv_cache_dtype sets its own, so leave the flag out" in " ".join(
        err.replace("│", "").split())


def test_unknown_peer_is_a_usage_error():
    code, out, err = run_bench("tiny-llama-bf16.yaml", "--peer", "vllm")
    assert code == 2 and out == "" and "'vllm' is not one of 'transformers'" in " ".join(err.replace("│", "").split())
    code, out, err = run_bench("tiny-llama-bf16.yaml", "--peer-attn", "eager")  # no peer to give it to
    assert code == 2 and out == "" and "--peer-attn sets the peer's attention: it needs --peer" in err


def test_a_suite_refuses_the_workload_options_it_would_not_honour():
    for given, named in ((["--prompts", "5"], "--prompts"), (["--output-len", "9", "--batch-1"],
                                                             "--output-len, --batch-1"),
                         (["--bandwidth-gbs", "1000"], "--bandwidth-gbs")):
        code, out, err = run_bench("tiny-llama-bf16.yaml", "--suite", "trtllm-h200", *given)
        assert code == 2 and out == "", err
        message = " ".join(err.replace("│", " ").split())  # unwrapped from the error box
        assert f"{named}: a --suite row sets its own requests and lengths" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_a_suite_measured_on_a_gpu_is_refused_on_the_cpu_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    code, out, err = run_bench("tiny-llama-bf16.yaml", "--suite", "trtllm-h200")
    message = " ".join(err.replace("│", " ").split())
    assert code == 2 and "--suite trtllm-h200: its figures were measured on cuda" in message, err
    assert not (tmp_path / "cache").exists()


def test_a_suite_runs_each_row_offline_and_sets_it_against_its_published_figure(monkeypatch):
    from kiln.pipeline.bench import suite

    tiny = suite.Suite("tiny", "made up for the test", "a few", (suite.SuiteRow(16, 6, 4, 2, 100.0, "v9"),
                                                                 suite.SuiteRow(8, 4, 3, 2, 50.0, "v8")),
                       runtime={"scheduler_policy": "guaranteed_no_evict"})
    monkeypatch.setitem(suite.SUITES, "tiny", tiny)
    report = bench_json("tiny-llama-bf16.yaml", "--suite", "tiny")
    assert [row["row"] for row in report["rows"]] == ["16/6", "8/4"] and report["suite"] == "tiny"
    assert report["runtime"] == {"scheduler_policy": "guaranteed_no_evict"}  # the suite's, where the user set none
    for row, expected in zip(report["rows"], tiny.rows, strict=True):
        assert row["kiln_tokens_per_s"] > 0 and row["prompts"] == expected.prompts
        assert row["ratio"] == pytest.approx(row["kiln_tokens_per_s"] / expected.published_tokens_per_s, abs=1e-4)
        assert row["offline_engine"]["steps"] >= expected.output_len and row["kv_pool"]["tokens"] > 0
    monkeypatch.setenv("KILN_SCHEDULER_POLICY", "max_utilization")
    code, out, err = run_bench("tiny-llama-bf16.yaml", "--suite", "tiny", "--rows", "8/4")
    assert code == 0, err
    assert "8/4" in out and "16/6" not in out
    assert "runtime: scheduler_policy max_utilization" in out  # the user's setting wins
    code, _, err = run_bench("tiny-llama-bf16.yaml", "--suite", "tiny", "--rows", "1/1")
    assert code != 0 and "suite tiny has rows 16/6, 8/4" in err
    for rows, named in (("", "(an empty row)"), ("8/4,", "(an empty row)"), ("8/4,8/4", "8/4 twice")):
        code, _, err = run_bench("tiny-llama-bf16.yaml", "--suite", "tiny", "--rows", rows)
        assert code == 2 and named in err, (rows, err)  # none runs the whole table or a row twice
    code, _, err = run_bench("tiny-llama-bf16.yaml", "--suite", "nope")
    assert code != 0 and "trtllm-h200" in err


def test_a_gpu_suite_runs_only_on_its_gpu_model_and_names_the_suite_for_this_one():
    from kiln.pipeline.bench.suite import SUITES, check_gpu
    from kiln.pipeline.bench.target import BenchTargetError

    check_gpu(SUITES["trtllm-h200"], "NVIDIA H200")
    check_gpu(SUITES["trtllm-h100"], "NVIDIA H100 80GB HBM3")
    with pytest.raises(BenchTargetError, match="measured on an H200 and this GPU is NVIDIA H100 80GB HBM3.*run "
                                               "--suite trtllm-h100"):
        check_gpu(SUITES["trtllm-h200"], "NVIDIA H100 80GB HBM3")
    with pytest.raises(BenchTargetError, match="--prompts"):  # a GH200 is neither
        check_gpu(SUITES["trtllm-h200"], "NVIDIA GH200 480GB")
    for suite, gpu in (("trtllm-h100", "NVIDIA H100 PCIe"), ("trtllm-h100", "NVIDIA H100 NVL"),
                       ("trtllm-h200", "NVIDIA H200 NVL")):
        with pytest.raises(BenchTargetError, match=f"figures are from the H[12]00 SXM card and this GPU is {gpu}"):
            check_gpu(SUITES[suite], gpu)


def suite_target(path: str) -> Target:
    from kiln.pipeline.config import find_config

    found = find_config(path)
    return Target("config" if found.suffix == ".yaml" else "architecture", found)


def test_a_trtllm_suite_builds_with_the_fp8_weights_and_kv_cache_of_its_figures_where_the_user_set_none():
    from kiln.pipeline.bench.suite import SUITES, suite_quantization

    llama = suite_target("llama3-8b")
    for suite in SUITES.values():
        for fmt, kv in ((None, None), ("fp8", None), (None, "fp8"), ("fp8", "fp8")):
            assert suite_quantization(suite, llama, fmt, kv) == ("fp8", "fp8")


def test_a_trtllm_suite_refuses_other_quantization_naming_what_its_figures_were_measured_with():
    from kiln.pipeline.bench.suite import SUITES, suite_quantization
    from kiln.pipeline.bench.target import BenchTargetError

    suite, llama = SUITES["trtllm-h200"], suite_target("llama3-8b")
    measured = "measured with --format fp8 --kv-cache-dtype fp8 on the shape of configs/models/llama3-8b.json"
    for fmt, kv, named in (("none", None, "--format none"), ("int4_awq", "fp8", "--format int4_awq"),
                           (None, "auto", "--kv-cache-dtype auto")):
        with pytest.raises(BenchTargetError, match=f"llama3-8b.json runs {named}, and its figures were {measured}"):
            suite_quantization(suite, llama, fmt, kv)
    with pytest.raises(BenchTargetError, match="runs quantize.kv_cache_dtype auto, and its figures were measured"):
        suite_quantization(suite, suite_target("tiny-llama-fp8.yaml"), None, None)  # fp8 weights, bf16 KV


def test_a_trtllm_suite_refuses_a_model_of_another_shape():
    from kiln.pipeline.bench.suite import SUITES, check_model, target_model
    from kiln.pipeline.bench.target import BenchTargetError

    suite = SUITES["trtllm-h100"]
    check_model(suite, target_model(suite_target("llama3-8b")), "llama3-8b")
    with pytest.raises(BenchTargetError, match=r"qwen3-8b has model_type qwen3 \(not llama\).*num_hidden_layers 36 "
                                               r"\(not 32\).*measured with --format fp8"):
        check_model(suite, target_model(suite_target("qwen3-8b")), "qwen3-8b")
    with pytest.raises(BenchTargetError, match=r"hidden_size 256 \(not 4096\)"):  # the bundled tiny Llama's
        check_model(suite, target_model(suite_target("tiny-llama-bf16.yaml")), "tiny")


def test_a_trtllm_suite_run_gives_the_rows_its_quantization_and_refuses_another_model(monkeypatch):
    from kiln.pipeline.bench import suite

    builds = []

    def build_and_measure(resolved, plan, **kwargs):
        builds.append(kwargs)
        return SimpleNamespace(kiln=defaultdict(lambda: None, output_tokens_per_s=1.0, kv_pool={"max_batch_size": 1}))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # an H200, as far as the suite can tell
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(suite, "build_and_measure", build_and_measure)
    bench_json("llama3-8b", "--suite", "trtllm-h200", "--rows", "128/128", "--random-quantized")
    assert [(b["fmt"], b["kv_cache_dtype"], b["random_quantized"]) for b in builds] == [("fp8", "fp8", True)]
    code, _, err = run_bench("qwen3-8b", "--suite", "trtllm-h200", "--format", "fp8")
    assert code == 2 and "model_type qwen3 (not llama)" in " ".join(err.replace("│", " ").split())
    assert bench_json("llama3-8b", "--suite", "trtllm-h200", "--rows", "128/128")["rows"]  # bf16 before the fix
    assert builds[-1]["fmt"] == "fp8" and builds[-1]["kv_cache_dtype"] == "fp8"
    code, _, err = run_bench("llama3-8b", "--suite", "trtllm-h200", "--format", "none")
    assert code == 2 and "runs --format none" in err and len(builds) == 2


def test_max_batch_size_sets_a_generated_plan_and_is_refused_for_a_config(tmp_path):
    from kiln.pipeline.bench.target import MAX_BENCH_BATCH, BenchPlan, bench_config

    cfg = json.loads(write_architecture(tmp_path / "arch.json").read_text())
    plans = {batch: bench_config(tmp_path, BenchPlan(5000, 16, 6, batch), cfg, fmt="none", kv_cache_dtype="auto",
                                 seed=0).build for batch in (None, 2048, 9000)}
    assert [plans[b].max_batch_size for b in (None, 2048, 9000)] == [MAX_BENCH_BATCH, 2048, 5000]  # <= the requests
    code, _, err = run_bench("tiny-llama-bf16.yaml", "--max-batch-size", "4")
    assert code == 2 and "--random-quantized and --checkpoint-cache apply to architecture files" in err


def test_random_quantized_fp8_weights_build_without_modelopt(tmp_path, kiln_cache, monkeypatch):
    arch = write_architecture(tmp_path / "tiny-direct.json")
    monkeypatch.chdir(tmp_path)  # a relative --checkpoint-cache is the working directory's, as KILN_CACHE is
    report = bench_json(str(arch), *SMALL, "--batch-1", "--format", "fp8", "--kv-cache-dtype", "fp8",
                        "--random-quantized", "--bandwidth-gbs", "10", "--checkpoint-cache", "ckpts")
    # the checkpoint in the cache --checkpoint-cache names, the engine in KILN_CACHE's
    assert [row["store"] for row in ls_entries(EngineCache.open_configured(tmp_path / "ckpts"))] == ["checkpoints"]
    assert Path(report["kiln"]["engine_dir"]).is_relative_to(kiln_cache)
    assert "random FP8 weights with an FP8 KV cache made directly" in report["kiln"]["quantization"]
    assert "modelopt (" not in report["kiln"]["quantization"]  # no quantize stage ran
    engine = json.loads((Path(report["kiln"]["engine_dir"]) / "engine.json").read_text())
    assert engine["quantization"]["format"] == "fp8" and engine["quantization"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert engine["quantization"]["exclude_modules"] == []  # every decoder linear FP8; the LM head is not one
    assert report["kiln"]["decode_tokens_per_s_batch1"] > 0
    code, _, err = run_bench(str(arch), "--random-quantized", "--format", "int4_awq")
    assert code == 2 and "needs --format fp8, not int4_awq" in err
    code, _, err = run_bench(str(arch), "--random-quantized", "--format", "fp8", "--peer", "transformers")
    assert code == 2 and "leave out --peer" in err


def test_random_fp8_checkpoint_dequantizes_to_the_bf16_checkpoints_spread(tmp_path):
    from kiln.engines.native.checkpoint import CheckpointTensors, read_quantization
    from kiln.pipeline.bench.random_checkpoint import random_checkpoint

    cfg = json.loads(write_architecture(tmp_path / "arch.json", initializer_range=0.05).read_text())
    cache = EngineCache.open_configured(tmp_path / "cache")
    fp8 = random_checkpoint(cache, tmp_path / "arch.json", cfg, seed=3, device="cpu", progress=lambda _: None,
                            fp8=True, fp8_kv_cache=True)
    tensors = CheckpointTensors(fp8)
    weight = tensors.get("model.layers.1.mlp.down_proj.weight")
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (128, 256)
    dequantized = weight.float() * tensors.get("model.layers.1.mlp.down_proj.weight_scale")
    assert dequantized.std().item() == pytest.approx(0.05, rel=0.05)
    assert tensors.get("model.layers.0.self_attn.v_proj.v_scale").item() == 1.0
    assert tensors.get("lm_head.weight").dtype == torch.bfloat16
    assert read_quantization(fp8, cfg).format == "fp8" and read_quantization(fp8, cfg).fp8_kv_cache
    bf16 = random_checkpoint(cache, tmp_path / "arch.json", cfg, seed=3, device="cpu", progress=lambda _: None)
    assert bf16 != fp8 and not (bf16 / "hf_quant_config.json").exists()


def test_the_warm_up_runs_the_offline_runs_first_two_steps_a_prefill_and_a_mixed_step(llm):
    from kiln.pipeline.bench.measure import Workload, warmup_prompts

    limits = llm.limits
    count = warmup_prompts(1000, 32, limits.max_num_tokens, limits.max_batch_size)  # 16: 8 prompts fill a step
    assert count == 2 * (limits.max_num_tokens // 32) > 8 and warmup_prompts(3, 32, 256, 16) == 3
    workload = Workload.make(limits.vocab_size, prompts=count, input_len=32, output_len=2, seed=0, warmup=count)
    before = llm.stats()["steps_by_kind"]["mixed"]["steps"]
    llm.generate(workload.warmup, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False))
    assert len(workload.warmup) == count and llm.stats()["steps_by_kind"]["mixed"]["steps"] > before


def test_last_steps_figures_use_the_whole_step_ring_of_a_run_longer_than_it():
    from kiln.pipeline.bench.measure import offline_engine_stats

    kinds = {kind: {"steps": 0, "duration_s": 0.0, "execute_s": 0.0} for kind in ("prefill", "mixed", "decode")}
    ring = [{"num_seqs": 8, "duration_s": 0.0123456, "execute_s": 0.01}] * 200 + [
        {"num_seqs": 2, "duration_s": 0.002, "execute_s": 0.001}] * 56  # 256 steps held of the run's 300
    counters = {"num_steps_queued_ahead": 0, "num_preemptions": 0, "steps_by_kind": kinds}
    stats = offline_engine_stats({**counters, "num_steps": 10},
                                 {**counters, "num_steps": 310, "recent_steps": {"steps": ring}})
    assert stats["last_steps_batch_size_p50"] == 8  # the last 44 alone would say 2
    assert stats["last_steps_ms_p50"] == 12.346 and stats["last_steps_execute_ms_p50"] == 10.0
