"""How a tensor-parallel engine splits the model over ``tp_size`` ranks, Megatron-style.

- Column-parallel (each rank computes some output features): ``qkv_proj`` (its own query heads and their KV heads;
  with fewer KV heads than ranks each rank holds the one KV head its query heads share, replicated) and
  ``gate_up_proj`` (a slice of the gate and the same slice of the up rows). Weight rows, per-row FP8 scales, INT4
  rows with their group scales and biases split; the input's FP8 scale and AWQ ``pre_quant_scale`` are replicated.
- Row-parallel (each rank sums part of the input features; the ranks' outputs are all-reduced): ``o_proj`` and
  ``down_proj``. Weight columns, packed INT4 columns, whole INT4 groups of scales and the AWQ ``pre_quant_scale``
  split; the per-row FP8 scale and the input scale are replicated; a bias is kept on rank 0 only (zero elsewhere),
  so the all-reduce adds it once.
- Vocabulary-parallel: ``embed_tokens`` and ``lm_head`` rows in ``vocab_rows_per_rank`` slices, the last padded with
  zero rows; a rank embeds the ids in its slice (the all-reduce adds the others) and its logits are all-gathered.
- Everything else (norms, KV cache scales) is replicated.

Rank ``r``'s weights are ``engine_format.weights_file(r)``; a rank's model has the shapes of ``rank_architecture``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kiln.runtime.native.engine_format import Architecture, EngineConfig

COLUMN_PARALLEL = ("self_attn.qkv_proj", "mlp.gate_up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")
SPLIT_BY_ROWS = ("weight", "weight_scale", "bias", "qweight", "scales")  # of a column-parallel linear
SPLIT_BY_COLUMNS = ("weight", "qweight", "scales", "pre_quant_scale")  # of a row-parallel linear (last dim)


def sharding_problems(arch: Architecture, tp_size: int, group_size: int | None = None) -> list[str]:
    """Why ``arch`` cannot be split over ``tp_size`` ranks (empty when it can)."""
    if tp_size == 1:
        return []
    problems = []
    if arch.num_heads % tp_size:
        problems.append(f"num_attention_heads ({arch.num_heads}) is not a multiple of tp_size {tp_size}")
    if arch.num_kv_heads % tp_size and tp_size % arch.num_kv_heads:
        problems.append(f"num_key_value_heads ({arch.num_kv_heads}) neither divides nor is a multiple of tp_size "
                        f"{tp_size}")
    if arch.intermediate_size % tp_size:
        problems.append(f"intermediate_size ({arch.intermediate_size}) is not a multiple of tp_size {tp_size}")
    if group_size:
        for name, features in (("the attention output", arch.num_heads * arch.head_dim),
                               ("intermediate_size", arch.intermediate_size)):
            if features % tp_size == 0 and (features // tp_size) % group_size:
                problems.append(f"{name} ({features} features) over tp_size {tp_size} splits an INT4 group of "
                                f"{group_size}")
    return problems


def vocab_rows_per_rank(vocab_size: int, tp_size: int) -> int:
    """Rows of the embedding and LM head each rank holds (the last rank's tail is zero padding)."""
    return -(-vocab_size // tp_size)


def rank_architecture(arch: Architecture, tp_size: int) -> Architecture:
    """The shapes one rank's model has: its query heads, KV heads (at least one), MLP features and vocabulary rows."""
    if tp_size == 1:
        return arch
    return replace(arch, num_heads=arch.num_heads // tp_size, num_kv_heads=max(1, arch.num_kv_heads // tp_size),
                   intermediate_size=arch.intermediate_size // tp_size,
                   vocab_size=vocab_rows_per_rank(arch.vocab_size, tp_size))


def rank_config(config: EngineConfig) -> EngineConfig:
    """``config`` with the architecture of one of its ``tp_size`` ranks (itself for a one-device engine)."""
    return replace(config, architecture=rank_architecture(config.architecture, config.tp_size))


def shard_weights(weights: dict[str, torch.Tensor], arch: Architecture, tp_size: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's runtime state dict, from the whole model's (``engines.native.weights.convert_weights``)."""
    if problems := sharding_problems(arch, tp_size):
        raise ValueError(f"cannot split the model over tp_size {tp_size}: {'; '.join(problems)}")
    return [{name: _shard(name, tensor, arch, tp_size, rank).contiguous() for name, tensor in weights.items()}
            for rank in range(tp_size)]


def _shard(name: str, tensor: torch.Tensor, arch: Architecture, tp_size: int, rank: int) -> torch.Tensor:
    module, _, leaf = name.rpartition(".")
    if name in VOCAB_PARALLEL:
        rows = vocab_rows_per_rank(arch.vocab_size, tp_size)
        shard = tensor[rank * rows:(rank + 1) * rows]
        return torch.cat([shard, shard.new_zeros(rows - shard.shape[0], *shard.shape[1:])])
    if module.endswith(COLUMN_PARALLEL) and leaf in SPLIT_BY_ROWS:
        return torch.cat([tensor[start:stop] for start, stop in _column_rows(module, arch, tp_size, rank)])
    if module.endswith(ROW_PARALLEL) and leaf in SPLIT_BY_COLUMNS:
        width = tensor.shape[-1] // tp_size
        return tensor[..., rank * width:(rank + 1) * width]
    if module.endswith(ROW_PARALLEL) and leaf == "bias":
        return tensor if rank == 0 else torch.zeros_like(tensor)
    return tensor


def _column_rows(module: str, arch: Architecture, tp_size: int, rank: int) -> list[tuple[int, int]]:
    """The row ranges of a fused column-parallel linear that ``rank`` holds (its members' rows, in order)."""
    if module.endswith("mlp.gate_up_proj"):
        width = arch.intermediate_size // tp_size
        return [(member + rank * width, member + (rank + 1) * width) for member in (0, arch.intermediate_size)]
    d = arch.head_dim
    heads = arch.num_heads // tp_size
    q = (rank * heads * d, (rank + 1) * heads * d)
    kv_heads = max(1, arch.num_kv_heads // tp_size)
    first_kv = rank * arch.num_kv_heads // tp_size  # with fewer KV heads than ranks: the head these queries share
    k_start = arch.num_heads * d + first_kv * d
    v_start = k_start + arch.num_kv_heads * d
    return [q, (k_start, k_start + kv_heads * d), (v_start, v_start + kv_heads * d)]
