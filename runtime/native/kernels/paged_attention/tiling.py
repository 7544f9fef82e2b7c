"""How the paged-attention kernels cut their work: KV tokens per tile and pipeline stages by cache dtype, the
split-KV decode's partition size, and when a small decode's partitions combine themselves."""

from __future__ import annotations

import torch
import triton

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.kernels.device_limits import num_sms

# Split-KV decode partitions hold a power of two of 64..4096 tokens, chosen by counting waves: the grid (sequences x
# KV heads x partitions) runs ``programs_per_sm`` programs an SM at a time (the kernel's occupancy, DECODE_TILES),
# each wave as long as a partition plus PROGRAM_COST_TOKENS of fixed work, and more than one partition adds the reduce
# kernel, REDUCE_COST_TOKENS. Fitted to tools/tune_partitions.py on an H200 (FP8 KV, output quantized, 2026-12-04:
# batches 4-256, plans of 1-8k tokens, contexts filling all or a quarter of them): the chosen size is within 2 % of
# the fastest (geometric mean; 7 % at a quarter), where the rule before (about 4 programs per SM) was 12 % off (21 %).
# The bf16 kernel's smaller tiles fit 4 programs an SM: counted with 3, its sizes were one step too long below batch
# 64 (9 % off the fastest on average, 27 % at worst); with 4, 0.2 % (2 %), and 3.8 % (32 %) for contexts a quarter
# of the plan (batches 4-128 of the same grid, 2026-12-04).
# KV tokens per tile and pipeline stages by cache dtype (model dtype, FP8), the fastest of tools/tune_attention.py on
# an H200 at batch 256 over 1k-2k contexts, and for a 1k-token prefill (FP8: with V token-major; 128-token varlen
# tiles spill registers there). On the H200, decode reading a contiguous V as rows (which the compiler copies
# asynchronously) was 12-15 % faster than the transposed tile, which the varlen kernel keeps (13 % faster there for
# bf16); an FP8 V read token-major was another 22 % faster in decode, 15 % slower in varlen. Decode with FP8 KV
# prefetches one tile ahead (3 stages: 2 K/V buffers, 74 KB of shared memory, 3 programs per SM), 7-9 % faster than
# 2 stages at batch 256; a bf16 cache gains nothing from it.
DECODE_TILES = {False: dict(block_n=64, num_stages=2, programs_per_sm=4),
                True: dict(block_n=128, num_stages=3, programs_per_sm=3)}
VARLEN_TILES = {False: dict(block_n=64, num_stages=2), True: dict(block_n=64, num_stages=3)}
# Contexts of up to SHORT_CONTEXT tokens (TensorRT-LLM's 128/128 row) read in tiles of at most SHORT_CONTEXT_BLOCK_N:
# each program then holds two to four tiles, not one or two. FP8 KV on an H200, output quantized, a plan of 256 tokens,
# contexts of 129-256 (2026-12-04, CUDA-graph medians a layer): 2,048 sequences 323 -> 295 us, 512 85 -> 79, 64 14.8
# -> 11.8, 8 unchanged. Over 1-2k tokens the 64-token tile is 8 % slower, so longer plans keep DECODE_TILES, and so do
# mixed steps (their partitions of MAX_PARTITION_SIZE), which keeps them to one compiled kernel whatever their
# contexts (with short tiles, 2,048 decodes of 129-256 tokens there took 307 us instead of 329).
SHORT_CONTEXT, SHORT_CONTEXT_BLOCK_N = 256, 64
MIN_PARTITION_SIZE, MAX_PARTITION_SIZE = 64, 4096
PROGRAM_COST_TOKENS, REDUCE_COST_TOKENS = 512, 128
# Small decode steps of two partitions skip the reduce kernel: the last of a (sequence, KV head)'s partitions to
# finish combines them (``combine_partitions``). On an H200 (FP8, FP8 KV, contexts of 1k, graph replay, two rounds)
# a step of 16 sequences (two partitions of 512) took 3.61-3.62 ms against 3.72; where the partitions are many, one
# program combining them all lost to the reduce kernel's many as often as it won (8 partitions at 4 sequences:
# 3.17-3.18 against 3.07 ms; 16 at 2: 3.03-3.04 against 2.99-3.00; 16 at one: 2.656-2.663 against 2.671-2.678).
COMBINE_MAX_SEQS, COMBINE_MAX_PARTITIONS = 16, 2


def combine_partitions(meta: AttentionMetadata, num_seqs: int, num_kv_heads: int, max_partitions: int) -> bool:
    """Whether the last partition of each (sequence, KV head) to finish combines the partitions itself, instead of
    the reduce kernel: where meta carries ``partition_counters`` (a decode graph's: zeros, one a sequence and KV head,
    which each combining program leaves zero again) and the step is small (up to COMBINE_MAX_SEQS sequences and
    COMBINE_MAX_PARTITIONS partitions)."""
    counters = meta.partition_counters
    if counters is None or num_seqs > COMBINE_MAX_SEQS or max_partitions > COMBINE_MAX_PARTITIONS:
        return False
    if counters.dtype != torch.int32 or counters.numel() < num_seqs * num_kv_heads:
        raise ValueError(f"paged_attention: partition_counters must be int32 with {num_seqs * num_kv_heads} "
                         f"entries or more, got {counters.dtype} {list(counters.shape)}")
    return True


def decode_block_n(fp8: bool, max_seq_len: int) -> int:
    """KV tokens per tile of the split-KV decode over contexts of up to ``max_seq_len``."""
    block_n = DECODE_TILES[fp8]["block_n"]
    return min(block_n, SHORT_CONTEXT_BLOCK_N) if max_seq_len <= SHORT_CONTEXT else block_n


def decode_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                          fp8: bool) -> int:
    """Tokens per split-KV partition over contexts of up to ``max_seq_len`` in an FP8 (``fp8``) or model-dtype
    cache: the power of two from MIN_PARTITION_SIZE to MAX_PARTITION_SIZE (and no larger than one partition holding
    ``max_seq_len`` needs) whose waves of programs take the least time by the count above; the smaller size on a
    tie."""
    slots = DECODE_TILES[fp8]["programs_per_sm"] * num_sms(device)

    def cost(size: int) -> int:
        partitions = triton.cdiv(max_seq_len, size)
        waves = triton.cdiv(num_seqs * num_kv_heads * partitions, slots)
        return waves * (min(size, max_seq_len) + PROGRAM_COST_TOKENS) + (REDUCE_COST_TOKENS if partitions > 1 else 0)

    sizes = [MIN_PARTITION_SIZE]
    while sizes[-1] < min(max_seq_len, MAX_PARTITION_SIZE):
        sizes.append(sizes[-1] * 2)
    return min(sizes, key=cost)
