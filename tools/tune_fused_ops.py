"""Sweep the launch parameters of the fused RMSNorm and SiLU-and-multiply kernels on one CUDA GPU.

Llama-3-8B widths, FP8-quantizing outputs as the FP8 engine runs them (RMSNorm with its residual add), at the token
counts of a batch-1 step, a batch-256 step and a 1k-token prefill. Each configuration is timed inside a CUDA graph,
each call on another copy of the inputs (so L2 never holds them), and checked to write the default's bytes; the
fastest is printed with its bandwidth (bytes read plus written) against the H200's ~4.3 TB/s. The winners become
the defaults of ``rms_norm`` / ``silu_and_mul``.

    python tools/tune_fused_ops.py [--m 1,256,1000] [--json OUT]
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

from sweep import bandwidth_text, grid, has_cuda, measure_or_skip, sweep_parser, tb_per_s, write_results

from kiln.engines.native.checkpoint import parse_architecture, read_json
from kiln.engines.native.tuning import WEIGHT_COPIES, graph_time_us

REPO = Path(__file__).resolve().parents[1]
RMS_NORM_GRID = dict(num_warps=[1, 2, 4, 8, 16])
SILU_GRID = dict(block=[256, 512, 1024, 2048, 4096], num_warps=[1, 2, 4, 8])


def main(argv: list[str] | None = None) -> int:
    parser = sweep_parser(__doc__, rep_ms=20)
    parser.add_argument("--arch", type=Path, default=REPO / "configs/models/llama3-8b.json",
                        help="architecture file")
    parser.add_argument("--m", default="1,256,1000", help="comma-separated token counts (default 1,256,1000)")
    args = parser.parse_args(argv)
    import torch

    from kiln.runtime.native.kernels.rms_norm import rms_norm
    from kiln.runtime.native.kernels.silu_mul import silu_and_mul

    if not has_cuda("tune_fused_ops"):
        return 2
    arch = parse_architecture(read_json(args.arch), {}, args.arch)
    hidden, inter = arch.hidden_size, arch.intermediate_size
    scale = torch.tensor(0.05, device="cuda")
    weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    results = []
    for m, op in itertools.product(map(int, args.m.split(",")), ("rms_norm", "silu_and_mul")):
        if op == "rms_norm":
            inputs = [(torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16),
                       torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)) for _ in range(WEIGHT_COPIES)]
            nbytes = m * hidden * (2 + 2 + 2 + 1)  # x and residual in, new residual and FP8 out

            def call(x, residual, **cfg):
                return rms_norm(x, weight, 1e-5, residual, scale, **cfg)
            configs = grid(RMS_NORM_GRID)
        else:
            inputs = [(torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16),) for _ in range(WEIGHT_COPIES)]
            nbytes = m * inter * (2 * 2 + 1)

            def call(x, **cfg):
                return silu_and_mul(x, scale, **cfg)
            configs = grid(SILU_GRID)
        reference = call(*inputs[0])
        reference = reference if isinstance(reference, tuple) else (reference,)

        def measure(cfg, call=call, inputs=inputs, reference=reference):
            out = call(*inputs[0], **cfg)
            out = out if isinstance(out, tuple) else (out,)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out, reference,
                                                                                             strict=True))
            return graph_time_us([functools.partial(call, *i, **cfg) for i in inputs], args.rep), same

        def timed(cfg, measure=measure):
            return measure_or_skip(measure, cfg, failed=(float("inf"), False))

        runs = [(*timed(cfg), cfg) for cfg in configs]
        default_us, _ = timed({})
        best_us, best_same, best = min(runs, key=lambda r: r[0])
        row = {"op": op, "m": m, "best": best, "best_us": best_us, "best_identical": best_same,
               "default_us": default_us, "best_tb_per_s": tb_per_s(nbytes, best_us),
               "all": [{"us": us, "identical": same, **cfg} for us, same, cfg in runs]}
        results.append(row)
        print(f"{op:<13} M={m:<5} best {best_us:7.2f} us ({bandwidth_text(row['best_tb_per_s'])}, identical "
              f"{best_same})  default {default_us:7.2f} us  {best}", flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
