"""Time the split-KV decode's partition size (``decode_partition_size``) against half and twice it on one CUDA GPU.

Llama-3-8B attention (32 heads, 8 KV heads, head_dim 128) with an FP8 KV cache (V token-major) and the output
quantized for an FP8 o_proj, as an FP8 engine decodes: every batch size of ``--batches`` over contexts just short of
each of ``--contexts`` tokens (a few tokens apart, as a batch's are). Each size is timed inside a CUDA graph; a row
says which was fastest and how much slower the rule's choice is than it.

    python tools/tune_partitions.py [--batches 8,16,32,64,128] [--contexts 1024,2048,4096,8192] [--json OUT]
"""

from __future__ import annotations

import functools
import sys

from bench_kernels import HEAD_DIM, NUM_KV_HEADS, make_case
from sweep import has_cuda, sweep_parser, write_results


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(__doc__, rep_ms=30)
    parser.add_argument("--batches", default="4,8,16,32,64,128,256", help="comma-separated batch sizes")
    parser.add_argument("--contexts", default="1024,2048,4096,8192", help="comma-separated context lengths")
    args = parser.parse_args(argv)
    import torch

    if not has_cuda("tune_partitions"):
        return 2
    from triton.testing import do_bench_cudagraph

    from kiln.runtime.native.kernels.paged_attention import (
        MAX_PARTITION_SIZE,
        MIN_PARTITION_SIZE,
        decode_partition_size,
        paged_attention_decode,
    )

    results = []
    generator = torch.Generator().manual_seed(0)
    quant_scale = torch.tensor(0.01, device="cuda")
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            seq_lens = [context - 7 * i % 64 for i in range(batch)]
            q, k_cache, v_cache, meta, (k_scale, v_scale) = make_case([1] * batch, seq_lens, "fp8", generator)
            rule = decode_partition_size(batch, NUM_KV_HEADS, context, q.device)
            sizes = [p for p in (rule // 2, rule, rule * 2) if MIN_PARTITION_SIZE <= p <= MAX_PARTITION_SIZE]
            timings = {}
            for size in sizes:
                call = functools.partial(paged_attention_decode, q, k_cache, v_cache, meta, HEAD_DIM**-0.5, k_scale,
                                         v_scale, quant_scale=quant_scale, partition_size=size)
                timings[size] = do_bench_cudagraph(call, rep=args.rep, return_mode="median") * 1e3
            best = min(timings, key=timings.get)
            row = {"batch": batch, "context": context, "rule": rule, "best": best,
                   "rule_over_best": timings[rule] / timings[best], "us": timings}
            results.append(row)
            print(f"batch {batch:4d} context {context:5d}: rule {rule:4d} best {best:4d}, rule/best "
                  f"{row['rule_over_best']:.3f}  " + "  ".join(f"{p}: {us:.1f} us" for p, us in timings.items()),
                  flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
