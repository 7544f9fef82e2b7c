"""The paged KV cache: per layer a (k_cache, v_cache) pair of [num_blocks, block_size, num_kv_heads, head_dim].

The dtype is the plan's ``kv_cache_dtype``: the engine dtype, or float8_e4m3fn with per-layer ``k_scale`` /
``v_scale`` owned by the model's attention layers (values are stored as ``x / scale`` and read as ``x * scale``).
"""

from __future__ import annotations

import torch

from runtime.engine_format import EngineConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


def kv_bytes_per_block(config: EngineConfig) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    arch = config.architecture
    elem = torch.empty((), dtype=config.kv_cache_torch_dtype).element_size()
    return 2 * arch.num_layers * config.plan.tokens_per_block * arch.num_kv_heads * arch.head_dim * elem


def allocate_kv_cache(config: EngineConfig, num_blocks: int, device: torch.device | str) -> list[KVCache]:
    """Zeroed K and V caches for every layer, ``num_blocks`` blocks of ``plan.tokens_per_block`` tokens each."""
    arch = config.architecture
    shape = (num_blocks, config.plan.tokens_per_block, arch.num_kv_heads, arch.head_dim)
    dtype = config.kv_cache_torch_dtype
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(arch.num_layers)
    ]
