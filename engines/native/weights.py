"""Conversion of checkpoint tensors to the native runtime layout (see ``runtime/native/layers/linear.py``).

q/k/v fuse into ``qkv_proj`` and gate/up into ``gate_up_proj`` (biases, where the family has them, in the engine
dtype). FP8 members keep their per-tensor weight scales as a per-output-channel vector (exact) and share the largest
input scale (modelopt calibrates members of one input to the same one). INT4-AWQ weights are repacked from
modelopt's layout (uint8 [out / 2, in], two output rows per byte, two's-complement nibbles, low nibble = even row) to
the runtime's (uint8 [out, in / 2], ``q + 8``, low nibble = even input column); scales stay [out, in / group_size].
Dense weights are cast to the engine dtype.
"""

from __future__ import annotations

import torch

from kiln.engines.native.checkpoint import CheckpointTensors
from kiln.runtime.errors import KilnError
from kiln.runtime.native.engine_format import Architecture
from kiln.runtime.native.layers.linear import pack_int4
from kiln.runtime.native.model.registry import family_named


def unpack_modelopt_int4(packed: torch.Tensor) -> torch.Tensor:
    """modelopt's ``pack_int4_in_uint8`` layout [out / 2, in] back to int8 values -8..7 [out, in]."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).to(torch.int8)
    values = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return values.reshape(-1, packed.shape[1])


def convert_weights(tensors: CheckpointTensors, arch: Architecture, fmt: str, group_size: int | None,
                    dtype: torch.dtype, fp8_kv_cache: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Runtime state dict of the whole model and the runtime names of linears left dense in a quantized model. A
    tied model whose checkpoint holds an ``lm_head.weight`` unlike its embedding gets that head (the state dict then
    has ``lm_head.weight``: the model is untied), as transformers 5 loads it."""
    family = family_named(arch.type)

    def norm(name: str) -> torch.Tensor:  # in float32 before the cast, as Gemma's 1 + weight is computed
        return (tensors.get(name).float() + family.norm_weight_offset).to(dtype)

    out = {"embed_tokens.weight": tensors.get("model.embed_tokens.weight").to(dtype),
           "norm.weight": norm("model.norm.weight")}
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = _dense(tensors, "lm_head", dtype)
    elif "lm_head.weight" in tensors:
        head = _dense(tensors, "lm_head", dtype)
        if not torch.equal(head, out["embed_tokens.weight"]):  # a head of its own: transformers 5 unties them
            out["lm_head.weight"] = head
    dense_modules = []
    layer_norms = ("input_layernorm", "post_attention_layernorm") + (
        ("pre_feedforward_layernorm", "post_feedforward_layernorm") if arch.sandwich_norms else ())
    for i in range(arch.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        for name in layer_norms:
            out[f"{dst}.{name}.weight"] = norm(f"{src}.{name}.weight")
        if arch.qk_norm:
            for name in ("q_norm", "k_norm"):
                out[f"{dst}.self_attn.{name}.weight"] = norm(f"{src}.self_attn.{name}.weight")
        for fused, members in family.linears.items():
            names = [f"{src}.{m}" for m in members]
            biased = {"self_attn.qkv_proj": arch.qkv_bias, "self_attn.o_proj": arch.o_bias,
                      "mlp.gate_up_proj": arch.mlp_bias, "mlp.down_proj": arch.mlp_bias}
            if biased[fused]:
                out[f"{dst}.{fused}.bias"] = torch.cat([tensors.get(f"{n}.bias") for n in names]).to(dtype)
            member_fmt = _group_format(tensors, names)
            if member_fmt == "none":
                out[f"{dst}.{fused}.weight"] = torch.cat([_dense(tensors, n, dtype) for n in names])
                if fmt != "none":
                    dense_modules.append(f"{dst}.{fused}")
            elif member_fmt != fmt:
                raise KilnError(f"{names[0]} is stored as {member_fmt} but the checkpoint declares {fmt}; "
                                "re-export the checkpoint")
            elif fmt == "fp8":
                out.update(_fuse_fp8(tensors, names, f"{dst}.{fused}"))
            else:
                out.update(_fuse_int4(tensors, names, f"{dst}.{fused}", group_size))
        for kind in ("k", "v"):
            scale = _kv_scale(tensors, f"{src}.self_attn", kind)
            if fp8_kv_cache and scale is None:
                raise KilnError(f"{src}.self_attn has no {kind}_scale, which an FP8 KV cache needs; re-export with "
                                "modelopt's FP8 KV cache config or choose a kv_cache_dtype of the model dtype")
            if fp8_kv_cache:
                out[f"{dst}.self_attn.attn.{kind}_scale"] = scale
    unused = tensors.unused()
    if unused:
        raise KilnError(f"checkpoint tensors not understood by the native builder: {', '.join(unused[:5])}"
                        f"{' ...' if len(unused) > 5 else ''}; the checkpoint is not in its family's layout")
    if dtype == torch.float16:  # a bf16 or float32 checkpoint's values can lie beyond float16's range
        _require_finite(out)
    return out, dense_modules


def _require_finite(weights: dict[str, torch.Tensor]) -> None:
    """Refuse float16 weights that are not finite: a value of the checkpoint beyond float16's largest (65504) cast
    to inf, which an engine turns into non-finite logits at its first step (or an inf or NaN already there)."""
    for name, weight in weights.items():
        if weight.dtype == torch.float16 and not bool(torch.isfinite(weight).all()):
            raise KilnError(f"{name} is not finite in float16: the checkpoint holds a value beyond float16's range "
                            f"(65504) there, or an inf or NaN; build with a model dtype of bfloat16 or float32")


def _group_format(tensors: CheckpointTensors, names: list[str]) -> str:
    formats = {_module_format(tensors, n) for n in names}
    if len(formats) > 1:
        raise KilnError(f"{', '.join(names)} mix quantization formats {sorted(formats)}; they are fused at runtime, "
                        "so quantize them alike")
    return formats.pop()


def _module_format(tensors: CheckpointTensors, name: str) -> str:
    if f"{name}.weight_scale" not in tensors:
        return "none"
    dtype = tensors.dtype(f"{name}.weight")  # the header only: the weight itself is read once, when fused
    if dtype == "F8_E4M3":
        return "fp8"
    if dtype == "U8":
        return "int4_awq"
    raise KilnError(f"{name}.weight has dtype {dtype} with a weight_scale; not an FP8 or INT4-AWQ export")


def _dense(tensors: CheckpointTensors, name: str, dtype: torch.dtype) -> torch.Tensor:
    weight = tensors.get(f"{name}.weight")
    if not weight.is_floating_point() or weight.dtype == torch.float8_e4m3fn:
        raise KilnError(f"{name}.weight is quantized ({weight.dtype}) without the scales the native backend needs")
    return weight.to(dtype)


def _fuse_fp8(tensors: CheckpointTensors, names: list[str], dst: str) -> dict[str, torch.Tensor]:
    weights, weight_scales, input_scales = [], [], []
    for name in names:
        weight = tensors.get(f"{name}.weight")
        scale = tensors.get(f"{name}.weight_scale").float()
        if scale.numel() != 1:
            raise KilnError(f"{name}.weight_scale has shape {list(scale.shape)}; only per-tensor FP8 is supported")
        if f"{name}.input_scale" not in tensors:
            raise KilnError(f"{name} has no input_scale; only static per-tensor FP8 activations are supported")
        weights.append(weight)
        weight_scales.append(scale.reshape(1).expand(weight.shape[0]))
        input_scales.append(tensors.get(f"{name}.input_scale").float().reshape(()))
    return {f"{dst}.weight": torch.cat(weights), f"{dst}.weight_scale": torch.cat(weight_scales),
            f"{dst}.input_scale": torch.stack(input_scales).max()}


def _fuse_int4(tensors: CheckpointTensors, names: list[str], dst: str, group_size: int) -> dict[str, torch.Tensor]:
    qweights, scales, pre_quant_scales = [], [], []
    for name in names:
        values = unpack_modelopt_int4(tensors.get(f"{name}.weight"))
        scale = tensors.get(f"{name}.weight_scale").float()
        if values.shape[1] % group_size:
            raise KilnError(f"{name} has {values.shape[1]} input features, not a multiple of the checkpoint's "
                            f"group_size {group_size}; re-export the checkpoint")
        if scale.shape != (values.shape[0], values.shape[1] // group_size):
            raise KilnError(f"{name}.weight_scale has shape {list(scale.shape)}, expected "
                            f"[{values.shape[0]}, {values.shape[1] // group_size}] for group_size {group_size}")
        qweights.append(pack_int4(values))
        scales.append(scale)
        pqs_name = f"{name}.pre_quant_scale"
        pre_quant_scales.append(tensors.get(pqs_name).float() if pqs_name in tensors else torch.ones(values.shape[1]))
    if any(not torch.equal(p, pre_quant_scales[0]) for p in pre_quant_scales[1:]):
        raise KilnError(f"{', '.join(names)} have different AWQ pre_quant_scale; export with modelopt's "
                        "export_hf_checkpoint, which resmooths fused linears to one scale")
    return {f"{dst}.qweight": torch.cat(qweights), f"{dst}.scales": torch.cat(scales),
            f"{dst}.pre_quant_scale": pre_quant_scales[0]}


def _kv_scale(tensors: CheckpointTensors, attn: str, kind: str) -> torch.Tensor | None:
    """The FP8 KV scale: modelopt writes ``self_attn.k_proj.k_scale``, vLLM-style exports ``self_attn.k_scale``."""
    for name in (f"{attn}.{kind}_proj.{kind}_scale", f"{attn}.{kind}_scale"):
        if name in tensors:
            return tensors.get(name).float().reshape(())
    return None
