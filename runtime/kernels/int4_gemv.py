"""Weight-streaming INT4-AWQ (W4A16) linear for small batches: ``y = (x * pre_quant_scale) @ (q * scales)^T``.

The layout is ``runtime.layers.linear``'s: ``qweight`` uint8 [N, K // 2], byte j of row n holds input columns 2j
(low nibble) and 2j + 1 (high nibble) as ``q + 8``; ``scales`` float32 [N, K // group_size]; ``pre_quant_scale``
float32 [K]. Each program owns ``BLOCK_N`` output rows and walks K in ``BLOCK_K`` chunks (a multiple of the group
size): it loads the packed bytes once, splits the nibbles in registers, dequantizes them with their group's scale
and multiplies them against the even and odd activation columns of all M rows, accumulating in float32. The
dequantized weight is rounded to the activation dtype before a ``tl.dot``, as ``int4_awq_linear_reference`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_awq_gemv_kernel(x_ptr, qw_ptr, scales_ptr, pqs_ptr, y_ptr, M, N, K: tl.constexpr,
                          stride_xm, stride_qn, stride_sn, stride_ym,
                          GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    HALF_K: tl.constexpr = BLOCK_K // 2
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, HALF_K)  # byte j of the chunk: input columns 2j and 2j + 1
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + 2 * offs_j  # even input columns
        mask_k = cols < K
        mask_w = mask_n[:, None] & mask_k[None, :]
        packed = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (k0 // 2 + offs_j)[None, :], mask=mask_w, other=0x88)
        # Columns 2j and 2j + 1 share a group (the group size is even): the scale is a broadcast load from cache.
        scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + (cols // GROUP_SIZE)[None, :], mask=mask_w,
                        other=0.0)
        w_even = ((packed & 0x0F).to(tl.int32) - 8).to(tl.float32) * scale
        w_odd = ((packed >> 4).to(tl.int32) - 8).to(tl.float32) * scale
        mask_x = mask_m[:, None] & mask_k[None, :]
        x_row = x_ptr + offs_m[:, None] * stride_xm + cols[None, :]
        x_even = tl.load(x_row, mask=mask_x, other=0.0)
        x_odd = tl.load(x_row + 1, mask=mask_x, other=0.0)
        # x * pre_quant_scale in the activation dtype, as the reference does.
        x_even = x_even * tl.load(pqs_ptr + cols, mask=mask_k, other=0.0).to(x_even.dtype)[None, :]
        x_odd = x_odd * tl.load(pqs_ptr + cols + 1, mask=mask_k, other=0.0).to(x_odd.dtype)[None, :]
        if BLOCK_M == 1:
            acc += tl.sum(w_even * x_even.to(tl.float32) + w_odd * x_odd.to(tl.float32), axis=1)[None, :]
        elif tl.float32 == DOT_DTYPE:
            acc = tl.dot(x_even.to(tl.float32), tl.trans(w_even), acc, input_precision="ieee")
            acc = tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_even.to(DOT_DTYPE), tl.trans(w_even.to(DOT_DTYPE)), acc)
            acc = tl.dot(x_odd.to(DOT_DTYPE), tl.trans(w_odd.to(DOT_DTYPE)), acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def int4_gemv_config(m: int, n: int, k: int, group_size: int) -> dict:
    """Launch parameters: a row-reduction for M = 1, a 16-row ``tl.dot`` tile otherwise. Untuned on a GPU yet."""
    block_n = 16 if n <= 8192 else 32
    block_k = group_size * max(1, 512 // group_size) if m == 1 else group_size * max(1, 256 // group_size)
    if m == 1:
        return dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return dict(BLOCK_M=16, BLOCK_N=max(block_n, 32), BLOCK_K=block_k, num_warps=4, num_stages=3)


def int4_awq_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pre_quant_scale: torch.Tensor,
                  group_size: int = 128, config: dict | None = None) -> torch.Tensor:
    """INT4-AWQ linear for small M: x [..., K] (float32/float16/bfloat16), qweight uint8 [N, K // 2],
    scales float32 [N, K // group_size], pre_quant_scale float32 [K]. Returns [..., N] in ``x.dtype``."""
    n, half_k = qweight.shape
    k = 2 * half_k
    if qweight.dtype != torch.uint8 or x.shape[-1] != k or k % group_size or group_size % 2:
        raise ValueError(f"int4_awq_gemv: qweight must be uint8 [N, {x.shape[-1] // 2}] with K a multiple of an even "
                         f"group_size {group_size}, got {qweight.dtype} {list(qweight.shape)}")
    if scales.shape != (n, k // group_size) or pre_quant_scale.shape != (k,):
        raise ValueError(f"int4_awq_gemv: scales must be [{n}, {k // group_size}] and pre_quant_scale [{k}], "
                         f"got {list(scales.shape)} and {list(pre_quant_scale.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scales = scales if scales.stride(-1) == 1 else scales.contiguous()
    pre_quant_scale = pre_quant_scale.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = dict(config or int4_gemv_config(m, n, k, group_size))
    if cfg["BLOCK_K"] % group_size:
        raise ValueError(f"int4_awq_gemv: BLOCK_K {cfg['BLOCK_K']} must be a multiple of group_size {group_size}")
    # q * scale rounded to the activation dtype, as the reference does; float32 dots are IEEE (no TF32), and the
    # interpreter's half-precision dot is not usable.
    dot_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype, tl.float32) if x.is_cuda \
        else tl.float32
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _int4_awq_gemv_kernel[grid](x2, qweight, scales, pre_quant_scale, y, m, n, k,
                                x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
                                GROUP_SIZE=group_size, DOT_DTYPE=dot_dtype, **cfg)
    return y.reshape(*x.shape[:-1], n)
