"""What the OpenAI features cost offline: output tokens/s of one engine on seeded random prompts, with no request
asking for anything (``plain``; run it under an older checkout's PYTHONPATH too, to compare the same engine without
the features), with half of the requests held to a JSON schema (``half-json``), and with every request asking for
5 log probabilities per token (``logprobs``).

    python tools/gpu_openai_cost.py ENGINE_DIR [--variants plain,half-json,logprobs] [--prompts 256]
        [--input-len 1024] [--output-len 256]

Prints one JSON object per variant. Only ``SamplingParams`` fields that older checkouts have are used for
``plain``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

# a free string: random weights fill it to max_tokens, so every request generates the same number of tokens
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
          "additionalProperties": False}


def params_of(variant: str, index: int, output_len: int):
    from kiln.runtime import SamplingParams

    common = dict(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    if variant == "half-json" and index % 2:
        return SamplingParams(**common, structured_output={"json": SCHEMA})
    if variant == "logprobs":
        return SamplingParams(**common, logprobs=5)
    return SamplingParams(**common)


def run(engine_dir: Path, variant: str, prompts: int, input_len: int, output_len: int) -> dict:
    from kiln.runtime import LLM

    generator = torch.Generator().manual_seed(0)
    with LLM.load(engine_dir) as llm:
        vocab = llm.limits.vocab_size
        warmup = torch.randint(0, vocab, (8, input_len), generator=generator).tolist()
        llm.generate(warmup, [params_of(variant, i, 16) for i in range(8)])
        batch = torch.randint(0, vocab, (prompts, input_len), generator=generator).tolist()
        params = [params_of(variant, i, output_len) for i in range(prompts)]
        start = time.perf_counter()
        outputs = llm.generate(batch, params)
        seconds = time.perf_counter() - start
    tokens = sum(len(output.token_ids) for output in outputs)
    return {"variant": variant, "requests": prompts, "output_tokens": tokens, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--variants", default="plain,half-json,logprobs")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()
    for variant in args.variants.split(","):
        print(json.dumps(run(args.engine_dir, variant, args.prompts, args.input_len, args.output_len)), flush=True)


if __name__ == "__main__":
    main()
