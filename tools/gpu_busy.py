"""How busy the GPU is while the offline engine runs a workload, and where its idle time lies: an offline run of
random prompts (`kiln bench`'s workload) with the CUDA activity traced (kernels, copies) over short windows of
the run, each window's kernels merged into busy time, the gaps between them summed, and the engine's steps of the
window listed with their kind and host timings.

    python tools/gpu_busy.py ENGINE_DIR --prompts 10000 --input-len 128 --output-len 128 [--at 10,25] [--window 1.5]

Prints a JSON report: per window the busy share, the idle time in gaps of 20 us and more, the longest gaps, the GPU
time of the heaviest kernels, and the steps that ran. The tracing slows the run a little: its tokens/s is not the
row's figure (`kiln bench --suite trtllm-h200` is).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.pipeline.bench.measure import Workload
from kiln.pipeline.runtime_env import runtime_options
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.native.engine_format import EngineConfig

GAP_US = 20.0


def busy_report(trace_path: Path, window_s: float) -> dict:
    """GPU busy time, gaps and heaviest kernels from a chrome trace of CUDA activity."""
    events = [e for e in json.loads(trace_path.read_text(encoding="utf-8"))["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"])
    busy, gaps, end = 0.0, [], None
    for e in events:
        start, stop = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = (end - float(events[0]["ts"])) if events else 0.0
    by_name = Counter()
    for e in events:
        by_name[e["name"][:80]] += float(e["dur"])
    long_gaps = [g for g in gaps if g >= GAP_US]
    return {
        "window_s": window_s, "span_ms": round(span / 1000, 2), "busy_ms": round(busy / 1000, 2),
        "busy_share": round(busy / span, 4) if span else None, "kernels": len(events),
        "idle_in_gaps_ms": round(sum(long_gaps) / 1000, 2), "gaps_over_20us": len(long_gaps),
        "longest_gaps_us": [round(g, 1) for g in sorted(long_gaps, reverse=True)[:12]],
        "heaviest_kernels_ms": {name: round(us / 1000, 2) for name, us in by_name.most_common(15)},
    }


def step_summary(steps: list[dict]) -> dict:
    """How many decode and mixed steps ran, and the median step of each kind (wall and execute time, batch)."""
    summary: dict = {"steps": dict(Counter("decode" if s["num_prefill_seqs"] == 0 else "mixed" for s in steps))}
    for kind in summary["steps"]:
        chosen = [s for s in steps if (s["num_prefill_seqs"] == 0) == (kind == "decode")]
        summary[f"{kind}_step"] = {
            "duration_ms": round(1000 * statistics.median(s["duration_s"] for s in chosen), 2),
            "execute_ms": round(1000 * statistics.median(s["execute_s"] for s in chosen), 2),
            "seqs": statistics.median(s["num_seqs"] for s in chosen),
            "tokens": statistics.median(s["num_batched_tokens"] for s in chosen),
        }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--prompts", type=int, default=10000)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--at", default="10,25", help="seconds into the offline run at which windows open")
    parser.add_argument("--window", type=float, default=1.5, help="seconds each window traces")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_busy: no CUDA GPU here: it traces the GPU's activity", file=sys.stderr)
        return 2

    llm = LLM.load(args.engine_dir, runtime_options(os.environ))
    llm.wait_until_warm()
    workload = Workload.for_engine(EngineConfig.load(args.engine_dir), prompts=args.prompts,
                                   input_len=args.input_len, output_len=args.output_len, seed=0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(workload.warmup, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False))

    result: dict = {}
    run = threading.Thread(target=lambda: result.update(outputs=llm.generate(workload.prompts, params)))
    start = time.perf_counter()
    run.start()
    windows = []
    for at in (float(a) for a in args.at.split(",")):
        time.sleep(max(0.0, at - (time.perf_counter() - start)))
        if not run.is_alive():
            break
        steps_before = llm.stats()["num_steps"]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            time.sleep(args.window)
        steps_after = llm.stats()
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            report = busy_report(trace, args.window)
        new_steps = steps_after["num_steps"] - steps_before
        report.update(at_s=at, **step_summary(steps_after["recent_steps"]["steps"][-new_steps:] if new_steps else []))
        windows.append(report)
    run.join()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in result["outputs"])
    print(json.dumps({"engine_dir": str(args.engine_dir), "prompts": args.prompts, "input_len": args.input_len,
                      "output_len": args.output_len, "offline_s": round(elapsed, 2),
                      "tokens_per_s": round(tokens / elapsed, 1), "windows": windows}, indent=1))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
