"""The fused elementwise Triton kernels of the decoder layer (RMSNorm with residual, rotary, SiLU-and-mul) against
the PyTorch layers they replace: on CPU through triton's interpreter, and on a CUDA GPU (``-m gpu``).

Both sides do the same float32 operations and round to the model dtype in the same places, so they are compared
bit for bit wherever they also share the math functions. The exceptions are named where they are asserted.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.native.kernel_choice import KernelChoice  # noqa: E402
from kiln.runtime.native.kernels.kv_store import CacheWrite, PagedCaches  # noqa: E402
from kiln.runtime.native.kernels.rms_norm import rms_norm  # noqa: E402
from kiln.runtime.native.kernels.rotary import apply_rotary  # noqa: E402
from kiln.runtime.native.kernels.silu_mul import silu_and_mul  # noqa: E402
from kiln.runtime.native.kv_cache import token_major  # noqa: E402
from kiln.runtime.native.layers.activation import SiluAndMul  # noqa: E402
from kiln.runtime.native.layers.attention import store_kv  # noqa: E402
from kiln.runtime.native.layers.linear import fp8_quantize  # noqa: E402
from kiln.runtime.native.layers.norm import RMSNorm  # noqa: E402
from kiln.runtime.native.layers.rotary import RotaryEmbedding  # noqa: E402

EPS = 1e-5
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}  # short, so that positions below 1024 reach the ramp
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
REFERENCE = KernelChoice(triton=False)  # layers on their PyTorch path, the reference, on CUDA tensors too


@pytest.fixture
def device(kernel_device: str) -> str:
    return kernel_device


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |out - ref| in units in the last place of ref's dtype at ref's magnitude."""
    magnitude = ref.double().abs().clamp_min(torch.finfo(ref.dtype).tiny)
    spacing = torch.finfo(ref.dtype).eps * torch.exp2(torch.floor(torch.log2(magnitude)))
    return ((out.double() - ref.double()).abs() / spacing).max().item()


def on_a_grid(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """Multiples of 1/64 below 1.5 in magnitude. They and their pairwise sums are exact in bfloat16, and the squares
    of those sums (multiples of 2**-12 below 9) add up exactly in float32 over a few hundred columns, in any order:
    the kernel's tree reduction and torch's sum of squares then agree, and only the rsqrt can differ."""
    return torch.randint(-96, 97, shape, generator=generator) / 64


def outputs(result: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    return result if isinstance(result, tuple) else (result, None)


@DTYPES
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_the_layer(device, poisoned_outputs, dtype, with_residual):
    num_tokens, hidden = 5, 320  # not a power of two: the row's tail lanes are masked
    generator = torch.Generator().manual_seed(0)
    x = on_a_grid(num_tokens, hidden, generator=generator).to(dtype).to(device)
    residual = on_a_grid(num_tokens, hidden, generator=generator).to(dtype).to(device) if with_residual else None
    x_before, residual_before = x.clone(), None if residual is None else residual.clone()
    unit = RMSNorm(hidden, EPS, dtype, REFERENCE).to(device)  # weight 1: its output is x normalized and rounded
    layer = RMSNorm(hidden, EPS, dtype, REFERENCE).to(device)
    layer.weight.copy_(torch.randn(hidden, generator=generator))

    normalized, new_residual = outputs(rms_norm(x, unit.weight, EPS, residual))
    out, _ = outputs(rms_norm(x, layer.weight, EPS, residual))
    expected_normalized, expected_residual = outputs(unit(x, residual))
    # The interpreter's rsqrt is 1 / sqrt in float32, as in torch's CPU kernel: bit for bit. On a GPU both sides
    # take an approximate rsqrt (and torch's mean multiplies by 1 / hidden): at most 1 ulp of a bfloat16 output;
    # in float32, where x * rsqrt is not rounded further, an ulp of rsqrt can become 2 ulps of the output.
    assert ulps(normalized, expected_normalized) <= (0 if device == "cpu" else 1 if dtype == torch.bfloat16 else 2)
    assert torch.equal(out, layer.weight * normalized)  # the weight product is rounded as torch rounds it
    if device == "cpu":
        assert torch.equal(out, outputs(layer(x, residual))[0])
    if with_residual:
        assert torch.equal(new_residual, expected_residual)
        assert torch.equal(residual, residual_before)
    assert torch.equal(x, x_before)


@DTYPES
@pytest.mark.parametrize(("head_dim", "scaling"), [(64, None), (128, LLAMA3_SCALING), (80, LLAMA3_SCALING)],
                         ids=["default", "llama3", "llama3-head-dim-80"])
def test_rotary_matches_the_layer_on_views_of_a_fused_qkv(device, poisoned_outputs, dtype, head_dim, scaling):
    num_tokens, num_heads, num_kv_heads = 7, 6, 2  # head counts that are not powers of two: masked rows
    generator = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 1024, 500000.0, scaling).to(device)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator) * 4).to(dtype)
    qkv = qkv.to(device)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1023, 5, 700, 300, 5, 64], device=device)
    qkv_before = qkv.clone()

    q_out, k_out = apply_rotary(positions, q, k, rope.cos_sin_cache)

    expected_q, expected_k = rope(positions, q, k)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, expected_q) and torch.equal(k_out, expected_k)
    assert torch.equal(qkv, qkv_before)


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache-token-major-v"])
@pytest.mark.parametrize("keep_k", [False, True], ids=["k-not-kept", "k-kept"])
def test_rotary_stores_the_rotated_k_and_the_v_as_store_kv_would(device, fp8, keep_k):
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 5, 6, 2, 64, 16
    generator = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(head_dim, 1024, 500000.0, LLAMA3_SCALING).to(device)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator) * 4)
    qkv = qkv.to(torch.bfloat16).to(device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in (q, k, v))
    positions = torch.tensor([0, 1023, 5, 700, 33], device=device)
    slots = torch.tensor([3, 40, -1, 17, 63], device=device)  # the third token is padding: nothing is written
    shape = (4, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(device) for _ in range(2))
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = torch.tensor(0.03, device=device), torch.tensor(0.02, device=device)
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), token_major(v_cache.to(torch.float8_e4m3fn))
    else:
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    expected_q, expected_k = rope(positions, q, k)
    expected_caches = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    store_kv(expected_k[real], v[real], *expected_caches, slots[real], k_scale, v_scale)

    q_out, k_out = apply_rotary(positions, q, k, rope.cos_sin_cache,
                                CacheWrite(v, PagedCaches(k_cache, v_cache, slots, k_scale, v_scale)), keep_k)

    assert torch.equal(q_out, expected_q)
    assert torch.equal(k_out, expected_k) if keep_k else k_out is None
    for cache, expected in zip((k_cache, v_cache), expected_caches, strict=True):
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@DTYPES
def test_silu_and_mul_matches_the_layer(device, poisoned_outputs, dtype):
    inter_size = 1500  # two column blocks of 1024, the second partly masked
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 2 * inter_size, generator=generator) * 3).to(dtype).to(device)

    out = silu_and_mul(x)

    expected = SiluAndMul(REFERENCE)(x)
    if device == "cpu" and dtype == torch.float32:
        # NumPy's exp (the interpreter's) and torch's vectorised CPU exp are each off by an ulp or two of float32.
        assert ulps(out, expected) <= 8
    else:  # the two exps agree after rounding to bfloat16 (for every gate: the next test); on a GPU both sides
        # call libdevice's expf
        assert torch.equal(out, expected)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's, as the interpreter meets infinities and NaNs
def test_silu_and_mul_matches_the_layer_for_every_bfloat16_gate(device):
    gate = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    # Every gate, infinities and NaNs included, but those so small that silu(gate) would be subnormal: the
    # interpreter's float32 -> bfloat16 cast mishandles subnormals.
    gate = gate[~(gate.abs() < 2.0**-100) | (gate == 0)]
    up = (torch.rand(gate.numel(), generator=torch.Generator().manual_seed(3)) + 0.5).to(torch.bfloat16)
    x = torch.cat([gate, up])[None, :].to(device)
    torch.testing.assert_close(silu_and_mul(x), SiluAndMul(REFERENCE)(x), rtol=0, atol=0, equal_nan=True)


@DTYPES
def test_a_fused_pre_norm_equals_the_two_norms_in_sequence(device, poisoned_outputs, dtype):
    """Gemma 2's post-norm fused into the next pre-norm: the same bytes as two kernels, and as the PyTorch layers."""
    generator = torch.Generator().manual_seed(6)
    x, residual = (on_a_grid(5, 320, generator=generator).to(dtype).to(device) for _ in range(2))
    post, pre = (RMSNorm(320, EPS, dtype, REFERENCE).to(device) for _ in range(2))
    post.weight.copy_(torch.randn(320, generator=generator) + 1)
    pre.weight.copy_(torch.randn(320, generator=generator) + 1)
    scale = torch.tensor(0.0137, device=device)
    out, new_residual = rms_norm(x, pre.weight, EPS, residual, pre_weight=post.weight)
    expected, expected_residual = rms_norm(rms_norm(x, post.weight, EPS), pre.weight, EPS, residual)
    assert torch.equal(out, expected) and torch.equal(new_residual, expected_residual)
    q_out, _ = rms_norm(x, pre.weight, EPS, residual, scale, pre_weight=post.weight)
    assert torch.equal(q_out.view(torch.uint8), fp8_quantize(expected, scale).view(torch.uint8))
    if device == "cpu":  # the layer's PyTorch path takes the same argument
        layer_out, layer_residual = pre(x, residual, pre_norm=post)
        assert torch.equal(layer_out, out) and torch.equal(layer_residual, new_residual)
    with pytest.raises(ValueError, match="pre_weight must be"):
        rms_norm(x, pre.weight, EPS, residual, pre_weight=post.weight[:64])
    with pytest.raises(ValueError, match="cannot fuse"):
        pre(x, residual, pre_norm=RMSNorm(320, 1e-6, dtype, REFERENCE).to(device))


@DTYPES
def test_rms_norm_and_silu_quantize_their_output_as_the_next_fp8_linear_would(device, poisoned_outputs, dtype):
    # Values beyond ±448 * scale clamp; the scale is not a power of two, so the division rounds.
    generator = torch.Generator().manual_seed(5)
    scale = torch.tensor(0.0137, device=device)
    x = (torch.randn(5, 320, generator=generator) * 4).to(dtype).to(device)
    residual = torch.randn(5, 320, generator=generator).to(dtype).to(device)
    weight = (torch.randn(320, generator=generator) * 3).to(dtype).to(device)
    out, new_residual = rms_norm(x, weight, EPS, residual)
    q_out, q_residual = rms_norm(x, weight, EPS, residual, quant_scale=scale)
    assert q_out.dtype == torch.float8_e4m3fn and torch.equal(q_residual, new_residual)
    assert torch.equal(q_out.view(torch.uint8), fp8_quantize(out, scale).view(torch.uint8))
    assert torch.equal(rms_norm(x, weight, EPS, quant_scale=scale).view(torch.uint8),
                       fp8_quantize(rms_norm(x, weight, EPS), scale).view(torch.uint8))
    gate_up = (torch.randn(5, 2 * 1500, generator=generator) * 3).to(dtype).to(device)
    q_act = silu_and_mul(gate_up, quant_scale=scale)
    assert q_act.dtype == torch.float8_e4m3fn
    assert torch.equal(q_act.view(torch.uint8), fp8_quantize(silu_and_mul(gate_up), scale).view(torch.uint8))
    # the PyTorch layers take the same argument
    assert torch.equal(SiluAndMul(REFERENCE)(gate_up.cpu(), scale.cpu()).view(torch.uint8),
                       fp8_quantize(SiluAndMul(REFERENCE)(gate_up.cpu()), scale.cpu()).view(torch.uint8))


def test_kernels_keep_leading_dims_and_take_an_empty_batch(device):
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4)).to(device)
    assert torch.equal(rms_norm(x, torch.ones(64, device=device), EPS).reshape(6, 64),
                       rms_norm(x.reshape(6, 64), torch.ones(64, device=device), EPS))
    assert silu_and_mul(x).shape == (2, 3, 32)
    empty = torch.empty(0, 64, device=device)
    out, new_residual = rms_norm(empty, torch.ones(64, device=device), EPS, empty)
    assert out.shape == new_residual.shape == (0, 64) and silu_and_mul(empty).shape == (0, 32)
    q_out, k_out = apply_rotary(torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, 4, 64, device=device),
                                torch.empty(0, 2, 64, device=device), torch.ones(8, 64, device=device))
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 2, 64)


def test_kernels_reject_inputs_they_cannot_handle():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight must be torch.bfloat16 \[64\]"):
        rms_norm(x, torch.ones(64), EPS)
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm(x, torch.ones(64, dtype=torch.bfloat16), EPS, x[:, :32])
    q, k = torch.randn(3, 4, 64, dtype=torch.bfloat16), torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="q and k must share a dtype"):
        apply_rotary(torch.arange(3), q, k, torch.ones(8, 64))
    with pytest.raises(ValueError, match="same number of tokens"):
        apply_rotary(torch.arange(2), q, k.bfloat16(), torch.ones(8, 64))
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(x[:, :63])
