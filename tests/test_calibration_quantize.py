"""The quantize stage end to end on small random checkpoints: outputs, gate and fallback, determinism, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kiln.calibration import CalibrationError
from kiln.calibration.export import KV_SCALE_NOTE
from kiln.calibration.quantize import quantize_checkpoint
from tests.calibration_factories import (
    corpus,
    make_checkpoint,
    small_recipe,
    tree_sha256,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")


def dtypes(path) -> dict[str, str]:
    with safe_open(path, "pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)


@pytest.mark.parametrize(("fmt", "weight_dtype", "quant_algo"), [("fp8", "F8_E4M3", "FP8"),
                                                                  ("int4_awq", "U8", "W4A16_AWQ")])
def test_quantized_checkpoint_is_exported_in_both_forms_with_report_and_plot(checkpoint, tmp_path, fmt,
                                                                               weight_dtype, quant_algo):
    progress = []
    report = quantize_checkpoint(checkpoint, small_recipe(format=fmt), tmp_path,
                                 progress=lambda message, fraction: progress.append(fraction))
    hf = dtypes(tmp_path / "hf" / "model.safetensors")
    assert hf["model.layers.0.mlp.down_proj.weight"] == weight_dtype
    assert hf["model.embed_tokens.weight"] == hf["model.norm.weight"] == "BF16"  # unquantized: checkpoint dtype
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == quant_algo and config["dtype"] == "bfloat16"
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "hf_quant_config.json").is_file()

    trtllm = json.loads((tmp_path / "trtllm" / "config.json").read_text())
    assert trtllm["quantization"]["quant_algo"] == quant_algo and trtllm["mapping"]["world_size"] == 1
    assert trtllm["rotary_base"] == 10000.0
    assert "transformer.layers.0.attention.qkv.weight" in dtypes(tmp_path / "trtllm" / "rank0.safetensors")

    assert json.loads((tmp_path / "calibration_report.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "calibration_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert progress[-1] == 1.0 and progress == sorted(progress)


def shapes(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(path, "pt") as f:
        return {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in f.keys()}  # noqa: SIM118


LINEARS = {"attention.qkv": (128, 128 + 2 * 64), "attention.dense": (128, 128), "mlp.fc": (128, 256),
           "mlp.gate": (128, 256), "mlp.proj": (256, 128)}  # (in, out) of the small checkpoint's fused layers


@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_trtllm_checkpoint_has_the_names_and_layouts_tensorrt_llm_1_2_loads(checkpoint, tmp_path, fmt):
    """The layouts TensorRT-LLM 1.2's preprocess_perlayer_weights expects (it transposes the AWQ weight and scales
    and reshapes the pre-quant scale itself), and the config fields its PretrainedConfig reads."""
    quantize_checkpoint(checkpoint, small_recipe(format=fmt, kv_cache_dtype="fp8"), tmp_path)
    config = json.loads((tmp_path / "trtllm" / "config.json").read_text())
    assert config["architecture"] == "LlamaForCausalLM" and config["dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (2, 128, 4, 2, 256)
    assert config["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert config["quantization"]["kv_cache_quant_algo"] == "FP8"
    tensors = shapes(tmp_path / "trtllm" / "rank0.safetensors")
    assert tensors["transformer.vocab_embedding.weight"][0] == tensors["lm_head.weight"][0] == "BF16"
    for layer in range(2):
        prefix = f"transformer.layers.{layer}."
        assert {prefix + "input_layernorm.weight", prefix + "post_layernorm.weight", prefix +
                "attention.k_cache_scaling_factor", prefix + "attention.v_cache_scaling_factor"} <= set(tensors)
        for name, (inputs, outputs) in LINEARS.items():
            if fmt == "fp8":
                assert tensors[prefix + name + ".weight"] == ("F8_E4M3", (outputs, inputs))
                assert tensors[prefix + name + ".weights_scaling_factor"] == ("F32", (1,))
                assert tensors[prefix + name + ".activation_scaling_factor"] == ("F32", (1,))
            else:
                assert tensors[prefix + name + ".weight"] == ("I8", (outputs // 2, inputs))  # two int4 per byte
                assert tensors[prefix + name + ".weights_scaling_factor"][1] == (outputs, inputs // 128)
                assert tensors[prefix + name + ".prequant_scaling_factor"][1] == (inputs,)
    if fmt == "int4_awq":
        assert config["quantization"] | {"group_size": 128, "has_zero_point": False, "pre_quant_scale": True} == \
            config["quantization"]


def test_report_carries_the_cli_json_fields(checkpoint, tmp_path):
    report = quantize_checkpoint(checkpoint, small_recipe(format="fp8"), tmp_path)
    assert {"format", "converged", "rounds", "gate", "fallback_from"} <= report.keys()
    assert {"samples", "max_rel_change", "kl", "top1_agreement"} <= report["rounds"][0].keys()
    assert {"passed", "ppl_increase", "kl", "top1_agreement"} <= report["gate"].keys()
    assert report["converged"] is True and report["fallback_from"] is None and report["gate"]["passed"] is True
    assert report["samples_used"] == report["rounds"][-1]["samples"] and report["times"]["total_s"] > 0
    assert [r["samples"] for r in report["rounds"]] == [4 * (i + 1) for i in range(len(report["rounds"]))]


def test_impossible_gate_falls_back_to_the_first_format_that_passes_and_says_why(checkpoint, tmp_path):
    recipe = small_recipe(format="int4_awq", fallback=["fp8", "none"], gate={"max_kl": 0.0})
    report = quantize_checkpoint(checkpoint, recipe, tmp_path)
    assert report["format"] == "none" and report["fallback_from"] == "int4_awq"
    assert [a["format"] for a in report["attempts"]] == ["int4_awq", "fp8", "none"]
    assert "int4_awq failed the gate: KL" in report["reason"] and "fp8 failed the gate: KL" in report["reason"]
    assert "> max_kl 0" in report["summary"]
    from kiln.pipeline.stages import report_summary  # what kiln build --json says of it

    summarized = report_summary(report)
    assert (summarized["reason"], summarized["summary"]) == (report["reason"], report["summary"])
    assert tree_sha256(tmp_path / "hf")["model.safetensors"] == tree_sha256(checkpoint)["model.safetensors"]


def test_fallback_ships_fp8_when_only_int4_fails_the_gate(checkpoint, tmp_path):
    int4 = quantize_checkpoint(checkpoint, small_recipe(format="int4_awq"), tmp_path / "probe")
    fp8 = quantize_checkpoint(checkpoint, small_recipe(format="fp8"), tmp_path / "probe_fp8")
    between = (fp8["gate"]["kl"] + int4["gate"]["kl"]) / 2
    assert fp8["gate"]["kl"] < between < int4["gate"]["kl"]
    report = quantize_checkpoint(checkpoint, small_recipe(format="int4_awq", fallback=["fp8", "none"],
                                                          gate={"max_kl": between}), tmp_path / "out")
    assert report["format"] == "fp8" and report["fallback_from"] == "int4_awq"
    assert report["reason"].startswith("fallback after int4_awq failed the gate")


def test_gate_failure_without_fallback_stops_and_writes_nothing(checkpoint, tmp_path):
    with pytest.raises(CalibrationError, match=r"no format passed the accuracy gate .*fp8 failed the gate: KL") as info:
        quantize_checkpoint(checkpoint, small_recipe(format="fp8", gate={"max_kl": 0.0}), tmp_path)
    assert list(tmp_path.iterdir()) == []
    (attempt,) = info.value.details["attempts"]  # what `--json` prints with the error, for automation
    assert attempt["format"] == "fp8" and attempt["gate"]["passed"] is False and attempt["gate"]["kl"] > 0


@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_same_config_and_seed_give_the_same_checkpoint_bytes(checkpoint, tmp_path, fmt):
    first = quantize_checkpoint(checkpoint, small_recipe(format=fmt), tmp_path / "a")
    second = quantize_checkpoint(checkpoint, small_recipe(format=fmt), tmp_path / "b")
    for form in ("hf", "trtllm"):
        assert tree_sha256(tmp_path / "a" / form) == tree_sha256(tmp_path / "b" / form)
    assert first["rounds"] == [dict(r, seconds=s["seconds"]) for r, s in zip(second["rounds"], first["rounds"],
                                                                               strict=True)]
    other = quantize_checkpoint(checkpoint, small_recipe(format=fmt, seed=1), tmp_path / "c")
    assert other["rounds"][0]["kl"] != first["rounds"][0]["kl"]


def test_format_none_copies_the_checkpoint_and_needs_no_calibration(checkpoint, tmp_path):
    report = quantize_checkpoint(checkpoint, small_recipe(format="none", dataset="/does/not/matter"), tmp_path)
    assert report["verdict"] == "not needed" and report["converged"] is True and report["rounds"] == []
    assert "no calibration needed" in report["summary"]
    assert tree_sha256(tmp_path / "hf") == {k: v for k, v in tree_sha256(checkpoint).items()}
    assert json.loads((tmp_path / "trtllm" / "config.json").read_text())["quantization"]["quant_algo"] is None


def test_a_failed_tensorrt_llm_export_leaves_the_hugging_face_form_and_a_note(checkpoint, tmp_path, monkeypatch):
    def fail(model, decoder, export_dir, **kwargs):  # as modelopt 0.47 pads a tied Gemma 2's lm_head it lacks
        export_dir.mkdir(parents=True, exist_ok=True)
        (export_dir / "rank0.safetensors").write_bytes(b"half")
        raise AttributeError("'NoneType' object has no attribute 'weight'")

    monkeypatch.setattr("kiln.calibration.export.export_tensorrt_llm_checkpoint", fail)
    report = quantize_checkpoint(checkpoint, small_recipe(format="none", dataset="/does/not/matter"), tmp_path)
    assert report["notes"] == ["no TensorRT-LLM checkpoint: modelopt's export failed (AttributeError: 'NoneType' "
                               "object has no attribute 'weight')"]
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / "trtllm").exists()  # nothing half-written


def test_a_tensorrt_llm_export_that_runs_out_of_memory_fails_the_stage(checkpoint, tmp_path, monkeypatch):
    def out_of_memory(model, decoder, export_dir, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")  # another run may succeed: nothing may be cached

    monkeypatch.setattr("kiln.calibration.export.export_tensorrt_llm_checkpoint", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        quantize_checkpoint(checkpoint, small_recipe(format="none", dataset="/does/not/matter"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fp8_kv_cache_exports_kv_scales_and_says_which_the_gate_measured(checkpoint, tmp_path):
    report = quantize_checkpoint(checkpoint, small_recipe(format="fp8", kv_cache_dtype="fp8"), tmp_path)
    hf, trtllm = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "trtllm" / "rank0.safetensors")
    assert json.loads((tmp_path / "trtllm" / "config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
    for layer in range(2):
        k_scale, v_scale = (hf[f"model.layers.{layer}.self_attn.{p}_proj.{p}_scale"] for p in "kv")
        assert 0 < k_scale < 1 and 0 < v_scale < 1  # calibrated: what the gate measured
        assert trtllm[f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"] == 1.0  # modelopt's clamp
    assert KV_SCALE_NOTE in report["notes"]


def test_non_finite_activations_are_named_and_nothing_is_written(tmp_path):
    poisoned = make_checkpoint(tmp_path / "poisoned", poison="model.layers.1.mlp.down_proj.weight")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CalibrationError, match=r"non-finite activations \(NaN/Inf\), first at model.layers.1.mlp"):
        quantize_checkpoint(poisoned, small_recipe(format="fp8"), out)
    assert list(out.iterdir()) == []


def test_int4_needs_in_features_divisible_by_the_block(tmp_path):
    odd = make_checkpoint(tmp_path / "odd", hidden=96, intermediate=256)
    with pytest.raises(CalibrationError, match=r"in-features divisible by 128, but model.layers.0.* use format fp8"):
        quantize_checkpoint(odd, small_recipe(format="int4_awq"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("fields", "message"), [
    ({"dataset": "/missing/calib.jsonl"}, "quantize.dataset: /missing/calib.jsonl does not exist"),
    ({"dataset": "EMPTY"}, "holds no text documents"),
    ({"dataset": "SMALL"}, "fewer than quantize.num_samples=16"),
])
def test_bad_data_exits_with_a_clear_message_and_writes_nothing(checkpoint, tmp_path, fields, message):
    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "small.jsonl", corpus(1))
    paths = {"EMPTY": str(tmp_path / "empty.jsonl"), "SMALL": str(tmp_path / "small.jsonl")}
    out = tmp_path / "out"
    with pytest.raises(CalibrationError, match=message):
        quantize_checkpoint(checkpoint, small_recipe(format="fp8", dataset=paths.get(fields["dataset"],
                                                                                     fields["dataset"])), out)
    assert not out.exists()


@pytest.mark.parametrize(("edit", "message"), [
    ("drop", r"lacks model.layers.1.mlp.down_proj.weight"),
    ("add", r"has tensors its model does not use: model.layers.1.mlp.extra.weight"),
])
def test_a_checkpoint_transformers_would_fill_in_or_skip_is_refused_and_nothing_is_written(tmp_path, edit, message):
    from safetensors.torch import load_file, save_file

    source = make_checkpoint(tmp_path / "hf")
    (weights,) = source.glob("*.safetensors")
    tensors = load_file(weights)
    if edit == "drop":
        del tensors["model.layers.1.mlp.down_proj.weight"]
    else:
        tensors["model.layers.1.mlp.extra.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(CalibrationError, match=message):
        quantize_checkpoint(source, small_recipe(format="fp8"), out)
    assert not out.exists()


def test_checkpoint_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CalibrationError, match="no \\*.safetensors weights"):
        quantize_checkpoint(tmp_path, small_recipe(format="fp8"), tmp_path / "out")


def test_calibration_loads_safetensors_only_so_a_pickle_beside_them_is_never_unpickled(tmp_path, monkeypatch):
    import types

    import torch
    import transformers

    from kiln.calibration.quantize import _Stage

    seen = {}

    def record(model_dir, **kwargs):
        seen.update(kwargs)
        return torch.nn.Linear(1, 1), {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set()}

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record)
    _Stage._load_model(types.SimpleNamespace(model_dir=tmp_path, dtype=torch.float32, device="cpu"))
    assert seen["use_safetensors"] is True
