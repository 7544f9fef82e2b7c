"""Build-time measurement of where each FP8 linear leaves its weight-streaming kernel for ``torch._scaled_mm``.

At small M the Triton kernel streams the FP8 weight once and wins; as M grows the FP8 tensor-core GEMM takes over,
at an M that depends on the shape and the GPU. A native FP8 engine built on CUDA times both on every linear shape of
the model at M = 1, 2, 4, ... 64 (random weights of the shape, pre-quantized activations as the fused kernels hand
them over, inside CUDA graphs, each call reading another copy of the weight so that L2 never holds it) and records,
per shape, the largest M up to which streaming is faster at every measured M: ``quantization.fp8_streaming_max_m``
of ``engine.json``, which ``runtime.native.layers.linear.Fp8Linear`` follows.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from kiln.runtime.native.engine_format import Architecture, QuantizationConfig
from kiln.runtime.native.kernels.device_limits import has_fp8_tensor_cores
from kiln.runtime.options import Kernels

logger = logging.getLogger("kiln.build")

CROSSOVER_TOKENS = (1, 2, 4, 8, 16, 32, 64)
WEIGHT_COPIES = 4  # more than the 50 MB L2 of an H100/H200 holds for every shape but the smallest
TIMING_REP_MS = 20


def fp8_kernels_measurable(device: torch.device | str, kernels: Kernels) -> bool:
    """Whether a build on ``device`` times both FP8 paths: CUDA with FP8 tensor cores, and the Triton kernels on
    (``RuntimeOptions.kernels``; with "torch" the engine never streams, and Triton may not even work there)."""
    device = torch.device(device)
    return device.type == "cuda" and kernels == "triton" and has_fp8_tensor_cores(device)


def tuning_material(device: str, kernels: Kernels) -> dict:
    """What of the runtime options changes the engine a native build writes, as key material: on CUDA the kernel
    choice decides whether the FP8 crossovers are measured (``fp8_kernels_measurable``); elsewhere nothing does."""
    return {"kernels": kernels} if torch.device(device).type == "cuda" else {}


def linear_shapes(arch: Architecture) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of the decoder layer's linears, fused as the runtime fuses them."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {"qkv_proj": (arch.hidden_size, q + 2 * kv), "o_proj": (q, arch.hidden_size),
            "gate_up_proj": (arch.hidden_size, 2 * arch.intermediate_size),
            "down_proj": (arch.intermediate_size, arch.hidden_size)}


def streaming_max_m(times_us: dict[int, tuple[float, float]]) -> int:
    """From {M: (streaming us, GEMM us)}: the largest M up to which streaming is faster at every measured M (0 when
    the GEMM already wins at the smallest)."""
    best = 0
    for m in sorted(times_us):
        streaming, gemm = times_us[m]
        if streaming >= gemm:
            break
        best = m
    return best


def graph_time_us(fns: list[Callable[[], object]], rep: int) -> float:
    """Median microseconds per call of ``fns`` replayed in a CUDA graph, each call taking the next function."""
    from triton.testing import do_bench_cudagraph

    calls = itertools.cycle(fns)
    return do_bench_cudagraph(lambda: next(calls)(), rep=rep, return_mode="median") * 1e3


def measure_fp8_streaming_max_m(arch: Architecture, dtype: torch.dtype,
                                device: torch.device | str) -> dict[str, int]:
    """``QuantizationConfig.shape_key -> streaming_max_m`` for every linear shape of ``arch``, timed on the CUDA
    ``device``."""
    generator = torch.Generator(device=device).manual_seed(0)
    input_scale = torch.tensor(0.05, device=device)
    result = {}
    for k, n in sorted(set(linear_shapes(arch).values())):
        weights = [(torch.randn(n, k, device=device, generator=generator) * 64).to(torch.float8_e4m3fn)
                   for _ in range(WEIGHT_COPIES)]
        weight_scale = torch.full((n,), 1e-3, device=device)
        times = {m: _time_both_paths((torch.randn(m, k, device=device, generator=generator) * 4).to(
            torch.float8_e4m3fn), weights, weight_scale, input_scale, dtype) for m in CROSSOVER_TOKENS}
        key = QuantizationConfig.shape_key(k, n)
        result[key] = streaming_max_m(times)
        logger.info("FP8 linear %s: streaming up to M=%d (%s)", key, result[key],
                    ", ".join(f"M={m} {s:.1f}/{g:.1f} us" for m, (s, g) in times.items()))
    return result


def _time_both_paths(x: torch.Tensor, weights: list[torch.Tensor], weight_scale: torch.Tensor,
                     input_scale: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """Microseconds of the streaming kernel and of ``torch._scaled_mm`` on the pre-quantized ``x``."""
    from kiln.runtime.native.kernels.fp8_gemv import fp8_gemv
    from kiln.runtime.native.layers.linear import fp8_linear_scaled_mm

    return (graph_time_us([lambda w=w: fp8_gemv(x, w, weight_scale, input_scale, out_dtype=dtype) for w in weights],
                          TIMING_REP_MS),
            graph_time_us([lambda w=w: fp8_linear_scaled_mm(x, w, weight_scale, input_scale, dtype) for w in weights],
                          TIMING_REP_MS))
