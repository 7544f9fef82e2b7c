"""Exact roundings shared by the Triton kernels: float32 to the model dtype, and to FP8 (E4M3) for activations and KV.

Compiled for a GPU they are the hardware conversions, which round to nearest even. Triton's interpreter (the CPU
tests) truncates float32 to bfloat16 and rounds some FP8 ties wrongly, so there they are done in integer/float32
arithmetic instead; the results are the same values either way. On an H200 the arithmetic versions made
SiLU-and-multiply over 1024 tokens 1.5x slower than the conversions (32 against 21 us).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # a global read inside a kernel must be a constexpr
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def round_to_dtype(x, DTYPE: tl.constexpr):
    """Round float32 ``x`` to the nearest ``DTYPE`` value (ties to even), staying in float32; NaN stays NaN."""
    if tl.bfloat16 == DTYPE:
        if not INTERPRETED:
            return x.to(tl.bfloat16).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # carries into the upper half when above the midpoint or a tie
        return tl.where(x == x, ((bits >> 16) << 16).to(tl.float32, bitcast=True), x)  # a NaN could carry to -0
    elif tl.float16 == DTYPE:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def multiply_rounded(a, b):
    """``a * b`` in float32, rounded on its own: compiled, a PTX ``mul.rn`` that neither LLVM nor ptxas contracts
    into an FMA with a later add (which would skip the rounding a separate PyTorch op makes)."""
    if INTERPRETED:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def round_to_e4m3(y):
    """Round float32 ``y`` (|y| <= 448) to the nearest float8_e4m3fn value, ties to even, staying in float32."""
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exponent = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; below 2**-6 the subnormal step is 2**-9
    ulp = ((ulp_exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse_ulp = ((127 - ulp_exponent) << 23).to(tl.float32, bitcast=True)  # powers of two: both products exact
    magic = 12582912.0  # 1.5 * 2**23: adding and removing it rounds |t| < 2**22 to an integer, ties to even
    rounded = ((y * inverse_ulp + magic) - magic) * ulp
    sign = y.to(tl.int32, bitcast=True) & -2147483648  # keep y's sign where it rounds to zero (-0, as torch)
    return (rounded.to(tl.int32, bitcast=True) & 0x7FFFFFFF | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x):
    """float32 ``x`` (|x| <= 448) as float8_e4m3fn, rounded to nearest even: the hardware conversion compiled; the
    interpreter's conversion does not carry a rounding up into the exponent (126.3 becomes 64), so there the value
    is rounded first and the conversion is exact."""
    if INTERPRETED:
        x = round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_e4m3(x, scale):
    """``fp8_e4m3(clamp(x / scale, ±448))``: the IEEE quotient (a plain ``/`` compiles to an approximate one on a
    GPU), the clamp (compiled, NaN stays NaN; the interpreter's FP8 conversion turns it into ±384), then round to
    nearest even; the bytes ``runtime.native.layers.linear.fp8_quantize`` writes once cast to float8_e4m3fn
    (compiled, the value already is one; interpreted, the exact float32 value).

    Compiled, the quotient comes from the scale's correctly rounded reciprocal and one FMA correction, which
    Markstein's theorem makes the correctly rounded quotient wherever it matters (a quotient above 896 clamps
    anyway): 7 instructions an element fewer than a division. The interpreter's fma rounds twice, so it divides."""
    x = x.to(tl.float32)
    if INTERPRETED:
        return round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX))
    inverse = tl.math.div_rn(1.0, scale)
    q = x * inverse
    exact = tl.fma(tl.fma(-q, scale, x), inverse, q)
    keep_q = (tl.abs(q) > 2 * FP8_MAX) | (q == 0)  # clamps anyway; or ±0.0, whose sign the correction would lose
    quotient = tl.where(keep_q, q, exact)
    return tl.clamp(quotient, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)
