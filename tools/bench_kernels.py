"""Micro-benchmark of the Triton paged-attention kernels against the PyTorch reference on one CUDA GPU.

Llama-3-8B-like attention (32 heads, 8 KV heads, head_dim 128, blocks of 32 tokens): decode at batch 1/16/64 over
contexts of 1k and 4k tokens, a 1k-token prefill, and the same prefill as a whole prompt attended over its new K/V
(``prompt_attention``, cuDNN; the "triton" column times it). Times are medians: the kernels replayed in a CUDA graph
(``do_bench_cudagraph``, as the engine runs them), the reference (which synchronises with the host) by
``do_bench``; bandwidth is the bytes of K/V each kernel must read once, over its time, against the H200's ~4.3 TB/s.

    python tools/bench_kernels.py [--kv-dtype fp8] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from kiln.pipeline.bench.floor import NOMINAL_COPY_GBS

PEAK_BANDWIDTH = NOMINAL_COPY_GBS["H200"] * 1e9  # bytes/s: what an H200 copies, the floor kiln bench uses
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 32
# (name, query_lens, seq_lens)
CASES = [(f"decode b{b} ctx{c // 1024}k", [1] * b, [c] * b) for b in (1, 16, 64) for c in (1024, 4096)]
CASES.append(("prefill 1k", [1024], [1024]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16", help="KV cache dtype (default bf16)")
    parser.add_argument("--warmup", type=int, default=25, help="reference warm-up time in ms (default 25)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time in ms (default 100)")
    parser.add_argument("--no-reference", action="store_true", help="time only the Triton kernels")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser.parse_args(argv)


def make_case(query_lens, seq_lens, kv_dtype, generator, block_size: int = BLOCK_SIZE):
    import torch

    from kiln.runtime.native.attention_metadata import AttentionMetadata
    from kiln.runtime.native.kv_cache import token_major

    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # scattered blocks, 0 is padding
    tables = []
    for n in blocks_per_seq:
        tables.append(order[:n])
        order = order[n:]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cuda")
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    scales = (None, None)
    if kv_dtype == "fp8":  # V token-major, as the engine keeps an FP8 V cache
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), token_major(v_cache.to(torch.float8_e4m3fn))
        scales = (torch.tensor(1.0, device="cuda"), torch.tensor(1.0, device="cuda"))
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return q, k_cache, v_cache, meta, scales


def time_case(case: str, kernel, reference, kv_bytes: int, args: argparse.Namespace) -> dict:
    """One row: ``kernel`` inside a CUDA graph, as the engine runs it (the Python launch cost of small kernels is not
    counted), the reference by ``do_bench``, and their largest difference."""
    import triton.testing

    max_err = (kernel().float() - reference().float()).abs().max().item()
    kernel_ms = triton.testing.do_bench_cudagraph(kernel, rep=args.rep, return_mode="median")
    reference_ms = None
    if not args.no_reference:
        reference_ms = triton.testing.do_bench(reference, warmup=args.warmup, rep=args.rep, return_mode="median")
    return {"case": case, "triton_us": kernel_ms * 1e3,
            "reference_us": None if reference_ms is None else reference_ms * 1e3,
            "kv_bytes": kv_bytes, "bandwidth_tb_s": kv_bytes / (kernel_ms * 1e-3) / 1e12, "max_abs_err": max_err}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU; run it on the GPU machine", file=sys.stderr)
        return 2
    from kiln.runtime.native.kernels.paged_attention import paged_attention
    from kiln.runtime.native.layers.attention import gather_kv, paged_attention_reference, prompt_attention

    generator = torch.Generator().manual_seed(0)
    rows = []
    for name, query_lens, seq_lens in CASES:
        q, k_cache, v_cache, meta, (k_scale, v_scale) = make_case(query_lens, seq_lens, args.kv_dtype, generator)
        scale = HEAD_DIM**-0.5
        kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
        reference = functools.partial(paged_attention_reference, q, k_cache, v_cache, meta, scale, k_scale, v_scale)
        kernels = {name: functools.partial(paged_attention, q, k_cache, v_cache, meta, scale, k_scale, v_scale)}
        if meta.whole_prompt:  # the new K/V as the cache holds them, so that the reference reads the same values
            k, v = (gather_kv(c, meta.block_tables[0], seq_lens[0], s, q.dtype)
                    for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
            kernels[f"{name} cuDNN"] = functools.partial(prompt_attention, q, k, v, scale)
        for case, kernel in kernels.items():
            rows.append(time_case(case, kernel, reference, kv_bytes, args))
    if args.json:
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "kv_dtype": args.kv_dtype, "rows": rows}, indent=2))
        return 0
    print(f"{torch.cuda.get_device_name()}  kv cache {args.kv_dtype}  (32 heads, 8 kv heads, head_dim 128, block 32)")
    print(f"{'case':<18}{'triton':>11}{'reference':>12}{'speedup':>9}{'KV TB/s':>9}{'of peak':>9}{'max err':>9}")
    for r in rows:
        ref = f"{r['reference_us']:9.1f} us" if r["reference_us"] is not None else f"{'-':>12}"
        speedup = f"{r['reference_us'] / r['triton_us']:8.1f}x" if r["reference_us"] is not None else f"{'-':>9}"
        print(f"{r['case']:<18}{r['triton_us']:8.1f} us{ref}{speedup}{r['bandwidth_tb_s']:9.2f}"
              f"{r['bandwidth_tb_s'] * 1e12 / PEAK_BANDWIDTH:8.0%}{r['max_abs_err']:9.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
