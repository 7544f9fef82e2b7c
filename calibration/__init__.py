"""Quantization that proves itself: modelopt calibration in rounds, a convergence monitor, an accuracy gate with
fallback, and export of the quantized checkpoint.

Importing the package is cheap (no torch, no modelopt); the stage itself is `calibration.quantize.quantize_checkpoint`.
"""

from kiln.calibration.errors import CalibrationError
from kiln.calibration.layout import QuantizedCheckpoint
from kiln.calibration.recipe import GateThresholds, QuantizeRecipe, recipe_material

__all__ = ["CalibrationError", "GateThresholds", "QuantizeRecipe", "QuantizedCheckpoint", "recipe_material"]
