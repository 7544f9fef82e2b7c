"""FP8 p @ v in the split-KV decode kernel against the float16 product, on one CUDA GPU: kernel time and error.

Llama-3-8B attention over an FP8 cache (``tools/bench_kernels.py``'s random caches, scattered blocks), the output
quantized for an FP8 o_proj as engines run it. Per case: both kernels timed in a CUDA graph (best of two rounds,
alternating), and the relative error of each against float32 attention over the same FP8 cache, beside how far the
FP8 cache itself moves that attention from the bf16 cache it was rounded from. docs/performance-notes.md has the
H200's figures (``RuntimeOptions.attention_fp8_pv``).

    python tools/attention_fp8_pv.py
"""

from __future__ import annotations

import functools
import sys

from bench_kernels import HEAD_DIM, make_case

# (name, context of each sequence)
CASES = [("b488 1-2k", [1000 + (i * 37) % 1000 for i in range(488)]), ("b256 1k", [1024] * 256),
         ("b256 2k", [2048] * 256), ("b2048 129-256", [129 + 37 * i % 128 for i in range(2048)]),
         ("b64 1k", [1024] * 64), ("b16 1k", [1024] * 16), ("b1 1k", [1024]), ("b440 3k", [3072] * 440)]
MAX_REFERENCE_SEQS = 488  # the reference attends sequence by sequence: skip the error where it would take minutes


def relative_error(out, expected) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("attention_fp8_pv: no CUDA GPU here", file=sys.stderr)
        return 2
    from triton.testing import do_bench_cudagraph

    from kiln.runtime.native.kernels.paged_attention import paged_attention_decode
    from kiln.runtime.native.kv_cache import token_major
    from kiln.runtime.native.layers.attention import paged_attention_reference

    generator = torch.Generator().manual_seed(0)
    scale, one = HEAD_DIM**-0.5, torch.tensor(1.0, device="cuda")
    print(f"{'case':14s} {'float16 us':>10s} {'FP8 us':>8s} {'ratio':>6s}   rel. error: float16, FP8, FP8 cache")
    for name, seq_lens in CASES:
        q, k_bf16, v_bf16, meta, _ = make_case([1] * len(seq_lens), seq_lens, "bf16", generator)
        k_cache, v_cache = k_bf16.to(torch.float8_e4m3fn), token_major(v_bf16.to(torch.float8_e4m3fn))
        call = functools.partial(paged_attention_decode, q, k_cache, v_cache, meta, scale, one, one)
        quantized = {fp8_pv: functools.partial(call, quant_scale=torch.tensor(0.01, device="cuda"), fp8_pv=fp8_pv)
                     for fp8_pv in (False, True)}
        times = {fp8_pv: [] for fp8_pv in quantized}
        for _ in range(2):
            for fp8_pv, kernel in quantized.items():
                times[fp8_pv].append(1e3 * do_bench_cudagraph(kernel, rep=50, return_mode="median"))
        fp16_us, fp8_us = min(times[False]), min(times[True])
        row = f"{name:14s} {fp16_us:10.1f} {fp8_us:8.1f} {fp8_us / fp16_us:6.3f}"
        if len(seq_lens) <= MAX_REFERENCE_SEQS:
            exact = paged_attention_reference(q.float(), k_cache, v_cache, meta, scale, one, one)
            errors = [relative_error(call(fp8_pv=fp8_pv), exact) for fp8_pv in (False, True)]
            errors.append(relative_error(exact, paged_attention_reference(q.float(), k_bf16, v_bf16, meta, scale)))
            row += "   " + ", ".join(f"{e:.1e}" for e in errors)
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
