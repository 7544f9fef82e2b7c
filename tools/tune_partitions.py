"""Time the split-KV decode at every partition size against ``decode_partition_size``'s choice on one CUDA GPU.

Llama-3-8B attention (32 heads, 8 KV heads, head_dim 128) with an FP8 KV cache (V token-major) and the output
quantized for an FP8 o_proj, as an FP8 engine decodes (``--kv-dtype bf16``: a bf16 cache and output, as a bf16
engine does; the rule was fitted to the FP8 kernel): every batch size of ``--batches`` with a plan of each of
``--max-seq-lens`` tokens, whose contexts fill ``--fill`` of it (a few tokens apart, as a batch's are: the decode
graphs choose the partition size from the plan's ``max_seq_len``, not from the contexts). Each power-of-two
partition size is timed inside a CUDA graph; a row gives the fastest and how much slower the rule's choice is.

    python tools/tune_partitions.py [--batches 8,16,32,64,128] [--max-seq-lens 2048,4096] [--fill 1.0]
        [--kv-dtype fp8|bf16] [--json OUT]
"""

from __future__ import annotations

import dataclasses
import functools
import sys

from bench_kernels import HEAD_DIM, NUM_KV_HEADS, make_case
from sweep import has_cuda, sweep_parser, write_results


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(__doc__, rep_ms=30)
    parser.add_argument("--batches", default="4,8,16,32,64,128,256", help="comma-separated batch sizes")
    parser.add_argument("--max-seq-lens", default="1024,2048,4096,8192", help="comma-separated plan lengths")
    parser.add_argument("--fill", type=float, default=1.0, help="the contexts' share of the plan's length")
    parser.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="fp8", help="the KV cache's dtype")
    args = parser.parse_args(argv)
    import torch

    if not has_cuda("tune_partitions"):
        return 2
    from triton.testing import do_bench_cudagraph

    from kiln.runtime.native.kernels.paged_attention import decode_partition_size, paged_attention_decode
    from kiln.runtime.native.kernels.paged_attention.tiling import MAX_PARTITION_SIZE, MIN_PARTITION_SIZE

    sizes = [1 << n for n in range(MIN_PARTITION_SIZE.bit_length() - 1, MAX_PARTITION_SIZE.bit_length())]
    results = []
    generator = torch.Generator().manual_seed(0)
    quant_scale = torch.tensor(0.01, device="cuda") if args.kv_dtype == "fp8" else None
    for batch in map(int, args.batches.split(",")):
        for max_seq_len in map(int, args.max_seq_lens.split(",")):
            context = max(int(max_seq_len * args.fill), 64)
            seq_lens = [context - 7 * i % 64 for i in range(batch)]
            q, k_cache, v_cache, meta, (k_scale, v_scale) = make_case([1] * batch, seq_lens, args.kv_dtype, generator)
            meta = dataclasses.replace(meta, max_seq_len=max_seq_len)  # the plan's bound, as the graphs launch it
            rule = decode_partition_size(batch, NUM_KV_HEADS, max_seq_len, q.device, args.kv_dtype == "fp8")
            timings = {}
            for size in sizes:
                call = functools.partial(paged_attention_decode, q, k_cache, v_cache, meta, HEAD_DIM**-0.5, k_scale,
                                         v_scale, quant_scale=quant_scale, partition_size=size)
                timings[size] = do_bench_cudagraph(call, rep=args.rep, return_mode="median") * 1e3
            best = min(timings, key=timings.get)
            row = {"batch": batch, "max_seq_len": max_seq_len, "context": context, "rule": rule, "best": best,
                   "rule_over_best": timings[rule] / timings[best], "us": timings}
            results.append(row)
            print(f"batch {batch:4d} plan {max_seq_len:5d} context {context:5d}: rule {rule:4d} best {best:4d}, "
                  f"rule/best {row['rule_over_best']:.3f}  " + " ".join(f"{p}:{us:.1f}" for p, us in timings.items()),
                  flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
