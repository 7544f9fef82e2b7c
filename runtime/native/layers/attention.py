"""Paged attention: rotate q and k by their positions (RoPE, when the layer has it), store the new tokens' K/V into
the block caches, then attend through each block table.

A step of one whole prompt (``AttentionMetadata.whole_prompt``) attends over its new K/V directly instead, as
TensorRT-LLM's context phase does: unquantized even when the cache is FP8, and on CUDA through cuDNN's fused
attention (``prompt_attention``).

``paged_attention_reference`` is the plain PyTorch implementation (the CPU path and the oracle for GPU kernels).
Caches are [num_blocks, block_size, num_kv_heads, head_dim]; an FP8 cache holds ``x / scale`` in float8_e4m3fn.
On a CUDA device the Triton kernels of ``runtime.native.kernels`` run instead, as the layer's ``KernelChoice`` says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.kernel_choice import DEFAULT_KERNELS, KernelChoice
from kiln.runtime.native.kv_cache import KVCache
from kiln.runtime.native.layers.linear import fp8_quantize
from kiln.runtime.native.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from kiln.runtime.native.kernels.kv_store import PagedCaches


class PagedAttention(nn.Module):
    """Causal GQA attention over the paged KV cache; owns the FP8 KV scales when the cache is FP8. With ``rotary``
    it first rotates q and k by their positions, as TensorRT-LLM's attention op does: on the Triton path in the same
    launch that stores the new K/V (``runtime.native.kernels.rotary.apply_rotary``), or in the qkv projection's own
    launch where that projection can (``caches_to_store``, then ``attend_cached``)."""

    def __init__(self, head_dim: int, fp8_kv_cache: bool, rotary: RotaryEmbedding | None = None,
                 kernels: KernelChoice = DEFAULT_KERNELS, window: int | None = None, scale: float | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.scale = head_dim**-0.5 if scale is None else scale
        self.rotary = rotary
        self.kernels = kernels
        self.window = window  # a token attends to the last ``window`` positions only (itself included)
        self.softcap = softcap  # scores become softcap * tanh(scores / softcap) before the softmax
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32) if fp8_kv_cache else None)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32) if fp8_kv_cache else None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, quant_scale: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]; with
        ``quant_scale`` (which only the Triton path takes: ``Fp8Linear.fusable_input_scale``) float8_e4m3fn,
        quantized with it for the next FP8 linear. ``positions`` [T] (the tokens' absolute positions) are needed
        with ``rotary``."""
        k_cache, v_cache = kv_cache
        triton_path, pdl = self.kernels.use_triton(q), self.kernels.pdl
        # cuDNN's prompt attention has neither windows nor soft-capping: on CUDA such layers take the Triton kernels
        plain = self.window is None and self.softcap is None
        if quant_scale is not None and not triton_path:
            raise ValueError("PagedAttention: only the Triton kernels quantize their output")
        if self.rotary is not None and positions is None:
            raise ValueError("PagedAttention: rotary embeddings need the tokens' positions")
        if triton_path:
            from kiln.runtime.native.kernels import (  # imports triton: only here
                fp8_quant,
                kv_store,
                rotary,
            )

            if self.rotary is None:
                kv_store.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale, pdl=pdl)
            else:
                write = kv_store.CacheWrite(v, self._paged_caches(kv_cache, meta))
                q, k = rotary.apply_rotary(positions, q, k, self.rotary.cos_sin_cache, write,
                                           keep_k=meta.whole_prompt and plain, pdl=pdl)
        else:
            if self.rotary is not None:
                q, k = self.rotary(positions, q, k)
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        if meta.whole_prompt and (plain or not triton_path):
            out = prompt_attention(q, k, v, self.scale, self.window, self.softcap)
            if quant_scale is None:
                return out
            rows = out.reshape(out.shape[0], -1)  # token rows
            return fp8_quant.quantize_fp8(rows, quant_scale, pdl=pdl).view(out.shape)
        if triton_path:
            return self.attend_cached(q, meta, kv_cache, quant_scale)
        return paged_attention_reference(q, k_cache, v_cache, meta, self.scale, self.k_scale, self.v_scale,
                                         self.window, self.softcap)

    def caches_to_store(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> PagedCaches | None:
        """Where a qkv projection of ``x`` may store this step's K/V itself, rotating q and k on the way
        (``kernels.kv_store.PagedCaches``), before ``attend_cached``: on the Triton path of a layer with RoPE, in a
        step that attends through the cache (not one whole prompt). None otherwise."""
        if not self.kernels.use_triton(x) or self.rotary is None or meta.whole_prompt:
            return None
        return self._paged_caches(kv_cache, meta)

    def attend_cached(self, q: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                      quant_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The Triton attention of q [T, num_heads, head_dim] (rotated) over the caches, this step's K/V stored."""
        from kiln.runtime.native.kernels import paged_attention  # imports triton: only here

        k_cache, v_cache = kv_cache
        return paged_attention.paged_attention(q, k_cache, v_cache, meta, self.scale, self.k_scale, self.v_scale,
                                               quant_scale, pdl=self.kernels.pdl, window=self.window,
                                               softcap=self.softcap, fp8_pv=self.kernels.fp8_pv)

    def _paged_caches(self, kv_cache: KVCache, meta: AttentionMetadata) -> PagedCaches:
        from kiln.runtime.native.kernels.kv_store import PagedCaches  # imports triton: only here

        return PagedCaches(*kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)


# cuDNN first: on an H200 it attends a 1000-token Llama-3-8B prompt in 31-32 us per layer, against 49-65 us for the
# Triton varlen kernel over a bf16 or FP8 cache (tools/bench_kernels.py) and 56 us for SDPA's FlashAttention-2.
PROMPT_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]


# cuDNN builds an execution plan for every new sequence length it sees (48-64 ms on an H200, 0.6-1.1 s for the
# first), so on CUDA a prompt is padded to a multiple of this many tokens: the prefill graphs' buckets need no
# padding, and a prompt run eagerly meets one of a bounded number of plans. Causal attention hides the padding rows.
CUDA_PROMPT_LENGTH_MULTIPLE = 64


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal GQA attention of one sequence's tokens over themselves (over the last ``window`` of them, and with
    soft-capped scores, when given): q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim] ->
    [T, num_heads, head_dim], row i at position i."""
    num_tokens = q.shape[0]
    padding = -num_tokens % CUDA_PROMPT_LENGTH_MULTIPLE if q.is_cuda else 0
    if padding:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, padding)) for x in (q, k, v))
    mask = None  # plain causal attention builds no mask (the hot path)
    if window is not None or softcap is not None:
        positions = torch.arange(q.shape[0], device=q.device)
        mask = attention_mask(positions, positions, window)
    if softcap is not None:
        return softcapped_attention(q, k, v, mask, scale, softcap)[:num_tokens]
    with sdpa_kernel(PROMPT_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                             scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)[:num_tokens]


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         softcap: float) -> torch.Tensor:
    """GQA attention with scores ``softcap * tanh(q k^T scale / softcap)`` (as Gemma 2), softmax in float32:
    q [Tq, num_heads, head_dim], k and v [Tk, num_kv_heads, head_dim], ``mask`` [Tq, Tk] -> [Tq, num_heads,
    head_dim]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(q_pos), len(k_pos)]: True where a query may attend to a key: causally, and within the last ``window``
    positions when given (as transformers' sliding window: key position > query position - window)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    return allowed if window is None else allowed & (k_pos[None, :] > q_pos[:, None] - window)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write K/V of the new tokens at their flat slots (block * block_size + offset), quantizing with the scales
    when the cache is FP8, where NaN is stored as 0 (attention reads stale slots past a sequence's end and cancels
    them with zero probabilities, which a NaN would defeat); a cache may be laid out in any order (a token-major V
    cache is)."""
    block, offset = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if cache.dtype == torch.float8_e4m3fn:
            quantized = fp8_quantize(torch.where(x.isnan(), 0.0, x), scale)
            cache.view(torch.uint8)[block, offset] = quantized.view(torch.uint8)
        else:
            cache[block, offset] = x.to(cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """The first ``seq_len`` cached positions of one sequence, [seq_len, num_kv_heads, head_dim] in ``dtype``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    x = cache[block_table[:num_blocks].long()].reshape(-1, *cache.shape[2:])[:seq_len]
    if cache.dtype == torch.float8_e4m3fn:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None, window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached K/V (the new tokens already stored), over the
    last ``window`` positions and with soft-capped scores when given."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        k = gather_kv(k_cache, meta.block_tables[i], seq_len, k_scale, q.dtype)
        v = gather_kv(v_cache, meta.block_tables[i], seq_len, v_scale, q.dtype)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        mask = attention_mask(q_pos, torch.arange(seq_len, device=q.device), window)
        if softcap is not None:
            out[start:end] = softcapped_attention(q[start:end], k, v, mask, scale, softcap)
            continue
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out
