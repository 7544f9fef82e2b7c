"""Sweep the launch parameters of the weight-streaming FP8, INT4-AWQ and dense (bf16, one token) kernels on one
CUDA GPU.

For each Llama-3-8B linear shape (see ``tools/bench_linears.py``) and token count M, times every configuration of a
small grid inside a CUDA graph (``bench_linears.graph_time_us``: no launch cost, each call on another copy of the
weights so L2 never holds them) and prints the fastest, with its weight
bandwidth against the H200's ~4.3 TB/s. The winners become the table in ``fp8_gemv_config`` / ``int4_gemv_config``
and ``dense_gemv``'s defaults (the dense kernel serves M = 1 only).

    python tools/tune_gemv.py [--m 1,4,16] [--kernels fp8,int4,dense] [--json OUT]
"""

from __future__ import annotations

import itertools
import sys

from bench_linears import GROUP_SIZE, SHAPES, WEIGHT_COPIES, graph_time_us, make_operands, weight_bytes
from sweep import bandwidth_text, grid, has_cuda, measure_or_skip, sweep_parser, tb_per_s, write_results

FP8_ROW_GRID = dict(BLOCK_M=[1], BLOCK_N=[4, 8, 16], BLOCK_K=[1024, 2048, 4096], num_warps=[4, 8], num_stages=[1, 3])
INT4_ROW_GRID = dict(BLOCK_N=[8, 16, 32], GROUPS=[8, 16, 32], num_warps=[4, 8], num_stages=[1, 3])
DENSE_GRID = dict(block_n=[4, 8, 16], block_k=[512, 1024, 2048], num_warps=[4, 8])
FP8_DOT_GRID = dict(BLOCK_M=[16], BLOCK_N=[16, 32, 64], BLOCK_K=[128, 256, 512], num_warps=[4, 8], num_stages=[3, 4])
INT4_ROWS_GRID = dict(BLOCK_M=[2], BLOCK_N=[8, 16], GROUPS=[16, 32], num_warps=[4, 8], num_stages=[1])
INT4_DOT_GRID = dict(BLOCK_M=[16], BLOCK_N=[16, 32, 64, 128], GROUPS=[1, 2, 4, 8], num_warps=[1, 2, 4, 8],
                     num_stages=[3])


def configs(kernel: str, m: int) -> list[dict]:
    """The grid of ``kernel`` (fp8, int4 or dense) for M tokens: its row reduction at M = 1, a 16-row ``tl.dot``
    tile above (for INT4 at M = 2 also the row reduction over a tile of two tokens)."""
    if kernel == "dense":
        return grid(DENSE_GRID)
    if kernel == "fp8":
        return grid(FP8_DOT_GRID if m > 1 else FP8_ROW_GRID)
    if m == 1:
        return grid(INT4_ROW_GRID)
    return (grid(INT4_ROWS_GRID) if m == 2 else []) + grid(INT4_DOT_GRID)


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(__doc__, rep_ms=20)
    parser.add_argument("--m", default="1,4,16", help="comma-separated token counts (default 1,4,16)")
    parser.add_argument("--kernels", default="fp8,int4", help="comma-separated subset of fp8,int4,dense")
    args = parser.parse_args(argv)
    import torch

    from kiln.runtime.native.kernels import dense_gemv as dense
    from kiln.runtime.native.kernels.fp8_gemv import fp8_gemv, fp8_gemv_config
    from kiln.runtime.native.kernels.fp8_quant import quantize_fp8
    from kiln.runtime.native.kernels.int4_gemv import int4_awq_gemv, int4_gemv_config

    if not has_cuda("tune_gemv"):
        return 2
    results = []
    for (name, k, n), m, kernel in itertools.product(SHAPES, map(int, args.m.split(",")), args.kernels.split(",")):
        if kernel == "dense" and m != 1:
            continue
        copies = [make_operands(k, n, seed) for seed in range(WEIGHT_COPIES)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if kernel == "fp8":  # the activation arrives quantized, as the engine's fused kernels write it
            default = fp8_gemv_config(m, n, k)
            nbytes = weight_bytes("triton_fp8", k, n)
            x_fp8 = quantize_fp8(x, copies[0]["input_scale"])

            def calls(cfg, x=x_fp8, copies=copies):
                return [lambda o=o: fp8_gemv(x, o["w_fp8"], o["weight_scale"], o["input_scale"], config=cfg,
                                             out_dtype=torch.bfloat16) for o in copies]
        elif kernel == "dense":
            default = dict(block_n=dense.BLOCK_N, block_k=dense.BLOCK_K, num_warps=dense.NUM_WARPS)
            nbytes = weight_bytes("bf16_matmul", k, n)

            def calls(cfg, x=x, copies=copies):
                return [lambda o=o: dense.dense_gemv(x, o["w_bf16"], **cfg) for o in copies]
        else:
            default = int4_gemv_config(m, n, k, GROUP_SIZE)
            nbytes = weight_bytes("triton_int4", k, n)

            def calls(cfg, x=x, copies=copies):
                return [lambda o=o: int4_awq_gemv(x, o["qweight"], o["scales"], o["pre_quant_scale"], GROUP_SIZE,
                                                  config=cfg) for o in copies]
        timed = [(measure_or_skip(lambda c, calls=calls: graph_time_us(calls(c), args.rep), cfg, float("inf")), cfg)
                 for cfg in configs(kernel, m)]
        default_us = graph_time_us(calls(default), args.rep)
        best_us, best = min(timed, key=lambda t: t[0])
        row = {"kernel": kernel, "shape": name, "k": k, "n": n, "m": m, "best": best, "best_us": best_us,
               "best_tb_per_s": tb_per_s(nbytes, best_us), "default": default, "default_us": default_us}
        results.append(row)
        print(f"{kernel:<5} {name:<8} M={m:<3} best {row['best_us']:7.1f} us ({bandwidth_text(row['best_tb_per_s'])})"
              f"  default {row['default_us']:7.1f} us  {best}", flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
