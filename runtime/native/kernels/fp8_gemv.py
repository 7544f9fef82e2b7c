"""Weight-streaming FP8 linear for small batches: ``y = (fp8(x / input_scale) * input_scale) @ (w * w_scale)^T``.

Decode at small M is bound by reading the weight once. The activation is quantized first (``quantize_fp8``, one
small kernel), then each program owns ``BLOCK_N`` output rows and walks K in ``BLOCK_K`` chunks of the FP8 weight
(contiguous along K: wide vector loads), multiplying them against the FP8 activations of all M rows, accumulating in
float32, and applies ``input_scale * weight_scale`` once at the end. M = 1 reduces each row in registers; larger M
uses one ``tl.dot`` per tile, on FP8 tensor cores on a GPU. The numerics are those of
``runtime.native.layers.linear.fp8_linear_reference`` (the layout is described there): both operands are exact E4M3
values, so the products are exact and only the float32 summation order differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.device_limits import program_shared_memory
from kiln.runtime.native.kernels.fp8_quant import quantize_fp8
from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel


@triton.jit
def accumulate_rows(acc, w, x, BLOCK_M: tl.constexpr, FP8_DOT: tl.constexpr):
    """``acc + x @ w^T`` in float32: ``acc`` [BLOCK_M, rows], FP8 ``x`` [BLOCK_M, BLOCK_K] and ``w`` [rows,
    BLOCK_K]. One row reduces in registers; more take a ``tl.dot`` (FP8 tensor cores with ``FP8_DOT``; the
    interpreter has no FP8 dot: exact float32 operands, IEEE products)."""
    if BLOCK_M == 1:
        return acc + tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
    elif FP8_DOT:
        return tl.dot(x, tl.trans(w), acc)
    else:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, w_scale_ptr, input_scale_ptr, y_ptr, M, N, K: tl.constexpr,
                     stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_DOT: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc = accumulate_rows(acc, w, x, BLOCK_M, FP8_DOT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0) * tl.load(input_scale_ptr)
    out = acc * out_scale[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_gemv_config(m: int, n: int, k: int) -> dict:
    """Launch parameters, the fastest of sweeps on an H200 inside CUDA graphs over Llama-3-8B's shapes with an FP8
    activation (tools/tune_gemv.py). M = 1: 4096-byte chunks of 8 weight rows (4 past 8192 input features), so that
    each program has its whole chunk in flight at once. More tokens: a 16-row FP8 ``tl.dot`` tile of 32 weight rows
    (64 past 4096) by 512 input columns, so that a narrow linear's few programs each load enough of its weight at
    once (128 columns for the widest linears, whose grid is large anyway), 6 tiles deep for the narrow linears (one
    program an SM streams a long row: Llama-3-8B's down_proj 23.1 -> 20.6 us at 8 tokens, o_proj 8.7 -> 8.1), 4 for
    the others. ``fitting_stages`` trims the depth to a smaller GPU's shared memory."""
    if m == 1:
        return dict(BLOCK_M=1, BLOCK_N=8 if k <= 8192 else 4, BLOCK_K=4096, num_warps=8,
                    num_stages=1 if k <= 8192 else 3)
    return dict(BLOCK_M=16, BLOCK_N=64 if n > 4096 else 32,
                BLOCK_K=128 if n >= 16384 else min(512, max(128, triton.next_power_of_2(k))), num_warps=4,
                num_stages=6 if n <= 4096 else 4)


def fitting_stages(cfg: dict, device: torch.device) -> dict:
    """``cfg`` with no more pipeline stages than a program's shared memory on ``device`` holds (each stage a
    [BLOCK_N, BLOCK_K] weight tile and a [BLOCK_M, BLOCK_K] activation tile, one byte an element): an H200 holds 6
    of the 2-16-token tiles, an sm_89 GPU 4."""
    if device.type != "cuda" or cfg["num_stages"] <= 2:
        return cfg
    stage_bytes = (cfg.get("BLOCK_N", 0) + 2 * cfg.get("BLOCK_P", 0) + cfg["BLOCK_M"]) * cfg["BLOCK_K"]
    return dict(cfg, num_stages=max(2, min(cfg["num_stages"], program_shared_memory(device) // stage_bytes)))


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
             config: dict | None = None, out_dtype: torch.dtype | None = None, pdl: bool = True) -> torch.Tensor:
    """FP8 linear for small M: x [..., K] (float32/float16/bfloat16, or float8_e4m3fn already quantized with
    ``input_scale``), weight float8_e4m3fn [N, K], weight_scale float32 [N], input_scale float32 [] (static).
    Returns [..., N] in ``out_dtype`` (default ``x.dtype``)."""
    x_q, weight = fp8_gemv_operands("fp8_gemv", x, weight, input_scale, out_dtype, pdl)
    (m, k), n = x_q.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m:
        cfg = fitting_stages(dict(config or fp8_gemv_config(m, n, k)), x.device)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
        _fp8_gemv_kernel[grid](x_q, weight, weight_scale, input_scale.reshape(()), y, m, n, k, x_q.stride(0),
                               weight.stride(0), y.stride(0), FP8_DOT=x.is_cuda, **cfg, **pdl_options(x_q, pdl))
    return y.reshape(*x.shape[:-1], n)


def fp8_gemv_operands(caller: str, x: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor,
                      out_dtype: torch.dtype | None, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked operands of an FP8 GEMV kernel: x's rows [M, K] quantized with ``input_scale`` (one small
    kernel, unless x is float8_e4m3fn already, which then needs ``out_dtype``) and the weight, each with a unit
    last stride."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{caller}: weight must be float8_e4m3fn [N, {x.shape[-1]}], got {weight.dtype} "
                         f"{list(weight.shape)}")
    k = weight.shape[1]
    if x.dtype == torch.float8_e4m3fn:
        if out_dtype is None:
            raise ValueError(f"{caller}: a float8_e4m3fn x needs out_dtype")
        x_q = x.reshape(-1, k)
        x_q = x_q if x_q.stride(-1) == 1 else x_q.contiguous()
    else:
        x_q = quantize_fp8(x, input_scale, pdl=pdl)
    return x_q, weight if weight.stride(-1) == 1 else weight.contiguous()
