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
    """The feature fields default to what in-flight batching with KV block reuse needs; a config may turn them off
    (preflight then refuses the build and says why). `gemm_plugin=None` lets Kiln pick it from the format."""

    plan: BuildPlan
    tp_size: int = 1
    pp_size: int = 1
    workers: int = 1
    log_level: str = "info"
    kv_cache_type: str = "paged"
    remove_input_padding: bool = True
    gpt_attention_plugin: str = "auto"
    gemm_plugin: str | None = None
    context_fmha: bool = True
    use_paged_context_fmha: bool = True

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
