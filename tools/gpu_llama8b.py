"""Llama-3-8B-shaped measurements on a GPU, with random weights (the real weights cannot be fetched there).

    python tools/gpu_llama8b.py prepare            # random bf16 checkpoint + the tiny text tokenizer
    python tools/gpu_llama8b.py hash               # checkpoint hash: cold, then memoised (hit decision)
    python tools/gpu_llama8b.py quantize fp8       # calibration time at 512 samples x 512 tokens

The checkpoint reuses ``kiln bench``'s random weights for ``configs/models/llama3-8b.json`` and swaps in the tiny
model's tokenizer, so calibration reads real text (token ids stay below 1024 of the 128256-entry vocabulary). The
accuracy gate is loosened (random weights give near-flat logits); the figures are times, not accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from tiny_corpus import generate_documents

from kiln.engines.cache import EngineCache, checkpoint_hash
from kiln.pipeline import runner
from kiln.pipeline.bench.random_checkpoint import random_checkpoint
from kiln.pipeline.bench.target import bench_root, read_architecture_file
from kiln.pipeline.config import cache_root
from kiln.pipeline.runtime_env import runtime_options

REPO = Path(__file__).resolve().parents[1]
ARCH = REPO / "configs" / "models" / "llama3-8b.json"
TINY = REPO / "models" / "tiny-llama"
OUT = Path(os.environ.get("OUT", "."))


def work_dir() -> Path:
    return bench_root() / "llama3-8b-text"


def prepare() -> dict:
    """The random checkpoint with the tiny tokenizer, and 3000 generated documents of calibration text."""
    start = time.perf_counter()
    cache = EngineCache.open_configured(cache_root())
    hf_dir = random_checkpoint(cache, ARCH, read_architecture_file(ARCH), seed=0, device="cuda",
                               progress=lambda *_: None)
    target = work_dir() / "hf"
    target.mkdir(parents=True, exist_ok=True)
    for path in hf_dir.iterdir():
        if path.suffix == ".safetensors" or path.name in ("config.json", "model.safetensors.index.json"):
            link = target / path.name
            if not link.exists():
                link.symlink_to(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, target / name)
    data = work_dir() / "calibration.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in generate_documents(3000, seed=8)))
    return {"checkpoint": str(target), "seconds": round(time.perf_counter() - start, 1)}


def hash_times() -> dict:
    """Hit-decision cost: the checkpoint content hash cold, then memoised per (path, size, mtime, inode)."""
    memo = work_dir() / "hashmemo.sqlite"
    memo.unlink(missing_ok=True)
    size = sum(p.stat().st_size for p in (work_dir() / "hf").iterdir() if p.suffix == ".safetensors")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        digest = checkpoint_hash(work_dir() / "hf", memo_path=memo)
        times.append(time.perf_counter() - start)
    return {"bytes": size, "cold_s": round(times[0], 2), "memoised_ms": [round(t * 1000, 1) for t in times[1:]],
            "hash": digest}


def config_text(fmt: str) -> str:
    return f"""model:
  path: {work_dir() / 'hf'}
  dtype: bfloat16
quantize:
  format: {fmt}
  dataset: {work_dir() / 'calibration.jsonl'}
  heldout: bundled
  num_samples: 512
  round_samples: 64
  heldout_samples: 16
  seq_len: 512
  on_failure: warn
  gate: {{max_ppl_increase: 100.0, max_kl: 100.0, min_top1_agreement: 0.0}}
build:
  max_batch_size: 64
  max_input_len: 1024
  max_seq_len: 2048
  max_num_tokens: 4096
  tokens_per_block: 32
"""


def quantize(fmt: str) -> dict:
    """Time ``kiln quantize`` for one format (model load, rounds, gate and export included)."""
    config = work_dir() / f"llama3-8b-{fmt}.yaml"
    config.write_text(config_text(fmt))
    start = time.perf_counter()
    ctx = runner.prepare(config, backend="native", force=True, dry_run=False, options=runtime_options(os.environ))
    last = [""]

    def show(message: str, _fraction: float) -> None:
        if message != last[0]:
            last[0] = message
            print(f"[{time.perf_counter() - start:7.1f} s] {message}", flush=True)

    result = runner.quantize_only(ctx, lambda _name: show)
    seconds = time.perf_counter() - start
    report = ctx.calibration or {}
    return {"format": fmt, "seconds": round(seconds, 1), "converged": result["converged"],
            "rounds": len(result["rounds"]), "samples_used": report.get("samples_used"),
            "max_rel_change": [r["max_rel_change"] for r in result["rounds"]],
            "times": report.get("times"), "config": str(config)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("prepare", "hash", "quantize"))
    parser.add_argument("format", nargs="?", default="fp8", choices=("fp8", "int4_awq"))
    args = parser.parse_args()
    result = {"prepare": prepare, "hash": hash_times, "quantize": lambda: quantize(args.format)}[args.step]()
    (OUT / f"llama8b-{args.step}-{args.format}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
