"""Weight-streaming INT4-AWQ (W4A16) linear for small batches: ``y = (x * pre_quant_scale) @ (q * scales)^T``.

The layout is ``runtime.layers.linear``'s: ``qweight`` uint8 [N, K // 2], byte j of row n holds input columns 2j
(low nibble) and 2j + 1 (high nibble) as ``q + 8``; ``scales`` float32 [N, K // group_size]; ``pre_quant_scale``
float32 [K]. The activation is multiplied by ``pre_quant_scale`` first (in its dtype, as the reference does). Each
program owns ``BLOCK_N`` output rows and walks K in ``BLOCK_K`` chunks (a multiple of the group size): it loads the
packed bytes and the chunk's group scales once and splits the nibbles in registers. M = 1 sums ``q * x`` per group
and multiplies each group's sum by its scale once; larger M dequantizes the tile, rounds it to the activation dtype
(as ``int4_awq_linear_reference`` does) and runs ``tl.dot`` against the even and odd activation columns. A nibble
becomes a float by bit arithmetic (``nibble_value``) rather than an integer-to-float conversion, which runs at a
quarter of the FMA rate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def nibble_value(nibble):
    """``nibble - 8`` as float32 for int32 ``nibble`` in 0..15: 0x4B000000 | n is the float 2**23 + n, exactly."""
    return (nibble | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _int4_awq_gemv_row_kernel(x_ptr, qw_ptr, scales_ptr, y_ptr, N, K: tl.constexpr, stride_qn, stride_sn,
                              GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """M = 1: each step covers GROUPS whole groups of BLOCK_N rows, as a [BLOCK_N, GROUPS, GROUP_SIZE // 2] tile of
    packed bytes; ``sum_k q_k s_g x_k = sum_g s_g sum_{k in g} q_k x_k``, so each group's sum takes its scale once."""
    HALF_GROUP: tl.constexpr = GROUP_SIZE // 2
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUPS)
    offs_j = tl.arange(0, HALF_GROUP)
    mask_n = offs_n < N
    byte = offs_g[:, None] * HALF_GROUP + offs_j[None, :]  # [GROUPS, HALF_GROUP]: byte of the step's chunk
    qw_rows = qw_ptr + offs_n.to(tl.int64)[:, None, None] * stride_qn
    cols = tl.arange(0, GROUPS * GROUP_SIZE)  # the step's input columns
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, GROUPS * GROUP_SIZE):
        groups = k0 // GROUP_SIZE + offs_g
        mask_g = groups < K // GROUP_SIZE
        packed = tl.load(qw_rows + (k0 // 2 + byte)[None, :, :], mask=mask_n[:, None, None] & mask_g[None, :, None],
                         other=0x88).to(tl.int32)
        x = tl.load(x_ptr + k0 + cols, mask=cols < K - k0, other=0.0).to(tl.float32)
        x_even, x_odd = tl.split(tl.reshape(x, [GROUPS, HALF_GROUP, 2]))  # input columns 2j and 2j + 1
        q_even = nibble_value(packed & 0x0F)
        q_odd = nibble_value(packed >> 4)
        per_group = tl.sum(q_even * x_even[None, :, :] + q_odd * x_odd[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
        scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + groups[None, :],
                        mask=mask_n[:, None] & mask_g[None, :], other=0.0)
        acc += tl.sum(per_group * scale, axis=1)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _int4_awq_gemv_kernel(x_ptr, qw_ptr, scales_ptr, y_ptr, M, N, K: tl.constexpr,
                          stride_xm, stride_qn, stride_sn, stride_ym,
                          GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    HALF_K: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, HALF_K)  # byte j of the chunk: input columns 2j and 2j + 1
    offs_g = tl.arange(0, GROUPS)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # input column of the chunk
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # masks and offsets over contiguous ranges (bytes, input columns), so that the loads are vectorised
        mask_j = k0 // 2 + offs_j < K // 2
        packed = tl.load(qw_ptr + offs_n[:, None].to(tl.int64) * stride_qn + (k0 // 2 + offs_j)[None, :],
                         mask=mask_n[:, None] & mask_j[None, :], other=0x88)
        q_even = nibble_value((packed & 0x0F).to(tl.int32))
        q_odd = nibble_value((packed >> 4).to(tl.int32))
        groups = k0 // GROUP_SIZE + offs_g
        scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + groups[None, :],
                        mask=mask_n[:, None] & (groups < K // GROUP_SIZE)[None, :], other=0.0)  # [BLOCK_N, GROUPS]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=mask_m[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, HALF_K, 2]))  # input columns 2j and 2j + 1
        s = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, GROUPS, GROUP_SIZE // 2]), [BLOCK_N, HALF_K])
        w_even = q_even * s
        w_odd = q_odd * s
        if tl.float32 == DOT_DTYPE:
            acc = tl.dot(x_even.to(tl.float32), tl.trans(w_even), acc, input_precision="ieee")
            acc = tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_even.to(DOT_DTYPE), tl.trans(w_even.to(DOT_DTYPE)), acc)
            acc = tl.dot(x_odd.to(DOT_DTYPE), tl.trans(w_odd.to(DOT_DTYPE)), acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def int4_gemv_config(m: int, n: int, k: int, group_size: int) -> dict:
    """Launch parameters: for M = 1, BLOCK_N rows of GROUPS whole groups per step; above, a 16-row ``tl.dot`` tile."""
    if m == 1:
        return dict(BLOCK_N=8, GROUPS=max(1, 1024 // group_size), num_warps=4, num_stages=3)
    return dict(BLOCK_M=16, BLOCK_N=64 if n >= 16384 else 32, BLOCK_K=group_size * max(1, 256 // group_size),
                num_warps=4, num_stages=3)


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
    x2 = x2 * pre_quant_scale.to(x.dtype)  # in the activation dtype, as the reference does
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = dict(config or int4_gemv_config(m, n, k, group_size))
    if m == 1:
        _int4_awq_gemv_row_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
            x2, qweight, scales, y, n, k, qweight.stride(0), scales.stride(0), GROUP_SIZE=group_size, **cfg)
        return y.reshape(*x.shape[:-1], n)
    if cfg["BLOCK_K"] % group_size:
        raise ValueError(f"int4_awq_gemv: BLOCK_K {cfg['BLOCK_K']} must be a multiple of group_size {group_size}")
    # q * scale rounded to the activation dtype, as the reference does; float32 dots are IEEE (no TF32), and the
    # interpreter's half-precision dot is not usable.
    dot_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype, tl.float32) if x.is_cuda \
        else tl.float32
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _int4_awq_gemv_kernel[grid](x2, qweight, scales, y, m, n, k,
                                x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
                                GROUP_SIZE=group_size, DOT_DTYPE=dot_dtype, **cfg)
    return y.reshape(*x.shape[:-1], n)
