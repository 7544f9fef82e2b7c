"""vLLM's keywords of ``LLM.generate`` and ``LLM.chat`` that Kiln lacks: taken at the values that change nothing
(vLLM's defaults), so that code forwarding them runs; any other value is refused saying why. vLLM's engine
arguments to ``LLM(...)`` are refused saying where Kiln takes each."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kiln.runtime.sampling_params import plain_number


def _none_or_empty(value: object) -> bool:
    return value is None or value == {}


def _no_priority(value: object) -> bool:
    """vLLM's priority: None, 0 (of any library), or a 0 for each prompt (first come, first served)."""
    values = [plain_number(v) for v in (value if isinstance(value, list | tuple) else [value])]
    return all(v is None or (type(v) is int and v == 0) for v in values)


# name -> (whether a value changes nothing, why another one cannot be honoured)
VLLM_CALL_OPTIONS: dict[str, tuple[Callable[[object], bool], str]] = {
    "lora_request": (lambda value: value is None, "Kiln serves one model and no LoRA adapter: build an engine of "
                     "the merged weights"),
    "priority": (_no_priority, "Kiln schedules requests first come, first served"),
    "tokenization_kwargs": (_none_or_empty, "text is encoded as the engine's tokenizer encodes it; "
                            "SamplingParams.truncate_prompt_tokens is refused too"),
    "mm_processor_kwargs": (_none_or_empty, "Kiln's engines take text only"),
    "chat_template_content_format": (lambda value: value == "auto", "Kiln passes a message's text parts as the "
                                     "template reads them, as vLLM's 'auto' does"),
}
GENERATE_OPTIONS = ("lora_request", "priority", "tokenization_kwargs")
CHAT_OPTIONS = ("lora_request", "chat_template_content_format", "mm_processor_kwargs", "tokenization_kwargs")


def check_vllm_call_options(method: str, options: Mapping[str, object], names: tuple[str, ...]) -> None:
    """Refuse a keyword of ``options`` that is none of vLLM's ``names`` (TypeError, as Python's), or one of them at a
    value that would change something (ValueError naming it and why)."""
    for name, value in options.items():
        if name not in names:
            raise TypeError(f"LLM.{method}() got an unexpected keyword argument {name!r}")
        changes_nothing, why = VLLM_CALL_OPTIONS[name]
        if not changes_nothing(value):
            raise ValueError(f"LLM.{method}: vLLM's {name}={value!r} is not supported ({why}); leave it out")


# vLLM's engine argument (as a config key; its flag is the dashed form) -> the build-config key that takes it
VLLM_BUILD_SETTINGS = {
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
# vLLM's engine arguments to LLM(...) that a loaded engine's options or a request take instead
VLLM_LOAD_ARGUMENTS: dict[str, str] = {
    "gpu_memory_utilization": "pass options=RuntimeOptions(gpu_memory_utilization=...)",
    "enable_prefix_caching": "pass options=RuntimeOptions(prefix_caching=...)",
    "enforce_eager": "pass options=RuntimeOptions(cuda_graphs=False)",
    "device": "pass options=RuntimeOptions(device=...)",
    "tokenizer": "the engine carries the tokenizer it was built with",
    "trust_remote_code": "Kiln runs no code from a checkpoint",
    "seed": "pass SamplingParams(seed=...) with each request",
}


def engine_argument_error(arguments: Mapping[str, object]) -> TypeError:
    """The TypeError for keyword arguments ``LLM(...)`` does not take, saying where Kiln takes vLLM's."""
    name = next(iter(arguments))
    where = VLLM_LOAD_ARGUMENTS.get(name) or (f"the engine is built with it: set {VLLM_BUILD_SETTINGS[name]} in the "
                                              f"config and `kiln build`" if name in VLLM_BUILD_SETTINGS else None)
    return TypeError(f"LLM() got an unexpected keyword argument {name!r}" + (f": {where}" if where else ""))
