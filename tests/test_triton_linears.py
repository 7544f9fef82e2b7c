"""Weight-streaming Triton linears (FP8, INT4-AWQ, dense) against the CPU references in runtime/native/layers/linear.py.

The CPU tests run the kernels in Triton's interpreter on float32 activations: both sides accumulate in float32, so
they agree to float32 summation-order error. The GPU tests take bfloat16 activations, where the reference rounds
its dequantized operands to bfloat16 and the kernels keep them exact, so they compare at 1e-2.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.native.kernels import fp8_gemv as fp8_gemv_module  # noqa: E402
from kiln.runtime.native.kernels.dense_gemv import dense_gemv  # noqa: E402
from kiln.runtime.native.kernels.fp8_gemv import fitting_stages, fp8_gemv, fp8_gemv_config  # noqa: E402
from kiln.runtime.native.kernels.int4_gemv import int4_awq_gemv  # noqa: E402
from kiln.runtime.native.layers.linear import (  # noqa: E402
    fp8_linear_reference,
    fp8_quantize,
    int4_awq_linear_reference,
    int4_dequantize,
    pack_int4,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CPU_REL_TOL = 1e-5  # max |kernel - reference| / max |reference|, float32 accumulation on both sides
GPU_REL_TOL = 1e-2  # bfloat16 activations and output
gpu = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(),
                         reason="needs a CUDA GPU and TRITON_INTERPRET=0")
interpreted = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")


def _fp8_operands(m, n, k, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2.0
    weight = (torch.randn(n, k, generator=g) * 100.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    weight_scale = torch.rand(n, generator=g) * 0.01 + 0.001
    input_scale = torch.tensor(0.02)  # |x| / 0.02 exceeds 448 in the tails: the clamp is exercised
    return [t.to(device) for t in (x, weight, weight_scale, input_scale)]


def _int4_operands(m, n, k, group_size, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    qweight = pack_int4(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8))
    scales = torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001
    pre_quant_scale = torch.rand(k, generator=g) + 0.5
    return [t.to(device) for t in (x, qweight, scales, pre_quant_scale)]


def _rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@interpreted
@pytest.mark.parametrize("m,n,k", [(1, 384, 256), (3, 256, 384), (16, 384, 128), (20, 128, 256)])
def test_fp8_gemv_matches_the_fake_quantized_reference(poisoned_outputs, m, n, k):
    x, weight, weight_scale, input_scale = _fp8_operands(m, n, k, seed=m * 1000 + n + k)
    out = fp8_gemv(x, weight, weight_scale, input_scale)
    ref = fp8_linear_reference(x, weight, weight_scale, input_scale)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert not out.isnan().any()
    assert _rel_err(out, ref) < CPU_REL_TOL


def test_fp8_gemv_quantizes_activations_exactly_like_the_runtime(kernel_device):
    # Identity weight: y = fp8(x / s) * s, so every rounding, tie, subnormal and clamp must agree bit for bit.
    k = 256
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(k // 2, generator=g) * 8.0, torch.randn(k // 2, generator=g) * 0.001])
    x[:8] = torch.tensor([1e3, -1e3, 0.0, -0.0, 7.5, 8.5, 9.5, 0.5 * 2.0 ** -9])  # clamp, ties to even, subnormal
    x = x[None, :]
    input_scale = torch.tensor(1.0)
    eye = torch.eye(k).to(torch.float8_e4m3fn)
    out = fp8_gemv(*(t.to(kernel_device) for t in (x, eye, torch.ones(k), input_scale))).cpu()
    assert torch.equal(out, fp8_quantize(x, input_scale).float() * input_scale)


def test_quantize_fp8_writes_the_bytes_of_the_torch_quantizer(kernel_device):
    # Every kernel that hands FP8 rows to a linear quantizes through the same Triton function; compiled, it may not
    # divide the way the interpreter does, so both are held to the bytes of torch's IEEE division: magnitudes over
    # 2^-30..2^20 of both signs, signed zeros, infinities, ties, subnormals and clamps, at scales over 2^-20..2^20.
    from kiln.runtime.native.kernels.fp8_quant import quantize_fp8

    g = torch.Generator().manual_seed(11)
    magnitude = (1 + torch.rand(6, 700, generator=g)) * torch.exp2(torch.randint(-30, 21, (6, 700), generator=g))
    x = torch.where(torch.rand(6, 700, generator=g) < 0.5, -magnitude, magnitude)
    x[0, :9] = torch.tensor([1e3, -1e3, 0.0, -0.0, 7.5, 8.5, 0.5 * 2.0 ** -9, float("inf"), -float("inf")])
    scales = [0.5, 1.0, 0.02, 448.0, *torch.exp2(torch.empty(4).uniform_(-20, 20, generator=g)).tolist()]
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        on_device = xd.to(kernel_device)
        for scale in map(torch.tensor, scales):
            out = quantize_fp8(on_device, scale.to(kernel_device)).cpu()
            assert out.dtype == torch.float8_e4m3fn and out.shape == (6, 700)
            assert torch.equal(out.view(torch.uint8), fp8_quantize(xd, scale).view(torch.uint8)), float(scale)
    if kernel_device == "cuda":  # the interpreter converts NaN to FP8 as ±384, whatever the kernel does
        nan = torch.full((2, 16), float("nan"), device=kernel_device)  # NaN stays NaN, as in torch (not +448)
        assert quantize_fp8(nan, torch.tensor(0.5, device=kernel_device)).float().isnan().all()


@interpreted
def test_fp8_gemv_decodes_every_e4m3_weight_value():
    # Each of the 254 finite E4M3 bytes (0x7F / 0xFF are NaN) as one weight column, activation 1.0.
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    k = 256
    weight = torch.zeros(2, k, dtype=torch.uint8)
    weight[0, :codes.numel()] = codes
    weight = weight.view(torch.float8_e4m3fn)
    x = torch.zeros(codes.numel(), k)
    x[torch.arange(codes.numel()), torch.arange(codes.numel())] = 1.0
    out = fp8_gemv(x, weight, torch.ones(2), torch.tensor(1.0))
    assert torch.equal(out[:, 0], codes.view(torch.float8_e4m3fn).float())


@interpreted
def test_fp8_gemv_pipelines_as_deep_as_the_gpus_shared_memory_holds(monkeypatch):
    down_proj = fp8_gemv_config(8, 4096, 14336)  # a narrow linear: 6 stages of 24 KB on an H200
    assert down_proj["num_stages"] == 6 and fitting_stages(down_proj, torch.device("cpu")) == down_proj
    cuda = torch.device("cuda", 0)
    one_token = fp8_gemv_config(1, 4096, 14336)  # 3 stages of 20 KB
    # an H200's, an sm_89 GPU's and 48 KB
    for shared_memory, stages in ((232448 - 8192, (6, 3)), (101376 - 8192, (3, 3)), (48 * 1024, (2, 2))):
        monkeypatch.setattr(fp8_gemv_module, "program_shared_memory", lambda device, m=shared_memory: m)
        assert (fitting_stages(down_proj, cuda)["num_stages"], fitting_stages(one_token, cuda)["num_stages"]) == stages


@interpreted
def test_fp8_gemv_keeps_leading_dims():
    x, weight, weight_scale, input_scale = _fp8_operands(6, 128, 128, seed=3)
    out = fp8_gemv(x.reshape(2, 3, 128), weight, weight_scale, input_scale)
    assert out.shape == (2, 3, 128)
    assert _rel_err(out.reshape(6, 128), fp8_linear_reference(x, weight, weight_scale, input_scale)) < CPU_REL_TOL


@interpreted
@pytest.mark.parametrize("m", [2, 3, 5])
def test_int4_awq_gemv_reduces_a_few_tokens_in_registers(poisoned_outputs, m):
    # tiles of 2 tokens (the register reduction's): 3 and 5 tokens leave the last tile half empty; 40 rows in
    # programs of 16, 6 groups of 64 in steps of 2
    x, qweight, scales, pre_quant_scale = _int4_operands(m, 40, 384, 64, seed=m)
    config = dict(BLOCK_M=2, BLOCK_N=16, GROUPS=2, num_warps=4, num_stages=1)
    out = int4_awq_gemv(x, qweight, scales, pre_quant_scale, 64, config=config)
    assert not out.isnan().any()
    assert _rel_err(out, int4_awq_linear_reference(x, qweight, scales, pre_quant_scale, 64)) < CPU_REL_TOL


@interpreted
@pytest.mark.parametrize("m,n,k,group_size", [(1, 384, 256, 128), (1, 40, 384, 64), (1, 40, 256, 32),
                                              (2, 40, 384, 64), (3, 256, 384, 128), (16, 384, 256, 64),
                                              (20, 128, 256, 128), (5, 40, 384, 32)])  # 12 groups: steps of 4
def test_int4_awq_gemv_matches_the_fake_quantized_reference(poisoned_outputs, m, n, k, group_size):
    x, qweight, scales, pre_quant_scale = _int4_operands(m, n, k, group_size, seed=m * 1000 + n + k)
    out = int4_awq_gemv(x, qweight, scales, pre_quant_scale, group_size)
    ref = int4_awq_linear_reference(x, qweight, scales, pre_quant_scale, group_size)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert not out.isnan().any()
    assert _rel_err(out, ref) < CPU_REL_TOL


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
# edge tiles in both dims; groups of a size that is not a power of two; groups of two bytes
@pytest.mark.parametrize("n,k,group_size", [(40, 2560, 128), (16, 384, 64), (9, 576, 96), (8, 64, 4)])
def test_int4_dequantize_kernel_writes_the_reference_weight_bit_for_bit(poisoned_outputs, dtype, n, k, group_size):
    import kiln.runtime.native.kernels.int4_dequant as mod

    _, qweight, scales, _ = _int4_operands(1, n, k, group_size, seed=n + k)
    out = mod.int4_dequantize(qweight, scales, group_size, dtype)
    assert out.dtype == dtype and torch.equal(out, int4_dequantize(qweight, scales, group_size).to(dtype))


@gpu
@pytest.mark.gpu
def test_int4_dequantize_kernel_writes_the_reference_weight_bit_for_bit_on_gpu():
    from kiln.runtime.native.kernels.int4_dequant import int4_dequantize as dequantize_kernel

    _, qweight, scales, _ = _int4_operands(1, 4096 + 8, 1024, 128, seed=3, device="cuda")
    out = dequantize_kernel(qweight, scales, 128, torch.bfloat16)
    assert torch.equal(out, int4_dequantize(qweight, scales, 128).to(torch.bfloat16))


@interpreted
@pytest.mark.parametrize("column", [1, 13])  # a high nibble of the first byte; one of the second 32-bit word
def test_int4_awq_gemv_reads_low_nibble_as_the_even_column(column):
    # One nonzero weight at an odd input column: only x[column] may reach the output.
    k, group_size = 128, 128
    q = torch.zeros(16, k, dtype=torch.int8)
    q[0, column] = 7
    q[1, column - 1] = -8
    x = torch.zeros(1, k)
    x[0, column] = 1.0
    out = int4_awq_gemv(x, pack_int4(q), torch.ones(16, 1), torch.ones(k), group_size)
    assert out[0, 0].item() == 7.0 and out[0, 1].item() == 0.0


def test_int4_awq_gemv_rejects_a_mismatched_layout():
    x, qweight, scales, pre_quant_scale = _int4_operands(1, 128, 256, 128, seed=0)
    with pytest.raises(ValueError, match="scales must be"):
        int4_awq_gemv(x, qweight, scales[:, :1], pre_quant_scale, 128)


@pytest.mark.parametrize("group_size", [4, 96])
def test_int4_awq_gemv_rejects_a_group_size_it_does_not_serve(group_size):
    x, qweight, scales, pre_quant_scale = _int4_operands(2, 32, 384, group_size, seed=0)
    with pytest.raises(ValueError, match="power of two from 32"):
        int4_awq_gemv(x, qweight, scales, pre_quant_scale, group_size)


GPU_SHAPES = [(1, 6144, 4096), (3, 4096, 4096), (16, 384, 4096), (16, 28672, 4096), (1, 4096, 14336),
              (64, 384, 256)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_fp8_gemv_matches_the_reference_on_gpu(poisoned_outputs, m, n, k):
    x, weight, weight_scale, input_scale = _fp8_operands(m, n, k, seed=n + k, device="cuda")
    x = x.bfloat16()
    out = fp8_gemv(x, weight, weight_scale, input_scale)
    ref = fp8_linear_reference(x, weight, weight_scale, input_scale)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert _rel_err(out, ref) < GPU_REL_TOL
    eye = torch.eye(k, device="cuda").to(torch.float8_e4m3fn)  # activation quantization bit for bit
    exact = fp8_gemv(x[:1].float(), eye, torch.ones(k, device="cuda"), input_scale)
    assert torch.equal(exact, fp8_quantize(x[:1].float(), input_scale).float() * input_scale)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_int4_awq_gemv_matches_the_reference_on_gpu(poisoned_outputs, m, n, k):
    x, qweight, scales, pre_quant_scale = _int4_operands(m, n, k, 128, seed=n + k, device="cuda")
    x = x.bfloat16()
    out = int4_awq_gemv(x, qweight, scales, pre_quant_scale, 128)
    ref = int4_awq_linear_reference(x, qweight, scales, pre_quant_scale, 128)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert _rel_err(out, ref) < GPU_REL_TOL


def test_bench_linears_imports_and_shows_help_without_a_gpu(capsys):
    from tools import bench_linears

    with pytest.raises(SystemExit) as exit_info:
        bench_linears.main(["--help"])
    assert exit_info.value.code == 0 and "--m" in capsys.readouterr().out
    assert bench_linears.weight_bytes("triton_int4", 4096, 4096) == 4096 * 2048 + 4 * 4096 * 32


def test_bench_linears_table_names_the_crossover(capsys):
    from tools import bench_linears

    rows = [{"shape": "o", "k": 4096, "n": 4096, "m": m, "us": {me: 10.0 for me in bench_linears.METHODS},
             "tb_per_s": {me: 1.0 for me in bench_linears.METHODS}} for m in (1, 16, 64)]
    rows[2]["us"]["scaled_mm_static"] = 5.0
    crossovers = {"o": {"fp8_vs_scaled_mm_static": bench_linears.crossover(rows, "o", "triton_fp8", "scaled_mm_static"),
                        "int4_vs_bf16_matmul": bench_linears.crossover(rows, "o", "triton_int4", "bf16_matmul")}}
    assert crossovers["o"] == {"fp8_vs_scaled_mm_static": 64, "int4_vs_bf16_matmul": None}
    bench_linears.print_table(rows, crossovers, "test GPU")
    out = capsys.readouterr().out
    assert "fp8 vs _scaled_mm static:    64" in out and " 23%)" in out


@gpu
@pytest.mark.gpu
def test_quantized_linears_take_the_streaming_kernels_on_cuda():
    from kiln.runtime.native.kernel_choice import KernelChoice
    from kiln.runtime.native.layers import linear

    x, weight, weight_scale, input_scale = _fp8_operands(2, 384, 512, seed=5, device="cuda")
    fp8 = linear.Fp8Linear(512, 384).cuda()
    fp8.weight.copy_(weight), fp8.weight_scale.copy_(weight_scale), fp8.input_scale.copy_(input_scale)
    x = x.bfloat16()
    kernels = KernelChoice()
    assert kernels.streams(x, 16) and not kernels.streams(x.cpu(), 16)
    assert not kernels.streams(x, 1)  # 2 tokens above a limit of 1: the GEMM path
    assert not KernelChoice(linear_max_m=1).streams(x, 16)  # RuntimeOptions.linear_max_m overrides every limit
    assert _rel_err(fp8(x), fp8_linear_reference(x, weight, weight_scale, input_scale)) < GPU_REL_TOL
    x, qweight, scales, pre_quant_scale = _int4_operands(2, 384, 512, 128, seed=5, device="cuda")
    int4 = linear.Int4AwqLinear(512, 384, 128).cuda()
    int4.qweight.copy_(qweight), int4.scales.copy_(scales), int4.pre_quant_scale.copy_(pre_quant_scale)
    x = x.bfloat16()
    ref = int4_awq_linear_reference(x, qweight, scales, pre_quant_scale, 128)
    assert _rel_err(int4(x), ref) < GPU_REL_TOL
    x_large = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)  # above the streaming limit: dequant + GEMM
    ref = int4_awq_linear_reference(x_large, qweight, scales, pre_quant_scale, 128)
    assert _rel_err(int4(x_large), ref) < GPU_REL_TOL
    x, qweight, scales, pre_quant_scale = _int4_operands(2, 384, 512, 16, seed=6, device="cuda")
    small_groups = linear.Int4AwqLinear(512, 384, 16).cuda()  # groups the streaming kernels do not serve: dequant
    small_groups.qweight.copy_(qweight), small_groups.scales.copy_(scales)
    small_groups.pre_quant_scale.copy_(pre_quant_scale)
    x = x.bfloat16()
    assert _rel_err(small_groups(x), int4_awq_linear_reference(x, qweight, scales, pre_quant_scale, 16)) < GPU_REL_TOL


@pytest.mark.parametrize("n,k", [(40, 1024), (13, 700)])  # N and K that are and are not multiples of the tiles
def test_dense_gemv_matches_f_linear(kernel_device, poisoned_outputs, n, k):
    g = torch.Generator().manual_seed(n + k)
    dtype = torch.float32 if kernel_device == "cpu" else torch.bfloat16
    x, weight = torch.randn(1, 1, k, generator=g).to(kernel_device, dtype), torch.randn(n, k, generator=g)
    weight = weight.to(kernel_device, dtype)
    out = dense_gemv(x, weight)
    assert out.shape == (1, 1, n) and out.dtype == dtype
    assert _rel_err(out, torch.nn.functional.linear(x.float(), weight.float())) < (
        CPU_REL_TOL if kernel_device == "cpu" else GPU_REL_TOL)


def test_dense_gemv_takes_one_token_in_the_weight_dtype():
    with pytest.raises(ValueError, match="dense_gemv: x must be one row"):
        dense_gemv(torch.zeros(2, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="dense_gemv: x must be one row"):
        dense_gemv(torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.float16))


def test_a_dense_linear_streams_one_token_and_gives_more_to_cublas(kernel_device, monkeypatch):
    from kiln.runtime.native.kernel_choice import KernelChoice
    from kiln.runtime.native.kernels import dense_gemv as dense_gemv_module
    from kiln.runtime.native.layers import linear

    calls = []
    monkeypatch.setattr(dense_gemv_module, "dense_gemv", lambda x, w, pdl: calls.append(len(x)) or x @ w.t())
    interpreted = KernelChoice(interpreted=True)  # as on CUDA, also in the interpreter
    layer = linear.Linear(64, 32, torch.float32, interpreted).to(kernel_device)
    layer(torch.zeros(1, 64, device=kernel_device))
    layer(torch.zeros(3, 64, device=kernel_device))
    assert calls == [1]
