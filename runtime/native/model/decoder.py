"""The decoder every family runs (``registry.py``): GQA, RoPE (Llama-3 scaling included), RMSNorm, SwiGLU, paged KV,
and the families' quirks as ``Architecture`` fields: q/k/v and o biases (Qwen2), per-head q/k norms (Qwen3),
sliding-window layers (Mistral, Gemma 2), and Gemma 2's GeGLU, sandwich norms, scaled embeddings, query scale and
logit soft-capping.

Weights come from an engine's ``rank0.safetensors`` in runtime layout: fused ``qkv_proj`` and ``gate_up_proj``,
each linear in the engine's quantization format unless listed in ``quantization.exclude_modules``. Given a
``TensorParallelGroup``, the model is that rank's shard (``parallel/sharding.py``): its layers have the rank's shapes,
the outputs of ``o_proj`` and ``down_proj`` and the embeddings are all-reduced, and the logits all-gathered.
"""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.engine_format import EngineConfig, weights_file
from kiln.runtime.native.kernel_choice import DEFAULT_KERNELS, KernelChoice
from kiln.runtime.native.kv_cache import KVCache
from kiln.runtime.native.layers.activation import gated_activation
from kiln.runtime.native.layers.attention import PagedAttention
from kiln.runtime.native.layers.linear import Fp8Linear, Linear, fusable_input_scale, make_linear
from kiln.runtime.native.layers.norm import RMSNorm
from kiln.runtime.native.layers.rotary import RotaryEmbedding
from kiln.runtime.native.parallel.group import TensorParallelGroup
from kiln.runtime.native.parallel.sharding import rank_config
from kiln.runtime.native.weight_loading import load_weights_into


class LinearFactory:
    """Makes the linear of module ``name`` in the engine's format, or dense when the module is excluded."""

    def __init__(self, config: EngineConfig, dtype: torch.dtype, kernels: KernelChoice) -> None:
        self.quant, self.dtype, self.kernels = config.quantization, dtype, kernels

    def __call__(self, name: str, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        excluded = any(fnmatch(name, pattern) for pattern in self.quant.exclude_modules)
        fmt = "none" if excluded else self.quant.format
        return make_linear(fmt, in_features, out_features, self.dtype, self.quant.group_size,
                           self.quant.fp8_streaming_max_m.get(self.quant.shape_key(in_features, out_features)),
                           self.kernels, bias)


def all_reduced(x: torch.Tensor, tp: TensorParallelGroup | None) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel ranks (``x`` itself on one device)."""
    return x if tp is None else tp.all_reduce(x)


class Attention(nn.Module):
    def __init__(self, config: EngineConfig, index: int, linear: LinearFactory, rotary: RotaryEmbedding,
                 dtype: torch.dtype, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        arch, prefix = config.architecture, f"layers.{index}.self_attn"
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.qkv_proj = linear(f"{prefix}.qkv_proj", arch.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias)
        self.o_proj = linear(f"{prefix}.o_proj", self.q_size, arch.hidden_size, arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, linear.kernels)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, linear.kernels)
        self.qk_norm = arch.qk_norm
        fp8_kv = config.kv_cache_torch_dtype == torch.float8_e4m3fn
        window = arch.layer_window(index)
        window = window if window is not None and window < config.plan.max_seq_len else None  # else it never binds
        scale = None if arch.query_pre_attn_scalar is None else arch.query_pre_attn_scalar**-0.5
        self.attn = PagedAttention(arch.head_dim, fp8_kv, rotary, linear.kernels, window, scale,
                                   arch.attn_logit_softcapping)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        quant_scale = fusable_input_scale(self.o_proj, x)
        q = self._rotated_q_with_kv_stored(positions, x, meta, kv_cache)
        if q is not None:
            o = self.attn.attend_cached(q, meta, kv_cache, quant_scale)
        else:
            q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm:  # over each head's head_dim values
                q = self.q_norm(q.reshape(-1, self.head_dim))
                k = self.k_norm(k.reshape(-1, self.head_dim))
            o = self.attn(q.reshape(-1, self.num_heads, self.head_dim),
                          k.reshape(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, self.head_dim),
                          meta, kv_cache, quant_scale, positions)
        return all_reduced(self.o_proj(o.reshape(-1, self.q_size)), self.tp)

    def _rotated_q_with_kv_stored(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                                  kv_cache: KVCache) -> torch.Tensor | None:
        """q rotated, from a qkv projection that rotates and stores K/V in its epilogue (an FP8 one of a few tokens
        or an INT4-AWQ one of one token, on the streaming kernels, attending through the cache); None where the layer
        runs them one after another."""
        if self.qk_norm:
            return None
        config = self.qkv_proj.rotary_config(x, self.head_dim)
        caches = None if config is None else self.attn.caches_to_store(x, meta, kv_cache)
        if caches is None:
            return None
        return self.qkv_proj.fused_rotary(x, positions, self.attn.rotary.cos_sin_cache, caches, self.num_heads,
                                          self.num_kv_heads, config)


class GatedMLP(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str, linear: LinearFactory,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        arch = config.architecture
        self.gate_up_proj = linear(f"{prefix}.gate_up_proj", arch.hidden_size, 2 * arch.intermediate_size,
                                   arch.mlp_bias)
        self.down_proj = linear(f"{prefix}.down_proj", arch.intermediate_size, arch.hidden_size, arch.mlp_bias)
        self.act = gated_activation(arch.hidden_act, linear.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return all_reduced(self.down_proj(self.act(gate_up, fusable_input_scale(self.down_proj, gate_up))), self.tp)


class DecoderLayer(nn.Module):
    def __init__(self, config: EngineConfig, index: int, linear: LinearFactory, rotary: RotaryEmbedding,
                 dtype: torch.dtype, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        arch = config.architecture
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, linear.kernels)
        self.self_attn = Attention(config, index, linear, rotary, dtype, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, linear.kernels)
        # Gemma 2's sandwich: post_attention_layernorm normalises the attention output alone, and each sub-layer's
        # post-norm runs fused into the norm that follows it (output_norm: the next layer's input norm, or the last)
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, linear.kernels)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, linear.kernels)
        self.sandwich_norms = arch.sandwich_norms
        self.mlp = GatedMLP(config, f"layers.{index}.mlp", linear, tp)

    @property
    def output_norm(self) -> RMSNorm | None:
        """The norm this layer's output still needs, fused into the next norm (Gemma 2's post-feedforward norm)."""
        return self.post_feedforward_layernorm if self.sandwich_norms else None

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, kv_cache: KVCache,
                pending_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, residual)`` after this layer; ``h`` still needs ``output_norm`` when the layer has one, and
        ``pending_norm`` is the previous layer's."""
        if residual is None:
            h, residual = self.input_layernorm(h, quant_scale=fusable_input_scale(self.self_attn.qkv_proj, h)), h
        else:
            h, residual = self.input_layernorm(h, residual, fusable_input_scale(self.self_attn.qkv_proj, h),
                                               pending_norm)
        h = self.self_attn(positions, h, meta, kv_cache)
        if self.sandwich_norms:
            h, residual = self.pre_feedforward_layernorm(h, residual, fusable_input_scale(self.mlp.gate_up_proj, h),
                                                         self.post_attention_layernorm)
        else:
            h, residual = self.post_attention_layernorm(h, residual, fusable_input_scale(self.mlp.gate_up_proj, h))
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """The decoder over a flat batch of new tokens; ``compute_logits`` applies the (possibly tied) LM head. Its
    layers run the kernels ``kernels`` chooses. With ``tp``, the shard of rank ``tp.rank`` of ``config.tp_size``."""

    def __init__(self, config: EngineConfig, dtype: torch.dtype, kernels: KernelChoice = DEFAULT_KERNELS,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        if (tp.size if tp is not None else 1) != config.tp_size:
            raise ValueError(f"an engine of tp_size {config.tp_size} needs a tensor-parallel group of that size")
        self.tp, self.vocab_size = tp, config.architecture.vocab_size
        config = rank_config(config)
        arch = config.architecture
        self.vocab_start = 0 if tp is None else tp.rank * arch.vocab_size  # this rank's rows of the vocabulary
        linear = LinearFactory(config, dtype, kernels)
        rotary = RotaryEmbedding(arch.head_dim, config.plan.max_seq_len, arch.rope_theta, arch.rope_scaling)
        self.rotary = rotary  # shared by the layers; its table_rows are the positions the model takes
        # filled by the weight load: not initialised, which would draw from (and advance) the global RNG
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype),
                                         _freeze=True)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, linear, rotary, dtype, tp) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, kernels)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, dtype, kernels)
        self.max_num_tokens = config.plan.max_num_tokens
        # sqrt(hidden) rounded to the model dtype first, as transformers' Gemma does
        scale = float(torch.tensor(arch.hidden_size**0.5, dtype=dtype, device="cpu"))  # on any default device
        self.embedding_scale = scale if arch.scale_embeddings else None
        self.final_logit_softcapping = arch.final_logit_softcapping

    @classmethod
    def from_engine(cls, engine_dir: Path, config: EngineConfig, device: torch.device | str,
                    dtype: torch.dtype | None = None, kernels: KernelChoice = DEFAULT_KERNELS,
                    tp: TensorParallelGroup | None = None) -> DecoderModel:
        """Build on ``device`` in ``dtype`` (default: the engine dtype) and load the rank's weights file."""
        with torch.device(device):
            model = cls(config, dtype or config.torch_dtype, kernels, tp)
        model.load_weights(Path(engine_dir) / weights_file(0 if tp is None else tp.rank))
        return model.eval()

    def load_weights(self, path: Path) -> None:
        """Copy every tensor of the engine's weight file into the model, casting dense weights to its dtype."""
        load_weights_into(path, self.state_dict())
        self.cache_derived_tensors()

    def cache_derived_tensors(self) -> None:
        """Recompute what the layers keep derived from their weights (FP8 linears: ``Fp8Linear.cache_derived_scales``
        for up to ``max_num_tokens`` rows); ``load_weights`` does it, call it after changing weights otherwise."""
        for module in self.modules():
            if isinstance(module, Fp8Linear):
                module.cache_derived_scales(self.max_num_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the flat batch; K/V of the new tokens are stored in ``kv_caches``."""
        h, residual = self.embed(input_ids), None
        if self.embedding_scale is not None:
            h = h * self.embedding_scale
        pending_norm = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(positions, h, residual, meta, kv_cache, pending_norm)
            pending_norm = layer.output_norm
        h, _ = self.norm(h, residual, pre_norm=pending_norm)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids``: on a rank, of the ids in its rows (zero elsewhere), summed over ranks."""
        if self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        h = self.embed_tokens(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of the given hidden states (select the last token of each sequence first), in the model
        dtype: greedy rows need only their argmax, and the sampler converts the rows it draws from to float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        if self.tp is not None:
            logits = self.tp.all_gather(logits)[..., :self.vocab_size]
        if self.final_logit_softcapping is None:
            return logits
        cap = self.final_logit_softcapping
        return cap * torch.tanh(logits / cap)
