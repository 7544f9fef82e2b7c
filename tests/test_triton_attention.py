"""Triton paged attention and KV store against the PyTorch reference: on CPU through triton's interpreter, and on a
CUDA GPU (``-m gpu``) in bf16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.native.attention_metadata import AttentionMetadata  # noqa: E402
from kiln.runtime.native.kernels import kv_store  # noqa: E402
from kiln.runtime.native.kernels.paged_attention import (  # noqa: E402
    decode_partition_size,
    paged_attention,
    paged_attention_decode,
    paged_attention_varlen,
    tiling,
)
from kiln.runtime.native.kv_cache import is_token_major, token_major  # noqa: E402
from kiln.runtime.native.layers.attention import paged_attention_reference, store_kv  # noqa: E402
from kiln.runtime.native.layers.linear import fp8_quantize  # noqa: E402

NUM_KV_HEADS, NUM_BLOCKS = 2, 48
# (cached tokens before this step, new tokens this step): a fresh prefill, a chunked prefill continuing a cached
# prefix, and decodes.
MIXED = [(0, 21), (37, 18), (40, 1), (5, 1)]
# a mixed step as the scheduler orders it: decodes first (split-KV), then a prefill and a chunk (varlen)
DECODES_FIRST = [(40, 1), (5, 1), (99, 1), (0, 21), (37, 18)]
# decode contexts: shorter than one partition of 32, exactly one, and spanning several
DECODE_SEQ_LENS = [1, 7, 32, 33, 100, 150]


@pytest.fixture
def device(kernel_device: str) -> str:
    return kernel_device


def model_dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def tolerance(device):
    return {"rtol": 2e-5, "atol": 2e-5} if device == "cpu" else {"rtol": 1e-2, "atol": 1e-2}


def random_batch(seqs, group, head_dim, block_size, device, fp8=False, seed=0, dtype=None):
    """Random caches (every slot filled, so a read outside a context shows), shuffled block tables, metadata and a
    q that is a strided view, as the model's qkv split gives it."""
    generator = torch.Generator().manual_seed(seed)
    dtype = dtype or model_dtype(device)
    shape = (NUM_BLOCKS, block_size, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = torch.tensor(0.02, device=device), torch.tensor(0.01, device=device)
        k_cache, v_cache = (k_cache / 0.02).to(torch.float8_e4m3fn), (v_cache / 0.01).to(torch.float8_e4m3fn)
    else:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()  # block 0 is the padding block
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    meta = AttentionMetadata.build([n for _, n in seqs], [c + n for c, n in seqs], tables, block_size, device)
    num_tokens, num_heads = sum(n for _, n in seqs), NUM_KV_HEADS * group
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, generator=generator).to(dtype)
    q = qkv.to(device)[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    return q, k_cache.to(device), v_cache.to(device), meta, k_scale, v_scale


def poisoned(q):
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


def token_major_with_stale_slots(v_cache, meta):
    """``v_cache`` stored token-major, as an engine keeps an FP8 V cache, with ±448 (E4M3's extremes) in every slot
    no sequence owns (each sequence's last block past its length, and the padding block): what a previous sequence
    may leave there, and what the kernels read and must cancel."""
    v_cache = token_major(v_cache)
    extreme = torch.tensor([0x7E, 0xFE], dtype=torch.uint8).repeat(v_cache.shape[-1] // 2)  # +448, -448
    block_size = v_cache.shape[1]
    for table, seq_len in zip(meta.block_tables.tolist(), meta.seq_lens.tolist(), strict=True):
        used = seq_len - (-(-seq_len // block_size) - 1) * block_size
        v_cache.view(torch.uint8)[table[-(-seq_len // block_size) - 1], used:] = extreme.to(v_cache.device)
    v_cache.view(torch.uint8)[0] = extreme.to(v_cache.device)
    return v_cache


FP8_V_LAYOUTS = pytest.mark.parametrize("token_major_v", [False, True], ids=["v-rows", "v-token-major"])


@pytest.mark.parametrize(("group", "head_dim", "block_size"),
                         [(1, 64, 16), (2, 128, 32), (4, 64, 32), (4, 128, 16)])
def test_varlen_kernel_matches_reference_on_a_mixed_batch(device, group, head_dim, block_size):
    q, k_cache, v_cache, meta, _, _ = random_batch(MIXED, group, head_dim, block_size, device)
    scale = head_dim**-0.5
    out = paged_attention_varlen(q, k_cache, v_cache, meta, scale, out=poisoned(q), block_m=16, block_n=16)
    torch.testing.assert_close(out, paged_attention_reference(q, k_cache, v_cache, meta, scale), **tolerance(device))


# A 16-bit model attends an FP8 cache in float16 with the scales folded into scores and output: bf16 on the CPU too.
FP8_CACHE_DTYPES = pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["model-dtype", "bf16"])


def fp8_tolerance(device, dtype):
    return tolerance(device) if dtype is None else {"rtol": 1e-2, "atol": 1e-2}


@FP8_V_LAYOUTS
@FP8_CACHE_DTYPES
def test_varlen_kernel_reads_an_fp8_cache_through_its_scales(device, dtype, token_major_v):
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch(MIXED, 2, 64, 16, device, fp8=True, dtype=dtype)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale)
    v_cache = token_major_with_stale_slots(v_cache, meta) if token_major_v else v_cache
    out = paged_attention_varlen(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale, out=poisoned(q))
    torch.testing.assert_close(out, expected, **fp8_tolerance(device, dtype))


# chunks whose cached prefix spans several whole 16-token tiles, which the varlen kernel attends without masks
# before the tiles of the causal diagonal: a prefix that ends on a tile boundary, one that does not, and a fresh prompt
LONG_PREFIXES = [(64, 20), (150, 37), (0, 45)]


@pytest.mark.parametrize("cache", ["bf16", "fp8-v-token-major"])
def test_varlen_kernel_attends_a_long_prefix_in_whole_tiles(device, cache):
    fp8 = cache != "bf16"
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch(LONG_PREFIXES, 2, 64, 16, device, fp8=fp8)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale)
    v_cache = token_major_with_stale_slots(v_cache, meta) if fp8 else v_cache
    out = paged_attention_varlen(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale, out=poisoned(q), block_m=16,
                                 block_n=16)
    torch.testing.assert_close(out, expected, **tolerance(device))


# blocks of 16 and 32 tokens: a partition of 32 spans two or one; of 64: a block holds two partitions
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(1, 128, 16), (2, 64, 32), (4, 64, 16), (2, 64, 64)])
def test_split_kv_decode_matches_reference_within_and_across_partitions(device, group, head_dim, block_size):
    q, k_cache, v_cache, meta, _, _ = random_batch([(n - 1, 1) for n in DECODE_SEQ_LENS], group, head_dim,
                                                   block_size, device)
    scale = head_dim**-0.5
    out = paged_attention_decode(q, k_cache, v_cache, meta, scale, out=poisoned(q), partition_size=32, block_n=16)
    torch.testing.assert_close(out, paged_attention_reference(q, k_cache, v_cache, meta, scale), **tolerance(device))


@FP8_V_LAYOUTS
@FP8_CACHE_DTYPES
def test_split_kv_decode_reads_an_fp8_cache_through_its_scales(device, dtype, token_major_v):
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch([(n - 1, 1) for n in DECODE_SEQ_LENS], 4, 64, 32,
                                                               device, fp8=True, dtype=dtype)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale)
    v_cache = token_major_with_stale_slots(v_cache, meta) if token_major_v else v_cache
    out = paged_attention_decode(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale, out=poisoned(q),
                                 partition_size=64)
    torch.testing.assert_close(out, expected, **fp8_tolerance(device, dtype))


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected).norm() / expected.norm()).item()


def test_fp8_pv_decode_is_within_e4m3_rounding_of_the_exact_attention(device):
    # FP8 p @ v rounds each probability to E4M3 (3 significant bits): about 2 % of the output on random data, where
    # the float16 product keeps it to a few 1e-3 (its bf16 q and output)
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch([(n - 1, 1) for n in DECODE_SEQ_LENS], 4, 64, 32,
                                                               device, fp8=True, dtype=torch.bfloat16)
    expected = paged_attention_reference(q.float(), k_cache, v_cache, meta, 0.125, k_scale, v_scale)
    v_cache = token_major_with_stale_slots(v_cache, meta)
    errors = {fp8_pv: relative_error(paged_attention_decode(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale,
                                                            out=poisoned(q), partition_size=64, fp8_pv=fp8_pv),
                                     expected) for fp8_pv in (False, True)}
    assert errors[False] < 5e-3 < errors[True] < 4e-2, errors
    # the dispatcher applies it to the decodes where the cache allows, and ignores it for a model-dtype cache
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale, fp8_pv=True),
                       paged_attention_decode(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale, fp8_pv=True))
    q, k_cache, v_cache, meta, _, _ = random_batch([(n - 1, 1) for n in DECODE_SEQ_LENS], 4, 64, 32, device)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.125, fp8_pv=True),
                       paged_attention(q, k_cache, v_cache, meta, 0.125))
    with pytest.raises(ValueError, match="fp8_pv needs an FP8 cache with V token-major"):
        paged_attention_decode(q, k_cache, v_cache, meta, 0.125, fp8_pv=True)


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])
def test_contexts_far_below_the_bound_split_into_the_grids_partitions(device, fp8):
    # a decode graph's bound is its plan's max_seq_len: 64 partitions of up to 64 tokens a sequence here, which
    # contexts of 1-150 tokens fill with partitions of whole tiles
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch([(n - 1, 1) for n in DECODE_SEQ_LENS], 4, 64, 16,
                                                               device, fp8=fp8)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale)
    bound = dataclasses.replace(meta, max_seq_len=64 * 64)
    out = paged_attention_decode(q, k_cache, v_cache, bound, 0.125, k_scale, v_scale, out=poisoned(q),
                                 partition_size=64, block_n=16)
    torch.testing.assert_close(out, expected, **(fp8_tolerance(device, None) if fp8 else tolerance(device)))


@pytest.mark.parametrize("quantized", [False, True], ids=["model-dtype", "fp8-output"])
def test_a_decode_within_one_partition_writes_what_the_reduce_would(device, quantized):
    # contexts of up to 150 tokens in partitions of 256: the partition kernel normalises and writes the output
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch([(n - 1, 1) for n in DECODE_SEQ_LENS], 4, 64, 32,
                                                               device, fp8=True)
    v_cache = token_major_with_stale_slots(v_cache, meta)
    quant_scale = torch.tensor(0.004, device=device) if quantized else None
    outs = [paged_attention_decode(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale, out=poisoned(q).to(
        torch.float8_e4m3fn if quantized else q.dtype), partition_size=256, quant_scale=quant_scale, lone=lone)
        for lone in (True, False)]
    assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8)) if quantized else \
        torch.allclose(outs[0], outs[1], atol=1e-2, rtol=0)
    if not quantized:
        expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale)
        torch.testing.assert_close(outs[0], expected, **fp8_tolerance(device, q.dtype))


@pytest.mark.parametrize(("fp8", "quantized"), [(False, False), (True, False), (True, True)],
                         ids=["model-dtype-cache", "fp8-cache", "fp8-cache-fp8-output"])
def test_a_small_decode_combines_its_partitions_in_the_last_program_to_finish(device, fp8, quantized):
    # with a decode graph's counters, the last partition of each (sequence, KV head) to finish combines them all:
    # the reduce kernel's output, the counters left zero for the next launch (run twice)
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch([(n - 1, 1) for n in DECODE_SEQ_LENS], 4, 64, 32,
                                                               device, fp8=fp8)
    quant_scale = torch.tensor(0.004, device=device) if quantized else None
    counters = torch.zeros(len(DECODE_SEQ_LENS) * NUM_KV_HEADS, dtype=torch.int32, device=device)

    def decode(metadata):
        out = poisoned(q).to(torch.float8_e4m3fn if quantized else q.dtype)
        return paged_attention_decode(q, k_cache, v_cache, metadata, 0.125, k_scale, v_scale, out=out,
                                      partition_size=128, quant_scale=quant_scale)  # two partitions

    counted = dataclasses.replace(meta, partition_counters=counters)
    assert tiling.combine_partitions(counted, len(DECODE_SEQ_LENS), NUM_KV_HEADS, 2)
    reduced = decode(meta)
    combined = [decode(counted) for _ in range(2)]
    assert not counters.any()
    for out in combined:
        if quantized:
            torch.testing.assert_close(out.float(), reduced.float(), rtol=0.07, atol=0.0)  # an E4M3 step at most
        else:
            torch.testing.assert_close(out, reduced, **tolerance(device))
    assert not quantized or torch.equal(combined[0].view(torch.uint8), combined[1].view(torch.uint8))


def test_only_small_decodes_with_counters_combine_in_the_partition_kernel():
    meta = AttentionMetadata.build([1], [5], [[1]], 32)
    with_counters = dataclasses.replace(meta, partition_counters=torch.zeros(16 * 8, dtype=torch.int32))
    combine = tiling.combine_partitions
    assert combine(with_counters, 16, 8, 2) and not combine(meta, 16, 8, 2)
    assert not combine(with_counters, 17, 8, 2) and not combine(with_counters, 16, 8, 3)
    with pytest.raises(ValueError, match="partition_counters must be int32 with 256 entries"):
        combine(with_counters, 16, 16, 2)


@pytest.mark.parametrize(("num_seqs", "max_seq_len", "fp8", "partition_size"), [
    (1, 1152, True, 64), (4, 8192, True, 1024), (16, 8192, True, 1024), (32, 2048, True, 2048),
    (64, 2048, True, 1024), (64, 4096, True, 2048), (440, 4096, True, 4096), (512, 2176, True, 4096),
    (2048, 256, True, 256), (8, 1024, False, 128), (16, 4096, False, 1024), (32, 4096, False, 2048),
    (16, 8192, False, 2048)])
def test_decode_partitions_fill_the_gpus_waves(monkeypatch, num_seqs, max_seq_len, fp8, partition_size):
    # an H200's 132 SMs and 8 KV heads; the FP8 kernel runs 3 programs an SM (396 a wave): 32 sequences of 2k take
    # one partition each, one wave of 256 programs and no reduce; 64 of 2k two waves of 1k-token partitions rather
    # than two of 2k; large batches one partition as long as the plan, never longer (2,048 sequences of 256 tokens:
    # 256, not 4,096). The bf16 kernel runs 4 (528 a wave), so its partitions are half as long below batch 64, as
    # the fastest measured were (tools/tune_partitions.py --kv-dtype bf16)
    monkeypatch.setattr(tiling, "num_sms", lambda device: 132)
    assert decode_partition_size(num_seqs, 8, max_seq_len, torch.device("cuda"), fp8) == partition_size


@pytest.mark.parametrize(("fp8", "max_seq_len", "block_n"), [
    (True, 256, 64), (True, 257, 128), (True, 4096, 128), (False, 256, 64), (False, 4096, 64)])
def test_short_plans_read_their_kv_in_small_tiles(fp8, max_seq_len, block_n):
    # a context of up to 256 tokens spans two to four 64-token tiles; the FP8 kernel's 128-token tile stays for
    # longer plans, where it is the faster
    assert tiling.decode_block_n(fp8, max_seq_len) == block_n


@pytest.mark.parametrize(("block_size", "block_n"), [(16, 32), (64, 16)], ids=["runs-of-blocks", "tiles-in-a-block"])
def test_token_major_fp8_v_tiles_smaller_and_larger_than_a_block(device, block_size, block_n):
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch([(n - 1, 1) for n in DECODE_SEQ_LENS], 2, 64,
                                                               block_size, device, fp8=True)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale)
    v_cache = token_major_with_stale_slots(v_cache, meta)
    out = paged_attention_decode(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale, out=poisoned(q),
                                 partition_size=64, block_n=block_n)
    torch.testing.assert_close(out, expected, **tolerance(device))


def test_kernels_refuse_a_v_cache_in_another_layout(device):
    q, k_cache, v_cache, meta, _, _ = random_batch(MIXED, 2, 64, 16, device)
    with pytest.raises(ValueError, match="V cache contiguous or token-major"):
        paged_attention_varlen(q, k_cache, v_cache.transpose(2, 3).contiguous().transpose(2, 3), meta, 0.125)


@pytest.mark.parametrize("seqs", [MIXED, DECODES_FIRST, [(n - 1, 1) for n in DECODE_SEQ_LENS]],
                         ids=["mixed", "decodes-first", "decode"])
def test_dispatcher_has_the_reference_contract(device, seqs):
    q, k_cache, v_cache, meta, _, _ = random_batch(seqs, 2, 64, 16, device)
    out = paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, paged_attention_reference(q, k_cache, v_cache, meta, 0.125), **tolerance(device))


def test_varlen_kernel_attends_only_the_sequences_from_first_seq_on(device):
    q, k_cache, v_cache, meta, _, _ = random_batch(DECODES_FIRST, 2, 64, 16, device)
    out = paged_attention_varlen(q, k_cache, v_cache, meta, 0.125, out=poisoned(q), first_seq=3)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out[3:], expected[3:], **tolerance(device))
    assert out[:3].isnan().all()


def test_dispatcher_splits_a_mixed_step_over_an_fp8_cache(device):
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch(DECODES_FIRST, 4, 64, 32, device, fp8=True)
    assert meta.num_decode_seqs == 3
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale)
    out = paged_attention(q, k_cache, token_major_with_stale_slots(v_cache, meta), meta, 0.125, k_scale, v_scale)
    torch.testing.assert_close(out, expected, **tolerance(device))


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["model-dtype-cache", "fp8-cache"])
@pytest.mark.parametrize("seqs", [DECODES_FIRST, [(n - 1, 1) for n in DECODE_SEQ_LENS]], ids=["mixed", "decode"])
def test_attention_quantizes_its_output_as_the_next_fp8_linear_would(device, fp8_cache, seqs):
    # with the o_proj's input scale, decode (the reduce kernel) and varlen rows come out as fp8_quantize of the
    # model-dtype output, byte for byte
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch(seqs, 4, 64, 32, device, fp8=fp8_cache)
    if fp8_cache:
        v_cache = token_major_with_stale_slots(v_cache, meta)
    scale = torch.tensor(0.004, device=device)
    plain = paged_attention(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale)
    quantized = paged_attention(q, k_cache, v_cache, meta, 0.125, k_scale, v_scale, quant_scale=scale)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == q.shape
    assert torch.equal(quantized.view(torch.uint8), fp8_quantize(plain, scale).view(torch.uint8))


def test_leading_decodes_are_the_batch_s_first_single_token_sequences():
    meta = AttentionMetadata.build([1, 1, 3, 2], [5, 9, 3, 6], [[1], [2], [3], [4]], 16)
    assert meta.num_decode_seqs == 2
    decodes = meta.leading_decodes()
    assert decodes.query_start_loc.tolist() == [0, 1, 2] and decodes.seq_lens.tolist() == [5, 9]
    assert decodes.max_query_len == 1 and decodes.block_tables.tolist() == [[1], [2]]
    assert decodes.slot_mapping.tolist() == [20, 40]
    assert AttentionMetadata.build([3, 1], [3, 4], [[1], [2]], 16).num_decode_seqs == 0


@pytest.mark.parametrize(("fp8", "token_major_v"), [(False, False), (True, False), (True, True)],
                         ids=["model-dtype-cache", "fp8-cache", "fp8-cache-token-major-v"])
def test_kv_store_kernel_writes_the_same_bytes_as_store_kv(device, fp8, token_major_v):
    generator = torch.Generator().manual_seed(1)
    dtype = model_dtype(device)
    q, k_cache, v_cache, meta, k_scale, v_scale = random_batch(MIXED, 1, 64, 16, device, fp8=fp8)
    k = (torch.randn(q.shape[0], NUM_KV_HEADS, 64, generator=generator) * 3).to(dtype).to(device)
    v = (torch.randn(q.shape[0], NUM_KV_HEADS, 64, generator=generator) * 3).to(dtype).to(device)
    if fp8:  # values that sit exactly on rounding ties and at the ±448 clamp
        k[0, 0, :4] = torch.tensor([0.02 * 17.0, 0.02 * 19.0, 0.02 * 500.0, -0.02 * 0.0068359375])
    rows_v = v_cache.clone()
    store_kv(k, v, k_cache.clone(), rows_v, meta.slot_mapping, k_scale, v_scale)
    v_cache = token_major(v_cache) if token_major_v else v_cache
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, expected_k, expected_v, meta.slot_mapping, k_scale, v_scale)
    kv_store.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    assert is_token_major(v_cache) == token_major_v  # and the same values as a row-major cache gets
    assert torch.equal(v_cache.view(torch.uint8), rows_v.view(torch.uint8))


@pytest.mark.parametrize("token_major_v", [False, True], ids=["v-rows", "v-token-major"])
def test_an_fp8_kv_store_writes_nan_as_zero(device, token_major_v):
    k_cache = torch.full((2, 16, NUM_KV_HEADS, 64), 1.0, device=device).to(torch.float8_e4m3fn)
    v_cache = token_major(k_cache) if token_major_v else k_cache
    k = torch.full((2, NUM_KV_HEADS, 64), float("nan"), dtype=model_dtype(device), device=device)
    k[1] = 2.0
    slots, scale = torch.tensor([3, 20], device=device), torch.tensor(0.5, device=device)
    for store in (store_kv, kv_store.store_kv):
        k_out, v_out = k_cache.clone(), v_cache.clone()
        store(k, k, k_out, v_out, slots, scale, scale)
        for cache in (k_out, v_out):
            assert cache[0, 3].float().eq(0).all() and cache[1, 4].float().eq(4).all()
            assert not cache.float().isnan().any()


def test_kv_store_kernel_skips_padding_slots(device):
    k_cache = torch.zeros(4, 16, NUM_KV_HEADS, 64, dtype=model_dtype(device), device=device)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, NUM_KV_HEADS, 64, dtype=k_cache.dtype, device=device)
    kv_store.store_kv(k, k, k_cache, v_cache, torch.tensor([17, -1, 3], device=device))
    written = k_cache.view(-1, NUM_KV_HEADS, 64)[:, 0, 0]
    assert written.nonzero().flatten().tolist() == [3, 17]


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (None, 2.0), (17, 3.0)],
                         ids=["window", "softcap", "window-and-softcap"])
@pytest.mark.parametrize("seqs", [DECODES_FIRST, [(n - 1, 1) for n in DECODE_SEQ_LENS]], ids=["mixed", "decode"])
def test_sliding_window_and_soft_capping_match_the_reference(device, seqs, window, softcap):
    q, k_cache, v_cache, meta, _, _ = random_batch(seqs, 2, 64, 16, device)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap),
                               expected, **tolerance(device))
    if meta.max_query_len == 1:  # partitions wholly before the window attend nothing
        out = paged_attention_decode(q, k_cache, v_cache, meta, 0.125, out=poisoned(q), partition_size=32,
                                     block_n=16, window=window, softcap=softcap)
        torch.testing.assert_close(out, expected, **tolerance(device))
