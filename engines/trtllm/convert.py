"""`python -m kiln.engines.trtllm.convert`: an unquantized HF Llama checkpoint → a TensorRT-LLM 1.2.x checkpoint.

Run as a subprocess by the trtllm builder for `quantize.format: none` (quantized formats come from the quantize
stage's export). It does what TensorRT-LLM's examples/models/core/llama/convert_checkpoint.py does for this case,
with the public API that the pip wheel ships (the examples folder is not part of the wheel): one
`LLaMAForCausalLM.from_hugging_face(...)` per rank, saved with `save_checkpoint`, rank 0 writing config.json, whose
rotary settings are then read from the HF config.json itself.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def convert(model_dir: Path, output_dir: Path, dtype: str, tp_size: int, pp_size: int) -> None:
    """Write `output_dir/config.json` and one `rank<N>.safetensors` per rank of the tp x pp mapping."""
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models import LLaMAForCausalLM

    world_size = tp_size * pp_size
    output_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        mapping = Mapping(world_size=world_size, rank=rank, tp_size=tp_size, pp_size=pp_size)
        model = LLaMAForCausalLM.from_hugging_face(str(model_dir), dtype=dtype, mapping=mapping)
        model.save_checkpoint(str(output_dir), save_config=rank == 0)
        del model
    written = output_dir / "config.json"
    config = json.loads(written.read_text(encoding="utf-8"))
    config.update(rotary_settings(json.loads((model_dir / "config.json").read_text(encoding="utf-8"))))
    written.write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")


def rotary_settings(hf_config: dict) -> dict:
    """TensorRT-LLM's ``rotary_base`` / ``rotary_scaling`` from an HF config.json of either layout (transformers 4's
    top-level ``rope_theta`` and ``rope_scaling``, or 5's ``rope_parameters``): TensorRT-LLM 1.2 reads
    ``hf_config.rope_theta``, which transformers 5 no longer has, and would take 10000 silently."""
    rope = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None) or hf_config.get("rope_theta") or 10000.0
    kind = rope.pop("rope_type", None) or rope.pop("type", None)
    return {"rotary_base": float(theta), **({"rotary_scaling": {"type": kind, **rope}} if kind not in (None, "default")
                                            else {})}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, required=True)
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tp_size", type=int, default=1)
    parser.add_argument("--pp_size", type=int, default=1)
    args = parser.parse_args(argv)
    convert(args.model_dir, args.output_dir, args.dtype, args.tp_size, args.pp_size)


if __name__ == "__main__":
    main()
