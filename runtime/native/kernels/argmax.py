"""Row-wise argmax of logits, the sampler's greedy tokens: ``torch.argmax(x, -1)``'s result (the first index of the
largest value, a NaN counting as larger than any number) from many programs per row.

PyTorch reduces each row in one thread block, which leaves a GPU with one or a few rows nearly idle: a Llama-3
vocabulary of 128,256 logits took 36 us of a 2.7 ms batch-1 decode step on an H200 (3 us here). Here each row is
split into chunks of ``BLOCK``-wide loads, enough programs to fill the GPU; each program keeps the best value and
index of its chunk, and a second launch picks each row's best of the chunks (a row that fits one program is written
directly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.native.kernels.device_limits import num_sms

BLOCK = 1024  # logits a program loads at once (8 per thread on 4 warps)
# Chunks are cut so that the launch has about this many programs an SM. On an H200 (bf16 logits of 128,256 tokens,
# CUDA graphs): 1, 8, 64, 256, 512 and 2,048 rows took 3.3, 4.9, 11.7, 33.5, 61.6 and 225.6 us, torch.argmax 26.2,
# 27.0, 27.2, 46.4, 79.2 and 270.5; with 2 programs an SM 256 rows took 68.9 us (one program a row), with 8 36.3.
PROGRAMS_PER_SM = 16
LAST_INDEX = tl.constexpr(2**31 - 1)  # the index of a masked lane: it loses every tie


@triton.jit
def _better(a_value, a_index, b_value, b_index):
    """``(a_value, a_index)`` or ``(b_value, b_index)``, whichever torch.argmax keeps: a NaN first, then the larger
    value, then on a tie the smaller index."""
    a_nan = a_value != a_value
    b_nan = b_value != b_value
    a_wins = (a_nan & (~b_nan | (a_index < b_index))) | (
        ~a_nan & ~b_nan & ((a_value > b_value) | ((a_value == b_value) & (a_index < b_index))))
    return tl.where(a_wins, a_value, b_value), tl.where(a_wins, a_index, b_index)


@triton.jit
def _argmax_chunks_kernel(x_ptr, stride_x, vocab, chunk, chunk_value_ptr, chunk_index_ptr, out_ptr,
                          BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    best_value = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], LAST_INDEX, tl.int32)
    for offset in tl.range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        inside = cols < end
        value = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
        best_value, best_index = _better(best_value, best_index, value, tl.where(inside, cols, LAST_INDEX))
    value, index = tl.reduce((best_value, best_index), 0, _better)
    if ONE_CHUNK:
        tl.store(out_ptr + row, index.to(tl.int64))
    else:
        chunks = tl.num_programs(1)
        tl.store(chunk_value_ptr + row * chunks + part, value)
        tl.store(chunk_index_ptr + row * chunks + part, index)


@triton.jit
def _argmax_of_chunks_kernel(chunk_value_ptr, chunk_index_ptr, out_ptr, chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, CHUNKS)
    inside = k < chunks
    value = tl.load(chunk_value_ptr + row * chunks + k, mask=inside, other=float("-inf"))
    index = tl.load(chunk_index_ptr + row * chunks + k, mask=inside, other=LAST_INDEX)
    _, best = tl.reduce((value, index), 0, _better)
    tl.store(out_ptr + row, best.to(tl.int64))


def argmax_rows(x: torch.Tensor, max_programs: int | None = None, block: int = BLOCK) -> torch.Tensor:
    """``x.argmax(-1)`` (int64 [n]) of ``x`` [n, vocab] (float32/float16/bfloat16, rows contiguous). ``max_programs``
    caps the launch (default: ``PROGRAMS_PER_SM`` an SM, and at least one a row); ``block`` (a power of two) is how
    many logits a program loads at once."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"argmax_rows takes [rows, vocab] with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    programs = max_programs or PROGRAMS_PER_SM * num_sms(x.device)
    chunks = max(1, min(triton.cdiv(vocab, block), programs // rows))
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    chunks = triton.cdiv(vocab, chunk)
    one_chunk = chunks == 1
    chunk_value = out if one_chunk else torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    chunk_index = out if one_chunk else torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    _argmax_chunks_kernel[(rows, chunks)](x, x.stride(0), vocab, chunk, chunk_value, chunk_index, out, BLOCK=block,
                                          ONE_CHUNK=one_chunk, num_warps=4)
    if not one_chunk:
        _argmax_of_chunks_kernel[(rows,)](chunk_value, chunk_index, out, chunks,
                                          CHUNKS=triton.next_power_of_2(chunks), num_warps=1)
    return out
