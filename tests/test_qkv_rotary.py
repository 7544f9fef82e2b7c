"""The qkv projections with RoPE and the KV store in their epilogue against the two launches each replaces (FP8:
``fp8_gemv``, INT4-AWQ: ``int4_awq_gemv``, then ``apply_rotary``): on CPU through triton's interpreter in float32,
on a CUDA GPU (``-m gpu``) in bfloat16. Their operands make every float32 sum exact, so the two agree bit for bit
though a program of a fused kernel reduces half as many rows at a time."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.native.kernels.fp8_gemv import fp8_gemv  # noqa: E402
from kiln.runtime.native.kernels.fp8_qkv_rotary import fp8_qkv_rotary, qkv_rotary_config  # noqa: E402
from kiln.runtime.native.kernels.int4_gemv import int4_awq_gemv  # noqa: E402
from kiln.runtime.native.kernels.int4_qkv_rotary import int4_qkv_rotary, int4_qkv_rotary_config  # noqa: E402
from kiln.runtime.native.kernels.kv_store import CacheWrite, PagedCaches  # noqa: E402
from kiln.runtime.native.kernels.rotary import apply_rotary  # noqa: E402
from kiln.runtime.native.kv_cache import token_major  # noqa: E402
from kiln.runtime.native.layers.linear import pack_int4  # noqa: E402
from kiln.runtime.native.layers.rotary import RotaryEmbedding  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}


def _operands(m: int, n: int, k: int, device: str, seed: int):
    """Integer activations and weights of at most 16 in magnitude, exact in FP8 (the input scale is 1): their float32
    sums are exact in any order, so the two launches agree bit for bit however each tiles the reduction."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-16, 17, (m, k), generator=g).to(device, torch.float32 if device == "cpu" else torch.bfloat16)
    weight = torch.randint(-16, 17, (n, k), generator=g).float().to(torch.float8_e4m3fn)
    weight_scale = torch.rand(n, generator=g) * 0.01 + 0.001
    return x, weight.to(device), weight_scale.to(device), torch.tensor(1.0, device=device)


def _int4_projections(m: int, n: int, k: int, device: str, seed: int):
    """The fused and the separate INT4-AWQ launches over integer activations of at most 16 in magnitude, q in -8..7,
    power-of-two scales and pre-quant scales: every float32 sum is exact."""
    group_size = 32
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-16, 17, (m, k), generator=g).to(device, torch.float32 if device == "cpu" else torch.bfloat16)
    qweight = pack_int4(torch.randint(-8, 8, (n, k), generator=g)).to(device)
    scales = (2.0 ** -torch.randint(4, 9, (n, k // group_size), generator=g)).to(device)
    pre_quant_scale = (2.0 ** torch.randint(-1, 2, (k,), generator=g)).to(device, x.dtype)
    weight = (qweight, scales, pre_quant_scale, group_size)
    return (lambda *args: int4_qkv_rotary(x, *weight, *args),
            lambda: int4_awq_gemv(x, *weight))


def _fp8_projections(m: int, n: int, k: int, device: str, seed: int):
    x, *weight = _operands(m, n, k, device, seed)
    return lambda *args: fp8_qkv_rotary(x, *weight, *args), lambda: fp8_gemv(x, *weight)


PROJECTIONS = {"fp8": _fp8_projections, "int4_awq": _int4_projections}


def _same_bytes(out: torch.Tensor, expected: torch.Tensor) -> bool:
    return out.dtype == expected.dtype and torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def _gpu_llama_shape():
    return pytest.param(32, 8, 128, 4096, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="Llama-3-8B's shape, on a GPU only (4 warps a token: no masked chunk)")],
        id="llama3-8b")


@pytest.mark.parametrize("fmt,m", [("fp8", 1), ("fp8", 3), ("int4_awq", 1)])
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache-token-major-v"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,k", [(4, 2, 64, 128), _gpu_llama_shape()])
def test_fused_projection_writes_q_and_the_caches_as_apply_rotary_would(kernel_device, poisoned_outputs, fmt, m, fp8,
                                                                         num_heads, num_kv_heads, head_dim, k):
    block_size = 16
    fused, separate = PROJECTIONS[fmt](m, (num_heads + 2 * num_kv_heads) * head_dim, k, kernel_device, seed=10 + m)
    rope = RotaryEmbedding(head_dim, 1024, 500000.0, LLAMA3_SCALING).to(kernel_device)
    positions = torch.tensor([1023, 5, 700][:m], device=kernel_device)
    slots = torch.tensor([40, -1, 17][:m], device=kernel_device)  # the second token is padding: nothing is written
    g = torch.Generator().manual_seed(4)
    dtype = torch.float32 if kernel_device == "cpu" else torch.bfloat16
    k_cache, v_cache = (torch.randn(4, block_size, num_kv_heads, head_dim, generator=g).to(kernel_device, dtype)
                        for _ in range(2))
    scales = (None, None)
    if fp8:
        scales = torch.tensor(0.03, device=kernel_device), torch.tensor(0.02, device=kernel_device)
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), token_major(v_cache.to(torch.float8_e4m3fn))
    expected_caches = k_cache.clone(), v_cache.clone()

    q = fused(positions, rope.cos_sin_cache, PagedCaches(k_cache, v_cache, slots, *scales), num_heads, num_kv_heads)

    q_in, k_in, v_in = (t.reshape(m, -1, head_dim) for t in separate().split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    expected_q, _ = apply_rotary(positions, q_in, k_in, rope.cos_sin_cache,
                                 CacheWrite(v_in, PagedCaches(*expected_caches, slots, *scales)), keep_k=False)
    assert q.shape == (m, num_heads, head_dim) and _same_bytes(q, expected_q)
    for cache, expected in zip((k_cache, v_cache), expected_caches, strict=True):
        assert _same_bytes(cache, expected)


def test_fused_projection_takes_only_tiles_inside_one_head():
    pairs = {head_dim: (qkv_rotary_config(1, 6144, 4096, head_dim), qkv_rotary_config(8, 6144, 4096, head_dim))
             for head_dim in (128, 96, 80)}
    assert pairs[128][0]["BLOCK_P"] == 4 and pairs[128][1]["BLOCK_P"] == 32  # fp8_gemv's 8 and 64 rows, as pairs
    assert pairs[96][1]["BLOCK_P"] == 16  # 48 dims a half: 16 pairs divide it
    assert pairs[80][0]["BLOCK_P"] == 4 and pairs[80][1] is None  # 40: no tl.dot tile of 16 or more divides it
    int4 = {head_dim: int4_qkv_rotary_config(6144, 4096, 128, head_dim) for head_dim in (128, 72)}
    assert int4[128]["BLOCK_P"] == 8 and int4[72]["BLOCK_P"] == 4  # the batch-1 kernel's 16 rows as pairs; 36 dims


def test_fused_projection_refuses_a_weight_that_is_not_its_heads():
    x, weight, weight_scale, input_scale = _operands(1, 500, 128, "cpu", seed=0)
    caches = PagedCaches(torch.zeros(1, 16, 2, 64), torch.zeros(1, 16, 2, 64), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="500 weight rows are not 4 q and 2 x 2 kv heads"):
        fp8_qkv_rotary(x, weight, weight_scale, input_scale, torch.zeros(1, dtype=torch.long),
                        torch.zeros(8, 64), caches, 4, 2)


def test_one_token_takes_four_warps_only_where_the_input_fills_whole_chunks():
    # Triton 3.6 sums a mostly masked 4-warp chunk wrongly on sm_90 (qkv_rotary_config): 8 warps there.
    assert qkv_rotary_config(1, 6144, 4096, 128)["num_warps"] == 4
    assert qkv_rotary_config(1, 512, 128, 64)["num_warps"] == 8
    assert qkv_rotary_config(1, 4608, 3072, 96)["num_warps"] == 8  # Phi-3-mini: 3072 of 4096 columns
    assert int4_qkv_rotary_config(6144, 4096, 128, 128)["num_warps"] == 4  # two steps of 2048 columns
    assert int4_qkv_rotary_config(512, 128, 32, 64)["num_warps"] == 8  # 128 of 2048
