"""Linear layers, one class per weight format; ``forward`` is one call, the CPU reference is a sibling function.

Runtime weight layouts (``rank0.safetensors``, per module prefix):

- ``Linear``: ``weight`` [out, in] in the engine dtype.
- ``Fp8Linear`` (modelopt FP8, static per-tensor scales): ``weight`` float8_e4m3fn [out, in], ``weight_scale``
  float32 [out] (per output channel, so fused QKV / gate-up keep each member's per-tensor scale exactly),
  ``input_scale`` float32 [] (static). ``y = (fp8(clamp(x / input_scale)) * input_scale) @ (weight * weight_scale)^T``,
  which is modelopt's fake-quantized numerics.
- ``Int4AwqLinear`` (modelopt W4A16_AWQ): ``qweight`` uint8 [out, in // 2] packed along the *input* dim: byte j of
  row n holds input columns 2j (low nibble) and 2j + 1 (high nibble) as ``q + 8`` (q in -8..7), so a kernel streams
  each output row contiguously along K; ``scales`` float32 [out, in // group_size]; ``pre_quant_scale`` float32
  [in] (AWQ smoothing factor, ones where modelopt folded it into the preceding norm).
  ``y = (x * pre_quant_scale) @ (q * scales[:, k // group_size])^T``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kiln.runtime.native.kernel_choice import DEFAULT_KERNELS, KernelChoice
from kiln.runtime.native.kernels.device_limits import has_fp8_tensor_cores

if TYPE_CHECKING:
    from kiln.runtime.native.kernels.kv_store import PagedCaches

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0
# The INT4 streaming kernel serves up to this many tokens; above, the weight is dequantized for a GEMM (on CUDA by
# one Triton kernel, runtime.native.kernels.int4_dequant).
INT4_STREAMING_MAX_M = 16
# An FP8 linear streams its weight up to this many tokens unless its engine's CUDA build measured the crossover with
# torch._scaled_mm for its shape (engines.native.tuning). On an H200 the Llama-3-8B shapes stream up to 16 or 32
# tokens (the narrow o_proj and down_proj 32, qkv_proj and gate_up_proj 16); an engine built on a CPU takes 16.
FP8_STREAMING_MAX_M = 16


class BiasedLinear(nn.Module, ABC):
    """What every format shares: an optional ``bias`` (in the engine dtype) added to ``matmul``'s output."""

    def init_bias(self, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        return out if self.bias is None else out + self.bias

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times the weight, in the format's own way."""

    def rotary_config(self, x: torch.Tensor, head_dim: int) -> dict | None:
        """The launch of this qkv projection of ``x`` with RoPE and the KV store in its epilogue (heads of
        ``head_dim``; ``fused_rotary`` runs it), or None where the format has no such kernel or it does not take
        ``x``: the caller then runs the linear, then the rotation."""
        return None


class Linear(BiasedLinear):
    """Dense linear, weight in the engine dtype; one token on CUDA takes the Triton weight-streaming kernel
    (``runtime.native.kernels.dense_gemv``), more take cuBLAS."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 kernels: KernelChoice = DEFAULT_KERNELS, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.kernels = kernels
        self.init_bias(out_features, bias, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.use_triton(x) and x.numel() == x.shape[-1] and x.dtype == self.weight.dtype:
            from kiln.runtime.native.kernels.dense_gemv import dense_gemv

            return dense_gemv(x, self.weight, pdl=self.kernels.pdl)
        return F.linear(x, self.weight)


class Fp8Linear(BiasedLinear):
    """FP8 (e4m3) weight with per-output-channel scale, activations quantized with a static per-tensor scale.

    Both CUDA paths start by quantizing the input with ``input_scale`` in a Triton kernel; ``fusable_input_scale``
    tells the kernel producing the input (RMSNorm, SiLU-and-multiply) to do it instead, and ``forward`` then takes
    the float8_e4m3fn input as it is and returns ``dtype``.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32,
                 streaming_max_m: int | None = None, kernels: KernelChoice = DEFAULT_KERNELS,
                 bias: bool = False) -> None:
        super().__init__()
        self.kernels = kernels
        self.init_bias(out_features, bias, dtype)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32))
        # measured by the engine's build when it ran on CUDA (engines.native.tuning), else the H200 default
        self.streaming_max_m = FP8_STREAMING_MAX_M if streaming_max_m is None else streaming_max_m
        self.dtype = dtype
        self.input_scale_rows: torch.Tensor | None = None  # see cache_derived_scales
        self.gemm_weight_scale: torch.Tensor | None = None

    def cache_derived_scales(self, max_rows: int) -> None:
        """Keep what the GEMM derives from the scales, so that no call derives it again; call it again whenever a
        scale changes. ``input_scale_rows``: ``input_scale`` repeated for up to ``max_rows`` rows, the per-row scale
        column of the rowwise ``torch._scaled_mm`` (one small kernel per linear per step otherwise).
        ``gemm_weight_scale``: the weight scale as one per-tensor value [] when every row has the same (an unfused
        linear of a per-tensor FP8 checkpoint: o_proj, down_proj), else ``weight_scale``."""
        self.input_scale_rows = self.input_scale.reshape(1, 1).expand(max_rows, 1).contiguous()
        scale = self.weight_scale
        self.gemm_weight_scale = scale[0].clone() if scale.numel() and bool((scale == scale[0]).all()) else scale

    def fusable_input_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """``input_scale`` when ``forward`` would quantize an input with the rows of ``x`` (any width) in a Triton
        kernel, so that the kernel producing it may hand over float8_e4m3fn rows instead; else None."""
        rows = x.reshape(-1, x.shape[-1])[:, :1].expand(-1, self.weight.shape[1])  # a view at this layer's width
        return self.input_scale if self.kernels.use_triton(rows) and self._cuda_path(rows) else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        path = self._cuda_path(x)
        if path == "streaming":
            from kiln.runtime.native.kernels.fp8_gemv import fp8_gemv

            return fp8_gemv(x, self.weight, self.weight_scale, self.input_scale, out_dtype=self._out_dtype(x),
                            pdl=self.kernels.pdl)
        if path == "scaled_mm":
            weight_scale = self.weight_scale if self.gemm_weight_scale is None else self.gemm_weight_scale
            return fp8_linear_scaled_mm(x, self.weight, weight_scale, self.input_scale, self._out_dtype(x),
                                        self.input_scale_rows, self.kernels)
        if x.dtype == torch.float8_e4m3fn:
            raise ValueError("Fp8Linear: a pre-quantized input needs a CUDA FP8 path (see fusable_input_scale)")
        return fp8_linear_reference(x, self.weight, self.weight_scale, self.input_scale)

    def rotary_config(self, x: torch.Tensor, head_dim: int) -> dict | None:
        """``kernels.fp8_qkv_rotary``'s launch, where the streaming kernel takes ``x``, its tiles fit the heads and
        there is no bias."""
        if self.bias is not None or self._cuda_path(x) != "streaming":
            return None
        from kiln.runtime.native.kernels.fp8_qkv_rotary import qkv_rotary_config

        n, k = self.weight.shape
        return qkv_rotary_config(x.numel() // k, n, k, head_dim)

    def fused_rotary(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, caches: PagedCaches,
                     num_heads: int, num_kv_heads: int, config: dict) -> torch.Tensor:
        """This qkv projection of ``x`` with RoPE and the KV store in one launch (``config`` from ``rotary_config``;
        ``caches`` the layer's ``PagedCaches``): q [T, num_heads, head_dim] rotated, the rotated K and the V stored."""
        from kiln.runtime.native.kernels.fp8_qkv_rotary import fp8_qkv_rotary

        return fp8_qkv_rotary(x.reshape(-1, self.weight.shape[1]), self.weight, self.weight_scale, self.input_scale,
                              positions, cos_sin_cache, caches, num_heads, num_kv_heads, self._out_dtype(x), config,
                              pdl=self.kernels.pdl)

    def _cuda_path(self, x: torch.Tensor) -> str | None:
        """The path an input with ``x``'s rows takes: "streaming" (the Triton kernel), "scaled_mm", or None (the
        dequantizing reference)."""
        if self.kernels.streams(x, self.streaming_max_m):
            return "streaming"
        return "scaled_mm" if use_scaled_mm(x, self.weight) else None

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        return self.dtype if x.dtype == torch.float8_e4m3fn else x.dtype


class Int4AwqLinear(BiasedLinear):
    """INT4 weight, symmetric per-group scales along the input dim, AWQ pre-quant scale on the activations."""

    def __init__(self, in_features: int, out_features: int, group_size: int,
                 dtype: torch.dtype = torch.float32, kernels: KernelChoice = DEFAULT_KERNELS,
                 bias: bool = False) -> None:
        super().__init__()
        self.kernels = kernels
        self.init_bias(out_features, bias, dtype)
        if in_features % group_size or in_features % 2:
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
        self.group_size = group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, in_features // group_size, dtype=torch.float32))
        # held in the activation dtype (rounded once when loaded), as every forward multiplies by it in that dtype
        self.register_buffer("pre_quant_scale", torch.ones(in_features, dtype=dtype))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._streams(x):
            from kiln.runtime.native.kernels.int4_gemv import int4_awq_gemv

            return int4_awq_gemv(x, self.qweight, self.scales, self.pre_quant_scale, self.group_size,
                                 pdl=self.kernels.pdl)
        if self.kernels.use_triton(x):  # dequantize once, in one pass, then a cuBLAS GEMM
            from kiln.runtime.native.kernels.int4_dequant import int4_dequantize as int4_dequantize_kernel

            weight = int4_dequantize_kernel(self.qweight, self.scales, self.group_size, x.dtype)
            return F.linear(x * self.pre_quant_scale.to(x.dtype), weight)
        return int4_awq_linear_reference(x, self.qweight, self.scales, self.pre_quant_scale, self.group_size)

    def rotary_config(self, x: torch.Tensor, head_dim: int) -> dict | None:
        """``kernels.int4_qkv_rotary``'s launch, for one token on the streaming kernel where its tiles fit the heads
        and there is no bias."""
        if self.bias is not None or x.numel() != x.shape[-1] or not self._streams(x):
            return None
        from kiln.runtime.native.kernels.int4_qkv_rotary import int4_qkv_rotary_config

        return int4_qkv_rotary_config(self.qweight.shape[0], x.shape[-1], self.group_size, head_dim)

    def _streams(self, x: torch.Tensor) -> bool:
        """Whether an input with ``x``'s rows takes the streaming kernels (a few tokens on the Triton path, in groups
        they serve)."""
        if not self.kernels.streams(x, INT4_STREAMING_MAX_M):
            return False
        from kiln.runtime.native.kernels.int4_gemv import supports_group_size

        return supports_group_size(self.group_size)

    def fused_rotary(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, caches: PagedCaches,
                     num_heads: int, num_kv_heads: int, config: dict) -> torch.Tensor:
        """This qkv projection of one token ``x`` with RoPE and the KV store in one launch (``config`` from
        ``rotary_config``): q [1, num_heads, head_dim] rotated, the rotated K and the V stored in ``caches``."""
        from kiln.runtime.native.kernels.int4_qkv_rotary import int4_qkv_rotary

        return int4_qkv_rotary(x.reshape(1, -1), self.qweight, self.scales, self.pre_quant_scale, self.group_size,
                               positions, cos_sin_cache, caches, num_heads, num_kv_heads, config,
                               pdl=self.kernels.pdl)


def make_linear(fmt: str, in_features: int, out_features: int, dtype: torch.dtype, group_size: int | None,
                fp8_streaming_max_m: int | None = None, kernels: KernelChoice = DEFAULT_KERNELS,
                bias: bool = False) -> BiasedLinear:
    """The linear module of quantization format ``fmt`` ("none", "fp8" or "int4_awq"), with a ``bias`` when asked;
    an FP8 one streams up to ``fp8_streaming_max_m`` tokens (default: ``FP8_STREAMING_MAX_M``)."""
    if fmt == "none":
        return Linear(in_features, out_features, dtype, kernels, bias)
    if fmt == "fp8":
        return Fp8Linear(in_features, out_features, dtype, fp8_streaming_max_m, kernels, bias)
    if fmt == "int4_awq":
        return Int4AwqLinear(in_features, out_features, group_size, dtype, kernels, bias)
    raise ValueError(f"unknown linear format {fmt!r}")


def fusable_input_scale(linear: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The scale with which the kernel producing ``linear``'s input (rows like ``x``'s) may quantize it: an FP8
    linear's ``Fp8Linear.fusable_input_scale``; None for other formats."""
    return linear.fusable_input_scale(x) if isinstance(linear, Fp8Linear) else None


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8_e4m3(clamp(x / scale, ±448))``, computed in float32."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor) -> torch.Tensor:
    """Dequantize both operands to ``x.dtype`` and multiply: modelopt's fake-quantized FP8 linear."""
    x_deq = (fp8_quantize(x, input_scale).float() * input_scale).to(x.dtype)
    w_deq = (weight.float() * weight_scale[:, None]).to(x.dtype)
    return F.linear(x_deq, w_deq)


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor, out_dtype: torch.dtype | None = None,
                         input_scale_rows: torch.Tensor | None = None,
                         kernels: KernelChoice = DEFAULT_KERNELS) -> torch.Tensor:
    """FP8 tensor-core GEMM (CUDA, compute capability >= 8.9), scales applied in the epilogue; returns
    ``out_dtype`` (default ``x.dtype``). A float8_e4m3fn ``x`` is taken as already quantized with ``input_scale``.
    ``weight_scale`` is float32 [N] (per output channel) or [] (per tensor).

    bfloat16 output with a per-tensor weight scale uses tensorwise scaling (cuBLASLt's FP8 GEMM; on an H200 as fast
    as rowwise at 512-1024 tokens, 11 % faster for a Llama-3-8B layer's o_proj and down_proj at 256 tokens and 6 % at
    8192); with per-channel scales, rowwise scaling (scale_a [M, 1], scale_b [1, N]), scale_a the first M rows of
    ``input_scale_rows`` (``input_scale`` repeated, float32 [R, 1]) when it has that many, else a fresh copy. Other
    dtypes take a float32 tensorwise GEMM and apply the weight scale afterwards, since rowwise scaling only produces
    bfloat16. Both accumulate with Hopper's fast FP8 accumulation (``use_fast_accum``), as
    Transformer Engine does for forward GEMMs: 1.08-1.12x faster on an H200 for Llama-3-8B's layers at 64-8192
    tokens, relative error against a float32 product 2.1e-3 instead of 1.7e-3.
    """
    x2 = x.reshape(-1, x.shape[-1])
    if x.dtype == torch.float8_e4m3fn:
        if out_dtype is None:
            raise ValueError("fp8_linear_scaled_mm: a float8_e4m3fn x needs out_dtype")
        x_q = x2
    elif kernels.use_triton(x):
        from kiln.runtime.native.kernels.fp8_quant import quantize_fp8

        x_q = quantize_fp8(x2, input_scale, pdl=kernels.pdl)  # one kernel instead of four
    else:
        x_q = fp8_quantize(x2, input_scale)
    out_dtype = out_dtype or x.dtype
    if out_dtype == torch.bfloat16 and weight_scale.dim() == 0:
        out = torch._scaled_mm(x_q, weight.t(), scale_a=input_scale, scale_b=weight_scale, out_dtype=torch.bfloat16,
                               use_fast_accum=True)
    elif out_dtype == torch.bfloat16:
        rows = x_q.shape[0]
        if input_scale_rows is not None and input_scale_rows.shape[0] >= rows:
            scale_a = input_scale_rows[:rows]
        else:
            scale_a = input_scale.reshape(1, 1).expand(rows, 1).contiguous()
        out = torch._scaled_mm(x_q, weight.t(), scale_a=scale_a, scale_b=weight_scale.reshape(1, -1),
                               out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        out = torch._scaled_mm(x_q, weight.t(), scale_a=input_scale, scale_b=input_scale.new_ones(()),
                               out_dtype=torch.float32, use_fast_accum=True)
        out = (out * weight_scale).to(out_dtype)
    return out.reshape(*x.shape[:-1], -1)


def use_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``fp8_linear_scaled_mm`` can run: a CUDA device with FP8 tensor cores and 16-aligned K and N."""
    return (x.is_cuda and x.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0 and x.numel() > 0
            and has_fp8_tensor_cores(x.device))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int values -8..7 [out, in] into uint8 [out, in // 2] along the input dim (low nibble = even column)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: int8 [out, in] with values -8..7."""
    low = (qweight & 0x0F).to(torch.int8) - 8
    high = (qweight >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).reshape(qweight.shape[0], -1)


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight [out, in] that modelopt's fake quantization used."""
    return unpack_int4(qweight).float() * scales.repeat_interleave(group_size, dim=1)


def int4_awq_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                              pre_quant_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dequantize the weight to ``x.dtype`` and multiply: modelopt's fake-quantized W4A16 AWQ linear."""
    x = x * pre_quant_scale.to(x.dtype)
    return F.linear(x, int4_dequantize(qweight, scales, group_size).to(x.dtype))
