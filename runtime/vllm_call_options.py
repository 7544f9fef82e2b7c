"""vLLM's keywords of ``LLM.generate`` and ``LLM.chat`` that Kiln lacks: taken at the values that change nothing
(vLLM's defaults), so that code forwarding them runs; any other value is refused saying why. vLLM's engine
arguments to ``LLM(...)`` are taken at the values that change nothing, and otherwise refused saying where Kiln takes
each."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.runtime.sampling_params import plain_number, same_value

if TYPE_CHECKING:
    from kiln.runtime.options import RuntimeOptions


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
    "tokenization_kwargs": (_none_or_empty, "text is encoded as the engine's tokenizer encodes it: encode it "
                            "yourself, llm.tokenizer.encode(text, add_special_tokens=...) (ids[-k:] to truncate), "
                            "and pass {'prompt_token_ids': ids}"),
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
# vLLM's build settings at the value that means the checkpoint's own, which the engine was built from
# (vLLM's defaults, which argparse-driven scripts pass through)
AUTO_BUILD_VALUES: dict[str, tuple] = {"dtype": ("auto",), "max_model_len": (None,), "quantization": (None,),
                                       "kv_cache_dtype": ("auto",), "max_num_seqs": (None,),
                                       "max_num_batched_tokens": (None,), "block_size": (None,),
                                       "pipeline_parallel_size": (1,)}
# vLLM's engine arguments to LLM(...) that Kiln takes elsewhere or not at all -> (the values that change nothing,
# taken; what to do instead of another value)
VLLM_LOAD_ARGUMENTS: dict[str, tuple[tuple, str]] = {
    "gpu_memory_utilization": ((), "pass options=RuntimeOptions(gpu_memory_utilization=...)"),
    "enable_prefix_caching": ((None,), "pass options=RuntimeOptions(prefix_caching=...)"),
    "enforce_eager": ((), "pass options=RuntimeOptions(cuda_graphs=False)"),
    "device": ((), "pass options=RuntimeOptions(device=...)"),
    "tokenizer": ((None,), "the engine carries the tokenizer it was built with"),
    "tokenizer_mode": (("auto",), "the engine's tokenizer encodes as the checkpoint's fast tokenizer does"),
    "trust_remote_code": ((False,), "Kiln runs no code from a checkpoint"),
    "seed": ((None,), "pass SamplingParams(seed=...) with each request"),
    "revision": ((None,), "set model.revision in the config and `kiln build`"),
    "download_dir": ((None,), "`kiln build` reads the Hugging Face cache of $HF_HOME; LLM loads a built engine"),
    "load_format": (("auto",), "LLM loads the engine `kiln build` made"),
    "enable_lora": ((False,), "Kiln serves one model and no LoRA adapter: build an engine of the merged weights"),
    "served_model_name": ((None,), "LLM names no model; `kiln serve --served-model-name` names a served one"),
    "disable_log_stats": ((True,), "LLM logs no statistics: read llm.stats()"),
    "max_logprobs": ((20,), "Kiln returns at most 20 log probabilities a token, as OpenAI does"),
    "swap_space": ((), "Kiln swaps no KV to the host: a preempted request is computed again"),
    "cpu_offload_gb": ((0,), "Kiln keeps every weight on the GPU: quantize the engine (quantize.format) or split it "
                             "over more GPUs (build.tp_size)"),
    "enable_chunked_prefill": ((None, True), "Kiln always chunks a long prompt's prefill (build.max_num_tokens a "
                                             "step)"),
    "max_seq_len_to_capture": ((), "Kiln captures CUDA graphs for the sizes its build chose: "
                                   "RuntimeOptions(cuda_graphs=..., cuda_graph_capture=...) say whether and when"),
    "compilation_config": ((None,), "Kiln runs its own Triton kernels with CUDA graphs: "
                                    "RuntimeOptions(kernels=..., cuda_graphs=...)"),
    "distributed_executor_backend": ((None,), "Kiln runs a tensor-parallel engine's ranks as processes of its own "
                                              "(build.tp_size; RuntimeOptions(tp_rendezvous=...) across hosts)"),
}


# vLLM's engine arguments that name a RuntimeOptions field -> that field
VLLM_RUNTIME_OPTIONS = {"enable_prefix_caching": "prefix_caching"}


def check_engine_arguments(arguments: Mapping[str, object], engine_dir: Path | None,
                           options: RuntimeOptions | None = None) -> None:
    """Raise one TypeError naming every keyword argument that ``LLM(...)`` does not take, with where Kiln takes each
    of vLLM's; vLLM's at a value that changes nothing are taken: one of VLLM_LOAD_ARGUMENTS's, one equal to the
    RuntimeOptions field it names in ``options`` (VLLM_RUNTIME_OPTIONS; None: the defaults), or a build setting
    (VLLM_BUILD_SETTINGS) equal to the engine's in ``engine_dir`` (None: an Engine object, whose are not known)."""
    from kiln.runtime.engine import is_engine_dir
    from kiln.runtime.options import RuntimeOptions

    built = (_engine_build_values(engine_dir) if engine_dir is not None and is_engine_dir(engine_dir)
             and arguments.keys() & VLLM_BUILD_SETTINGS.keys() else {})
    refused = []
    for name, value in arguments.items():
        if name in VLLM_BUILD_SETTINGS:
            taken = (*AUTO_BUILD_VALUES.get(name, ()), *([built[name]] if name in built else []))
            instead = f"the engine is built with it: set {VLLM_BUILD_SETTINGS[name]} in the config and `kiln build`"
        else:
            taken, instead = VLLM_LOAD_ARGUMENTS.get(name, ((), ""))
            if name in VLLM_RUNTIME_OPTIONS:  # the value options hold (vLLM's True with prefix_caching on)
                taken = (*taken, getattr(options or RuntimeOptions(), VLLM_RUNTIME_OPTIONS[name]))
        if any(same_value(value, same) for same in taken):
            continue
        refused.append(f"{name!r}" + (f": {instead}" if instead else "")
                       + (f" (taken at {' or '.join(map(repr, taken))}, which changes nothing)" if taken else ""))
    if len(refused) == 1:
        raise TypeError(f"LLM() got an unexpected keyword argument {refused[0]}")
    if refused:
        raise TypeError(f"LLM() got unexpected keyword arguments {'; '.join(refused)}")


def _engine_build_values(engine_dir: Path) -> dict[str, object]:
    """The values of vLLM's build settings (VLLM_BUILD_SETTINGS's names) that the engine in ``engine_dir`` was built
    with; EngineFormatError where its description does not read."""
    from kiln.runtime.trtllm.engine_info import TrtllmEngineInfo, is_trtllm_engine

    if is_trtllm_engine(engine_dir):
        info = TrtllmEngineInfo.load(engine_dir)
        plan, tp_size = info.plan, info.tp_size
    else:
        from kiln.runtime.native.engine_format import EngineConfig

        config = EngineConfig.load(engine_dir)
        plan, tp_size = config.plan, config.tp_size
    return {"tensor_parallel_size": tp_size, "max_model_len": plan.max_seq_len, "max_num_seqs": plan.max_batch_size,
            "max_num_batched_tokens": plan.max_num_tokens, "block_size": plan.tokens_per_block}
