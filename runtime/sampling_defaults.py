"""The sampling defaults a model's creator recommends in its ``generation_config.json`` (Llama 3 Instruct:
temperature 0.6, top_p 0.9; Qwen3: 0.6, 0.95, top_k 20), as vLLM takes them by default: a served request that
leaves a field unset gets them (``--generation-config auto``; ``vllm`` keeps vLLM's own defaults instead), and so
does an offline ``LLM.generate`` given no SamplingParams."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from kiln.runtime.errors import KilnError
from kiln.runtime.sampling_params import SamplingParams

logger = logging.getLogger("kiln.runtime")

GenerationConfigMode = Literal["auto", "vllm"]
GENERATION_CONFIG_MODES: tuple[GenerationConfigMode, ...] = ("auto", "vllm")
# What vLLM takes from a generation config (its max_new_tokens, a cap on every request there, is not taken here)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(engine_dir: Path, mode: GenerationConfigMode) -> dict[str, float]:
    """The defaults of ``engine_dir``'s generation_config.json (none with ``mode`` "vllm", or without the file);
    KilnError naming the file when one of them is not a value SamplingParams takes."""
    path = Path(engine_dir) / "generation_config.json"
    if mode == "vllm" or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KilnError(f"{path}: not readable JSON ({exc}); fix it, or serve with --generation-config vllm (which "
                        f"leaves it aside)") from None
    defaults = {key: config[key] for key in SAMPLING_KEYS if isinstance(config, dict) and config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise KilnError(f"{path}: {exc}; fix it, or serve with --generation-config vllm (which leaves it "
                        f"aside)") from None
    return defaults


def described(defaults: dict[str, float]) -> str:
    """``temperature 0.6, top_p 0.9``: the defaults as a log line names them."""
    return ", ".join(f"{key} {value}" for key, value in defaults.items())
