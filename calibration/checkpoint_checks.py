"""What the quantize stage needs of a source checkpoint, checked before anything runs (a dry run too): its
config.json with an ``architectures`` entry, safetensors weights, and no quantization of its own. Imports no
torch."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.calibration.errors import CalibrationError


def check_quantizable(model_dir: Path) -> None:
    """Raise CalibrationError naming what ``model_dir`` lacks for the quantize stage (and how to fix it)."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CalibrationError(f"{model_dir}: no config.json; point the model at a Hugging Face checkpoint folder")
    if not any(model_dir.glob("*.safetensors")):
        raise CalibrationError(f"{model_dir}: no *.safetensors weights (Kiln never unpickles .bin files); re-save "
                               "the checkpoint with save_pretrained(safe_serialization=True)")
    config = _json_object(config_path)
    if not config.get("architectures"):
        raise CalibrationError(f"{config_path}: no 'architectures' entry (modelopt's exporters need it); add e.g. "
                               '"architectures": ["LlamaForCausalLM"]')
    if quantized := _declared_quantization(model_dir, config):
        raise CalibrationError(f"{model_dir}: the checkpoint is already quantized ({quantized}); point model.path at "
                               "the unquantized checkpoint, or build a modelopt FP8 / W4A16_AWQ export as it is with "
                               "quantize.format: none")


def _json_object(path: Path) -> dict:
    """The JSON object in ``path`` (the layer rule keeps calibration off the runtime's reader)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{path}: unreadable JSON ({e}); re-export the checkpoint") from None
    if isinstance(data, dict):
        return data
    raise CalibrationError(f"{path}: expected a JSON object; re-export the checkpoint")


def _declared_quantization(model_dir: Path, config: dict) -> str | None:
    """The quantization the checkpoint declares (modelopt's hf_quant_config.json, or config.json's
    quantization_config), named as it names it; None for an unquantized checkpoint."""
    hf_quant = model_dir / "hf_quant_config.json"
    section = _json_object(hf_quant).get("quantization") or {} if hf_quant.is_file() else {}
    declared = config.get("quantization_config") or {}
    for key, value in (("quant_algo", section.get("quant_algo")), ("quant_algo", declared.get("quant_algo")),
                       ("quant_method", declared.get("quant_method"))):
        if value:
            return f"{key} {value!r}"
    return None
