"""The build plan: the limits an engine is built for and serves under. One definition, passed by value from the
config's ``build:`` section (``pipeline.config.BuildSection.plan``) to the builders, into ``engine.json`` and
``kiln_trtllm.json``, and from there to the scheduler and ``EngineLimits``. Its names are TensorRT-LLM's, as in the
config; vLLM calls ``max_batch_size`` ``max_num_seqs`` and ``max_num_tokens`` ``max_num_batched_tokens``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from kiln.runtime.errors import KilnError

# "auto" and "fp8" as a config asks for them; a dtype name once a native build has resolved them
KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "float8_e4m3fn", "bfloat16", "float16", "float32")


class PlanError(KilnError, ValueError):
    """A build plan whose limits are not positive or contradict each other."""


@dataclass(frozen=True)
class BuildPlan:
    """``max_batch_size`` sequences in flight, prompts of up to ``max_input_len`` tokens, ``max_seq_len`` tokens per
    sequence (prompt and generated), ``max_num_tokens`` tokens batched per step, ``tokens_per_block`` tokens per
    paged-KV block (a power of two), and the KV cache's dtype."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in LIMITS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise PlanError(f"build.{name} must be a positive integer, got {value!r}")
        if self.max_input_len > self.max_seq_len:
            raise PlanError(f"build.max_input_len ({self.max_input_len}) must not exceed build.max_seq_len "
                            f"({self.max_seq_len})")
        if self.tokens_per_block & (self.tokens_per_block - 1):
            raise PlanError(f"build.tokens_per_block ({self.tokens_per_block}) must be a power of two, e.g. 16 or 32")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise PlanError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPE_NAMES)}")

    @property
    def blocks_per_seq(self) -> int:
        """KV blocks one sequence of ``max_seq_len`` tokens needs."""
        return -(-self.max_seq_len // self.tokens_per_block)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildPlan:
        """From an engine file's ``plan`` object; PlanError names what is missing or wrong."""
        if not isinstance(data, dict):
            raise PlanError("plan is not an object")
        names = {f.name for f in fields(cls)}
        if missing := [name for name in LIMITS if name not in data]:
            raise PlanError(f"plan lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})


LIMITS = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "tokens_per_block")
