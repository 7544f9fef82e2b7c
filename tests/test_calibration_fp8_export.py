"""The FP8 checkpoints the quantize stage ships hold the weights its accuracy gate measured, ties included."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.calibration.quantize import quantize_checkpoint
from tests.calibration_factories import make_checkpoint, small_recipe

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# With this amax (that of the bundled tiny model's layers.0.mlp.down_proj) about 1 % of bf16 weights sit exactly
# between two E4M3 values once scaled by 448 / amax; the gate's fake quant and modelopt's exporters round them apart.
TIE_PRONE_AMAX = 0.3984375


def test_both_exported_forms_hold_the_fp8_weights_the_gate_measured(tmp_path):
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    checkpoint = make_checkpoint(tmp_path / "model")
    weights = load_file(checkpoint / "model.safetensors")
    for name in [n for n in weights if n.endswith("_proj.weight")]:  # every linear's amax (q/k/v and gate/up fused)
        weights[name] = (weights[name].float() * (TIE_PRONE_AMAX / weights[name].float().abs().max())).bfloat16()
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    quantize_checkpoint(checkpoint, small_recipe(format="fp8"), tmp_path / "out")

    fake_quant = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))  # as the gate quantizes
    fake_quant.amax = torch.tensor(TIE_PRONE_AMAX)

    def gated(*names: str) -> torch.Tensor:
        return torch.cat([fake_quant(weights[f"{name}.weight"].float()) for name in names])

    hf = load_file(tmp_path / "out" / "hf" / "model.safetensors")
    trtllm = load_file(tmp_path / "out" / "trtllm" / "rank0.safetensors")
    for layer in ("model.layers.0", "model.layers.1"):
        for name in [n.removesuffix(".weight") for n in weights if n.startswith(layer) and n.endswith("_proj.weight")]:
            exported = hf[f"{name}.weight"].float() * hf[f"{name}.weight_scale"]
            torch.testing.assert_close(exported, gated(name), rtol=1e-6, atol=0, msg=f"hf/{name}")
        trt = layer.replace("model.", "transformer.")
        for trt_name, names in ((f"{trt}.attention.qkv", [f"{layer}.self_attn.{p}_proj" for p in "qkv"]),
                                (f"{trt}.mlp.proj", [f"{layer}.mlp.down_proj"])):
            exported = trtllm[f"{trt_name}.weight"].float() * trtllm[f"{trt_name}.weights_scaling_factor"]
            torch.testing.assert_close(exported, gated(*names), rtol=1e-6, atol=0, msg=f"trtllm/{trt_name}")
