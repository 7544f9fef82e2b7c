"""Weight-streaming FP8 linear for small batches: ``y = (fp8(x / input_scale) * input_scale) @ (w * w_scale)^T``.

Decode at small M is bound by reading the weight once. Each program owns ``BLOCK_N`` output rows and walks K in
``BLOCK_K`` chunks: it loads the FP8 weight tile (contiguous along K, so 16-byte vector loads), converts it in
registers, quantizes the matching activation chunk of all M rows with the static input scale, and accumulates in
float32. All rows of a small batch share one pass over the weight. The numerics are those of
``runtime.layers.linear.fp8_linear_reference`` (the layout is described there): the activation is rounded to the
E4M3 grid exactly (round to nearest even, clamped to ±448), both operands are exact in bfloat16, so the products
are exact and only the float32 summation order differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _round_to_e4m3(y):
    """Round float32 ``y`` (already clamped to ±448) to the nearest E4M3 value, ties to even, as float32.

    Arithmetic instead of a float8 cast, so it is exact in the interpreter too (its float8 cast truncates).
    """
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share the quantum of 2^-6
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    scaled = y / quantum  # a power of two: exact, |scaled| <= 16
    rounded = (scaled + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 addition rounds to an integer, ties to even
    return rounded * quantum


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, w_scale_ptr, input_scale_ptr, y_ptr, M, N, K: tl.constexpr,
                     stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_DTYPE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    input_scale = tl.load(input_scale_ptr)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        x = tl.math.div_rn(x, input_scale)
        x_q = _round_to_e4m3(tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX))
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x_q, axis=1)[None, :]  # [1, BLOCK_K] against [BLOCK_N, BLOCK_K]
        elif tl.float32 == DOT_DTYPE:
            acc = tl.dot(x_q, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_q.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0) * input_scale
    out = acc * out_scale[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_gemv_config(m: int, n: int, k: int) -> dict:
    """Launch parameters: a row-reduction for M = 1, a 16-row ``tl.dot`` tile otherwise. Untuned on a GPU yet."""
    block_n = 16 if n <= 8192 else 32
    if m == 1:
        return dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=512, num_warps=4, num_stages=3)
    return dict(BLOCK_M=16, BLOCK_N=max(block_n, 32), BLOCK_K=256, num_warps=4, num_stages=3)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
             config: dict | None = None) -> torch.Tensor:
    """FP8 linear for small M: x [..., K] (float32/float16/bfloat16), weight float8_e4m3fn [N, K],
    weight_scale float32 [N], input_scale float32 [] (static). Returns [..., N] in ``x.dtype``."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_gemv: weight must be float8_e4m3fn [N, {x.shape[-1]}], got {weight.dtype} "
                         f"{list(weight.shape)}")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = dict(config or fp8_gemv_config(m, n, k))
    # bfloat16 holds every E4M3 value exactly, so a bfloat16 dot is exact; the interpreter's bfloat16 dot is not.
    dot_dtype = tl.bfloat16 if x.is_cuda else tl.float32
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _fp8_gemv_kernel[grid](x2, weight, weight_scale, input_scale.reshape(()), y, m, n, k,
                           x2.stride(0), weight.stride(0), y.stride(0), DOT_DTYPE=dot_dtype, **cfg)
    return y.reshape(*x.shape[:-1], n)
