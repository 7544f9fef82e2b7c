"""vLLM's names for Kiln's settings, so that a user who writes vLLM's (a config key, a ``vllm serve`` flag) is told
Kiln's instead of a look-alike."""

from __future__ import annotations

from kiln.runtime.vllm_call_options import VLLM_BUILD_SETTINGS, VLLM_LOAD_ARGUMENTS

# `vllm serve` flags asking for what Kiln cannot do or does another way, refused (a usage error) with why and what
# Kiln has instead
REFUSED_VLLM_FLAGS = {
    "--enable-log-requests": "Kiln logs no request's contents; --access-log logs a line per request",
    "--model": "kiln serve takes its target as an argument: an engine directory, a cache key, or a config whose "
               "model.path names the checkpoint",
    "--trust-remote-code": "Kiln runs no code a checkpoint ships: the families it runs need none, so leave it out",
    "--revision": "set model.revision in the build config",
    "--download-dir": "Kiln reads the Hugging Face cache of $HF_HOME; set that instead",
    "--tokenizer": "the engine keeps its checkpoint's tokenizer",
    "--tokenizer-mode": "the engine keeps its checkpoint's tokenizer, as transformers loads it",
    "--seed": "send a seed with each request (its `seed` field); Kiln has no server-wide one",
    "--root-path": "Kiln serves at /: strip the prefix at the proxy",
    "--uds": "Kiln listens on TCP (--host, --port): put a proxy on the socket if clients must use one",
    "--ssl-keyfile": "Kiln serves plain HTTP: terminate TLS at the proxy or ingress",
    "--ssl-certfile": "Kiln serves plain HTTP: terminate TLS at the proxy or ingress",
    "--ssl-ca-certs": "Kiln serves plain HTTP: terminate TLS at the proxy or ingress",
    "--ssl-cert-reqs": "Kiln serves plain HTTP: terminate TLS at the proxy or ingress",
    "--enforce-eager": "set KILN_CUDA_GRAPHS=0 to run every step eagerly",
    "--swap-space": VLLM_LOAD_ARGUMENTS["swap_space"][1],
    "--config": "Kiln's config is its own YAML (docs/config.md), given as the target",
    "--lora-modules": "Kiln serves no LoRA adapters",
    "--guided-decoding-backend": "Kiln's structured output always runs on llguidance",
    "--return-tokens-as-token-ids": "send return_tokens_as_token_ids with each request",
    "--data-parallel-size": "one kiln serve runs one engine: run a replica per data-parallel rank",
    "--api-server-count": "one kiln serve runs one API server (its engine in a process of its own)",
    "--distributed-executor-backend": "Kiln's tensor-parallel ranks are its own processes (build.tp_size)",
    "--compilation-config": "Kiln's kernels are its own Triton ones, with CUDA graphs (KILN_CUDA_GRAPHS)",
    "--speculative-config": "Kiln does no speculative decoding",
    "--kv-transfer-config": "Kiln transfers no KV between servers",
    "--enable-sleep-mode": "Kiln has no sleep mode: close the LLM to free the GPU",
    "--scheduling-policy": "set KILN_SCHEDULER_POLICY (max_utilization or guaranteed_no_evict)",
    "--max-logprobs": VLLM_LOAD_ARGUMENTS["max_logprobs"][1],
    "--response-role": "Kiln's chat answers are always the assistant's",
    "--chat-template-content-format": "Kiln finds the content format in the chat template, as vLLM's auto does",
    "--load-format": "Kiln loads safetensors only",
    "--hf-overrides": "edit the checkpoint's config.json; Kiln builds from what it says",
    "--limit-mm-per-prompt": "Kiln serves text models only",
    "--no-enable-chunked-prefill": "Kiln always chunks a long prompt's prefill (build.max_num_tokens a step)",
    "--max-num-partial-prefills": "Kiln chunks one prompt's prefill a step",
    "--num-scheduler-steps": "Kiln schedules every step",
    "--enable-force-include-usage": "send stream_options.include_usage with each request",
    "--enable-server-load-tracking": "/metrics has the running and waiting requests (vllm:num_requests_running)",
    "--disable-frontend-multiprocessing": "--no-engine-process runs the engine on a thread of the server",
}


# `vllm serve`'s short aliases of its flags
VLLM_SHORT_FLAGS = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
                    "-dp": "--data-parallel-size", "-q": "--quantization"}


def vllm_flag_advice(flag: str) -> str | None:
    """What Kiln does instead of ``vllm serve``'s ``flag`` (also written with underscores, or as its short alias):
    where it takes the setting, or why it refuses it; None for a flag vLLM does not have, as far as Kiln knows."""
    dashed = flag.split("=", 1)[0].replace("_", "-")
    dashed = VLLM_SHORT_FLAGS.get(dashed, dashed)
    if kiln_name := kiln_setting_for(dashed):
        return f"vLLM's; Kiln takes it as {kiln_name} in the build config"
    if dashed in REFUSED_VLLM_FLAGS:
        return f"vLLM's; {REFUSED_VLLM_FLAGS[dashed]}"
    return None


def kiln_setting_for(name: str) -> str | None:
    """Where Kiln takes the setting vLLM names ``name`` (a config key, or a flag such as ``--max-model-len``)."""
    return VLLM_BUILD_SETTINGS.get(name.lstrip("-").replace("-", "_"))

# vLLM's --tool-call-parser names -> the format of runtime/server/tool_calls.py that reads the same calls (vLLM
# registers llama4_json as its llama3_json parser); Kiln parses no other
VLLM_TOOL_CALL_PARSERS = {"hermes": "hermes", "llama3_json": "llama3_json", "llama4_json": "llama3_json",
                          "mistral": "mistral"}
