"""How long a cached engine takes to be ready: the weight loaders against each other, `LLM.load` by phase, and
process start to first token and to every CUDA graph captured, with a warm page cache and a cold one (the engine's
files dropped from the page cache with posix_fadvise, which needs no privileges), and with the graphs captured at load
instead of deferred.

    python tools/load_time.py ENGINE_DIR [--repeats 3] [--json] [--profile FILE] [--disk DIR]

``--disk DIR`` measures a copy of the engine made in DIR (removed afterwards) instead of ENGINE_DIR: a cold page
cache needs a disk's, and an engine cache in /dev/shm (tmpfs) keeps its pages whatever is asked.

``--profile FILE`` also writes where a fresh process's `LLM.load` and first token spend their time (cProfile, the
40 functions of largest cumulative time) to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.runtime.native.engine_format import EngineConfig, weights_file
from kiln.runtime.native.model.decoder import DecoderModel
from kiln.runtime.native.weight_loading import load_weights_into

FIRST_TOKEN = """
import cProfile, io, json, pstats, sys, time
start = float(sys.argv[2])
from kiln.runtime import LLM, RuntimeOptions, SamplingParams
imported = time.time() - start
profile = cProfile.Profile() if sys.argv[3] else None
if profile:
    profile.enable()
llm = LLM.load(sys.argv[1], RuntimeOptions(cuda_graph_capture=sys.argv[4] or None))
loaded = time.time() - start
llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, detokenize=False))
first = time.time() - start
if profile:
    profile.disable()
    text = io.StringIO()
    for order, count in (("cumulative", 40), ("tottime", 25)):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(count)
    open(sys.argv[3], "w").write(text.getvalue())
llm.wait_until_warm()
print(json.dumps({"start_to_first_token_s": round(first, 3), "import_s": round(imported, 3),
                  "start_to_loaded_s": round(loaded, 3), "llm_load_s": round(llm.load_ms / 1000, 3),
                  "start_to_warm_s": round(time.time() - start, 3), "load_phases_s": llm.stats()["load_phases_s"],
                  "cuda_graphs": llm.stats()["cuda_graphs"]}), flush=True)
llm.close()
"""


def drop_page_cache(engine_dir: Path) -> None:
    """Ask the kernel to drop the engine's files from the page cache."""
    for path in engine_dir.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def load_with_safe_open(path: Path, params: dict[str, torch.Tensor]) -> None:
    """The loader Kiln had before: safetensors' memory map, one tensor at a time, copied to the device."""
    with safe_open(str(path), framework="pt", device="cuda") as f:
        for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
            params[name].copy_(f.get_tensor(name))


def time_loaders(engine_dir: Path, repeats: int) -> dict:
    config = EngineConfig.load(engine_dir)
    with torch.device("cuda"):
        model = DecoderModel(config, config.torch_dtype)
    params = model.state_dict()
    path = engine_dir / weights_file(0)
    out = {"weights_bytes": path.stat().st_size}
    for name, loader in (("safetensors_mmap", load_with_safe_open), ("kiln_preadv_pinned", load_weights_into)):
        for cache in ("cold", "warm"):
            times = []
            for _ in range(repeats):
                if cache == "cold":
                    drop_page_cache(engine_dir)
                torch.cuda.synchronize()
                start = time.perf_counter()
                loader(path, params)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            out[f"{name}_{cache}_s"] = round(statistics.median(times), 3)
    reference = {name: p.clone() for name, p in params.items()}
    for p in params.values():
        p.zero_()
    load_weights_into(path, params)
    out["loaders_agree"] = all(torch.equal(params[n].reshape(-1).view(torch.uint8),
                                           reference[n].reshape(-1).view(torch.uint8)) for n in params)
    return out


def first_token(engine_dir: Path, cold: bool, profile: Path | None = None, capture: str = "") -> dict:
    """A fresh process's import, `LLM.load` (with its phases), first token of a 4-token prompt and every CUDA graph
    captured, from its start (``capture``: RuntimeOptions.cuda_graph_capture, empty for the default)."""
    if cold:
        drop_page_cache(engine_dir)
    run = subprocess.run([sys.executable, "-c", FIRST_TOKEN, str(engine_dir), repr(time.time()), str(profile or ""),
                          capture], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.splitlines()[-1])


def filesystem_type(path: Path) -> str:
    """The type of the filesystem that holds ``path`` (the longest mount point above it in /proc/mounts)."""
    mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text(encoding="utf-8").splitlines()]
    resolved = str(path.resolve())
    best = max((m for m in mounts if resolved == m[0] or resolved.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]))
    return best[1]


def measure(engine_dir: Path, args: argparse.Namespace) -> dict:
    report = {"engine_dir": str(engine_dir), "filesystem": filesystem_type(engine_dir),
              "loaders": time_loaders(engine_dir, args.repeats)}
    torch.cuda.empty_cache()
    report["process_warm"] = [first_token(engine_dir, cold=False) for _ in range(args.repeats)]
    report["process_cold"] = first_token(engine_dir, cold=True)
    report["process_graphs_at_load"] = first_token(engine_dir, cold=False, capture="at_load")
    if args.profile:
        report["process_profiled"] = first_token(engine_dir, cold=False, profile=args.profile)
    from kiln.runtime import LLM

    with LLM.load(engine_dir) as llm:
        start = time.perf_counter()
        llm.wait_until_warm()
        report["llm_load_s"] = round(llm.load_ms / 1000, 3)
        report["then_warm_s"] = round(time.perf_counter() - start, 3)
        report["load_phases_s"] = llm.stats()["load_phases_s"]
        report["cuda_graphs"] = llm.stats()["cuda_graphs"]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", type=Path, help="write a cProfile of a fresh process's load to this file")
    parser.add_argument("--disk", type=Path, help="measure a copy of the engine made in this directory")
    args = parser.parse_args()
    if args.disk is None:
        report = measure(args.engine_dir, args)
    else:
        copy = args.disk / args.engine_dir.name
        shutil.copytree(args.engine_dir, copy)
        try:
            os.sync()  # the copy's pages on the disk, so that they can be dropped from the page cache
            report = measure(copy, args)
        finally:
            shutil.rmtree(copy)
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
