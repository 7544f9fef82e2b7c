"""``kiln bench TARGET --suite trtllm-h200`` (or ``trtllm-h100``): TensorRT-LLM's published H200 (H100) throughput
table, row by row, in one command: each row builds its own engine (the random and quantized checkpoints are shared
through the cache), runs the offline workload alone (all requests at once, no TTFT or batch-1 passes) and is printed
against the published figure; a suite runs only on the GPU model, and with the model shape and quantization, its
figures come from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kiln.pipeline.bench.floor import gpu_variant
from kiln.pipeline.bench.provenance import runtime_record
from kiln.pipeline.bench.run import build_and_measure, report_progress
from kiln.pipeline.bench.target import BENCH_TAKES, BenchPlan, BenchTargetError, read_architecture_file
from kiln.pipeline.config import CONFIGS_DIR, cache_root, load_config
from kiln.pipeline.model_source import resolve_model
from kiln.pipeline.targets import Target, resolve_target
from kiln.runtime.options import RuntimeOptions


@dataclass(frozen=True)
class SuiteRow:
    """One row: the sizes, how many requests Kiln sends and how many it runs at once, and the published figure it
    is held against."""

    input_len: int
    output_len: int
    prompts: int
    max_batch_size: int
    published_tokens_per_s: float
    published_by: str

    @property
    def name(self) -> str:
        return f"{self.input_len}/{self.output_len}"


@dataclass(frozen=True)
class Suite:
    """A named table of rows, where its figures come from, why each row sends the requests it does, and the
    runtime settings the published figures ran with (``runtime``: RuntimeOptions fields, applied where the user set
    none); ``device``: the kind of device its figures were measured on, which a run needs (None: any); ``gpu``: the
    GPU they were measured on, as ``gpu_variant`` names it (``H200``: the SXM card), which a run needs too;
    ``format`` and ``kv_cache_dtype``: the quantization they were measured with, which a run takes where the user
    set none and needs (None: any); ``model``: an architecture file (a bundled name) with the shape of the model
    they were measured on, which the target's needs to match (None: any)."""

    name: str
    source: str
    why_counts: str
    rows: tuple[SuiteRow, ...]
    runtime: dict[str, object] = field(default_factory=dict)
    device: str | None = None
    gpu: str | None = None
    format: str | None = None
    kv_cache_dtype: str | None = None
    model: str | None = None

    @property
    def measured_with(self) -> str:
        """What its figures were measured with, for a message."""
        quantization = f"--format {self.format or 'any'} --kv-cache-dtype {self.kv_cache_dtype or 'any'}"
        return f"{quantization} on the shape of configs/models/{self.model}.json" if self.model else quantization


# The counts: at least twice the row's batch cap, so the batch is full for most of the run and the ramp-up and the
# last stragglers are a small share of it; enough for steady state, without the 30,000 requests TensorRT-LLM sends
# at 128/128 or the 3,000 at the other rows (minutes of device time per row). 2048/2048 sends TensorRT-LLM's own
# 1,500: its pool holds about 473 sequences (below), so the count sets the last, thin wave (about 80 of 1,500),
# and the peer's count compares like with like. The caps: the best measured on an H200
# (2026-12-03): 2,048 at 128/128 (0.94x against 0.90x at 512 and 0.92x at 4,096); at the long rows the GEMMs are
# bound by compute from 512 tokens.
# The runtime: the scheduler policy TensorRT-LLM defaults to, guaranteed_no_evict, and the memory its published
# runs give the KV cache, 95 % of what the weights leave free (gpu_memory_utilization 0.95; Kiln's default of 0.9
# holds about 445 sequences of 4,096 tokens at 2048/2048, 0.95 about 473). At 2048/2048 max_utilization admitted
# 512, preempted 100 and ended at batch 8 (0.89x); guaranteed_no_evict stops at what the pool holds, as a cap of
# 440 does (docs/performance.md). On an H200 only 2048/2048 gains from the larger pool (the other rows' batches
# fit either way); on an H100, 128/2048 too.
TRTLLM_H200 = Suite(
    name="trtllm-h200",
    source="TensorRT-LLM perf-overview, best published H200 figure per row (Llama-3.1-8B FP8, trtllm-bench)",
    why_counts="two or more full batches at the row's batch cap, so steady state dominates the run; 2048/2048 "
               "TensorRT-LLM's own 1,500, as its pool holds about 473 sequences",
    rows=(
        SuiteRow(128, 128, 10000, 2048, 29526, "v0.17"),
        SuiteRow(128, 2048, 1000, 512, 26221, "v1.0"),
        SuiteRow(500, 2000, 1000, 512, 21463, "v0.19"),
        SuiteRow(1000, 1000, 1000, 512, 17744, "v1.0"),
        SuiteRow(2048, 2048, 1500, 512, 12194, "v1.0"),
    ),
    runtime={"scheduler_policy": "guaranteed_no_evict", "gpu_memory_utilization": 0.95},
    device="cuda",
    gpu="H200",
    format="fp8",  # FP8 weights and an FP8 KV cache, Llama-3.1-8B (the shape of Llama-3-8B)
    kv_cache_dtype="fp8",
    model="llama3-8b",
)
# The same rows against the best published H100 SXM figure of each (TensorRT-LLM perf-overview v0.17-v1.0): the
# same counts and caps; at 2048/2048 an H100's pool holds about 227 sequences of 4,096 tokens, so 1,000 requests
# are four full waves and a part.
TRTLLM_H100 = replace(
    TRTLLM_H200,
    name="trtllm-h100",
    source="TensorRT-LLM perf-overview, best published H100 SXM figure per row (Llama-3.1-8B FP8, trtllm-bench)",
    why_counts="two or more full batches at the row's batch cap, so steady state dominates the run; 2048/2048 "
               "1,000, as an H100's pool holds about 227 sequences",
    rows=(
        SuiteRow(128, 128, 10000, 2048, 28837, "v0.17"),
        SuiteRow(128, 2048, 1000, 512, 22714, "v1.0"),
        SuiteRow(500, 2000, 1000, 512, 17833, "v0.20"),
        SuiteRow(1000, 1000, 1000, 512, 15271, "v0.20"),
        SuiteRow(2048, 2048, 1000, 512, 9654, "v0.19"),
    ),
    gpu="H100",
)
SUITES = {suite.name: suite for suite in (TRTLLM_H200, TRTLLM_H100)}
# The fields of a config.json that give a model its shape, and so its speed
MODEL_FIELDS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "vocab_size")
MEASURE_INSTEAD = "measure with --prompts, --input-len and --output-len"


def check_gpu(suite: Suite, gpu_name: str) -> None:
    """Refuse a suite whose figures come from another GPU than ``gpu_name`` (naming the suite for this one, if there
    is one), or from another form factor of it (a PCIe or NVL card: other memory and power): its ratios would
    compare different hardware."""
    variant = gpu_variant(gpu_name)
    if suite.gpu is None or variant == suite.gpu:
        return
    if variant is not None and variant.split()[0] == suite.gpu:
        raise BenchTargetError(f"--suite {suite.name}: its figures are from the {suite.gpu} SXM card and this GPU is "
                               f"{gpu_name}, an {variant} (other memory bandwidth and power limit), so its ratios "
                               f"would compare different hardware: {MEASURE_INSTEAD}")
    matching = [other.name for other in SUITES.values() if other.gpu is not None and other.gpu == variant]
    hint = f"run --suite {matching[0]}" if matching else MEASURE_INSTEAD
    raise BenchTargetError(f"--suite {suite.name}: its figures were measured on an {suite.gpu} and this GPU is "
                           f"{gpu_name}, so its ratios would compare different hardware: {hint}")


def model_shape(cfg: dict) -> dict[str, object]:
    """The ``MODEL_FIELDS`` of a config.json (``num_key_value_heads`` left out is ``num_attention_heads``, as in
    transformers)."""
    shape = {name: cfg.get(name) for name in MODEL_FIELDS}
    if shape["num_key_value_heads"] is None:
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    return shape


def check_model(suite: Suite, cfg: dict, what: str) -> None:
    """Refuse a model (``cfg``, the config.json of ``what``) whose shape is not that of the suite's figures."""
    if suite.model is None:
        return
    expected = model_shape(read_architecture_file(CONFIGS_DIR / "models" / f"{suite.model}.json"))  # bundled
    differs = [f"{name} {value} (not {expected[name]})" for name, value in model_shape(cfg).items()
               if value != expected[name]]
    if differs:
        raise BenchTargetError(f"--suite {suite.name}: {what} has {', '.join(differs)}, and its figures were measured "
                               f"with {suite.measured_with}: benchmark that architecture, or {MEASURE_INSTEAD}")


def suite_quantization(suite: Suite, target: Target, fmt: str | None, kv_cache_dtype: str | None
                       ) -> tuple[str | None, str]:
    """The ``--format`` and ``--kv-cache-dtype`` the rows build ``target`` with: the user's (None: not given),
    else the suite's. One the suite's figures were not measured with is refused, as is a config whose quantize
    section builds another (a config sets its own: given ones are refused, and it keeps ``fmt`` None)."""
    if target.kind == "config":
        if fmt is not None or kv_cache_dtype is not None:
            raise BenchTargetError(f"--format and --kv-cache-dtype apply to architecture files; {target.path.name} "
                                   "sets its own quantize.format and quantize.kv_cache_dtype, so leave them out")
        quantize = load_config(target.path).config.quantize
        given = {"quantize.format": quantize.format, "quantize.kv_cache_dtype": quantize.kv_cache_dtype}
        fix = "use a config that builds those, or the model's architecture file"
    else:
        given = {"--format": fmt, "--kv-cache-dtype": kv_cache_dtype}
        fix = "leave them out to run the suite's"
    wanted = {"--format": suite.format, "--kv-cache-dtype": suite.kv_cache_dtype}
    differs = [f"{name} {value}" for (name, value), measured in zip(given.items(), wanted.values(), strict=True)
               if value is not None and measured is not None and value != measured]
    if differs:
        raise BenchTargetError(f"--suite {suite.name}: {target.path.name} runs {', '.join(differs)}, and its figures "
                               f"were measured with {suite.measured_with}: {fix}")
    if target.kind == "config":
        return None, "auto"
    return fmt or suite.format, kv_cache_dtype or suite.kv_cache_dtype or "auto"


def target_model(target: Target) -> dict:
    """The config.json of the model ``target`` builds: an architecture file's own, a config's checkpoint's."""
    if target.kind == "architecture":
        return read_architecture_file(target.path)
    return json.loads((resolve_model(load_config(target.path).config.model) / "config.json").read_text())


def select_rows(suite: Suite, names: list[str] | None) -> tuple[SuiteRow, ...]:
    """The suite's rows named ``IN/OUT`` (all of them when ``names`` is None); an unknown, empty or repeated name is
    an error."""
    if names is None:
        return suite.rows
    by_name = {row.name: row for row in suite.rows}
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise BenchTargetError(f"--rows names {', '.join(repeated)} twice: name each row once")
    unknown = [name or "(an empty row)" for name in names if name not in by_name]
    if unknown:
        raise BenchTargetError(f"--rows {', '.join(unknown)}: suite {suite.name} has rows {', '.join(by_name)}")
    return tuple(by_name[name] for name in names)


def run_suite(target: str, suite: Suite, rows: tuple[SuiteRow, ...], *, fmt: str | None, kv_cache_dtype: str | None,
              tp_size: int | None, allow_large: bool, seed: int, options: RuntimeOptions,
              max_batch_size: int | None = None, random_quantized: bool = False,
              checkpoint_cache: Path | None = None) -> dict:
    """Each row's offline output tokens/s against its published figure, with what the engine did to get there
    (``max_batch_size`` overrides every row's own). The suite's runtime settings apply where ``options`` leave them
    unset, and its quantization where ``fmt`` and ``kv_cache_dtype`` are None; a target of another model, or
    another quantization given, is refused before anything runs."""
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if suite.device is not None and not device.startswith(suite.device):
        raise BenchTargetError(f"--suite {suite.name}: its figures were measured on {suite.device} and its rows send "
                               f"up to {max(row.prompts for row in rows):,} requests each; this run is on {device}. "
                               "Run it on a GPU, or measure here with --prompts, --input-len and --output-len")
    if device.startswith("cuda"):
        check_gpu(suite, torch.cuda.get_device_name(torch.device(device)))
    resolved = resolve_target(target, cache_root(), no_engines=BENCH_TAKES)
    fmt, kv_cache_dtype = suite_quantization(suite, resolved, fmt, kv_cache_dtype)
    if suite.model is not None:
        check_model(suite, target_model(resolved), str(resolved.path))
    options = replace(options, **{name: value for name, value in suite.runtime.items()
                                  if getattr(options, name) is None})
    results = []
    for row in rows:
        batch = max_batch_size or (row.max_batch_size if resolved.kind == "architecture" else None)
        at_once = f", up to {batch} at once" if batch else ""
        report_progress(f"suite {suite.name}: row {row.name}, {row.prompts} requests{at_once}")
        kiln = build_and_measure(resolved, BenchPlan(row.prompts, row.input_len, row.output_len, batch), fmt=fmt,
                                 kv_cache_dtype=kv_cache_dtype, allow_large=allow_large, seed=seed, tp_size=tp_size,
                                 options=options, offline_only=True, random_quantized=random_quantized,
                                 checkpoint_cache=checkpoint_cache).kiln
        tokens_per_s = kiln["output_tokens_per_s"]
        results.append({
            "row": row.name, "input_len": row.input_len, "output_len": row.output_len, "prompts": row.prompts,
            "max_batch_size": kiln["kv_pool"]["max_batch_size"],
            "kiln_tokens_per_s": tokens_per_s, "published_tokens_per_s": row.published_tokens_per_s,
            "published_by": row.published_by, "ratio": round(tokens_per_s / row.published_tokens_per_s, 4),
            **{name: kiln[name] for name in ("kv_pool", "offline_engine", "offline_s", "load_ms", "load_phases_s",
                                             "warm_ms", "cuda_graphs", "quantization", "engine_dir", "engine_key",
                                             "cache_hit", "build_s")},
        })
    return {"suite": suite.name, "source": suite.source, "counts": suite.why_counts, "target": str(resolved.path),
            "runtime": runtime_record(options),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "device": device,
            "seed": seed, "rows": results}
