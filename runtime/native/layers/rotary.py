"""Rotary position embedding (GPT-NeoX half rotation, as in Hugging Face Llama), with Llama-3, linear and LongRoPE
(Phi-3) scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kiln.runtime.errors import EngineFormatError

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with the HF ``rope_scaling`` dict applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "longrope":
        return longrope_inv_freqs(head_dim, theta, scaling)[0]
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise EngineFormatError(f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths divided by ``factor``, a smooth ramp in between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: the dimensions that turn fewer than ``beta_slow`` times over the original context interpolated (divided
    by ``factor``), those that turn more than ``beta_fast`` times kept, a linear ramp between (transformers'
    ``_compute_yarn_parameters``; its attention factor scales the table)."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling["beta_fast"]), dimension(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / ((high - low) or 0.001)).clamp(0, 1)
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    kept = 1 - ramp  # the share of each dimension's frequency extrapolated (kept as it is)
    return (1.0 / (factor * base)) * (1 - kept) + (1.0 / base) * kept


def longrope_inv_freqs(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE's short and long inverse frequencies, [head_dim // 2] each: the base ones divided by
    ``short_factor`` / ``long_factor`` per dimension, as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    base = theta**exponents
    short, long = (torch.tensor(scaling[key], dtype=torch.float32, device="cpu")
                   for key in ("short_factor", "long_factor"))
    if short.shape != base.shape or long.shape != base.shape:
        raise EngineFormatError(f"longrope factors need head_dim / 2 = {base.shape[0]} values each, got "
                                f"{short.shape[0]} short and {long.shape[0]} long")
    return 1.0 / (short * base), 1.0 / (long * base)


class RotaryEmbedding(nn.Module):
    """Rotates q and k [num_tokens, heads, head_dim] by their absolute ``positions`` using a float32 cos/sin table.

    The table is computed on the CPU (identical on every device) and placed on the current default device. This is
    the PyTorch path; on CUDA ``PagedAttention`` rotates q and k with the table in the Triton kernel that stores the
    K/V (``runtime.native.kernels.rotary``, same numerics) when its ``KernelChoice`` runs the Triton kernels.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.long_offset = self.original_max = 0  # LongRoPE: where the long table starts, and when it applies
        if (scaling or {}).get("rope_type") == "longrope":  # the short table, then the long one, both scaled
            short, long = longrope_inv_freqs(head_dim, theta, scaling)
            table = torch.cat([_cos_sin(max_position, short), _cos_sin(max_position, long)])
            table = table * scaling["attention_factor"]
            self.long_offset, self.original_max = max_position, scaling["original_max_position_embeddings"]
        else:
            table = _cos_sin(max_position, rope_inv_freq(head_dim, theta, scaling))
            if (scaling or {}).get("rope_type") == "yarn":
                table = table * scaling["attention_factor"]
        self.register_buffer("cos_sin_cache", table.to(torch.get_default_device()), persistent=False)

    def is_long(self, seq_len: int) -> bool:
        """Whether a sequence ``seq_len`` tokens long takes LongRoPE's long table: it outgrew ``original_max``."""
        return bool(self.long_offset) and seq_len > self.original_max

    def table_rows(self, start: int, count: int, seq_len: int) -> range:
        """The rows of ``cos_sin_cache`` of positions ``start .. start + count`` of a sequence now ``seq_len`` tokens
        long: the positions themselves, except that with LongRoPE a sequence longer than ``original_max`` takes the
        long table for all of them, as transformers computes it. A sequence that grows past ``original_max`` has its
        KV recomputed with the long table (``recompute_point``), as transformers' Phi-3 recomputes its cache."""
        offset = self.long_offset if self.is_long(seq_len) else 0
        return range(start + offset, start + count + offset)

    def cache_salt(self, seq_len: int) -> bytes:
        """What sets apart, in the prefix cache, the KV of a sequence ``seq_len`` long rotated by another table than
        another's with the same tokens: LongRoPE's long sequences (``table_rows``)."""
        return b"longrope-long" if self.is_long(seq_len) else b""

    def recompute_point(self, seq_len: int) -> int | None:
        """The length at which a sequence now ``seq_len`` long must recompute its KV: ``original_max + 1`` for a
        LongRoPE sequence still on the short table, else None."""
        return self.original_max + 1 if self.long_offset and not self.is_long(seq_len) else None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos.to(q.dtype), sin.to(q.dtype)), _rotate(k, cos.to(k.dtype), sin.to(k.dtype))


def frequency_problem(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> str | None:
    """Why ``theta`` and ``scaling`` (whose type's keys are there) make no rotary table: a value the scaling
    refuses, or frequencies that are not finite (a tiny theta; YaRN's logarithms of a theta of 1); None when they
    make one. A value of the wrong type raises, as the parsing around it names it."""
    try:
        if (scaling or {}).get("rope_type") == "longrope":
            inv_freqs = longrope_inv_freqs(head_dim, theta, scaling)
        else:
            inv_freqs = (rope_inv_freq(head_dim, theta, scaling),)
    except EngineFormatError as e:
        return f"rope_scaling: {e}"
    except ArithmeticError:  # YaRN's logarithm of a theta of 1 divides by zero
        inv_freqs = (torch.tensor(float("nan")),)
    if not all(torch.isfinite(inv_freq).all() for inv_freq in inv_freqs):
        return (f"rope_theta {theta!r} with rope type {(scaling or {}).get('rope_type', 'default')!r} gives rotary "
                f"frequencies that are not finite")
    return None


def _cos_sin(max_position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[max_position, head_dim]: cos then sin of each position times each inverse frequency, in float32."""
    freqs = torch.arange(max_position, dtype=torch.float32, device="cpu")[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
