"""``paged_attention``: the split-KV decode, the varlen kernel, or both for a mixed step."""

from __future__ import annotations

import torch

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.kernels.paged_attention.decode import paged_attention_decode
from kiln.runtime.native.kernels.paged_attention.operands import fp8_pv_applies
from kiln.runtime.native.kernels.paged_attention.tiling import MAX_PARTITION_SIZE
from kiln.runtime.native.kernels.paged_attention.varlen import paged_attention_varlen


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    quant_scale: torch.Tensor | None = None, pdl: bool = True, window: int | None = None,
                    softcap: float | None = None, fp8_pv: bool = False) -> torch.Tensor:
    """Same contract as ``paged_attention_reference`` (with ``quant_scale`` the output quantized for an FP8 linear,
    as the varlen kernel does): split-KV decode when every q_len is 1, varlen otherwise; a
    mixed step's leading decodes go through the decode kernel (on an H200, varlen reads their long contexts in one
    program per sequence and KV head: 63 of a 168 ms step of 504 decodes and 7,688 prefill tokens, 32 once split).
    Their partitions are the largest, whatever the step's size, so that every mixed step runs one compiled kernel
    (one partition holds each context of up to MAX_PARTITION_SIZE tokens, with no reduce). ``fp8_pv``: the decodes'
    p @ v in FP8 where the cache allows it (``paged_attention_decode``); prompts keep float16."""
    options = dict(quant_scale=quant_scale, pdl=pdl, window=window, softcap=softcap)
    fp8_pv = fp8_pv and fp8_pv_applies(q, k_cache, v_cache)
    if meta.max_query_len == 1:
        return paged_attention_decode(q, k_cache, v_cache, meta, scale, k_scale, v_scale, fp8_pv=fp8_pv, **options)
    if meta.num_decode_seqs:
        out = paged_attention_decode(q, k_cache, v_cache, meta.leading_decodes(), scale, k_scale, v_scale,
                                     partition_size=MAX_PARTITION_SIZE, fp8_pv=fp8_pv, **options)
        return paged_attention_varlen(q, k_cache, v_cache, meta, scale, k_scale, v_scale, out=out,
                                      first_seq=meta.num_decode_seqs, **options)
    return paged_attention_varlen(q, k_cache, v_cache, meta, scale, k_scale, v_scale, **options)
