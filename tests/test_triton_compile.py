"""Every Triton kernel launch of ``runtime/native/kernels`` compiles for Hopper (sm_90), on a machine without a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``, which the CPU tests use) runs a kernel as Python, so it accepts code
the compiler rejects: a kernel that reads a plain float global runs on the CPU and fails to compile on the GPU
("Cannot access global variable ... from within @jit'ed function"). Triton compiles to a cubin without a GPU, so this
module records the launches that the public wrappers make for a Llama-3-8B layer on an H100 (``configs/models/
llama3-8b.json``, bf16 activations, bf16 and FP8 KV caches, the engine configs' 32 tokens per KV block and 8192-token
context), and compiles each for sm_90 with the signature, constexprs, specialisations and options (``num_warps``,
``num_stages``, ``launch_pdl``, ...) that triton's launcher would give it. Each compiled kernel must also fit an H100:
ptxas spills no registers, and its shared memory is within the per-block limit.

The launches are recorded, not run. The wrappers get CPU tensors that answer ``is_cuda`` as CUDA tensors do, so they
pick their GPU configuration (a bf16 ``tl.dot``, libdevice's ``exp``, the split-KV partition for an H100's SMs),
which the interpreter cannot run, and the shapes are an 8B model's, far too large for the interpreter. The kernels'
numerics are tested elsewhere (test_triton_attention.py, test_triton_linears.py, test_triton_fused_ops.py).

The compiler runs in worker processes without ``TRITON_INTERPRET`` (this file run as a script): under the
interpreter even triton's own ``@jit`` library functions (``tl.zeros``, ...) are interpreter wrappers, which patch
``triton.language`` for the interpreter when the compiler calls them.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kiln.engines.native.checkpoint import parse_architecture, read_json  # noqa: E402
from kiln.engines.native.tuning import linear_shapes  # noqa: E402
from kiln.runtime.native.kv_cache import zeros_token_major  # noqa: E402
from tests.subprocess_env import REPO, repo_env  # noqa: E402

KERNELS_DIR = REPO / "runtime" / "native" / "kernels"
TARGET = GPUTarget("cuda", 90, 32)
H100_SMS = 132  # the split-KV decode sizes its partitions by the SM count
H100_MAX_SHARED = 227 * 1024  # bytes of shared memory one block may opt in to on sm_90

_MODEL_FILE = REPO / "configs" / "models" / "llama3-8b.json"
ARCH = parse_architecture(read_json(_MODEL_FILE), {}, _MODEL_FILE)
HIDDEN, INTERMEDIATE = ARCH.hidden_size, ARCH.intermediate_size
HEADS, KV_HEADS, HEAD_DIM = ARCH.num_heads, ARCH.num_kv_heads, ARCH.head_dim
BLOCK_SIZE = 32  # build.tokens_per_block of configs/llama3-8b-*.yaml
MAX_SEQ_LEN = 8192  # build.max_seq_len there
GROUP_SIZE = 128  # the INT4-AWQ block
LINEAR_MAX_M = 16  # the largest M a streaming linear serves by default (runtime.native.layers.linear)


# --- inputs -----------------------------------------------------------------------------------------------------


class _CudaLooking(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` as a CUDA tensor does, so that a wrapper takes its GPU configuration."""

    @property
    def is_cuda(self):
        return True


def gpu(*tensors: torch.Tensor | None):
    """The tensors as ``_CudaLooking`` (None stays None); their values are never read."""
    out = tuple(None if t is None else t.as_subclass(_CudaLooking) for t in tensors)
    return out if len(out) > 1 else out[0]


def activations(num_tokens: int, features: int) -> torch.Tensor:
    return gpu(torch.empty(num_tokens, features, dtype=torch.bfloat16))


def qkv_views(num_tokens: int):
    """q [T, HEADS, HEAD_DIM] and k, v [T, KV_HEADS, HEAD_DIM]: views of one fused qkv projection, as the model
    splits it."""
    qkv = torch.empty(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return gpu(q.view(num_tokens, HEADS, HEAD_DIM), k.view(num_tokens, KV_HEADS, HEAD_DIM),
               v.view(num_tokens, KV_HEADS, HEAD_DIM))


def kv_cache(fp8: bool, num_blocks: int = 4):
    """(k_cache, v_cache, k_scale, v_scale): bf16 caches, or FP8 ones with their scales and V token-major, as the
    engine allocates them."""
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    v_zeros = zeros_token_major if fp8 else torch.zeros
    k_cache, v_cache = gpu(torch.empty(shape, dtype=dtype), v_zeros(shape, dtype=dtype, device="cpu"))
    k_scale, v_scale = gpu(torch.tensor(0.02), torch.tensor(0.01)) if fp8 else (None, None)
    return k_cache, v_cache, k_scale, v_scale


def metadata(seqs: list[tuple[int, int]]):
    """Metadata of sequences given as (cached tokens, new tokens); every table points at block 1 (nothing runs)."""
    from kiln.runtime.native.attention_metadata import AttentionMetadata

    tables = [[1] * -(-(cached + new) // BLOCK_SIZE) for cached, new in seqs]
    return AttentionMetadata.build([new for _, new in seqs], [cached + new for cached, new in seqs], tables,
                                   BLOCK_SIZE)


# --- the launches of each public wrapper --------------------------------------------------------------------------


def kernels_module(name: str):
    """``runtime.native.kernels.<name>`` (a module that is gone fails its case: it is never skipped)."""
    return importlib.import_module(f"kiln.runtime.native.kernels.{name}")


def paged_attention_launches(fp8: bool) -> None:
    mod = kernels_module("paged_attention")
    k_cache, v_cache, k_scale, v_scale = kv_cache(fp8)
    scale = HEAD_DIM**-0.5
    # The dispatcher, as the attention layer calls it. A mixed batch (prefill, chunked prefill, decode) takes the
    # varlen kernel; all-decode batches the split-KV one, whose partition size (a constexpr) follows the work per SM:
    # 1024 for a full batch, 128 for one 8192-token context, and 64 with the most partitions, so the widest reduce,
    # for one context just past 4096 tokens.
    # With an FP8 model the output is quantized for o_proj.
    quant_scale = gpu(torch.tensor(0.03))
    # An FP8 cache's decodes multiply p @ v in FP8 (RuntimeOptions.attention_fp8_pv, on by default).
    for seqs in ([(0, 21), (37, 18), (40, 1)], [(2047, 1)] * 64, [(MAX_SEQ_LEN - 1, 1)], [(4099, 1)]):
        q = qkv_views(sum(new for _, new in seqs))[0]
        for fp8_pv in (False, True):
            mod.paged_attention(q, k_cache, v_cache, metadata(seqs), scale, k_scale, v_scale, fp8_pv=fp8_pv)
            mod.paged_attention(q, k_cache, v_cache, metadata(seqs), scale, k_scale, v_scale, quant_scale,
                                fp8_pv=fp8_pv)
    # A decode graph's small step (its metadata carries counters) combines the partitions in the partition kernel.
    counters = gpu(torch.zeros(16 * KV_HEADS, dtype=torch.int32))
    counted = dataclasses.replace(metadata([(1023, 1)] * 16), partition_counters=counters)  # two partitions of 512
    assert mod.combine_partitions(counted, 16, KV_HEADS, 2)
    for quant in (None, quant_scale):
        mod.paged_attention(qkv_views(16)[0], k_cache, v_cache, counted, scale, k_scale, v_scale, quant, fp8_pv=fp8)
    # Both kernels' wrappers called directly, with their defaults, on sequences of one block.
    mod.paged_attention_varlen(qkv_views(4)[0], k_cache, v_cache, metadata([(5, 3), (0, 1)]), scale, k_scale,
                               v_scale)
    mod.paged_attention_decode(qkv_views(2)[0], k_cache, v_cache, metadata([(20, 1), (7, 1)]), scale, k_scale,
                               v_scale)


def store_kv_launches(fp8: bool) -> None:
    mod = kernels_module("kv_store")
    k_cache, v_cache, k_scale, v_scale = kv_cache(fp8)
    _, k, v = qkv_views(40)
    mod.store_kv(k, v, k_cache, v_cache, metadata([(0, 21), (37, 18), (40, 1)]).slot_mapping, k_scale, v_scale)


def fp8_gemv_launches(m: int) -> None:
    mod = kernels_module("fp8_gemv")
    for in_features, out_features in linear_shapes(ARCH).values():
        weight = gpu(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        weight_scale, input_scale = gpu(torch.empty(out_features), torch.tensor(0.02))
        mod.fp8_gemv(activations(m, in_features), weight, weight_scale, input_scale)


def fp8_qkv_rotary_launches(m: int) -> None:
    mod, kv_store = kernels_module("fp8_qkv_rotary"), kernels_module("kv_store")
    out_features = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    weight = gpu(torch.empty(out_features, HIDDEN, dtype=torch.float8_e4m3fn))
    weight_scale, input_scale = gpu(torch.empty(out_features), torch.tensor(0.02))
    slots = metadata([(37, 1)] * m).slot_mapping
    for fp8 in (False, True):
        k_cache, v_cache, k_scale, v_scale = kv_cache(fp8)
        mod.fp8_qkv_rotary(activations(m, HIDDEN), weight, weight_scale, input_scale, gpu(torch.arange(m)),
                           gpu(torch.empty(MAX_SEQ_LEN, HEAD_DIM)),
                           kv_store.PagedCaches(k_cache, v_cache, slots, k_scale, v_scale), HEADS, KV_HEADS)


def dense_gemv_launches() -> None:
    mod = kernels_module("dense_gemv")
    for in_features, out_features in linear_shapes(ARCH).values():  # a bf16 engine's linears at batch 1
        mod.dense_gemv(activations(1, in_features), gpu(torch.empty(out_features, in_features, dtype=torch.bfloat16)))


def int4_gemv_launches(m: int) -> None:
    mod = kernels_module("int4_gemv")
    for in_features, out_features in linear_shapes(ARCH).values():
        qweight = gpu(torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        scales = gpu(torch.empty(out_features, in_features // GROUP_SIZE))
        pre_quant_scale = gpu(torch.empty(in_features))
        mod.int4_awq_gemv(activations(m, in_features), qweight, scales, pre_quant_scale, GROUP_SIZE)


def int4_qkv_rotary_launches() -> None:
    mod, kv_store = kernels_module("int4_qkv_rotary"), kernels_module("kv_store")
    out_features = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qweight = gpu(torch.empty(out_features, HIDDEN // 2, dtype=torch.uint8))
    scales, pre_quant_scale = gpu(torch.empty(out_features, HIDDEN // GROUP_SIZE), torch.empty(HIDDEN))
    slots = metadata([(37, 1)]).slot_mapping
    for fp8 in (False, True):
        k_cache, v_cache, k_scale, v_scale = kv_cache(fp8)
        mod.int4_qkv_rotary(activations(1, HIDDEN), qweight, scales, pre_quant_scale, GROUP_SIZE, gpu(torch.arange(1)),
                            gpu(torch.empty(MAX_SEQ_LEN, HEAD_DIM)),
                            kv_store.PagedCaches(k_cache, v_cache, slots, k_scale, v_scale), HEADS, KV_HEADS)


def int4_dequant_launches() -> None:
    mod = kernels_module("int4_dequant")
    for in_features, out_features in linear_shapes(ARCH).values():  # the large-batch INT4 path: dequantize, then cuBLAS
        qweight = gpu(torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        mod.int4_dequantize(qweight, gpu(torch.empty(out_features, in_features // GROUP_SIZE)), GROUP_SIZE,
                            torch.bfloat16)


def fp8_quant_launches() -> None:
    mod = kernels_module("fp8_quant")
    mod.quantize_fp8(activations(512, HIDDEN), gpu(torch.tensor(0.02)))  # a prefill's, for torch._scaled_mm


def rms_norm_launches() -> None:
    mod = kernels_module("rms_norm")
    weight = gpu(torch.empty(HIDDEN, dtype=torch.bfloat16))
    mod.rms_norm(activations(5, HIDDEN), weight, 1e-5)
    mod.rms_norm(activations(5, HIDDEN), weight, 1e-5, activations(5, HIDDEN))
    # quantizing for the next FP8 linear, with and without the residual
    mod.rms_norm(activations(5, HIDDEN), weight, 1e-5, quant_scale=gpu(torch.tensor(0.02)))
    mod.rms_norm(activations(5, HIDDEN), weight, 1e-5, activations(5, HIDDEN), gpu(torch.tensor(0.02)))


def rotary_launches() -> None:
    mod = kernels_module("rotary")
    q, k, v = qkv_views(5)
    positions = gpu(torch.tensor([0, 1, 2, 700, MAX_SEQ_LEN - 1]))
    cos_sin = gpu(torch.empty(MAX_SEQ_LEN, HEAD_DIM))
    mod.apply_rotary(positions, q, k, cos_sin)
    # as the attention layer calls it: storing the rotated K and the V, keeping k for a whole prompt or not
    slots = metadata([(0, 2), (37, 2), (40, 1)]).slot_mapping
    for fp8 in (False, True):
        k_cache, v_cache, k_scale, v_scale = kv_cache(fp8)
        kv_store = kernels_module("kv_store")
        write = kv_store.CacheWrite(v, kv_store.PagedCaches(k_cache, v_cache, slots, k_scale, v_scale))
        for keep_k in (False, True):
            mod.apply_rotary(positions, q, k, cos_sin, write, keep_k)


def argmax_launches() -> None:
    mod = kernels_module("argmax")
    for rows in (1, 512, 4096):  # chunks combined by a second kernel; one chunk a row at 4,096
        mod.argmax_rows(gpu(torch.empty(rows, ARCH.vocab_size, dtype=torch.bfloat16)))
    mod.argmax_rows(gpu(torch.empty(3, ARCH.vocab_size)))  # float32: the sampled rows' race


def silu_mul_launches() -> None:
    mod = kernels_module("silu_mul")
    mod.silu_and_mul(activations(5, 2 * INTERMEDIATE))
    mod.silu_and_mul(activations(5, 2 * INTERMEDIATE), gpu(torch.tensor(0.02)))  # quantizing for down_proj


CASES: dict[str, Callable[[], None]] = {
    "paged_attention-bf16-cache": lambda: paged_attention_launches(fp8=False),
    "paged_attention-fp8-cache": lambda: paged_attention_launches(fp8=True),
    "store_kv-bf16-cache": lambda: store_kv_launches(fp8=False),
    "store_kv-fp8-cache": lambda: store_kv_launches(fp8=True),
    "fp8_gemv-m1": lambda: fp8_gemv_launches(1),
    "fp8_gemv-m3": lambda: fp8_gemv_launches(3),
    f"fp8_gemv-m{LINEAR_MAX_M}": lambda: fp8_gemv_launches(LINEAR_MAX_M),
    "fp8_qkv_rotary-m1": lambda: fp8_qkv_rotary_launches(1),
    f"fp8_qkv_rotary-m{LINEAR_MAX_M}": lambda: fp8_qkv_rotary_launches(LINEAR_MAX_M),
    "dense_gemv-m1": dense_gemv_launches,
    "int4_awq_gemv-m1": lambda: int4_gemv_launches(1),
    "int4_awq_gemv-m2": lambda: int4_gemv_launches(2),
    "int4_awq_gemv-m3": lambda: int4_gemv_launches(3),
    f"int4_awq_gemv-m{LINEAR_MAX_M}": lambda: int4_gemv_launches(LINEAR_MAX_M),
    "int4_qkv_rotary-m1": int4_qkv_rotary_launches,
    "int4_dequant": int4_dequant_launches,
    "fp8_quant": fp8_quant_launches,
    "rms_norm": rms_norm_launches,
    "rotary": rotary_launches,
    "silu_mul": silu_mul_launches,
    "argmax": argmax_launches,
}


# --- recording and specialising launches --------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    kernel: InterpretedFunction | JITFunction
    args: tuple
    kwargs: dict


@contextmanager
def recording():
    """Record, instead of running, every ``kernel[grid](*args, **kwargs)`` (interpreted or compiled), and size the
    split-KV decode for an H100's SMs."""
    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InterpretedFunction, "run", record)
        patch.setattr(JITFunction, "run", record)
        for sized_by_sms in ("paged_attention.tiling", "argmax"):  # their launches fill an H100's SMs
            patch.setattr(importlib.import_module(f"kiln.runtime.native.kernels.{sized_by_sms}"), "num_sms",
                          lambda device: H100_SMS)
        # launched as on an H100, with programmatic dependent launch
        patch.setattr(importlib.import_module("kiln.runtime.native.kernels.device_limits"), "supports_pdl",
                      lambda device: True)
        yield launches


def record_launches(case: Callable[[], None]) -> list[Launch]:
    with recording() as launches:
        case()
    return launches


_POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                  torch.float8_e4m3fn: "*fp8e4nv", torch.uint8: "*u8", torch.int8: "*i8", torch.int16: "*i16",
                  torch.int32: "*i32", torch.int64: "*i64"}
_DIVISIBLE = [["tt.divisibility", 16]]


def _encode_constexpr(value):
    if isinstance(value, tl.dtype):
        return {"tl.dtype": value.name}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"constexpr {value!r} of type {type(value).__name__} cannot be sent to the compile worker")


def _decode_constexpr(value):
    return tl.dtype(value["tl.dtype"]) if isinstance(value, dict) else value


def qualname(kernel: InterpretedFunction | JITFunction) -> str:
    return f"{kernel.fn.__module__}.{kernel.fn.__name__}"


def specialize(launch: Launch) -> tuple[str, dict]:
    """(a readable description, a JSON compile request) of what triton's launcher compiles for ``launch``: tensors
    are pointers to their dtype (16-byte aligned ones marked divisible by 16), ints i32 (i64 out of range; 1 becomes
    a constexpr, multiples of 16 are marked), floats fp32, bools i1, None and constexpr parameters constexprs; the
    launch's other keywords (num_warps, num_stages, ...) are the options."""
    kernel = launch.kernel
    module = importlib.import_module(kernel.fn.__module__)
    if getattr(module, kernel.fn.__name__, None) is not kernel:
        raise TypeError(f"{qualname(kernel)} is not a module-level kernel: the compile worker cannot import it")
    # The parameters as the real launcher sees them: which are constexpr, which are not to be specialised.
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    names = [p.name for p in jit.params]
    bound = jit.signature.bind(*launch.args, **{k: v for k, v in launch.kwargs.items() if k in names})
    bound.apply_defaults()
    options = {k: v for k, v in launch.kwargs.items() if k not in names}
    signature, constexprs, attrs = {}, {}, []
    for i, param in enumerate(jit.params):
        value = bound.arguments[param.name]
        specialize_value = not param.do_not_specialize
        align = specialize_value and not param.do_not_specialize_on_alignment
        if param.is_constexpr or value is None or (type(value) is int and value == 1 and specialize_value):
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if align and value % 16 == 0:
                attrs.append([i, _DIVISIBLE])
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        elif isinstance(value, torch.Tensor):
            if value.dtype not in _POINTER_TYPES:
                raise TypeError(f"{qualname(kernel)}: no pointer type for {param.name} of {value.dtype}")
            signature[param.name] = _POINTER_TYPES[value.dtype]
            if align and value.data_ptr() % 16 == 0:
                attrs.append([i, _DIVISIBLE])
        else:
            raise TypeError(f"{qualname(kernel)}: argument {param.name} is a {type(value).__name__}")
    shown = ", ".join(f"{name}={constexprs[name]}" if kind == "constexpr" else f"{name}: {kind}"
                      for name, kind in signature.items())
    opts = f"[{', '.join(f'{k}={v}' for k, v in sorted(options.items()))}]" if options else ""
    request = {"module": kernel.fn.__module__, "kernel": kernel.fn.__name__, "signature": signature,
               "constexprs": {k: _encode_constexpr(v) for k, v in constexprs.items()}, "attrs": attrs,
               "options": options}
    divisible = ", ".join(names[i] for i, _ in attrs)
    return f"{qualname(kernel)}{opts}({shown}) [divisible by 16: {divisible or 'none'}]", request


# --- compiling, in worker processes without TRITON_INTERPRET ------------------------------------------------------


def ptxas_usage(ptx: str, fp_fusion: bool) -> tuple[int, int]:
    """(registers, spill stores + loads in bytes) that ``ptxas -v`` reports for the PTX, assembled as triton does;
    triton itself reads these from the driver, when a GPU loads the kernel."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(TARGET.arch).path, "-v", f"--gpu-name={sm_arch_from_capability(TARGET.arch)}",
               *([] if fp_fusion else ["--fmad=false"]), str(src), "-o", str(src.with_suffix(".cubin"))]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert registers and spills, f"unexpected ptxas -v output:\n{log}"
    return int(registers[1]), int(spills[1]) + int(spills[2])


def compile_requests(requests: list[dict]) -> list[dict]:
    """The worker's side: compile each request for sm_90; a failure is reported as its error."""
    from triton.compiler import ASTSource

    results = []
    for request in requests:
        try:
            kernel = getattr(importlib.import_module(request["module"]), request["kernel"])
            if not isinstance(kernel, JITFunction):
                raise TypeError(f"{request['kernel']} is a {type(kernel).__name__}, not a JITFunction")
            constexprs = {k: _decode_constexpr(v) for k, v in request["constexprs"].items()}
            attrs = {(i,): attr for i, attr in request["attrs"]}
            compiled = triton.compile(ASTSource(kernel, request["signature"], constexprs, attrs), target=TARGET,
                                      options=request["options"])
            ptx = compiled.asm["ptx"]
            registers, spilled = ptxas_usage(ptx, compiled.metadata.enable_fp_fusion)
            results.append({"registers": registers, "spilled_bytes": spilled, "shared": compiled.metadata.shared,
                            "cubin_bytes": len(compiled.asm["cubin"]),
                            "ptx_target": re.search(r"^\.target (\w+)", ptx, re.M)[1]})
        except Exception as e:  # noqa: BLE001 - reported per launch by the test
            results.append({"error": f"{type(e).__name__}: {e}"})
    return results


def compile_for_hopper(requests: list[dict], python_path: tuple[str, ...] = ()) -> list[dict]:
    """Compile the requests in worker processes (this file as a script, without TRITON_INTERPRET), a few at once."""
    env = repo_env(*python_path)
    env.pop("TRITON_INTERPRET", None)
    workers = max(1, min(len(requests), os.cpu_count() or 1, 4))

    def run(batch: list[dict]) -> list[dict]:
        proc = subprocess.run([sys.executable, __file__], input=json.dumps(batch), capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"the compile worker exited with {proc.returncode}:\n{proc.stderr[-10000:]}")
        return json.loads(proc.stdout)

    results: list[dict] = [{}] * len(requests)
    with ThreadPoolExecutor(workers) as pool:
        for i, batch_results in enumerate(pool.map(run, [requests[i::workers] for i in range(workers)])):
            results[i::workers] = batch_results
    return results


# --- the tests ----------------------------------------------------------------------------------------------------

# A kernel with the bug this module exists for: the interpreter reads the plain float global, the compiler does not.
PLAIN_GLOBAL_MODULE = "kiln_plain_float_global_kernel"
PLAIN_GLOBAL_SOURCE = '''
import triton
import triton.language as tl

LIMIT = 448.0  # not a tl.constexpr


@triton.jit
def clamp_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, tl.minimum(x, LIMIT), mask=offs < n)
'''


@dataclasses.dataclass
class Build:
    launches: list[tuple[str, dict]]  # (description, result), one per unique specialisation of the case's launches
    kernels: set[str]  # the qualified names of the kernels it launched


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Build | Exception]:
    """Each case's unique launches compiled for sm_90, or what stopped its wrappers, and
    the plain-global kernel's, under PLAIN_GLOBAL_MODULE. Everything compiles in one go: the workers start once."""
    scratch = tmp_path_factory.mktemp("scratch_kernels")
    (scratch / f"{PLAIN_GLOBAL_MODULE}.py").write_text(PLAIN_GLOBAL_SOURCE)
    spec = importlib.util.spec_from_file_location(PLAIN_GLOBAL_MODULE, scratch / f"{PLAIN_GLOBAL_MODULE}.py")
    sys.modules[PLAIN_GLOBAL_MODULE] = plain_global = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain_global)
    cases = {**CASES, PLAIN_GLOBAL_MODULE: lambda: plain_global.clamp_kernel[(1,)](
        torch.empty(10), torch.empty(10), 10, BLOCK=16)}
    recorded: dict[str, tuple[list[tuple[str, dict]], set[str]] | Exception] = {}
    for name, case in cases.items():
        try:
            launches = record_launches(case)
            recorded[name] = (list(dict(specialize(launch) for launch in launches).items()),
                              {qualname(launch.kernel) for launch in launches})
        except Exception as e:  # noqa: BLE001 - raised again by the case's test
            recorded[name] = e
    requests = {json.dumps(request, sort_keys=True): request for entry in recorded.values()
                if not isinstance(entry, Exception) for _, request in entry[0]}
    results = dict(zip(requests, compile_for_hopper(list(requests.values()), (str(scratch),)), strict=True))
    yield {name: entry if isinstance(entry, Exception) else
           Build([(description, results[json.dumps(request, sort_keys=True)]) for description, request in entry[0]],
                 entry[1])
           for name, entry in recorded.items()}
    del sys.modules[PLAIN_GLOBAL_MODULE]


def case_build(builds: dict[str, Build | Exception], case: str) -> Build:
    build = builds[case]
    if isinstance(build, Exception):
        raise build
    return build


def problem(result: dict) -> str | None:
    """What keeps a compiled launch from running on an H100, if anything."""
    if "error" in result:
        return f"does not compile for sm_90: {result['error']}"
    if not result["cubin_bytes"] or not result["ptx_target"].startswith(f"sm_{TARGET.arch}"):
        return f"no sm_90 cubin ({result['cubin_bytes']} bytes, PTX for {result['ptx_target']})"
    if result["spilled_bytes"]:
        return f"spills {result['spilled_bytes']} bytes of registers ({result['registers']} registers)"
    if result["shared"] > H100_MAX_SHARED:
        return f"needs {result['shared']} bytes of shared memory, more than an H100's {H100_MAX_SHARED}"
    return None


@pytest.mark.parametrize("case", list(CASES))
def test_every_launch_compiles_for_hopper_without_spills(builds, case):
    build = case_build(builds, case)
    assert build.launches, f"{case}: the wrappers launched no kernel"
    failures = []
    for description, result in build.launches:
        print(f"{result.get('registers', '-'):>4} registers {result.get('shared', '-'):>6} B shared  {description}")
        if (why := problem(result)) is not None:
            failures.append(f"{description}\n  {why}")
    assert not failures, f"{len(failures)} of the {len(build.launches)} launches of {case} fail on sm_90:\n" + \
        "\n".join(failures)


def test_every_kernel_of_runtime_kernels_has_a_case(builds):
    """A kernel added to runtime/native/kernels must be launched by a case above; a jit function that other jit
    functions call is a helper, compiled inside them."""
    jitted = {}
    paths = sorted(KERNELS_DIR.rglob("*.py"))
    assert len(paths) > 10, f"no kernel modules under {KERNELS_DIR}"
    for path in paths:
        name = ".".join(path.relative_to(KERNELS_DIR).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(f"kiln.runtime.native.kernels.{name}")
        jitted |= {qualname(obj): inspect.getsource(obj.fn) for obj in vars(module).values()
                   if isinstance(obj, InterpretedFunction | JITFunction) and obj.fn.__module__ == module.__name__}
    launched = set().union(*(build.kernels for name, build in builds.items()
                             if name in CASES and isinstance(build, Build)))
    helpers = {name for name in jitted
               if any(re.search(rf"\b{name.rsplit('.', 1)[1]}\(", source) for other, source in jitted.items()
                      if other != name)}
    uncovered = sorted(set(jitted) - launched - helpers)
    assert not uncovered, f"kernels that no case of {Path(__file__).name} launches: {uncovered}"


def test_a_kernel_reading_a_plain_float_global_runs_in_the_interpreter_but_does_not_compile(builds):
    """The check catches the bug it is here for."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        x = torch.tensor([1.0, 500.0, -600.0])
        y = torch.empty(3)
        sys.modules[PLAIN_GLOBAL_MODULE].clamp_kernel[(1,)](x, y, 3, BLOCK=16)
        assert y.tolist() == [1.0, 448.0, -600.0]
    [(_, result)] = case_build(builds, PLAIN_GLOBAL_MODULE).launches
    assert "Cannot access global variable LIMIT" in (problem(result) or ""), result


if __name__ == "__main__":  # a compile worker: JSON requests on stdin, JSON results on stdout
    results_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # triton prints its ptxas reproducers: keep them off the reply
    json.dump(compile_requests(json.load(sys.stdin)), results_out)
    results_out.close()
