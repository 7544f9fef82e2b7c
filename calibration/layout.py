"""The folder ``quantize_checkpoint`` writes, and what a builder reads from it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """``hf/``: the Hugging Face unified checkpoint with the tokenizer (the native builder's input); ``trtllm/``: the
    TensorRT-LLM checkpoint; the calibration report (JSON) and its curves (PNG)."""

    root: Path

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def trtllm(self) -> Path:
        return self.root / "trtllm"

    @property
    def report_path(self) -> Path:
        return self.root / "calibration_report.json"

    @property
    def curves_path(self) -> Path:
        return self.root / "calibration_curves.png"

    def report(self) -> dict:
        """The calibration report."""
        return json.loads(self.report_path.read_text(encoding="utf-8"))
