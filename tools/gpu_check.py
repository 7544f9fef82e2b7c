"""Check the native engine on a CUDA GPU against transformers, for the tiny bundled model.

For each of the bf16 and FP8 configs: build the engine through the cache (on the GPU), load it twice (cold, then
from the cache), generate greedily from a few prompts, and compare with transformers' eager bf16 ``generate`` on the
same GPU: identical greedy tokens (first N) and the relative error of the logits at every prompt position, against
transformers in bf16 and in float32.

    python tools/gpu_check.py --tokens 32 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln.pipeline import runner
from kiln.pipeline.runtime_env import runtime_options
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.kv_cache import allocate_kv_cache

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny-llama"
PROMPTS = ["Monday, Tuesday,", "3 plus 4 is 7. 6 plus 2 is", "Once upon a time", "The months go like this: March,"]


def build(config: str) -> dict:
    """Build (or hit) the config's engine; returns the run result."""
    ctx = runner.prepare(config, backend="native", force=False, dry_run=False, options=runtime_options(os.environ))
    return runner.run(ctx, runner.decide(ctx))


def reference(prompts: list[str], tokens: int) -> tuple[list[list[int]], dict[str, list[torch.Tensor]]]:
    """transformers' eager greedy tokens (bf16) and prompt logits at every position (bf16 and float32), on the GPU."""
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    outs, logits = [], {"bfloat16": [], "float32": []}
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(TINY, dtype=dtype, attn_implementation="eager").cuda().eval()
        with torch.no_grad():
            for prompt in prompts:
                ids = tokenizer(prompt, return_tensors="pt").input_ids.cuda()
                logits[str(dtype).removeprefix("torch.")].append(model(ids).logits[0].float().cpu())
                if dtype == torch.bfloat16:
                    gen = model.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None,
                                         pad_token_id=tokenizer.pad_token_id)
                    outs.append(gen[0, ids.shape[1]:].tolist())
    return outs, logits


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


@torch.inference_mode()
def engine_logits(llm: LLM, prompt: str) -> torch.Tensor:
    """The engine model's logits at every prompt position: one prefill into a scratch KV cache."""
    runner_ = llm.engine.model_runner
    ids = llm.tokenizer.encode(prompt)
    blocks = -(-len(ids) // runner_.block_size)
    kv = allocate_kv_cache(runner_.config, blocks, runner_.device)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], runner_.block_size, runner_.device)
    device = runner_.device
    hidden = runner_.model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), meta, kv)
    return runner_.model.compute_logits(hidden).float().cpu()


def check(config: str, tokens: int, ref_tokens: list[list[int]], ref_logits: dict[str, list[torch.Tensor]]) -> dict:
    first = build(config)
    second = build(config)
    llm = LLM.load(first["engine_dir"], runtime_options(os.environ, device="cuda"))
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(PROMPTS, params)
        seconds = time.perf_counter() - start
        same = [o.token_ids[:tokens] == r[:tokens] for o, r in zip(outs, ref_tokens, strict=True)]
        ours = [engine_logits(llm, p) for p in PROMPTS]
        rel = {name: [rel_err(o, r) for o, r in zip(ours, refs, strict=True)] for name, refs in ref_logits.items()}
        rel["transformers_bf16_vs_float32"] = [rel_err(b, f) for b, f in
                                               zip(ref_logits["bfloat16"], ref_logits["float32"], strict=True)]
    finally:
        llm.close()
    return {"config": config, "identical_greedy": same, "logits_rel_err": rel,
            "first_build_cache": first["cache"], "second_cache": second["cache"], "load_ms_cold": first["load_ms"],
            "load_ms_cached": second["load_ms"], "generate_s": round(seconds, 3),
            "samples": [o.text for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_check.json")
    args = parser.parse_args()
    ref_tokens, ref_logits = reference(PROMPTS, args.tokens)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "reference_samples": ref_tokens,
               "checks": [check(c, args.tokens, ref_tokens, ref_logits)
                          for c in ("configs/tiny-llama-bf16.yaml", "configs/tiny-llama-fp8.yaml")]}
    args.out.write_text(json.dumps(results, indent=2))
    print("logits relative error (max over prompts, all positions): engine vs transformers bf16 / float32, and "
          "transformers bf16 vs float32")
    print(f"{'config':30} {'greedy==hf':>10} {'vs bf16':>9} {'vs fp32':>9} {'hf bf16':>9} {'load cold/cached ms':>20}")
    for c in results["checks"]:
        rel = {k: max(v) for k, v in c["logits_rel_err"].items()}
        print(f"{c['config']:30} {sum(c['identical_greedy'])}/{len(PROMPTS):>8} {rel['bfloat16']:9.2e} "
              f"{rel['float32']:9.2e} {rel['transformers_bf16_vs_float32']:9.2e} "
              f"{c['load_ms_cold']:9.1f}/{c['load_ms_cached']:.1f}")


if __name__ == "__main__":
    main()
