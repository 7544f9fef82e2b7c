"""Micro-benchmark of the weight-streaming Triton linears against cuBLAS paths on one CUDA GPU.

Llama-3-8B linear shapes (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) at M tokens: the
Triton FP8 and INT4-AWQ kernels (runtime/native/kernels), ``torch._scaled_mm`` with a static and with a dynamic
(per-call amax) activation scale, and bf16 ``torch.matmul``. Times are medians of
``triton.testing.do_bench_cudagraph`` (inside a CUDA graph, as the engine decodes, so Python launch cost is not
counted), each call reading the next of ``WEIGHT_COPIES`` copies of the weights (so L2 never holds them); bandwidth
is the bytes of weight each path must read once (bf16 2 B, FP8 1 B, INT4 0.5 B per weight plus its scales), over its
time, against the H200's ~4.3 TB/s. The crossover M per shape is the smallest M at which the
existing path (``_scaled_mm`` static for FP8, bf16 matmul for INT4, which dequantizes to bf16 otherwise) is faster
than the Triton kernel: the ``KILN_LINEAR_MAX_M`` threshold to choose.

    python tools/bench_linears.py [--m 1,4,16,64,256] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from kiln.engines.native.tuning import WEIGHT_COPIES, graph_time_us
from kiln.pipeline.bench.floor import NOMINAL_COPY_GBS

PEAK_BANDWIDTH = NOMINAL_COPY_GBS["H200"] * 1e9  # bytes/s: what an H200 copies, the floor kiln bench uses
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]  # (name, K, N)
METHODS = ["triton_fp8", "scaled_mm_static", "scaled_mm_dynamic", "triton_int4", "bf16_matmul"]
GROUP_SIZE = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="1,4,16,64,256", help="comma-separated token counts (default 1,4,16,64,256)")
    parser.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES),
                        help="comma-separated subset of qkv,o,gate_up,down (default all)")
    parser.add_argument("--rep", type=int, default=100, help="measuring time per method in ms (default 100)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser.parse_args(argv)


def weight_bytes(method: str, k: int, n: int) -> int:
    if method == "bf16_matmul":
        return 2 * n * k
    if method == "triton_int4":
        return n * k // 2 + 4 * n * (k // GROUP_SIZE)
    return n * k + 4 * n  # FP8 weight and its per-channel scale


def make_operands(k: int, n: int, seed: int = 0):
    import torch

    from kiln.runtime.native.layers.linear import pack_int4

    g = torch.Generator(device="cuda").manual_seed(seed)
    w_bf16 = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    weight_scale = w_bf16.float().abs().amax(dim=1) / 448.0
    w_fp8 = (w_bf16.float() / weight_scale[:, None]).to(torch.float8_e4m3fn)
    qweight = pack_int4(torch.randint(-8, 8, (n, k), device="cuda", generator=g, dtype=torch.int8))
    scales = torch.rand(n, k // GROUP_SIZE, device="cuda", generator=g) * 0.01
    pre_quant_scale = torch.ones(k, device="cuda")
    return dict(w_bf16=w_bf16, w_fp8=w_fp8, weight_scale=weight_scale, qweight=qweight, scales=scales,
                pre_quant_scale=pre_quant_scale, input_scale=torch.tensor(0.05, device="cuda"))


def method_fns(x, ops):
    import torch

    from kiln.runtime.native.kernels.fp8_gemv import fp8_gemv
    from kiln.runtime.native.kernels.int4_gemv import int4_awq_gemv
    from kiln.runtime.native.layers.linear import FP8_MAX, fp8_linear_scaled_mm

    def scaled_mm_dynamic():
        scale = (x.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
        return fp8_linear_scaled_mm(x, ops["w_fp8"], ops["weight_scale"], scale)

    return {
        "triton_fp8": lambda: fp8_gemv(x, ops["w_fp8"], ops["weight_scale"], ops["input_scale"]),
        "scaled_mm_static": lambda: fp8_linear_scaled_mm(x, ops["w_fp8"], ops["weight_scale"], ops["input_scale"]),
        "scaled_mm_dynamic": scaled_mm_dynamic,
        "triton_int4": lambda: int4_awq_gemv(x, ops["qweight"], ops["scales"], ops["pre_quant_scale"], GROUP_SIZE),
        "bf16_matmul": lambda: torch.matmul(x, ops["w_bf16"].t()),
    }


def crossover(rows: list[dict], shape: str, ours: str, theirs: str) -> int | None:
    """The smallest M of ``shape`` at which ``theirs`` is faster than ``ours`` (None: ours wins at every M)."""
    for row in sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["m"]):
        if row["us"][theirs] < row["us"][ours]:
            return row["m"]
    return None


def print_table(rows: list[dict], crossovers: dict, gpu: str) -> None:
    print(f"{gpu}: median us (weight TB/s, % of {PEAK_BANDWIDTH / 1e12:.1f} TB/s)")
    header = f"{'shape':<8} {'M':>4}  " + "  ".join(f"{method:>24}" for method in METHODS)
    print(header)
    for r in rows:
        cells = [f"{r['us'][me]:8.1f} ({r['tb_per_s'][me]:4.2f}, {r['tb_per_s'][me] * 1e14 / PEAK_BANDWIDTH:3.0f}%)"
                 for me in METHODS]
        print(f"{r['shape']:<8} {r['m']:>4}  " + "  ".join(f"{c:>24}" for c in cells))
    print("crossover M (smallest M where the existing path wins; none = the Triton kernel wins at every M):")
    for s, c in crossovers.items():
        print(f"  {s:<8} fp8 vs _scaled_mm static: {c['fp8_vs_scaled_mm_static'] or 'none':>5}   "
              f"int4 vs bf16 matmul: {c['int4_vs_bf16_matmul'] or 'none':>5}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_linears: no CUDA GPU; run it on the GPU machine", file=sys.stderr)
        return 2
    wanted = args.shapes.split(",")
    unknown = [s for s in wanted if s not in {name for name, _, _ in SHAPES}]
    if unknown:
        print(f"bench_linears: unknown shape(s) {unknown}; choose from qkv,o,gate_up,down", file=sys.stderr)
        return 2
    ms = [int(v) for v in args.m.split(",")]
    rows = []
    for name, k, n in (s for s in SHAPES if s[0] in wanted):
        copies = [make_operands(k, n, seed) for seed in range(WEIGHT_COPIES)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "k": k, "n": n, "m": m, "us": {}, "tb_per_s": {}}
            fns = [method_fns(x, ops) for ops in copies]
            for method in METHODS:
                us = graph_time_us([f[method] for f in fns], args.rep)
                row["us"][method] = us
                row["tb_per_s"][method] = weight_bytes(method, k, n) / us / 1e6
            rows.append(row)
            print(f"{name} M={m} done", file=sys.stderr)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    crossovers = {s: {"fp8_vs_scaled_mm_static": crossover(rows, s, "triton_fp8", "scaled_mm_static"),
                      "int4_vs_bf16_matmul": crossover(rows, s, "triton_int4", "bf16_matmul")} for s in shapes}
    gpu = torch.cuda.get_device_name()
    if args.json:
        print(json.dumps({"gpu": gpu, "peak_bandwidth_tb_per_s": PEAK_BANDWIDTH / 1e12, "rows": rows,
                          "crossover_m": crossovers}, indent=2))
        return 0
    print_table(rows, crossovers, gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
