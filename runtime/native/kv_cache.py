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
