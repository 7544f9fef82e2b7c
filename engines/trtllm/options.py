"""The build options the TensorRT-LLM backend acts on, as plain data (filled from the config's `build:` section)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

KV_CACHE_TYPES = ("paged", "continuous", "disabled")
PLUGIN_DTYPES = ("auto", "float16", "bfloat16", "float32", "disable")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class TrtllmBuildOptions:
    """Limits, parallelism and the engine features that in-flight batching depends on.

    The feature fields default to what in-flight batching with KV block reuse needs; a config may turn them off
    (preflight then refuses the build and says why). `gemm_plugin=None` lets Kiln pick it from the format.
    """

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
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

    @classmethod
    def from_config(cls, build: dict[str, Any]) -> TrtllmBuildOptions:
        """From the `build:` section as a dict (`BuildSection.model_dump()`, plus an optional `trtllm:` mapping of
        feature overrides); keys this backend does not use (backend, device, timeout_s) are ignored."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in build.items() if k in known}
        values.update({k: v for k, v in (build.get("trtllm") or {}).items() if k in known})
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
