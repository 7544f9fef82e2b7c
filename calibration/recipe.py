"""The `quantize:` section of a Kiln config, and the key material that identifies a quantized checkpoint."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.calibration.errors import CalibrationError
from kiln.calibration.sources import RANDOM, source_sha256

Format = Literal["none", "fp8", "int4_awq"]

# Per-format gate defaults, justified in docs/quantization.md: about two to three times the held-out damage that
# goes with the published Llama-3.1-8B MMLU losses (FP8 1.5 %, INT4-AWQ 5.7 %), as perplexity increase, KL, top-1.
GATE_DEFAULTS: dict[str, dict[str, float]] = {
    "fp8": {"max_ppl_increase": 0.02, "max_kl": 0.02, "min_top1_agreement": 0.94},
    "int4_awq": {"max_ppl_increase": 0.08, "max_kl": 0.08, "min_top1_agreement": 0.88},
}

# Bump when a change in calibration/ changes the bytes of a quantized checkpoint for the same inputs.
# 2: held-out documents the calibration data holds are left out; 3: FP8 linears that read one input share their scales,
# and held-out documents made only of calibration paragraphs are left out
MATERIAL_VERSION = 3
MODELOPT_REQUIREMENT = "nvidia-modelopt==0.47.0"  # as pyproject.toml pins it
INT4_BLOCK_SIZE = 128  # the input features int4_awq quantizes together (one scale a group)
# torch.manual_seed takes up to 2**64 - 1, and random held-out rows are drawn from seed + 1
MAX_SEED = 2**64 - 2


class GateValues(BaseModel):
    """The accuracy gate's three thresholds on held-out data; a field left out is not set here."""

    model_config = ConfigDict(extra="forbid")

    max_ppl_increase: float | None = Field(None, ge=0, description="relative perplexity increase, 0.03 = 3 %")
    max_kl: float | None = Field(None, ge=0, description="mean KL(reference || quantized) per token, nats")
    min_top1_agreement: float | None = Field(None, ge=0, le=1, description="share of tokens with the same argmax")

    def values(self) -> dict[str, float]:
        """The thresholds set here."""
        return {name: getattr(self, name) for name in GateValues.model_fields if getattr(self, name) is not None}


class GateThresholds(GateValues):
    """Accuracy gate on held-out data: thresholds for every format of the chain, and a format's own under its name
    (``fp8:``, ``int4_awq:``), which win over them; a field left out takes the default of the format being gated."""

    fp8: GateValues | None = None
    int4_awq: GateValues | None = None

    def for_format(self, fmt: str) -> dict[str, float]:
        """The thresholds that apply to `fmt`: its own, then those of every format, then the format's defaults."""
        own = getattr(self, fmt)
        return {**GATE_DEFAULTS[fmt], **self.values(), **(own.values() if own else {})}

    def formats_set(self) -> list[str]:
        """The formats with thresholds of their own."""
        return [fmt for fmt in GATE_DEFAULTS if getattr(self, fmt) is not None]


class QuantizeRecipe(BaseModel):
    """How to quantize, calibrate, gate and fall back. Defaults suit the tiny model on CPU and are sane for 8B."""

    model_config = ConfigDict(extra="forbid")

    format: Format = "none"
    algorithm: Literal["awq_lite", "awq_clip", "awq_full"] = "awq_lite"
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    dataset: str = "bundled"
    text_field: str = "text"
    heldout: str = "bundled"
    num_samples: int = Field(64, ge=1)
    round_samples: int = Field(8, ge=1)
    heldout_samples: int = Field(32, ge=1)
    seq_len: int = Field(128, ge=2)
    batch_size: int | Literal["auto"] = "auto"
    seed: int = Field(0, ge=0, le=MAX_SEED)
    tolerance: float = Field(0.1, gt=0)
    patience: int = Field(2, ge=1)
    on_failure: Literal["fail", "warn"] = "fail"
    gate: GateThresholds | None = Field(default_factory=GateThresholds, description="null: measured, not applied "
                                        "(for checkpoints with no accuracy to keep, such as random weights)")
    fallback: list[Format] = []

    @model_validator(mode="after")
    def _check_consistency(self) -> QuantizeRecipe:
        if isinstance(self.batch_size, int) and self.batch_size < 1:
            raise ValueError(f"quantize.batch_size ({self.batch_size}) must be a positive integer or 'auto'")
        if self.round_samples > self.num_samples:
            raise ValueError(
                f"quantize.round_samples ({self.round_samples}) must not exceed quantize.num_samples "
                f"({self.num_samples})"
            )
        if self.format in self.fallback:
            raise ValueError(f"quantize.fallback must not contain the primary format '{self.format}'")
        repeated = sorted({f for f in self.fallback if self.fallback.count(f) > 1})
        if repeated:
            raise ValueError(f"quantize.fallback repeats {', '.join(repeated)}; list each format once")
        if self.format == "none" and self.fallback:
            raise ValueError("quantize.fallback: format none is never calibrated or gated, so nothing falls back from "
                             "it; make a quantized format the primary one, or remove the fallback")
        if "none" in self.chain[:-1]:
            raise ValueError("quantize.fallback: 'none' always passes the gate, so it can only come last")
        if (self.dataset == RANDOM) != (self.heldout == RANDOM):
            raise ValueError("quantize.dataset and quantize.heldout: random token ids calibrate and check a checkpoint "
                             "with no text to keep (random weights); set both to random, or neither")
        if "text_field" in self.model_fields_set and not self.reads_text_field:
            raise ValueError(f"quantize.text_field ({self.text_field}) names the JSONL field or parquet column that "
                             f"holds the text, and quantize.dataset ({self.dataset}) and quantize.heldout "
                             f"({self.heldout}) read no such file (the bundled set keeps its text in 'text', random "
                             "has none); remove text_field, or point dataset or heldout at your own data")
        if self.format == "none" and self.kv_cache_dtype == "fp8":
            raise ValueError("quantize.kv_cache_dtype 'fp8' needs quantize.format fp8 or int4_awq, not 'none'")
        return self

    @property
    def reads_text_field(self) -> bool:
        """Whether a source may read ``text_field``: one of them is text files or a Hugging Face dataset, not the
        bundled set (always "text") or random token ids."""
        return not {self.dataset, self.heldout} <= {"bundled", RANDOM}

    @property
    def heldout_is_split(self) -> bool:
        """Whether the held-out rows are split from the end of the (non-bundled) calibration dataset."""
        return self.heldout != "bundled" and self.heldout == self.dataset

    @property
    def chain(self) -> list[str]:
        """The formats to try, in order: the primary format, then the fallback chain."""
        return [self.format, *self.fallback]

    @property
    def int4_group_size(self) -> int | None:
        """The INT4 group size of a checkpoint this recipe may make (None when no format tried is int4_awq)."""
        return INT4_BLOCK_SIZE if "int4_awq" in self.chain else None


def recipe_material(recipe: QuantizeRecipe, dataset_root: Path | None = None) -> dict:
    """The effective recipe as cache-key material: content hashes of the data instead of paths, versions included.

    Options that cannot change the quantized checkpoint are left out, so a change to them never recalibrates.
    """
    material: dict = {"material_version": MATERIAL_VERSION, "format": recipe.format}
    if recipe.format == "none":
        return material
    calibrated = [f for f in recipe.chain if f != "none"]
    dataset_sha256 = source_sha256(recipe.dataset, "calibration", dataset_root)
    heldout_sha256 = dataset_sha256 if recipe.heldout_is_split else source_sha256(recipe.heldout, "heldout",
                                                                                   dataset_root)
    material.update(
        {
            "kv_cache_dtype": recipe.kv_cache_dtype,
            "algorithm": recipe.algorithm if "int4_awq" in calibrated else None,
            "dataset_sha256": dataset_sha256,
            "heldout_sha256": heldout_sha256,
            "heldout_split_from_dataset": recipe.heldout_is_split,
            "text_field": recipe.text_field,
            "num_samples": recipe.num_samples,
            "round_samples": recipe.round_samples,
            "heldout_samples": recipe.heldout_samples,
            "seq_len": recipe.seq_len,
            "batch_size": recipe.batch_size,
            "seed": recipe.seed,
            "tolerance": recipe.tolerance,
            "patience": recipe.patience,
            "on_failure": recipe.on_failure,
            "gate": {f: recipe.gate.for_format(f) for f in calibrated} if recipe.gate else None,
            "fallback": list(recipe.fallback),
            "modelopt": modelopt_version(recipe.format),
        }
    )
    return material


def modelopt_version(fmt: str) -> str:
    """The installed nvidia-modelopt's version; a CalibrationError that says how to install it where it is not (a
    ``pip install --no-deps``), which quantizing to `fmt` needs."""
    try:
        return version("nvidia-modelopt")
    except PackageNotFoundError:
        raise CalibrationError(f"quantize.format {fmt} needs NVIDIA modelopt, which is not installed; pip install "
                               f"'{MODELOPT_REQUIREMENT}', or set quantize.format: none") from None
