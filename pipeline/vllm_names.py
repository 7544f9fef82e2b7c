"""vLLM's names for Kiln's settings, so that a user who writes vLLM's (a config key, a ``vllm serve`` flag) is told
Kiln's instead of a look-alike."""

from __future__ import annotations

# vLLM's engine argument (as a config key; its flag is the dashed form) -> where Kiln takes it
VLLM_SETTINGS = {
    "max_num_seqs": "build.max_batch_size",
    "max_num_batched_tokens": "build.max_num_tokens",
    "max_model_len": "build.max_seq_len",
    "tensor_parallel_size": "build.tp_size",
    "pipeline_parallel_size": "build.pp_size",
    "block_size": "build.tokens_per_block",
    "dtype": "model.dtype",
    "quantization": "quantize.format",
    "kv_cache_dtype": "quantize.kv_cache_dtype",
}


def kiln_setting_for(name: str) -> str | None:
    """Where Kiln takes the setting vLLM names ``name`` (a config key, or a flag such as ``--max-model-len``)."""
    return VLLM_SETTINGS.get(name.lstrip("-").replace("-", "_"))

# vLLM's --tool-call-parser names -> the format of runtime/server/tool_calls.py that reads the same calls (vLLM
# registers llama4_json as its llama3_json parser); Kiln parses no other
VLLM_TOOL_CALL_PARSERS = {"hermes": "hermes", "llama3_json": "llama3_json", "llama4_json": "llama3_json",
                          "mistral": "mistral"}
