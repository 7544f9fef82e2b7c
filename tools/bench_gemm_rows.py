"""How cuBLAS's FP8 GEMM (``torch._scaled_mm``) of each Llama-3-8B linear shape runs at decode batch sizes, and
whether padding the rows would help: tensorwise at M rows, the same GEMM on M rows padded to a multiple of 128,
the product swapped (weight first: the output comes out transposed) with and without the transpose back, and
rowwise scaling. Medians of CUDA-graph replays, each call reading the next of four weight copies (so L2 never holds
them); TFLOP/s counts the M rows asked for. A batch whose tensorwise time is far above its padded one is a shape
where cuBLAS's heuristic picks a poor kernel for that M.

    python tools/bench_gemm_rows.py [--m 144,256,384,448,512] [--shapes qkv,o,gate_up,down]
"""

from __future__ import annotations

import argparse

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # name: (K, N)
WEIGHT_COPIES = 4
VARIANTS = ("tensorwise", "pad128", "swapped", "swap+T", "rowwise")


def variant_calls(gemm, x, padded, row_scale, column_scale) -> dict:
    """Each variant's GEMM of the rows ``x`` (``padded``: the same count rounded up) by a weight ``w``."""
    return {
        "tensorwise": lambda w: gemm(x, w.t()),
        "pad128": lambda w: gemm(padded, w.t()),
        "swapped": lambda w: gemm(w, x.t()),
        "swap+T": lambda w: gemm(w, x.t()).t().contiguous(),
        "rowwise": lambda w: gemm(x, w.t(), row_scale, column_scale),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", default="144,256,384,448,512", help="comma-separated row counts (decode batches)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: qkv, o, gate_up, down")
    args = parser.parse_args(argv)
    import torch

    from kiln.engines.native.tuning import graph_time_us

    generator = torch.Generator(device="cuda").manual_seed(0)
    one = torch.tensor(1.0, device="cuda")

    def fp8(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=generator) * 4).to(torch.float8_e4m3fn)

    def gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor = one, scale_b: torch.Tensor = one):
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    print(f"{torch.cuda.get_device_name()}: median us (TFLOP/s)")
    print(f"{'shape':8} {'M':>5} " + " ".join(f"{name:>16}" for name in VARIANTS))
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        weights = [fp8(n, k) for _ in range(WEIGHT_COPIES)]
        column_scale = torch.full((1, n), 1e-3, device="cuda")
        for m in (int(value) for value in args.m.split(",")):
            calls = variant_calls(gemm, fp8(m, k), fp8(-(-m // 128) * 128, k),
                                  torch.full((m, 1), 0.05, device="cuda"), column_scale)
            flop = 2 * m * k * n / 1e6
            cells = []
            for variant in VARIANTS:
                us = graph_time_us([lambda w=w, call=calls[variant]: call(w) for w in weights], 200)
                cells.append(f"{us:7.1f} ({flop / us:5.0f})")
            print(f"{name:8} {m:>5} " + " ".join(f"{cell:>16}" for cell in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
