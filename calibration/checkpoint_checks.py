"""What the quantize stage needs of a source checkpoint, checked before anything runs (a dry run too): its
config.json with an ``architectures`` entry and safetensors weights. Imports no torch."""

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
    try:
        architectures = json.loads(config_path.read_text()).get("architectures")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CalibrationError(f"{config_path}: not a JSON object ({e}); re-export the checkpoint") from None
    if not architectures:
        raise CalibrationError(f"{config_path}: no 'architectures' entry (modelopt's exporters need it); add e.g. "
                               '"architectures": ["LlamaForCausalLM"]')
