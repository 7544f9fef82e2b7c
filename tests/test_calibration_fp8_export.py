"""The FP8 checkpoints the quantize stage ships hold the weights and scales its accuracy gate measured, ties and
fused GEMMs included."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.calibration import quantize
from kiln.calibration.quantize import quantize_checkpoint
from tests.calibration_factories import make_checkpoint, small_recipe

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# With this amax (that of the bundled tiny model's layers.0.mlp.down_proj) about 1 % of bf16 weights sit exactly
# between two E4M3 values once scaled by 448 / amax; the gate's fake quant and modelopt's exporters round them apart.
TIE_PRONE_AMAX = 0.3984375
# Each linear's amax as a share of it: q/k/v and gate/up, which TensorRT-LLM runs as one GEMM each, differ.
AMAX_SHARE = {"q_proj": 1.0, "k_proj": 0.71, "v_proj": 0.83, "o_proj": 1.0, "gate_proj": 1.0, "up_proj": 0.77,
              "down_proj": 1.0}
TRTLLM_GEMMS = {"attention.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                "attention.dense": ["self_attn.o_proj"], "mlp.fc": ["mlp.gate_proj"], "mlp.gate": ["mlp.up_proj"],
                "mlp.proj": ["mlp.down_proj"]}


def test_both_exported_forms_hold_the_fp8_weights_and_scales_the_gate_measured(tmp_path, monkeypatch):
    checkpoint = make_checkpoint(tmp_path / "model")
    weights = load_file(checkpoint / "model.safetensors")
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        amax = TIE_PRONE_AMAX * AMAX_SHARE[name.split(".")[-2]]
        weights[name] = (weights[name].float() * (amax / weights[name].float().abs().max())).bfloat16()
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    gated: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # linear: (fake-quantized weight, input amax / 448)
    evaluate = quantize.evaluate

    def record_gated_model(model, heldout, label):
        if label.endswith("gate"):
            for name, module in model.named_modules():
                if name.endswith("_proj"):
                    gated[name] = (module.weight_quantizer(module.weight.float()).detach(),
                                   module.input_quantizer.amax.float() / 448)
        return evaluate(model, heldout, label)

    monkeypatch.setattr(quantize, "evaluate", record_gated_model)
    quantize_checkpoint(checkpoint, small_recipe(format="fp8"), tmp_path / "out")

    hf = load_file(tmp_path / "out" / "hf" / "model.safetensors")
    trtllm = load_file(tmp_path / "out" / "trtllm" / "rank0.safetensors")
    for layer in range(2):
        for name in [n for n in gated if n.startswith(f"model.layers.{layer}.")]:
            torch.testing.assert_close(hf[f"{name}.weight"].float() * hf[f"{name}.weight_scale"], gated[name][0],
                                       rtol=1e-6, atol=0, msg=f"hf/{name}")
            assert torch.equal(hf[f"{name}.input_scale"], gated[name][1]), f"hf/{name}.input_scale"
        for gemm, linears in TRTLLM_GEMMS.items():
            trt_name, names = f"transformer.layers.{layer}.{gemm}", [f"model.layers.{layer}.{n}" for n in linears]
            exported = trtllm[f"{trt_name}.weight"].float() * trtllm[f"{trt_name}.weights_scaling_factor"]
            torch.testing.assert_close(exported, torch.cat([gated[n][0] for n in names]), rtol=1e-6, atol=0,
                                       msg=f"trtllm/{trt_name}")
            assert all(torch.equal(trtllm[f"{trt_name}.activation_scaling_factor"], gated[n][1].reshape(1))
                       for n in names), f"trtllm/{trt_name}.activation_scaling_factor"
