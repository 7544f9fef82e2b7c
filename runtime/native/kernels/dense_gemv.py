"""Weight-streaming linear for one token with weights in the model dtype: ``y = x @ w^T``.

A batch-1 decode step is bound by reading every weight once. cuBLAS's GEMV streams a bf16 weight near bandwidth,
but a cuBLAS kernel is not launched with programmatic dependent launch (``runtime.native.kernels.pdl``), so each linear
waited for the kernel before it to drain and the next kernel for it. This kernel streams the same way and chains:
each program owns ``BLOCK_N`` output rows, walks K in ``BLOCK_K`` chunks (contiguous along K: wide vector loads),
multiplies them by the token in float32 and reduces each row in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel

# The fastest of 18 configurations (tools/tune_gemv.py --kernels dense --m 1's grid) on an H200, inside CUDA graphs,
# over the four Llama-3-8B linears at batch 1: 109 us for qkv, o, gate_up and down together against cuBLAS's 118
# (o 9.4 vs 13.8 us, down 28.4 vs 32.2; 3.6-4.2 TB/s).
BLOCK_N, BLOCK_K, NUM_WARPS = 8, 1024, 8


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, stride_wn, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptr + k0 + offs_k, mask=mask_k, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        w_ptrs += BLOCK_K
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
               num_warps: int = NUM_WARPS, pdl: bool = True) -> torch.Tensor:
    """``x @ weight^T`` for one token: x [..., K] with one row, weight [N, K] in x's dtype -> [..., N]."""
    k = x.shape[-1]
    if x.numel() != k or weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"dense_gemv: x must be one row of K features and weight [N, K] in its dtype, got x "
                         f"{x.dtype} {list(x.shape)}, weight {weight.dtype} {list(weight.shape)}")
    x1 = x.reshape(1, k).contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n = weight.shape[0]
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _dense_gemv_kernel[(triton.cdiv(n, block_n),)](x1, weight, y, n, k, weight.stride(0), BLOCK_N=block_n,
                                                  BLOCK_K=block_k, num_warps=num_warps, **pdl_options(x1, pdl))
    return y.reshape(*x.shape[:-1], n)
