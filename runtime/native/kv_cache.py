"""The paged KV cache: per layer a (k_cache, v_cache) pair of [num_blocks, block_size, num_kv_heads, head_dim].

The dtype is the plan's ``kv_cache_dtype``: the engine dtype, or float8_e4m3fn with per-layer ``k_scale`` /
``v_scale`` owned by the model's attention layers (values are stored as ``x / scale`` and read as ``x * scale``).
An FP8 V cache is kept token-major within each block (``token_major``): decode attention multiplies the
probabilities by V^T tiles whose rows are consecutive tokens, which an FP8 tensor-core operand needs and which the
compiler then copies asynchronously (on an H200 at batch 256, 22 % faster than V stored as rows). K, and a 16-bit
V, are stored row-major (contiguous).
"""

from __future__ import annotations

import torch

from kiln.runtime.native.engine_format import EngineConfig

KVCache = tuple[torch.Tensor, torch.Tensor]

# Where no num_kv_blocks is given, on CUDA the KV pool takes the memory left after the weights and an activation
# reserve within the share of the GPU the engine may hold (RuntimeOptions.gpu_memory_utilization, by default this
# one), up to GPU_KV_MAX_PLAN_MULTIPLE times what max_batch_size full-length sequences need (the excess serves the
# prefix cache; the cap keeps a small model on a large GPU from holding millions of blocks). The build refuses a plan
# whose one sequence this pool cannot hold, so what it builds loads.
GPU_MEMORY_UTILIZATION = 0.9
GPU_KV_MAX_PLAN_MULTIPLE = 4
# On CPU the KV pool holds max_batch_size full-length sequences, at most this many bytes.
CPU_KV_MAX_BYTES = 2 << 30


def kv_bytes_per_block(config: EngineConfig) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    arch = config.architecture
    elem = torch.empty((), dtype=config.kv_cache_torch_dtype).element_size()
    return 2 * arch.num_layers * config.plan.tokens_per_block * arch.num_kv_heads * arch.head_dim * elem


def default_kv_blocks(config: EngineConfig, device: torch.device,
                      gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION, weights_to_load: int = 0) -> int:
    """The KV pool's blocks on ``device`` where no ``num_kv_blocks`` is given (the rule above); ``weights_to_load``:
    bytes of weights not yet on the device (a build's), which the pool must leave room for."""
    plan, arch = config.plan, config.architecture
    block_bytes = kv_bytes_per_block(config)
    plan_blocks = plan.max_batch_size * plan.blocks_per_seq
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        hidden_width = 4 * arch.hidden_size + 3 * arch.intermediate_size
        activations = 4 * plan.max_num_tokens * hidden_width + 8 * plan.max_batch_size * arch.vocab_size
        usable = free - weights_to_load - (1 - gpu_memory_utilization) * total - 2 * activations
        return max(0, min(int(usable // block_bytes), GPU_KV_MAX_PLAN_MULTIPLE * plan_blocks))
    return min(plan_blocks, CPU_KV_MAX_BYTES // block_bytes)


def allocate_kv_cache(config: EngineConfig, num_blocks: int, device: torch.device | str) -> list[KVCache]:
    """Zeroed K and V caches for every layer, ``num_blocks`` blocks of ``plan.tokens_per_block`` tokens each."""
    arch = config.architecture
    shape = (num_blocks, config.plan.tokens_per_block, arch.num_kv_heads, arch.head_dim)
    dtype = config.kv_cache_torch_dtype
    v_zeros = zeros_token_major if dtype == torch.float8_e4m3fn else torch.zeros
    return [
        (torch.zeros(shape, dtype=dtype, device=device), v_zeros(shape, dtype=dtype, device=device))
        for _ in range(arch.num_layers)
    ]


def zeros_token_major(shape: tuple[int, int, int, int], dtype: torch.dtype,
                      device: torch.device | str) -> torch.Tensor:
    """A zeroed cache of ``shape`` [num_blocks, block_size, num_kv_heads, head_dim], token-major in memory."""
    num_blocks, block_size, num_kv_heads, head_dim = shape
    return torch.zeros(num_blocks, num_kv_heads, head_dim, block_size, dtype=dtype, device=device).permute(0, 3, 1, 2)


def token_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` [num_blocks, block_size, num_kv_heads, head_dim] with the same values stored token-major within
    each block: [num_blocks, num_kv_heads, head_dim, block_size] in memory, seen through a permutation."""
    return cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def is_token_major(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is stored as ``token_major`` makes it (and is not also contiguous, as with 1-token blocks)."""
    return cache.permute(0, 2, 3, 1).is_contiguous() and not cache.is_contiguous()
