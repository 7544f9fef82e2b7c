"""Where a fresh process spends the CUDA-graph part of `LLM.load`: the decode and prefill graph captures of an
architecture's plan on random FP8 weights made on the GPU, each captured twice in one process (the first pays the
process's first use of every kernel, the second only the captures), with the host's hottest functions of the first
under cProfile and the Triton kernel variants the captures compiled or loaded.

    python tools/capture_profile.py [--arch configs/models/llama3-8b.json] [--max-batch 512] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import REPO, engine_config, randomize  # noqa: E402

from kiln.runtime.native.decode_graphs import DecodeGraphRunner  # noqa: E402
from kiln.runtime.native.kv_cache import allocate_kv_cache  # noqa: E402
from kiln.runtime.native.model.decoder import DecoderModel  # noqa: E402
from kiln.runtime.native.prefill_graphs import PrefillGraphRunner  # noqa: E402


def triton_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of the runtime, from each JITFunction's per-device cache."""
    import triton

    counts = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("kiln.runtime.native.kernels"):
            continue
        for attr, value in vars(module).items():
            caches = getattr(value, "device_caches", None)
            if isinstance(value, triton.runtime.jit.JITFunction) and caches:
                counts[f"{name.rsplit('.', 1)[-1]}.{attr}"] = sum(len(c[0]) for c in caches.values())
    return counts


def timed(label: str, fn, report: dict, profile: bool = False):
    torch.cuda.synchronize()
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    result = fn()
    torch.cuda.synchronize()
    if profiler:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        report[f"{label}_profile"] = text.getvalue().splitlines()[:60]
    report[f"{label}_s"] = round(time.perf_counter() - start, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=str(REPO / "configs/models/llama3-8b.json"))
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict = {}
    start = time.perf_counter()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    report["cuda_init_s"] = round(time.perf_counter() - start, 3)
    config = engine_config(Path(args.arch), "fp8", args.max_batch, 8192, 8192, "float8_e4m3fn", 32)
    with torch.device("cuda"):
        model = DecoderModel(config, torch.bfloat16).eval()
    randomize(model)
    model.cache_derived_tensors()
    kv = allocate_kv_cache(config, 4096, "cuda")
    device = torch.device("cuda")

    def decode() -> None:
        DecodeGraphRunner(model, kv, config, device).graphs.capture_all()

    def prefill() -> None:
        PrefillGraphRunner(model, kv, config, device).graphs.capture_all()

    timed("decode_first", decode, report, profile=True)
    report["triton_variants_after_decode"] = triton_variants()
    timed("decode_second", decode, report)
    timed("prefill_first", prefill, report, profile=True)
    timed("prefill_second", prefill, report)
    report["triton_variants"] = triton_variants()
    report["triton_variants_total"] = sum(report["triton_variants"].values())
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text)
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("_profile")}, indent=1))


if __name__ == "__main__":
    main()
