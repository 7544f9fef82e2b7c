"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this sample greedily (as in vLLM): dividing logits by a tinier one overflows them to inf.
GREEDY_TEMPERATURE = 1e-5
# Seeds are unsigned 64-bit, what both torch.Generator.manual_seed and TensorRT-LLM's SamplingConfig take.
MAX_SEED = 2**64 - 1


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, in vLLM's vocabulary.

    `temperature=0` (or anything below 1e-5) is greedy. `top_k=0` (or -1) and `top_p=1` disable those filters.
    `seed`, an int in [0, 2**64 - 1], makes sampling reproducible for this request whatever else shares its batch.
    Generation stops at `max_tokens` (finish_reason "length"), at a token in `stop_token_ids` or the engine's EOS
    unless `ignore_eos`, or at a string in `stop`, which is cut from the text (finish_reason "stop").
    `detokenize=False` returns token ids only (the text stays empty, as TensorRT-LLM's executor and transformers'
    `generate` return them), which saves decoding every token; stop strings need the text.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 is greedy), "
                             f"got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an int >= 1, or 0/-1 to disable it, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**64 - 1], got {self.seed}: reduce it modulo 2**64")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop needs detokenize=True: stop strings are found in the text")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (a temperature below GREEDY_TEMPERATURE)."""
        return self.temperature < GREEDY_TEMPERATURE
