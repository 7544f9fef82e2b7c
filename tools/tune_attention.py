"""Sweep the launch parameters of the Triton paged-attention kernels on one CUDA GPU.

Llama-3-8B attention (see ``tools/bench_kernels.py``): split-KV decode at batch 256 over contexts of 1k and 2k tokens
(the offline benchmark's steps), at batch 488 over 1-2k and 445 over 2-4k (TensorRT-LLM's 1000/1000 and 2048/2048
rows) and at batch 2,048 over 129-256 tokens (its 128/128 row), over an FP8 cache with p @ v in FP8 as the engine
runs it (``fp8_pv``), with the output
written by the partition kernel or by the reduce (also quantized for an FP8 o_proj), and a 1k-token prefill, with a
bfloat16 and an FP8 KV cache. Each configuration of a small grid is timed inside a CUDA graph and checked against the
default's output; the fastest is printed with its KV bandwidth against the H200's ~4.3 TB/s. The winners become the
defaults of ``paged_attention_decode`` / ``paged_attention_varlen``.

    python tools/tune_attention.py [--kv-dtypes bf16,fp8] [--json OUT]
"""

from __future__ import annotations

import functools
import itertools
import sys

from bench_kernels import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, make_case
from sweep import bandwidth_text, grid, has_cuda, measure_or_skip, sweep_parser, tb_per_s, write_results

DECODE_GRID = dict(block_n=[32, 64, 128], num_warps=[2, 4, 8], num_stages=[2, 3, 4], partition_size=[None])
PARTITION_SIZES = [512, 2048, 4096]  # tried with the best decode configuration (None: decode_partition_size's choice)
VARLEN_GRID = dict(block_m=[64, 128], block_n=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3])
# (name, query_lens, seq_lens, kernel)
CASES = [(f"decode b256 ctx{c // 1024}k", [1] * 256, [c] * 256, "decode") for c in (2048, 1024)]
CASES.append(("decode b488 ctx1-2k", [1] * 488, [1000 + 397 * i % 1001 for i in range(488)], "decode"))  # 1000/1000
CASES.append(("decode b445 ctx2-4k", [1] * 445, [2048 + 797 * i % 2049 for i in range(445)], "decode"))  # 2048/2048
CASES.append(("decode b2048 ctx129-256", [1] * 2048, [129 + 37 * i % 128 for i in range(2048)], "decode"))  # 128/128
CASES.append(("prefill 1k", [1024], [1024], "varlen"))


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(__doc__, rep_ms=30)
    parser.add_argument("--kv-dtypes", default="bf16,fp8", help="comma-separated subset of bf16,fp8")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                        help=f"tokens per KV block (default {BLOCK_SIZE})")
    args = parser.parse_args(argv)
    import torch

    if not has_cuda("tune_attention"):
        return 2
    from triton.testing import do_bench_cudagraph

    from kiln.runtime.native.kernels.paged_attention import paged_attention_decode, paged_attention_varlen
    from kiln.runtime.native.kernels.paged_attention.operands import fp8_pv_applies

    results = []
    generator = torch.Generator().manual_seed(0)
    for (name, query_lens, seq_lens, kind), kv_dtype in itertools.product(CASES, args.kv_dtypes.split(",")):
        q, k_cache, v_cache, meta, (k_scale, v_scale) = make_case(query_lens, seq_lens, kv_dtype, generator,
                                                                  args.block_size)
        kernel = paged_attention_decode if kind == "decode" else paged_attention_varlen
        fp8_pv = {"fp8_pv": fp8_pv_applies(q, k_cache, v_cache)} if kind == "decode" else {}  # as the engine decodes
        call = functools.partial(kernel, q, k_cache, v_cache, meta, HEAD_DIM**-0.5, k_scale, v_scale, **fp8_pv)
        kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
        expected = call().float()

        def measure(cfg, call=call, expected=expected):
            err = (call(**cfg).float() - expected).abs().max().item()
            return do_bench_cudagraph(lambda: call(**cfg), rep=args.rep, return_mode="median") * 1e3, err

        def timed(cfg, measure=measure):
            return measure_or_skip(measure, cfg, failed=(float("inf"), None))

        configs = grid(DECODE_GRID if kind == "decode" else VARLEN_GRID)
        runs = [(*timed(cfg), cfg) for cfg in configs]
        if kind == "decode":
            best_cfg = min(runs, key=lambda r: r[0])[2]
            runs += [(*timed({**best_cfg, "partition_size": p}), {**best_cfg, "partition_size": p})
                     for p in PARTITION_SIZES]
            # contexts within one partition: the output from the partition kernel, or partials and the reduce
            runs += [(*timed({**best_cfg, "lone": lone}), {**best_cfg, "lone": lone}) for lone in (False, True)]
        default_us, _ = timed({})
        best_us, best_err, best = min(runs, key=lambda r: r[0])
        row = {"case": name, "kv_dtype": kv_dtype, "best": best, "best_us": best_us, "best_max_abs_err": best_err,
               "default_us": default_us, "best_tb_per_s": tb_per_s(kv_bytes, best_us),
               "default_tb_per_s": tb_per_s(kv_bytes, default_us),
               "all": [{"us": us, "max_abs_err": err, **cfg} for us, err, cfg in runs]}
        if kind == "decode":  # the output quantized for an FP8 o_proj, as FP8 engines run it
            quant_scale = torch.tensor(0.01, device="cuda")
            quantized = {lone: functools.partial(call, quant_scale=quant_scale, lone=lone) for lone in (False, True)}
            row["quantized_output_us"] = {("lone" if lone else "reduce"): do_bench_cudagraph(
                fn, rep=args.rep, return_mode="median") * 1e3 for lone, fn in quantized.items()}
        results.append(row)
        print(f"{name:<18} {kv_dtype:<4} best {best_us:8.1f} us ({bandwidth_text(row['best_tb_per_s'])}, err "
              f"{best_err:.1e})  default {default_us:8.1f} us ({row['default_tb_per_s']:4.2f} TB/s)  {best}"
              f"{'  quantized output ' + str(row['quantized_output_us']) if 'quantized_output_us' in row else ''}",
              flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
