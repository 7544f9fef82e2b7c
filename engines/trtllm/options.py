"""The build options the TensorRT-LLM backend acts on, as plain data: the build plan, the parallel mapping and the
engine features that in-flight batching depends on (the pipeline fills them from the config's `build:` section)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kiln.runtime.plan import BuildPlan

KV_CACHE_TYPES = ("paged", "continuous", "disabled")
PLUGIN_DTYPES = ("auto", "float16", "bfloat16", "float32", "disable")
GEMM_PLUGINS = (*PLUGIN_DTYPES, "fp8")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class TrtllmBuildOptions:
    """What ``trtllm-build`` is asked for: the plan, the parallel mapping, and the features the config's
    ``build.trtllm`` section sets (its defaults, in ``pipeline/config.py``, are what in-flight batching with KV block
    reuse needs; preflight refuses a config that turns one off, saying why). ``gemm_plugin=None`` lets Kiln pick it
    from the format."""

    plan: BuildPlan
    tp_size: int
    pp_size: int
    workers: int
    log_level: str
    kv_cache_type: str
    remove_input_padding: bool
    gpt_attention_plugin: str
    gemm_plugin: str | None
    context_fmha: bool
    use_paged_context_fmha: bool

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
