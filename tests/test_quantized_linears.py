"""FP8 and INT4-AWQ linears: runtime layouts, and engine logits against modelopt's fake-quantized model."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.engines.native.builder import build_native_engine
from kiln.engines.native.weights import unpack_modelopt_int4
from kiln.runtime.native.engine_format import EngineConfig
from kiln.runtime.native.layers import linear
from kiln.runtime.native.layers.linear import (
    Fp8Linear,
    fp8_linear_reference,
    fp8_linear_scaled_mm,
    int4_dequantize,
    pack_int4,
    unpack_int4,
    use_scaled_mm,
)
from kiln.runtime.native.model.decoder import DecoderModel
from tests.model_factories import (
    FP8_GPU,
    NEEDS_FP8_GPU,
    QUANT_SHAPE,
    PagedRunner,
    copy_tokenizer,
    make_fp8_checkpoint,
    make_hf_checkpoint,
    tiny_plan,
)

# Engine logits vs modelopt fake-quant logits, float32 on CPU: max |difference| relative to the largest |logit|.
# Measured about 1e-6; the quantization error itself (fake-quant vs unquantized) is 0.2 - 0.8 on these models.
FAKE_QUANT_REL_TOL = 1e-4


def test_int4_runtime_packing_round_trips():
    q = torch.randint(-8, 8, (6, 256), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.shape == (6, 128) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert int(packed[0, 0]) == (int(q[0, 0]) + 8) | ((int(q[0, 1]) + 8) << 4)  # low nibble = even input column


def test_modelopt_int4_layout_unpacks_to_the_values_modelopt_packed():
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 256, generator=generator)
    scale = weight.abs().reshape(8, 2, 128).amax(-1) / 7
    expected = (weight / scale.repeat_interleave(128, dim=1)).round().clamp(-8, 7).to(torch.int8)
    assert torch.equal(unpack_modelopt_int4(pack_int4_in_uint8(weight, scale, 128)), expected)
    torch.testing.assert_close(int4_dequantize(pack_int4(expected), scale, 128),
                               expected.float() * scale.repeat_interleave(128, dim=1))


def test_fused_fp8_linear_equals_its_members_with_their_own_scales():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=generator)
    weights = [torch.randn(n, 64, generator=generator) for n in (32, 16, 16)]
    scales = [w.abs().max() / 448 for w in weights]
    fp8 = [(w / s).to(torch.float8_e4m3fn) for w, s in zip(weights, scales, strict=True)]
    input_scale = x.abs().max() / 448
    fused = Fp8Linear(64, 64)
    fused.weight.copy_(torch.cat(fp8))
    fused.weight_scale.copy_(torch.cat([s.expand(w.shape[0]) for s, w in zip(scales, weights, strict=True)]))
    fused.input_scale.copy_(input_scale)
    members = [fp8_linear_reference(x, w, s.reshape(1), input_scale) for w, s in zip(fp8, scales, strict=True)]
    torch.testing.assert_close(fused(x), torch.cat(members, dim=-1))


def modelopt_config(recipe: str) -> dict:
    """modelopt's quantization config for a recipe; the FP8 KV cache config is merged into FP8's, as modelopt says."""
    import modelopt.torch.quantization as mtq

    if recipe == "int4-awq":
        return mtq.INT4_AWQ_CFG
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if recipe == "fp8-kv-cache":
        cfg["quant_cfg"] = cfg["quant_cfg"] + mtq.FP8_KV_CFG["quant_cfg"]
    return cfg


@pytest.mark.parametrize("recipe", ["fp8", "fp8-kv-cache", "int4-awq"])
def test_engine_logits_match_modelopt_fake_quant(tmp_path, recipe):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers
    from transformers import LlamaForCausalLM

    checkpoint = make_hf_checkpoint(tmp_path / "hf", **QUANT_SHAPE)
    generator = torch.Generator().manual_seed(1)
    calibration = torch.randint(0, 96, (4, 24), generator=generator)
    batch = torch.randint(0, 96, (3, 12), generator=generator)
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model = mtq.quantize(model, modelopt_config(recipe), lambda m: m(calibration))
    # export resmooths fused AWQ linears to one pre_quant_scale; apply it first so the fake-quant model is the export
    requantize_resmooth_fused_llm_layers(model)
    with torch.no_grad():
        fake_quant_logits = model(batch).logits
    export_hf_checkpoint(model, dtype=torch.float32, export_dir=tmp_path / "export")
    copy_tokenizer(checkpoint, tmp_path / "export")

    (tmp_path / "engine").mkdir()
    build_native_engine(tmp_path / "export", tmp_path / "engine", tiny_plan(), "float32")
    config = EngineConfig.load(tmp_path / "engine")
    engine = DecoderModel.from_engine(tmp_path / "engine", config, "cpu", torch.float32)
    logits = torch.stack(PagedRunner(engine, config, len(batch)).all_logits(batch.tolist()))

    assert config.quantization.format == {"fp8": "fp8", "fp8-kv-cache": "fp8", "int4-awq": "int4_awq"}[recipe]
    assert config.plan.kv_cache_dtype == ("float8_e4m3fn" if recipe == "fp8-kv-cache" else "float32")
    rel = (logits - fake_quant_logits).abs().max() / fake_quant_logits.abs().max()
    assert rel <= FAKE_QUANT_REL_TOL, f"{recipe}: engine vs fake-quant relative difference {rel:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_engine_of_a_half_precision_checkpoint_matches_the_gated_fake_quant_model(tmp_path, dtype):
    # bf16/fp16 weights often sit exactly between two E4M3 values (w * 448 / amax = 336, between 320 and 352); the
    # gate's fake quant multiplies by 448 / amax and modelopt's export divides by amax / 448, which round such ties
    # apart. An amax of 0.3984375 (as in the bundled tiny model's layers.0.mlp.down_proj) makes ~1 % of them ties.
    import modelopt.torch.quantization as mtq
    from transformers import LlamaForCausalLM

    from kiln.calibration.export import export_hf
    from kiln.calibration.modelopt_quantize import fuse_shared_inputs

    checkpoint = make_hf_checkpoint(tmp_path / "hf", **QUANT_SHAPE)
    tie_prone = clamped_linears(load_file(checkpoint / "model.safetensors"), amax=0.3984375)
    save_file({name: t.to(dtype) for name, t in tie_prone.items()}, checkpoint / "model.safetensors",
              metadata={"format": "pt"})
    generator = torch.Generator().manual_seed(1)
    calibration = torch.randint(0, 96, (4, 24), generator=generator)
    batch = torch.randint(0, 96, (3, 12), generator=generator)
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()  # as calibration on a CPU
    model = mtq.quantize(model, modelopt_config("fp8"), lambda m: m(calibration))
    fuse_shared_inputs(model)  # what the quantize stage gates
    with torch.no_grad():
        fake_quant_logits = model(batch).logits
    export_hf(model, checkpoint, tmp_path / "export", dtype)

    (tmp_path / "engine").mkdir()
    build_native_engine(tmp_path / "export", tmp_path / "engine", tiny_plan(), "float32")
    config = EngineConfig.load(tmp_path / "engine")
    engine = DecoderModel.from_engine(tmp_path / "engine", config, "cpu", torch.float32)
    logits = torch.stack(PagedRunner(engine, config, len(batch)).all_logits(batch.tolist()))
    rel = (logits - fake_quant_logits).abs().max() / fake_quant_logits.abs().max()
    assert rel <= 1e-5, f"{dtype}: engine vs fake-quant relative difference {rel:.2e}"  # 3e-7; 0.1 with ties off


def clamped_linears(tensors: dict[str, torch.Tensor], amax: float) -> dict[str, torch.Tensor]:
    """`tensors` with every *_proj weight clamped to ±amax and its first element set to amax (its calibrated amax)."""
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        tensors[name] = tensors[name].clamp(-amax, amax)
        tensors[name].view(-1)[0] = amax
    return tensors


def test_cpu_fp8_linear_uses_the_dequantize_reference():
    assert not use_scaled_mm(torch.zeros(2, 64), torch.zeros(64, 64, dtype=torch.float8_e4m3fn))


def _random_fp8_linear(n: int, k: int, device: str):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, k, generator=generator) * 100).to(torch.float8_e4m3fn).to(device)
    weight_scale = (torch.rand(n, generator=generator) * 1e-3 + 1e-4).to(device)  # per channel, as after fusion
    return weight, weight_scale, torch.tensor(0.01, device=device)


@pytest.mark.gpu
@NEEDS_FP8_GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_scaled_mm_matches_dequantize_reference(dtype, m):
    weight, weight_scale, input_scale = _random_fp8_linear(96, 128, "cuda")
    x = torch.randn(m, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(dtype)
    assert use_scaled_mm(x, weight)
    out = fp8_linear_scaled_mm(x, weight, weight_scale, input_scale)
    ref = fp8_linear_reference(x.float(), weight, weight_scale, input_scale)
    assert out.dtype == dtype and out.shape == (m, 96)
    rel = (out.float() - ref).abs().max() / ref.abs().max()
    assert rel <= 1e-2, f"_scaled_mm vs dequantize reference: relative difference {rel:.2e}"  # H200: <= 3.6e-3
    # a cached per-row scale column gives the same bytes; one too short is not used
    for cached_rows in (m, 80, m - 1):
        rows = input_scale.reshape(1, 1).expand(cached_rows, 1).contiguous()
        assert torch.equal(fp8_linear_scaled_mm(x, weight, weight_scale, input_scale, input_scale_rows=rows), out)
    # a per-tensor weight scale [] takes the tensorwise GEMM: the product of the same scales, so the same values up
    # to the order of the epilogue's float32 multiplications
    uniform = weight_scale[:1].expand(96).contiguous()
    per_tensor = fp8_linear_scaled_mm(x, weight, uniform[0], input_scale)
    assert per_tensor.dtype == dtype and per_tensor.shape == (m, 96)
    per_channel = fp8_linear_scaled_mm(x, weight, uniform, input_scale).float()
    assert (per_tensor.float() - per_channel).abs().max() <= 1e-2 * per_channel.abs().max()


def test_loading_an_fp8_engine_caches_each_linears_input_scale_column(fp8_engine):
    config = EngineConfig.load(fp8_engine)
    model = DecoderModel.from_engine(fp8_engine, config, "cpu")
    fp8_linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert fp8_linears
    for module in fp8_linears:
        rows = module.input_scale_rows
        assert rows.shape == (config.plan.max_num_tokens, 1) and rows.is_contiguous()
        assert torch.equal(rows, module.input_scale.expand(rows.shape))
    module.input_scale.mul_(2)  # a changed scale is picked up by the next cache_derived_tensors
    model.cache_derived_tensors()
    assert torch.equal(module.input_scale_rows[:, 0], module.input_scale.expand(config.plan.max_num_tokens))


def test_an_fp8_linear_with_one_weight_scale_for_every_row_gives_the_gemm_that_one_value(fp8_engine):
    config = EngineConfig.load(fp8_engine)
    model = DecoderModel.from_engine(fp8_engine, config, "cpu")
    o_proj = model.layers[0].self_attn.o_proj  # unfused: the checkpoint's per-tensor scale on every row
    assert o_proj.gemm_weight_scale.shape == () and o_proj.gemm_weight_scale == o_proj.weight_scale[0]
    o_proj.weight_scale[1] *= 2  # rows of different scales keep the per-channel vector
    o_proj.cache_derived_scales(4)
    assert o_proj.gemm_weight_scale is o_proj.weight_scale


# (engine dtype, FP8 GEMM path on the GPU, tolerance): the dequantize reference on the GPU matches the CPU closely;
# _scaled_mm accumulates differently, and on these random models any tiny difference flips some FP8 roundings of later
# activations (bf16 vs float32 on the CPU alone differ by about 15% of the logit scale), so those are smoke checks:
# a wrong scale or layout gives differences of order 1.
# Measured on an H200: 4e-7, 5e-2 and 1e-1.
GPU_FP8_CASES = {"float32-reference": ("float32", False, 1e-3), "float32-scaled_mm": ("float32", True, 0.15),
                 "bfloat16-scaled_mm": ("bfloat16", True, 0.3)}


@pytest.mark.gpu
@NEEDS_FP8_GPU
@pytest.mark.parametrize("fp8_kv_cache", [False, True], ids=["plain-kv-cache", "fp8-kv-cache"])
@pytest.mark.parametrize("case", GPU_FP8_CASES.values(), ids=GPU_FP8_CASES.keys())
def test_fp8_engine_on_gpu_matches_the_cpu_reference(tmp_path, monkeypatch, fp8_kv_cache, case):
    dtype, scaled_mm, tolerance = case
    if not scaled_mm:
        monkeypatch.setattr(linear, "use_scaled_mm", lambda x, weight: False)
    checkpoint = make_fp8_checkpoint(tmp_path / "hf", fp8_kv_cache=fp8_kv_cache, **QUANT_SHAPE)
    prompts = [[5, 17, 33, 8, 90, 41, 12], [3, 64, 9]]
    logits = {}
    for device in ("cpu", "cuda"):
        engine_dir = tmp_path / device
        engine_dir.mkdir()
        build_native_engine(checkpoint, engine_dir, tiny_plan(), dtype, device=device)
        config = EngineConfig.load(engine_dir)
        engine = DecoderModel.from_engine(engine_dir, config, device)
        logits[device] = torch.cat(PagedRunner(engine, config, len(prompts), device).all_logits(prompts)).cpu()
    rel = (logits["cuda"] - logits["cpu"]).abs().max() / logits["cpu"].abs().max()
    assert rel <= tolerance, f"GPU vs CPU FP8 engine: relative difference {rel:.2e}"


@pytest.mark.parametrize(("device", "prompts"), [
    pytest.param("cpu", [[5, 17, 33, 8, 90, 41, 12], [3, 64, 9]], id="cpu-streaming",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter runs without CUDA")),
    pytest.param("cuda", [list(range(3, 40)), [3, 64, 9]], id="gpu-scaled_mm", marks=FP8_GPU),
    pytest.param("cuda", [[5, 17, 33, 8, 90, 41, 12], [3, 64, 9]], id="gpu-streaming", marks=FP8_GPU),
])
def test_fused_activation_quantization_gives_the_unfused_logits_with_no_quantize_kernel(
        fp8_engine, monkeypatch, device, prompts):
    # RMSNorm, attention and SiLU-and-multiply quantize for the next FP8 linear, so no input takes the standalone
    # quantize kernel; the bytes reaching each linear, hence the logits, are those of every linear quantizing its own
    # input. 10 tokens take the streaming kernel, 40 torch._scaled_mm. On the CPU the Triton
    # path runs through the interpreter.
    import kiln.runtime.native.kernels.fp8_gemv as fp8_gemv_module
    import kiln.runtime.native.kernels.fp8_quant as fp8_quant_module
    import kiln.runtime.native.model.decoder as llama
    from kiln.runtime.native.kernel_choice import KernelChoice

    config = EngineConfig.load(fp8_engine)
    engine = DecoderModel.from_engine(fp8_engine, config, device, kernels=KernelChoice(interpreted=device == "cpu"))
    quantize_calls = []
    real_quantize = fp8_quant_module.quantize_fp8
    counting = lambda *a, **kw: quantize_calls.append(1) or real_quantize(*a, **kw)  # noqa: E731
    monkeypatch.setattr(fp8_gemv_module, "quantize_fp8", counting)
    monkeypatch.setattr(fp8_quant_module, "quantize_fp8", counting)

    fused = torch.cat(PagedRunner(engine, config, len(prompts), device).all_logits(prompts))
    fused_calls = len(quantize_calls)
    monkeypatch.setattr(llama, "fusable_input_scale", lambda linear, x: None)
    quantize_calls.clear()
    unfused = torch.cat(PagedRunner(engine, config, len(prompts), device).all_logits(prompts))

    layers = config.architecture.num_layers
    assert (fused_calls, len(quantize_calls)) == (0, 4 * layers)
    assert torch.equal(fused, unfused)


def _int4_qkv_projection(fp8_projection: Fp8Linear) -> linear.Int4AwqLinear:
    """An INT4-AWQ projection of the FP8 one's shape, with random weights."""
    out_features, in_features = fp8_projection.weight.shape
    g = torch.Generator().manual_seed(3)
    int4 = linear.Int4AwqLinear(in_features, out_features, 32, fp8_projection.dtype, fp8_projection.kernels)
    int4.qweight.copy_(pack_int4(torch.randint(-8, 8, (out_features, in_features), generator=g)))
    int4.scales.copy_(torch.rand(out_features, in_features // 32, generator=g) * 0.02)
    int4.pre_quant_scale.copy_(torch.rand(in_features, generator=g) + 0.5)
    return int4.to(fp8_projection.weight.device)


@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter runs without CUDA")),
    pytest.param("cuda", marks=FP8_GPU),
])
def test_an_attention_layer_whose_qkv_projection_stores_k_and_v_gives_what_separate_launches_give(
        fp8_engine, monkeypatch, device, fmt):
    # A decode step's qkv_proj rotates q and k and stores K/V in its epilogue, then the layer attends over the cache.
    # A program of the fused kernel reduces each row as the format's GEMV does, so the output and the caches are
    # those of the separate launches bit for bit.
    import kiln.runtime.native.kernels.fp8_qkv_rotary as fp8_module
    import kiln.runtime.native.kernels.int4_qkv_rotary as int4_module
    from kiln.runtime.native.attention_metadata import AttentionMetadata
    from kiln.runtime.native.kernel_choice import KernelChoice

    config = EngineConfig.load(fp8_engine)
    engine = DecoderModel.from_engine(fp8_engine, config, device, kernels=KernelChoice(interpreted=device == "cpu"))
    runner = PagedRunner(engine, config, 1, device)
    runner.step([[5, 17, 33]], [3])  # a whole prompt: its K/V in the caches
    meta = AttentionMetadata.build([1], [4], runner.block_tables, runner.block_size, device)
    attention, positions = engine.layers[1].self_attn, torch.tensor([3], device=device)
    module, launcher = (fp8_module, "fp8_qkv_rotary") if fmt == "fp8" else (int4_module, "int4_qkv_rotary")
    if fmt == "int4_awq":
        attention.qkv_proj = _int4_qkv_projection(attention.qkv_proj)
    x = torch.randn(1, config.architecture.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    x = x.to(engine.embed_tokens.weight.dtype)
    caches = {"fused": runner.kv_caches[1], "separate": tuple(c.clone() for c in runner.kv_caches[1])}
    calls = []
    real = getattr(module, launcher)
    monkeypatch.setattr(module, launcher, lambda *a, **kw: calls.append(1) or real(*a, **kw))

    with torch.inference_mode():
        fused = attention(positions, x, meta, caches["fused"])
        monkeypatch.setattr(type(attention.qkv_proj), "rotary_config", lambda self, *args: None)
        separate = attention(positions, x, meta, caches["separate"])

    assert len(calls) == 1
    assert torch.equal(fused, separate)
    for fused_cache, separate_cache in zip(caches["fused"], caches["separate"], strict=True):
        assert torch.equal(fused_cache.view(torch.uint8), separate_cache.view(torch.uint8))


def test_fp8_linears_take_a_prequantized_input_and_need_its_output_dtype(kernel_device):
    from kiln.runtime.native.kernels.fp8_gemv import fp8_gemv

    weight, weight_scale, input_scale = _random_fp8_linear(48, 64, kernel_device)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(kernel_device)
    expected = fp8_gemv(x, weight, weight_scale, input_scale)
    got = fp8_gemv(linear.fp8_quantize(x, input_scale), weight, weight_scale, input_scale, out_dtype=torch.float32)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="needs out_dtype"):
        fp8_gemv(linear.fp8_quantize(x, input_scale), weight, weight_scale, input_scale)
    with pytest.raises(ValueError, match="needs out_dtype"):
        fp8_linear_scaled_mm(linear.fp8_quantize(x, input_scale), weight, weight_scale, input_scale)
