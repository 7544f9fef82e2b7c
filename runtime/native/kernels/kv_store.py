"""Store the new tokens' K/V into the paged caches: the Triton twin of ``runtime.native.layers.attention.store_kv``.

One program per token writes its K and V rows at ``slot_mapping[t]`` (flat slot = block * block_size + offset); a
negative slot is a padding token and writes nothing. Each cache is addressed through its strides, so a token-major V
cache (``runtime.native.kv_cache.token_major``) gets its values a token column at a time. An FP8 cache gets
``fp8_e4m3(clamp(x / scale, ±448))``, rounded to nearest-even exactly as torch does, so the stored bytes equal the
reference's; NaN is stored as 0. ``store_in_cache`` is that write for one token, which the rotary kernel shares
(``runtime.native.kernels.rotary``: an attention layer with RoPE stores its K/V there, in the launch that rotates k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.pdl import pdl_options, wait_for_previous_kernel
from kiln.runtime.native.kernels.rounding import quantize_e4m3
from kiln.runtime.native.kv_cache import is_token_major


@triton.jit
def store_in_cache(cache_ptr, x, slot, heads, dims, mask, scale_ptr, stride_block, stride_tok, stride_head,
                   stride_dim, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    """Write one token's values ``x`` [heads, dims] (masked by ``mask``, in the model dtype) at flat ``slot``
    (block * BLOCK_SIZE + offset) of a cache addressed through its strides; an FP8 cache gets them quantized with
    the scale at ``scale_ptr``, NaN as 0 (attention reads a block's stale slots past a sequence's end)."""
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    if FP8:
        x = quantize_e4m3(tl.where(x == x, x, 0.0), tl.load(scale_ptr))
    offs = block * stride_block + offset * stride_tok + heads * stride_head + dims * stride_dim
    tl.store(cache_ptr + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, stride_v_tok, stride_v_head, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr,
                     v_scale_ptr, stride_kc_block, stride_kc_tok, stride_kc_head, stride_vc_block, stride_vc_tok,
                     stride_vc_head, stride_vc_dim, stride_k_tok, stride_k_head,
                     BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    store_in_cache(k_cache_ptr, k, slot, heads, dims, mask, k_scale_ptr, stride_kc_block, stride_kc_tok,
                   stride_kc_head, 1, BLOCK_SIZE, FP8)
    store_in_cache(v_cache_ptr, v, slot, heads, dims, mask, v_scale_ptr, stride_vc_block, stride_vc_tok,
                   stride_vc_head, stride_vc_dim, BLOCK_SIZE, FP8)


@dataclass(frozen=True)
class PagedCaches:
    """One layer's paged caches (K contiguous, V contiguous or token-major), each token's flat slot (negative:
    padding, not written) and, for an FP8 cache, the K and V scales: where a step's new K/V go."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.k_cache.dtype == torch.float8_e4m3fn

    def kernel_args(self) -> tuple[tuple, dict]:
        """The kernels' arguments, checked: (caches, slots, scales, the caches' strides) and the BLOCK_SIZE and FP8
        constexprs."""
        if self.fp8 and (self.k_scale is None or self.v_scale is None):
            raise ValueError("store_kv: an FP8 KV cache needs k_scale and v_scale")
        if not self.k_cache.is_contiguous() or not (self.v_cache.is_contiguous() or is_token_major(self.v_cache)):
            raise ValueError("store_kv: the K cache must be contiguous and the V cache contiguous or token-major")
        scales = (self.k_scale, self.v_scale) if self.fp8 else (self.k_cache, self.v_cache)
        args = (self.k_cache, self.v_cache, self.slot_mapping, *scales, *self.k_cache.stride()[:3],
                *self.v_cache.stride())
        return args, {"BLOCK_SIZE": self.k_cache.shape[1], "FP8": self.fp8}

    @staticmethod
    def absent_args(pointer: torch.Tensor, slots: torch.Tensor) -> tuple[tuple, dict]:
        """``kernel_args``' shape for a launch that writes no cache (the kernel reads none of them): ``pointer``
        for every tensor but the integer ``slots``, zero strides."""
        return (pointer, pointer, slots, pointer, pointer) + (0,) * 7, {"BLOCK_SIZE": 1, "FP8": False}


@dataclass(frozen=True)
class CacheWrite:
    """The V [T, num_kv_heads, head_dim] (unit last stride) of a step's new tokens and the caches they go to.
    ``store_kv`` writes it; ``runtime.native.kernels.rotary.apply_rotary`` writes it from the K it rotates, in the
    same launch."""

    v: torch.Tensor
    caches: PagedCaches

    def kernel_args(self) -> tuple[tuple, dict]:
        """The kernels' arguments, checked: (V, its token and head strides, ``PagedCaches.kernel_args``) and that
        method's constexprs."""
        if self.v.stride(-1) != 1:
            raise ValueError("store_kv: v needs a unit last stride")
        args, constexprs = self.caches.kernel_args()
        return (self.v, self.v.stride(0), self.v.stride(1), *args), constexprs

    @staticmethod
    def absent_args(pointer: torch.Tensor, slots: torch.Tensor) -> tuple[tuple, dict]:
        """``kernel_args``' shape for a launch that writes no cache: see ``PagedCaches.absent_args``."""
        args, constexprs = PagedCaches.absent_args(pointer, slots)
        return (pointer, 0, 0, *args), constexprs


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, pdl: bool = True) -> None:
    """Write K/V [num_tokens, num_kv_heads, head_dim] at their flat slots; same contract as the reference."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        raise ValueError("store_kv: k needs a unit last stride")
    args, constexprs = CacheWrite(v, PagedCaches(k_cache, v_cache, slot_mapping, k_scale, v_scale)).kernel_args()
    _store_kv_kernel[(num_tokens,)](k, *args, k.stride(0), k.stride(1), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                                    BLOCK_H=triton.next_power_of_2(num_kv_heads),
                                    BLOCK_D=triton.next_power_of_2(head_dim), **constexprs, **pdl_options(k, pdl))
