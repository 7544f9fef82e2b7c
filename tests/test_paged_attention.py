"""Paged attention reference against dense causal attention, for a mixed flat batch over shuffled blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.layers.attention import PagedAttention, store_kv
from kiln.runtime.native.layers.linear import fp8_quantize

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 4, 32
# (cached tokens before this step, new tokens this step): a fresh prefill, a chunked prefill continuing a cached
# prefix, and two decodes.
SEQUENCES = [(0, 7), (5, 6), (9, 1), (14, 1)]


def dense_causal_attention(q, k, v, q_start):
    """q [q_len, H, D] at positions q_start.., k/v [seq_len, KVH, D]: plain softmax(q k^T / sqrt(D)) v with GQA."""
    k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v)


def shuffled_block_tables(generator):
    free = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()  # block 0 is the padding block
    tables = []
    for cached, new in SEQUENCES:
        n = -(-(cached + new) // BLOCK_SIZE)
        tables.append([free.pop() for _ in range(n)])
    return tables


def run_mixed_batch(fp8: bool):
    generator = torch.Generator().manual_seed(0)
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.float32
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    attn = PagedAttention(HEAD_DIM, fp8_kv_cache=fp8)
    if fp8:
        attn.k_scale.fill_(0.02)
        attn.v_scale.fill_(0.01)
    tables = shuffled_block_tables(generator)
    keys = [torch.randn(c + n, NUM_KV_HEADS, HEAD_DIM, generator=generator) for c, n in SEQUENCES]
    values = [torch.randn(c + n, NUM_KV_HEADS, HEAD_DIM, generator=generator) for c, n in SEQUENCES]
    queries = [torch.randn(n, NUM_HEADS, HEAD_DIM, generator=generator) for _, n in SEQUENCES]

    # earlier steps: the cached prefixes are already in the cache
    cached = [(i, c) for i, (c, _) in enumerate(SEQUENCES) if c]
    prefix = AttentionMetadata.build([c for _, c in cached], [c for _, c in cached], [tables[i] for i, _ in cached],
                                     BLOCK_SIZE)
    store_kv(torch.cat([keys[i][:c] for i, c in cached]), torch.cat([values[i][:c] for i, c in cached]),
             k_cache, v_cache, prefix.slot_mapping, attn.k_scale, attn.v_scale)

    meta = AttentionMetadata.build([n for _, n in SEQUENCES], [c + n for c, n in SEQUENCES], tables, BLOCK_SIZE)
    out = attn(torch.cat(queries), torch.cat([k[c:] for k, (c, _) in zip(keys, SEQUENCES, strict=True)]),
               torch.cat([v[c:] for v, (c, _) in zip(values, SEQUENCES, strict=True)]), meta, (k_cache, v_cache))
    if fp8:  # the reference sees what an FP8 cache can hold
        keys = [fp8_quantize(k, attn.k_scale).float() * attn.k_scale for k in keys]
        values = [fp8_quantize(v, attn.v_scale).float() * attn.v_scale for v in values]
    expected = [dense_causal_attention(q, k, v, c)
                for q, k, v, (c, _) in zip(queries, keys, values, SEQUENCES, strict=True)]
    return out, torch.cat(expected)


@pytest.mark.parametrize("fp8", [False, True], ids=["float32-cache", "fp8-cache"])
def test_mixed_batch_matches_dense_causal_attention(fp8):
    out, expected = run_mixed_batch(fp8)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("whole_prompt", [False, True], ids=["mixed-batch", "whole-prompt"])
def test_rotary_attention_rotates_q_and_k_before_storing_and_attending(kernel_device, whole_prompt):
    """With RoPE the layer attends rotate(q) over rotate(k) at the tokens' positions, and caches the rotated K; the
    Triton path (interpreted on CPU, in float32; compiled on a GPU, in bfloat16), which rotates and stores in one
    launch, agrees with the PyTorch path."""
    pytest.importorskip("triton")
    from kiln.runtime.native.kernel_choice import KernelChoice
    from kiln.runtime.native.layers.rotary import RotaryEmbedding

    dtype, tolerance = (torch.float32, 1e-5) if kernel_device == "cpu" else (torch.bfloat16, 1e-2)
    generator = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None).to(kernel_device)
    seqs = SEQUENCES[:1] if whole_prompt else SEQUENCES
    tables = shuffled_block_tables(generator)[:len(seqs)]
    meta = AttentionMetadata.build([n for _, n in seqs], [c + n for c, n in seqs], tables, BLOCK_SIZE, kernel_device)
    meta.whole_prompt = whole_prompt
    positions = torch.cat([torch.arange(c, c + n) for c, n in seqs]).to(kernel_device)
    total = positions.shape[0]
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=generator).to(kernel_device, dtype)
    k, v = (torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(kernel_device, dtype) for _ in range(2))
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(kernel_device, dtype)
    results = []
    for triton_path in (False, True):
        kernels = KernelChoice(triton=triton_path, interpreted=triton_path)
        caches = (cache.clone(), cache.clone())
        out = PagedAttention(HEAD_DIM, fp8_kv_cache=False, rotary=rope, kernels=kernels)(q, k, v, meta, caches,
                                                                                          positions=positions)
        results.append((out, *caches))
    rotated_q, rotated_k = rope(positions, q, k)
    plain_caches = (cache.clone(), cache.clone())
    reference = PagedAttention(HEAD_DIM, fp8_kv_cache=False, kernels=KernelChoice(triton=False))
    expected = reference(rotated_q, rotated_k, v, meta, plain_caches)
    for out, k_cache, v_cache in results:
        torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
        assert torch.equal(k_cache, plain_caches[0]) and torch.equal(v_cache, plain_caches[1])
    with pytest.raises(ValueError, match="positions"):
        PagedAttention(HEAD_DIM, fp8_kv_cache=False, rotary=rope)(q, k, v, meta, (cache, cache))


def test_a_whole_prompt_attends_over_its_unquantized_kv_and_stores_it_quantized():
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(9, NUM_HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(9, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    attn = PagedAttention(HEAD_DIM, fp8_kv_cache=True)
    attn.k_scale.fill_(0.02)
    meta = AttentionMetadata.build([9], [9], [[5, 3, 8]], BLOCK_SIZE)
    assert meta.whole_prompt
    out = attn(q, k, v, meta, (k_cache, v_cache))
    torch.testing.assert_close(out, dense_causal_attention(q, k, v, 0), rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache[5].view(torch.uint8), fp8_quantize(k[:4], attn.k_scale).view(torch.uint8))
    assert torch.equal(v_cache[8, 0].view(torch.uint8), fp8_quantize(v[8], attn.v_scale).view(torch.uint8))


def test_only_one_sequence_without_cached_context_is_a_whole_prompt():
    assert AttentionMetadata.build([1], [1], [[1]], BLOCK_SIZE).whole_prompt
    assert not AttentionMetadata.build([6], [11], [[1, 2, 3]], BLOCK_SIZE).whole_prompt  # after a prefix-cache hit
    assert not AttentionMetadata.build([7, 5], [7, 5], [[1, 2], [3, 4]], BLOCK_SIZE).whole_prompt


def test_slot_mapping_follows_the_block_table():
    meta = AttentionMetadata.build([3, 1], [6, 5], [[7, 2], [4, 9]], block_size=4)
    # sequence 0 writes positions 3, 4, 5 -> block 7 offset 3, block 2 offsets 0 and 1; sequence 1 writes position 4
    assert meta.slot_mapping.tolist() == [31, 8, 9, 36]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [6, 5]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 6)
    assert meta.block_tables.tolist() == [[7, 2], [4, 9]]
    assert (meta.slot_mapping.dtype, meta.query_start_loc.dtype, meta.seq_lens.dtype, meta.block_tables.dtype) == (
        torch.int64, torch.int32, torch.int32, torch.int32)


def test_block_tables_of_different_lengths_are_padded_with_block_0():
    meta = AttentionMetadata.build([1, 2], [1, 6], [[3], [5, 6]], block_size=4)
    assert meta.block_tables.tolist() == [[3, 0], [5, 6]]
    assert meta.slot_mapping.tolist() == [12, 24, 25]


@pytest.mark.parametrize(("query_lens", "seq_lens", "tables", "message"), [
    ([0], [4], [[1]], "query_len 0, seq_len 4"),
    ([5], [4], [[1, 2]], "query_len 5, seq_len 4"),
    ([1, 9], [1, 9], [[1], [2, 3]], "query_len 9, seq_len 9, 2 blocks of 4"),
    ([1], [1, 2], [[1]], "one of each per sequence"),
])
def test_inconsistent_sequences_are_refused_by_name(query_lens, seq_lens, tables, message):
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(query_lens, seq_lens, tables, block_size=4)


def test_fp8_cache_stores_values_divided_by_the_scale():
    k_cache = torch.zeros(2, 4, 1, 2, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    k = torch.tensor([[[0.5, -1.0]]])
    store_kv(k, 2 * k, k_cache, v_cache, torch.tensor([5]), torch.tensor(0.25), torch.tensor(0.5))
    assert k_cache[1, 1].float().tolist() == [[2.0, -4.0]]
    assert v_cache[1, 1].float().tolist() == [[2.0, -4.0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_paged_attention_on_gpu_matches_cpu():
    generator = torch.Generator().manual_seed(0)
    tables = shuffled_block_tables(generator)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    total_new = sum(n for _, n in SEQUENCES)
    q = torch.randn(total_new, NUM_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(total_new, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(total_new, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    attn = PagedAttention(HEAD_DIM, fp8_kv_cache=False)
    outputs = []
    for device in ("cpu", "cuda"):
        meta = AttentionMetadata.build([n for _, n in SEQUENCES], [c + n for c, n in SEQUENCES], tables, BLOCK_SIZE,
                                       device)
        caches = (k_cache.clone().to(device), v_cache.clone().to(device))
        outputs.append(attn.to(device)(q.to(device), k.to(device), v.to(device), meta, caches).cpu())
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantized_output", [False, True], ids=["bf16-out", "fp8-out"])
def test_whole_prompt_attention_on_gpu_matches_dense_attention(quantized_output):
    from kiln.runtime.native.kernels.fp8_quant import quantize_fp8

    generator = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_dim, tokens, block_size = 32, 8, 128, 1000, 16
    q = torch.randn(tokens, num_heads, head_dim, generator=generator)
    k, v = (torch.randn(tokens, num_kv_heads, head_dim, generator=generator) for _ in range(2))
    caches = tuple(torch.zeros(64, block_size, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn, device="cuda")
                   for _ in range(2))
    meta = AttentionMetadata.build([tokens], [tokens], [list(range(1, 64))], block_size, "cuda")
    attn = PagedAttention(head_dim, fp8_kv_cache=True).cuda()
    quant_scale = torch.tensor(0.01, device="cuda") if quantized_output else None
    qkv = [x.cuda().bfloat16() for x in (q, k, v)]
    out = attn(*qkv, meta, caches, quant_scale)
    expected = F.scaled_dot_product_attention(*(x.float().transpose(0, 1) for x in qkv), is_causal=True,
                                              enable_gqa=True).transpose(0, 1)
    if quantized_output:
        assert out.dtype == torch.float8_e4m3fn
        out = out.float().view_as(expected) * quant_scale
        expected = quantize_fp8(expected, quant_scale).float().view_as(expected) * quant_scale
        torch.testing.assert_close(out, expected, rtol=0.13, atol=2 * 0.01)  # one FP8 step either side
    else:
        torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_longrope_takes_the_long_table_for_every_position_of_a_sequence_past_the_original_context():
    from kiln.runtime.native.layers.rotary import RotaryEmbedding

    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
               "original_max_position_embeddings": 6, "attention_factor": 1.2}
    rotary = RotaryEmbedding(8, 16, 10000.0, scaling)
    assert list(rotary.table_rows(3, 3, seq_len=6)) == [3, 4, 5]  # as long as the original context: short
    assert list(rotary.table_rows(0, 3, seq_len=7)) == [16, 17, 18]  # longer: long from its first position
    assert (rotary.cache_salt(6), rotary.cache_salt(7)) == (b"", b"longrope-long")
    assert (rotary.recompute_point(4), rotary.recompute_point(7)) == (7, None)  # a short one recomputes at 7
    cos_short, cos_long = rotary.cos_sin_cache[1, :4], rotary.cos_sin_cache[16 + 1, :4]
    assert torch.allclose(cos_short, 1.2 * torch.cos(1.0 / 10000.0 ** (torch.arange(0, 8, 2) / 8)))
    assert torch.allclose(cos_long, 1.2 * torch.cos(1.0 / (4.0 * 10000.0 ** (torch.arange(0, 8, 2) / 8))))
    plain = RotaryEmbedding(8, 16, 10000.0, None)
    assert plain.table_rows(3, 2, seq_len=100) == range(3, 5) and plain.cache_salt(100) == b""
    assert plain.recompute_point(4) is None
