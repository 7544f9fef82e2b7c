"""Writing the checkpoint that ships: the Hugging Face unified checkpoint (native engine) and the TensorRT-LLM
checkpoint (config.json + rank0.safetensors, trtllm backend), both through modelopt's exporters."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kiln.calibration.errors import CalibrationError
from kiln.calibration.modelopt_quantize import gated_fp8_weights

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    from modelopt.torch.export.model_utils import get_model_type

# transformers 5's folder of named chat templates (tool_use.jinja, ...): the runtime's name for it, which this layer
# may not import
CHAT_TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the checkpoint was saved in (config.json `dtype` or `torch_dtype`), float32 when unstated."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, name)


def copy_checkpoint(model_dir: Path, out: Path) -> None:
    """Copy an unquantized checkpoint as it is: config, safetensors weights (and index), tokenizer files."""
    out.mkdir(parents=True)
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and (path.name == "config.json" or path.name in TOKENIZER_FILES
                               or path.name.endswith((".safetensors", ".safetensors.index.json"))):
            shutil.copy2(path, out / path.name)


def export_hf(model: nn.Module, model_dir: Path, out: Path, dtype: torch.dtype) -> None:
    """modelopt's unified Hugging Face checkpoint plus the tokenizer files of the input checkpoint; the layers that
    stay unquantized (embeddings, norms, lm_head) are stored in the checkpoint's own dtype, scales in float32.
    `model` is the model as gated (after ``fuse_shared_inputs``): its FP8 weights are written as the E4M3 codes its
    fake quantization used (``gated_fp8_weights``), where modelopt's exporter rounds ties the other way."""
    gated = gated_fp8_weights(model)  # before the exporter replaces the weights by its own codes
    try:
        export_hf_checkpoint(model, export_dir=out)
    except Exception as exc:
        raise CalibrationError(f"{model_dir}: modelopt cannot export the quantized model as a Hugging Face checkpoint "
                               f"({type(exc).__name__}: {exc}); try another quantize.format") from exc
    for name, (_, scale) in gated.items():
        written = model.get_submodule(name.removesuffix(".weight")).weight_scale
        if not torch.equal(written.cpu(), scale):
            raise RuntimeError(f"{name}: modelopt exported weight_scale {written.item():g}, but the gate measured "
                               f"the model with {scale.item():g} (amax / 448); export the model as gated")
    _rewrite_tensors(out, dtype, {name: codes for name, (codes, _) in gated.items()})
    copy_tokenizer_files(model_dir, out)


def _rewrite_tensors(out: Path, dtype: torch.dtype, fp8_codes: dict[str, torch.Tensor]) -> None:
    """Put `fp8_codes` in place of the FP8 weights of those names, rewrite float32 tensors that are not scales in
    `dtype`, and say so in config.json (and the shard index)."""
    total, missing = 0, set(fp8_codes)
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if name in fp8_codes:
                if tensor.dtype != torch.float8_e4m3fn or tensor.shape != fp8_codes[name].shape:
                    raise RuntimeError(f"{name}: modelopt exported a {tensor.dtype} {tuple(tensor.shape)} tensor "
                                       "where Kiln expected the FP8 weight it gated")
                tensors[name] = fp8_codes[name]
                missing.discard(name)
            elif tensor.dtype == torch.float32 and not name.endswith("scale"):
                tensors[name] = tensor.to(dtype)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, path, metadata={"format": "pt"})
    if missing:
        raise RuntimeError(f"modelopt's export has no tensor {sorted(missing)[0]} for the FP8 weight the gate measured")
    index_path = out / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text(encoding="utf-8"))
        index.setdefault("metadata", {})["total_size"] = total
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def copy_tokenizer_files(model_dir: Path, out: Path) -> None:
    """The TOKENIZER_FILES ``model_dir`` has, and transformers 5's named chat templates (CHAT_TEMPLATES_DIR)."""
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    for path in sorted((model_dir / CHAT_TEMPLATES_DIR).glob("*.jinja")):
        (out / CHAT_TEMPLATES_DIR).mkdir(exist_ok=True)
        shutil.copy2(path, out / CHAT_TEMPLATES_DIR / path.name)


# modelopt clamps each FP8 K/V cache scale of its TensorRT-LLM export to at least 1.0 (its recommended default, which
# TensorRT-LLM's own converters write), and TensorRT-LLM keeps one scale for K and V, the larger
KV_SCALE_NOTE = ("trtllm/: the FP8 K/V cache scale of each layer is max(k_scale, v_scale, 1.0), as modelopt's "
                 "TensorRT-LLM export writes it; the accuracy gate measured the calibrated k_scale and v_scale of hf/")

# what modelopt raises where it cannot export a model (it has no export for the family, or code that does not fit
# its shape): the same on every run, so the checkpoint is cached without the form. Anything else (out of memory, a
# full disk) fails the stage, and nothing is cached.
STRUCTURAL_EXPORT_ERRORS = (NotImplementedError, AttributeError, KeyError, IndexError, TypeError, ValueError)


def export_trtllm(model: nn.Module, out: Path, dtype: torch.dtype) -> str | None:
    """modelopt's TensorRT-LLM checkpoint (tensor parallel 1), with the rotary settings of the HF config filled in
    (modelopt 0.47 misses them under transformers 5, where rope_theta moved into rope_parameters). Returns a note for
    the report or None: why modelopt has no checkpoint for this model (no export for the family, Phi-3 for one, or a
    failed one; the native backend builds from the Hugging Face form alone), or that its FP8 K/V cache scale is not
    the one the gate measured (KV_SCALE_NOTE)."""
    decoder = get_model_type(model)
    if decoder is None:
        return f"no TensorRT-LLM checkpoint: modelopt has no TensorRT-LLM decoder type for {type(model).__name__}"
    try:
        export_tensorrt_llm_checkpoint(model, decoder, dtype=dtype, export_dir=out, inference_tensor_parallel=1)
    except STRUCTURAL_EXPORT_ERRORS as exc:  # no export for the family, or a shape modelopt did not foresee (a
        shutil.rmtree(out, ignore_errors=True)  # tied lm_head it pads): a TensorRT-LLM build names what is missing
        why = exc if isinstance(exc, NotImplementedError) else f"modelopt's export failed ({type(exc).__name__}: {exc})"
        return f"no TensorRT-LLM checkpoint: {why}"
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(_rotary_settings(model.config))
    config_path.write_text(json.dumps(config, indent=4) + "\n")
    return KV_SCALE_NOTE if config["quantization"].get("kv_cache_quant_algo") == "FP8" else None


def _rotary_settings(hf_config) -> dict:
    """TensorRT-LLM's rotary_base / rotary_scaling from an HF config (transformers 4 or 5 layout)."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = rope.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    settings: dict = {"rotary_base": float(theta)}
    kind = rope.pop("rope_type", None) or rope.pop("type", None)
    if kind and kind != "default":
        settings["rotary_scaling"] = {"type": kind, **rope}
    return settings
