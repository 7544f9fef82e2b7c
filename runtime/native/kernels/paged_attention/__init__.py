"""Paged attention in Triton: the GPU twin of ``runtime.native.layers.attention.paged_attention_reference``.

Two kernels over the same paged caches ([num_blocks, block_size, num_kv_heads, head_dim]; K contiguous, V contiguous
or token-major within each block, as an engine keeps an FP8 V cache: ``runtime.native.kv_cache``). An FP8 cache is read
as it is stored: its elements convert exactly to float16 (one instruction per pair on sm_89+) and the two scales
are applied once per tile, ``k_scale`` to the scores and ``v_scale`` to the output, instead of per element. With
``fp8_pv``, decode keeps V in E4M3 and rounds the probabilities to E4M3 for p @ v.
V enters p @ v as rows [tokens, head_dim] (decode, contiguous V), as a transposed [head_dim, tokens] tile (varlen,
contiguous V), or, token-major, as V^T in v^T @ p^T with the output accumulated transposed.

- ``paged_attention_varlen``: any flat batch (prefill, chunked prefill, prefix-cache hits, decode). Token t of
  sequence i sits at position ``seq_lens[i] - q_len_i + t`` and attends causally. One program per (query tile of a
  sequence, KV head); its rows are the tile's tokens times the KV head's GQA group, so each K/V tile is read once for
  the whole group. Online softmax in float32, K/V gathered through the block table token by token.
- ``paged_attention_decode``: every q_len == 1 (flash-decoding). The context is cut into partitions of
  ``partition_size`` tokens (64 to 2048, smaller when few sequences would leave SMs idle); one program per
  (sequence, KV head, partition) reads the partition's block-table entries once, then writes a partial max, sum and
  unnormalised output, and a second kernel combines the partitions of each (sequence, head). When one partition
  holds every context, the partition kernel writes the output itself; in a small decode graph's step of two
  partitions, the last of them to finish combines both (``combine_partitions``).

Both grids launch the KV heads fastest, so that the programs reading one token's heads, whose K rows lie side by side
in the cache, run together (on an H200 decode is 1.2-2.5 % faster than with the sequences fastest, varlen 0.3-4 %).
Every length is read from device tensors: the grids are bounded by ``meta.max_query_len`` / ``meta.max_seq_len``,
host ints the metadata already carries, so no launch synchronises with the host.
"""

from __future__ import annotations

from kiln.runtime.native.kernels.paged_attention.decode import paged_attention_decode
from kiln.runtime.native.kernels.paged_attention.dispatch import paged_attention
from kiln.runtime.native.kernels.paged_attention.operands import fp8_pv_applies
from kiln.runtime.native.kernels.paged_attention.tiling import combine_partitions, decode_partition_size
from kiln.runtime.native.kernels.paged_attention.varlen import paged_attention_varlen

__all__ = ["combine_partitions", "decode_partition_size", "fp8_pv_applies", "paged_attention",
           "paged_attention_decode", "paged_attention_varlen"]
