"""Everything that drives NVIDIA modelopt: quantization configs, calibration in rounds, statistic snapshots.

FP8 (max calibration) continues round by round: modelopt's max calibrators keep their running maximum while
calibration is enabled, so after round k every amax is the maximum over all samples of rounds 1..k.
AWQ's search is not incremental, so round k re-runs AWQ from the unquantized model on the samples of rounds 1..k.

A snapshot holds the statistics calibration estimates from data: FP8, the amax of every quantizer; AWQ, the
per-channel activation scales, the alpha search losses, the chosen clip ratio of every weight block (awq_clip,
awq_full) and any K/V amax. The pre-quant scales and weight amax are left out: they are fixed functions of those
statistics and of the discrete alpha, which can flip between two near-equal candidates (its regret is tracked).
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from kiln.calibration.recipe import INT4_BLOCK_SIZE

with warnings.catch_warnings():  # modelopt warns at import about untested transformers versions
    warnings.simplefilter("ignore")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion
    from modelopt.torch.export.unified_export_hf import (
        collect_shared_input_modules,
        requantize_resmooth_fused_llm_layers,
    )
    from modelopt.torch.quantization.model_calib import enable_stats_collection, finish_stats_collection
    from modelopt.torch.quantization.nn import TensorQuantizer

Forward = Callable[[nn.Module, torch.Tensor], None]
Snapshot = dict[str, torch.Tensor]
E4M3_MAX = 448.0


def quant_config(fmt: str, algorithm: str, kv_cache_dtype: str) -> dict:
    """The modelopt config for a Kiln format: fp8 = FP8 E4M3 per-tensor weights and activations (max calibration),
    int4_awq = INT4 weights in blocks of 128 with AWQ; kv_cache_dtype fp8 adds FP8 K/V quantizers."""
    if fmt == "fp8":
        config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    elif fmt == "int4_awq":
        config = copy.deepcopy(mtq.INT4_AWQ_CFG)
        config["algorithm"] = {"method": algorithm, "debug": True}
        if algorithm != "awq_clip":
            config["algorithm"]["alpha_step"] = 0.1
    else:
        raise ValueError(f"no modelopt config for format {fmt!r}")
    if kv_cache_dtype == "fp8":
        config["quant_cfg"] = [*config["quant_cfg"], *copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])]
    return config


@contextlib.contextmanager
def quiet(notes: list[str]) -> Iterator[None]:
    """Keep modelopt's prints off stdout (which carries --json output) and collect its warnings into `notes`."""
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("always")
        yield
    for w in caught:
        message = f"{w.category.__name__}: {str(w.message).splitlines()[0]}"
        if "modelopt" in w.filename and message not in notes:
            notes.append(message)


class MaxRounds:
    """FP8 calibration continued over rounds on one model copy."""

    def __init__(self, reference: nn.Module, config: dict):
        self.reference = reference
        self.config = config
        self.model: nn.Module | None = None

    def calibrate(self, rounds: list[torch.Tensor], k: int, forward: Forward) -> tuple[nn.Module, Snapshot]:
        """Calibrate on round k's samples (0-based); rerunning a round after an OOM is harmless (max is idempotent)."""
        if self.model is None:
            model = copy.deepcopy(self.reference)
            mtq.quantize(model, self.config, lambda m: forward(m, rounds[0]))
            self.model = model
        else:
            enable_stats_collection(self.model)
            forward(self.model, rounds[k])
            finish_stats_collection(self.model)
        return self.model, amax_snapshot(self.model)


class AwqRounds:
    """AWQ re-run from the unquantized model on the growing sample set of rounds 1..k."""

    def __init__(self, reference: nn.Module, config: dict):
        self.reference = reference
        self.config = config

    def calibrate(self, rounds: list[torch.Tensor], k: int, forward: Forward) -> tuple[nn.Module, Snapshot]:
        seen = torch.cat(rounds[: k + 1])
        model = copy.deepcopy(self.reference)
        mtq.quantize(model, self.config, lambda m: forward(m, seen))
        snapshot = amax_snapshot(model, weights=False)
        snapshot.update(_take_awq_search_state(model))
        return model, snapshot


def amax_snapshot(model: nn.Module, weights: bool = True) -> Snapshot:
    """amax (float32, CPU) of every enabled quantizer; `weights=False` leaves the weight quantizers out."""
    return {
        name: module.amax.detach().float().cpu().clone()
        for name, module in model.named_modules()
        if isinstance(module, TensorQuantizer) and module.is_enabled and module.amax is not None
        and (weights or not name.endswith("weight_quantizer"))
    }


def _take_awq_search_state(model: nn.Module) -> Snapshot:
    """What modelopt's AWQ searches kept in debug mode, then drop it: the per-channel activation scales and the search
    loss of every alpha (the chosen alpha is its argmin), as `<linear>.awq_lite.act_scale / .search_loss`, and the
    chosen clip ratio of every weight block, as `<linear>.awq_clip.clip_ratio`."""
    state: Snapshot = {}
    for name, module in model.named_modules():
        helper = getattr(module, "awq_lite", None)
        if helper is not None:
            if isinstance(helper.act_scale, torch.Tensor):
                state[f"{name}.awq_lite.act_scale"] = helper.act_scale.detach().float().cpu().clone()
            if helper.best_alpha is not None:
                state[f"{name}.awq_lite.search_loss"] = torch.tensor([float(helper.loss[a]) for a in
                                                                      sorted(helper.loss)])
            del module.awq_lite
        helper = getattr(module, "awq_clip", None)
        if helper is not None:
            if helper.best_clip_val is not None:
                ratio = module.weight_quantizer.amax.float() / helper.w_amax.float().clamp_min(1e-12)
                state[f"{name}.awq_clip.clip_ratio"] = ratio.detach().cpu().clone()
            del module.awq_clip
    return state


def rounds_calibrator(fmt: str, reference: nn.Module, config: dict) -> MaxRounds | AwqRounds:
    """The round strategy of a format."""
    return MaxRounds(reference, config) if fmt == "fp8" else AwqRounds(reference, config)


def tie_shared_input_scales(model: nn.Module) -> None:
    """Give the per-tensor FP8 linears that read one input (q/k/v, gate/up) one weight amax and one input amax, the
    largest of theirs, as modelopt's TensorRT-LLM export does when it fuses them into one GEMM (and vLLM when it loads
    them fused). Done before the gate, the gate, ``hf/`` and ``trtllm/`` hold the same E4M3 codes; modelopt's Hugging
    Face export leaves FP8 groups as they are, and a linear stored fused (Phi-3's qkv_proj) has one scale already."""

    def dummy_forward() -> None:
        model(torch.ones(1, 2, dtype=torch.long, device=model.device))

    groups, _ = collect_shared_input_modules(model, dummy_forward)
    with torch.no_grad():
        for linears in groups.values():
            if len(linears) > 1 and all(_per_tensor_fp8(m.weight_quantizer) for m in linears):
                preprocess_linear_fusion(linears)


def fuse_shared_inputs(model: nn.Module) -> None:
    """Apply the export-time fusions of the Hugging Face export (AWQ: one pre-quant scale for the linears that share
    an input, folded into the preceding norm) now, so the accuracy gate measures the model that is exported."""
    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)


def gated_fp8_weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(E4M3 codes on the CPU, weight_scale) of every per-tensor FP8 weight, by tensor name: the codes the model's
    fake quantization rounds the weight to, which are what the accuracy gate measured, and the scale amax / 448 that
    modelopt's export writes beside them.

    modelopt's fake quantization multiplies by 448 / amax; its export divides by amax / 448, which rounds exact ties
    the other way: bf16 and fp16 weights often sit exactly between two E4M3 values (1 % of one tensor of the bundled
    tiny model), and the exporter's own codes are one E4M3 step off there. The fake-quantized weight in float32 is
    its code times the reciprocal of 448 / amax, a few float32 ulps from amax / 448, so dividing it by the scale and
    rounding to E4M3 gives the code back (checked)."""
    gated = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            quantizer = getattr(module, "weight_quantizer", None)
            if not _per_tensor_fp8(quantizer):
                continue
            amax = quantizer.amax.item()
            scale = torch.tensor(amax / E4M3_MAX, dtype=torch.float32)
            fake_quantized = quantizer(module.weight.float())  # float32: no fp16 underflow of small values
            codes = (fake_quantized / scale).to(torch.float8_e4m3fn)
            if not torch.allclose(codes.float() * scale, fake_quantized, rtol=2**-16, atol=0):
                raise RuntimeError(f"{name}: its fake-quantized weight is not E4M3 codes times amax / 448 (amax "
                                   f"{amax:g}), so Kiln cannot export the weights the gate measured")
            gated[f"{name}.weight"] = (codes.cpu(), scale)
    return gated


def use_gated_fp8_weights(target: nn.Module, gated: nn.Module) -> None:
    """Replace every per-tensor FP8 weight of `target` (an unfused copy of `gated`) by `gated`'s fake quantization
    of it, module by module: an exporter that divides by amax / 448 (TensorRT-LLM's) then writes the E4M3 codes the
    gate measured (see gated_fp8_weights), not its own rounding of the ties."""
    sources = dict(gated.named_modules())
    with torch.no_grad():
        for name, module in target.named_modules():
            source = sources.get(name)
            if source is not None and _per_tensor_fp8(getattr(source, "weight_quantizer", None)):
                module.weight.copy_(source.weight_quantizer(source.weight))


def _per_tensor_fp8(quantizer: nn.Module | None) -> bool:
    return (isinstance(quantizer, TensorQuantizer) and quantizer.is_enabled and quantizer.num_bits == (4, 3)
            and not quantizer.block_sizes and quantizer.amax is not None and quantizer.amax.numel() == 1)


def int4_incompatible_linears(model: nn.Module) -> list[str]:
    """Linear layers that int4_awq would quantize whose in-features are not a multiple of the block size."""
    return [
        f"{name} (in_features {module.in_features})"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and "lm_head" not in name and module.in_features % INT4_BLOCK_SIZE
    ]
