"""One ``kiln bench`` run: resolve the target, build the engine through the cache, measure Kiln and the peer, size
the floor, and assemble the report (its shape is in docs/performance.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape

from kiln.engines.cache import EngineCache
from kiln.pipeline.bench.common import free_memory
from kiln.pipeline.bench.floor import decode_step_bytes, floor_tokens_per_s, ranks_sharing_memory, resolve_bandwidth
from kiln.pipeline.bench.measure import Workload, measure_kiln
from kiln.pipeline.bench.provenance import runtime_record
from kiln.pipeline.bench.random_checkpoint import random_checkpoint
from kiln.pipeline.bench.report import speedups
from kiln.pipeline.bench.target import (
    BENCH_TAKES,
    CALIB_LEN,
    CALIB_SAMPLES,
    BenchPlan,
    BenchTargetError,
    bench_config,
    check_config_holds,
    check_fits_machine,
    read_architecture_file,
    write_config,
)
from kiln.pipeline.config import cache_root
from kiln.pipeline.console import stderr
from kiln.pipeline.stages import BuildContext
from kiln.pipeline.targets import Target, resolve_target
from kiln.runtime.native.engine_format import EngineConfig
from kiln.runtime.options import RuntimeOptions

__all__ = ["BenchPlan", "MeasuredEngine", "build_and_measure", "report_progress", "run_bench"]


def report_progress(message: str) -> None:
    stderr.print(f"[dim]bench:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)


def run_bench(target: str, plan: BenchPlan, *, batch_1_only: bool, peer: str | None, peer_attn: str,
              fmt: str | None, bandwidth_gbs: float | None, allow_large: bool, seed: int, options: RuntimeOptions,
              kv_cache_dtype: str = "auto", tp_size: int | None = None, random_quantized: bool = False,
              checkpoint_cache: Path | None = None) -> dict:
    """Build (or find) the engine, measure it with ``options`` (on the device it was built for unless they name one)
    and the peer, and return the report."""
    resolved = resolve_target(target, cache_root(), no_engines=BENCH_TAKES)
    run = build_and_measure(resolved, plan, fmt=fmt, kv_cache_dtype=kv_cache_dtype, allow_large=allow_large,
                            seed=seed, tp_size=tp_size, options=options, batch_1_only=batch_1_only,
                            random_quantized=random_quantized, checkpoint_cache=checkpoint_cache)
    ctx, engine, workload, kiln, device = run.ctx, run.engine, run.workload, run.kiln, run.ctx.load_options.device

    peer_report = None
    if peer == "transformers":
        peer_report = _run_peer(run.peer_checkpoint or ctx.model_dir, workload, device, peer_attn, batch_1_only,
                                quantized=engine.quantization.format != "none")

    report_progress("floor: sizing the decode step and the memory bandwidth")
    step = decode_step_bytes(ctx.engine_dir, plan.input_len, plan.output_len,
                             ranks=ranks_sharing_memory(device, engine.tp_size))
    bandwidth = resolve_bandwidth(device, bandwidth_gbs)
    floor = floor_tokens_per_s(step["bytes_per_step"], bandwidth.gbs)
    ratios = speedups(kiln, peer_report)
    basis = "decode_tokens_per_s_batch1" if batch_1_only else "output_tokens_per_s"
    return {
        "kiln": kiln,
        "peer": peer_report,
        "speedup_vs_peer": ratios.get(basis),
        "speedup_basis": basis,
        "speedups": ratios,
        "floor_tokens_per_s_batch1": round(floor, 2),
        "floor_fraction_batch1": round(kiln["decode_tokens_per_s_batch1"] / floor, 4),
        "floor": {"bandwidth_gbs": bandwidth.gbs, "bandwidth_source": bandwidth.source, **step},
        "gpu": torch.cuda.get_device_name(torch.device(device)) if device == "cuda" else None,
        "device": device,
        "tp_size": engine.tp_size,
        "runtime": runtime_record(options),
        "cpu_threads": torch.get_num_threads(),  # each rank's: its workers start with this environment
        "cpu_count": os.cpu_count(),
        "target": str(resolved.path),
        "target_kind": resolved.kind,
        "config": str(run.config_path),
        "prompts": plan.prompts,
        "input_len": plan.input_len,
        "output_len": plan.output_len,
        "batch_1_only": batch_1_only,
        "seed": seed,
    }


@dataclass(frozen=True)
class MeasuredEngine:
    """One engine built for a plan and measured: the build context, its engine.json, the workload it ran, Kiln's
    figures (the quantization note and build record included), the config it was built from, and the peer's
    checkpoint when it is not the config's model."""

    ctx: BuildContext
    engine: EngineConfig
    workload: Workload
    kiln: dict
    config_path: Path
    peer_checkpoint: Path | None


def build_and_measure(resolved: Target, plan: BenchPlan, *, fmt: str | None, kv_cache_dtype: str, allow_large: bool,
                      seed: int, tp_size: int | None, options: RuntimeOptions, batch_1_only: bool = False,
                      offline_only: bool = False, random_quantized: bool = False,
                      checkpoint_cache: Path | None = None) -> MeasuredEngine:
    """Build (or find) the engine of ``resolved`` for ``plan`` and measure it with ``options`` (on the device it was
    built for unless they name one), its memory freed afterwards for whatever runs next."""
    config_path, peer_checkpoint, weights_note = bench_config_for(resolved, plan, fmt=fmt,
                                                                  kv_cache_dtype=kv_cache_dtype,
                                                                  allow_large=allow_large, seed=seed, tp_size=tp_size,
                                                                  random_quantized=random_quantized,
                                                                  checkpoint_cache=checkpoint_cache)
    ctx, build = build_engine(config_path, options)
    try:
        engine = EngineConfig.load(ctx.engine_dir)
        workload = Workload.for_engine(engine, prompts=plan.prompts, input_len=plan.input_len,
                                       output_len=plan.output_len, seed=seed)
        kiln = measure_kiln(ctx.engine_dir, workload, ctx.load_options, batch_1_only=batch_1_only,
                            offline_only=offline_only, on_loaded=lambda ms: ctx.cache.record_load(ctx.engine_key, ms),
                            progress=report_progress)
    finally:
        ctx.release_engine()
    free_memory(ctx.load_options.device)  # the closed engine's KV pool and weights
    kiln.update(backend="native", quantization=quantization_note(engine, ctx, weights_note), **build)
    return MeasuredEngine(ctx, engine, workload, kiln, config_path, peer_checkpoint)


def bench_config_for(target: Target, plan: BenchPlan, *, fmt: str | None, kv_cache_dtype: str, allow_large: bool,
                     seed: int, tp_size: int | None = None, random_quantized: bool = False,
                     checkpoint_cache: Path | None = None) -> tuple[Path, Path | None, str | None]:
    """The config to build, the peer's checkpoint when it is not the config's model, and what the weights are.
    ``random_quantized`` makes an FP8 checkpoint directly instead of quantizing a bf16 one with modelopt;
    ``checkpoint_cache`` keeps the random checkpoint in the engine cache at that root instead of the configured one."""
    if target.kind == "config":
        if (fmt is not None or tp_size is not None or plan.max_batch_size is not None or random_quantized
                or checkpoint_cache is not None):
            raise BenchTargetError(f"--format, --tp-size, --max-batch-size, --random-quantized and --checkpoint-cache "
                                   f"apply to architecture files; {target.path.name} sets its own quantize.format, "
                                   f"build.tp_size and build.max_batch_size, and names its checkpoint")
        check_config_holds(target.path, plan)
        return target.path, None, None
    fmt = fmt or "none"
    if random_quantized and fmt != "fp8":
        raise BenchTargetError(f"--random-quantized makes FP8 weights directly; it needs --format fp8, not {fmt}")
    arch = read_architecture_file(target.path)
    cuda = torch.cuda.is_available()
    check_fits_machine(target.path, arch, cuda=cuda, allow_large=allow_large, fp8=random_quantized)
    cache = EngineCache.open_configured(checkpoint_cache or cache_root())
    kv = " with an FP8 KV cache" if kv_cache_dtype == "fp8" else ""
    bench_config(target.path, plan, arch, fmt=fmt, kv_cache_dtype=kv_cache_dtype, seed=seed,
                 tp_size=tp_size or 1)  # the plan's checks, before minutes of writing random weights
    hf_dir = random_checkpoint(cache, target.path, arch, seed=seed, device="cuda" if cuda else "cpu",
                               progress=report_progress, fp8=random_quantized, fp8_kv_cache=kv_cache_dtype == "fp8")
    if random_quantized:  # built as it is: the builder reads the FP8 linears and K/V scales of the checkpoint
        fmt, kv_cache_dtype = "none", "auto"
        note = (f"random FP8 weights{kv} made directly (seed {seed}, no bf16 checkpoint, no modelopt) for "
                f"{target.path.name}")
    else:
        note = f"random bf16 weights (seed {seed}) for {target.path.name}"
    config = bench_config(hf_dir, plan, arch, fmt=fmt, kv_cache_dtype=kv_cache_dtype, seed=seed,
                          tp_size=tp_size or 1)
    if fmt != "none":
        method = "max" if fmt == "fp8" else config.quantize.algorithm
        note += (f", quantized to {fmt}{kv} by modelopt ({method}) in kiln's quantize stage on {CALIB_SAMPLES} "
                 f"random sequences of {CALIB_LEN} token ids (one round, no accuracy gate)")
    if (tp_size or 1) > 1:
        note += f", split over {tp_size} tensor-parallel ranks"
    return write_config(config, note), hf_dir, note


def build_engine(config_path: Path, options: RuntimeOptions):
    """The native engine of ``config_path`` through the cache (quantize → build → publish; a hit is instant)."""
    from kiln.pipeline import runner

    report_progress(f"building {config_path.name} through the engine cache (a hit is instant)")
    ctx = runner.prepare(str(config_path), backend="native", force=False, dry_run=False, options=options)
    # bench loads the engine itself: held until it is done with it (measure_engine)
    result = runner.run(ctx, runner.decide(ctx, smoke=False), None, keep_engine_hold=True)
    return ctx, {"engine_dir": result["engine_dir"], "engine_key": ctx.engine_key,
                 "cache_hit": result["cache"]["hit"], "build_s": result["build_seconds"]}


def quantization_note(engine, ctx, weights_note: str | None) -> str:
    fmt = engine.quantization.format
    label = f"{engine.dtype}, unquantized" if fmt == "none" else f"{fmt} ({engine.dtype} compute)"
    if weights_note:
        return f"{label}; {weights_note}"
    if ctx.calibration:
        gate = ctx.calibration.get("gate")
        passed = gate.get("passed") if isinstance(gate, dict) else gate
        converged = ctx.calibration.get("converged")
        verdict = "gate not applied" if passed is None else f"gate passed: {passed}"
        return f"{label}; calibrated by kiln build (converged: {converged}, {verdict})"
    return label


def _run_peer(checkpoint, workload, device, attn, batch_1_only, *, quantized: bool) -> dict:
    from kiln.pipeline.bench.peer import PeerError, measure_transformers

    try:
        report = measure_transformers(checkpoint, workload, device=device, attn_implementation=attn,
                                      batch_1_only=batch_1_only, progress=report_progress)
    except PeerError as e:
        stderr.print(f"[yellow]warning:[/] peer transformers did not run: {escape(str(e))}", markup=True,
                     highlight=False)
        return {"name": "transformers", "error": str(e)}
    report["name"] = "transformers"
    if quantized:
        report["note"] = "the peer runs the unquantized checkpoint"
    return report


