"""``kiln bench TARGET``: Kiln's engine against a peer (transformers) on the same machine in one run, and against
the memory-bandwidth floor of batch-1 decode.

TARGET is a config (built through the engine cache: a hit is instant) or an architecture file instantiated with
seeded random weights. Figures: offline output tokens/s (all ``--prompts`` requests at once), batch-1 decode
tokens/s (one request alone, after its first token; median of 3), median time to first token on an idle engine, and
the engine's load time from the cache. The run is in ``pipeline/bench/run.py``; see docs/performance.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import typer

from kiln.calibration.recipe import MAX_SEED, Format
from kiln.pipeline.bench.provenance import run_record
from kiln.pipeline.bench.report import print_report
from kiln.pipeline.console import friendly_errors, print_json
from kiln.pipeline.float_flags import finite_float
from kiln.pipeline.runtime_env import runtime_options

DEFAULT_PROMPTS, DEFAULT_LENGTH = 64, 128  # --prompts, and --input-len and --output-len


@friendly_errors
def bench(
    target: Annotated[str, typer.Argument(help="A config (a path or a name under configs/, e.g. tiny-llama-bf16.yaml) "
                                               "or an architecture file (configs/models/llama3-8b.json: random "
                                               "weights).")],
    prompts: Annotated[int | None, typer.Option(min=1, help="Requests in the offline run (default "
                                                                f"{DEFAULT_PROMPTS}).")] = None,
    input_len: Annotated[int | None, typer.Option(min=1, help="Prompt length in tokens (random token ids, seeded; "
                                                              f"default {DEFAULT_LENGTH}).")] = None,
    output_len: Annotated[int | None, typer.Option(min=2, help="Tokens generated per request (EOS ignored; "
                                                               f"default {DEFAULT_LENGTH}).")] = None,
    batch_1: Annotated[bool, typer.Option("--batch-1", help="Measure only batch-1 decode, TTFT and load time "
                                                            "(skip the offline run).")] = False,
    peer: Annotated[Literal["transformers"] | None, typer.Option(
        help="Also measure the same model in this peer.")] = None,
    peer_attn: Annotated[Literal["sdpa", "eager"] | None, typer.Option(
        help="The peer's attention (default sdpa).")] = None,
    fmt: Annotated[Format | None, typer.Option("--format", help="For an architecture file (a config's "
                                                                "quantize.format decides otherwise).")] = None,
    kv_cache_dtype: Annotated[Literal["auto", "fp8"] | None, typer.Option(
        "--kv-cache-dtype", help="fp8: with a quantized --format, also calibrate an FP8 KV cache (halves the KV "
                                 "bytes; default auto, a --suite's own).")] = None,
    tp_size: Annotated[int | None, typer.Option("--tp-size", min=1, help="Split an architecture file's engine over "
                                                "this many GPUs (tensor parallelism; a config's build.tp_size "
                                                "decides otherwise).")] = None,
    bandwidth_gbs: Annotated[float | None, typer.Option(
        "--bandwidth-gbs", **finite_float(0.001), help="Memory bandwidth for the floor, GB/s (default: 4300 on an H200 "
                                                       "SXM, another H100 or H200 card's datasheet peak, else "
                                                       "measured).")] = None,
    allow_large: Annotated[bool, typer.Option("--allow-large", help="Benchmark a large architecture on a CPU-only "
                                                                     "machine anyway.")] = False,
    suite: Annotated[str | None, typer.Option(help="Run a table of rows instead: trtllm-h200 or trtllm-h100 "
                                                   "(TensorRT-LLM's published throughput rows on that GPU, each "
                                                   "against its figure).")] = None,
    rows: Annotated[str | None, typer.Option(help="With --suite, only these rows, comma-separated IN/OUT "
                                                  "(128/128,1000/1000).")] = None,
    random_quantized: Annotated[bool, typer.Option("--random-quantized", help="With --format fp8 on an architecture "
                                "file: make the FP8 weights and scales directly at random instead of writing bf16 "
                                "weights and quantizing them with modelopt (for models whose bf16 weights outgrow "
                                "the disk or one GPU, such as Llama-3-70B).")] = False,
    checkpoint_cache: Annotated[Path | None, typer.Option("--checkpoint-cache", help="Keep the random-weight "
                                "checkpoints of an architecture file in the engine cache at this directory instead "
                                "of KILN_CACHE's, e.g. in /dev/shm when the disk holds the engine but not both "
                                "(Llama-3-70B FP8: 72 GB each).")] = None,
    max_batch_size: Annotated[int | None, typer.Option("--max-batch-size", min=1, help="The most requests an "
                              "architecture file's engine runs at once (default: --prompts, at most 512; a --suite "
                              "row's own).")] = None,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Seed of the prompts and of random weights.")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print a machine-readable object on stdout.")] = False,
) -> None:
    """Measure Kiln (and a peer) on one model: throughput, batch-1 decode, TTFT, load time, and the floor."""
    if peer_attn is not None and peer is None:
        raise typer.BadParameter("--peer-attn sets the peer's attention: it needs --peer")
    if kv_cache_dtype == "fp8" and fmt not in ("fp8", "int4_awq") and suite is None:  # a suite's --format fills in
        raise typer.BadParameter("--kv-cache-dtype fp8 needs --format fp8 or int4_awq (an FP8 KV cache is calibrated "
                                 "with the quantized weights), and like them applies to architecture files: a "
                                 "config's quantize.kv_cache_dtype sets its own, so leave the flag out")
    if random_quantized and peer is not None:
        raise typer.BadParameter("--random-quantized writes a checkpoint only Kiln reads (modelopt's FP8 layout); "
                                 "leave out --peer")
    # from the working directory, as KILN_CACHE is: the generated config that names it lives elsewhere
    checkpoint_cache = None if checkpoint_cache is None else checkpoint_cache.absolute()
    if suite is not None:
        _refuse_given("a --suite row sets its own requests and lengths, and runs offline only",
                      {"--prompts": prompts, "--input-len": input_len, "--output-len": output_len,
                       "--batch-1": batch_1 or None, "--bandwidth-gbs": bandwidth_gbs})
        _run_suite(target, suite, rows, fmt=fmt, kv_cache_dtype=kv_cache_dtype, tp_size=tp_size,
                   random_quantized=random_quantized, checkpoint_cache=checkpoint_cache, max_batch_size=max_batch_size,
                   allow_large=allow_large, seed=seed, peer=peer, json_out=json_out)
        return
    if rows is not None:
        raise typer.BadParameter("--rows selects rows of a --suite")
    from kiln.pipeline.bench.run import BenchPlan, run_bench  # torch and the runtime load only when a bench runs

    plan = BenchPlan(prompts or DEFAULT_PROMPTS, input_len or DEFAULT_LENGTH, output_len or DEFAULT_LENGTH,
                     max_batch_size)
    run = run_record()
    report = run_bench(target, plan, batch_1_only=batch_1, peer=peer, peer_attn=peer_attn or "sdpa", fmt=fmt,
                       kv_cache_dtype=kv_cache_dtype or "auto", tp_size=tp_size, bandwidth_gbs=bandwidth_gbs,
                       allow_large=allow_large, seed=seed, options=runtime_options(os.environ),
                       random_quantized=random_quantized, checkpoint_cache=checkpoint_cache)
    print_json({**report, "run": run}) if json_out else print_report(report)


def _refuse_given(why: str, options: dict[str, object]) -> None:
    """A usage error naming the ``options`` the user gave (not None), which the run would not honour because
    ``why``."""
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise typer.BadParameter(f"{', '.join(given)}: {why}; leave {'it' if len(given) == 1 else 'them'} out")


def _run_suite(target: str, name: str, rows: str | None, *, fmt: str | None, kv_cache_dtype: str | None,
               tp_size: int | None, random_quantized: bool, checkpoint_cache: Path | None,
               max_batch_size: int | None, allow_large: bool, seed: int, peer: str | None, json_out: bool) -> None:
    from kiln.pipeline.bench.report import print_suite
    from kiln.pipeline.bench.suite import SUITES, run_suite, select_rows

    if name not in SUITES:
        raise typer.BadParameter(f"--suite {name!r} is not one of {', '.join(SUITES)}")
    if peer is not None:
        raise typer.BadParameter("--suite compares with published figures; leave out --peer")
    selected = select_rows(SUITES[name], None if rows is None else [row.strip() for row in rows.split(",")])
    run = run_record()
    report = run_suite(target, SUITES[name], selected, fmt=fmt, kv_cache_dtype=kv_cache_dtype, tp_size=tp_size,
                       random_quantized=random_quantized, checkpoint_cache=checkpoint_cache,
                       max_batch_size=max_batch_size, allow_large=allow_large, seed=seed,
                       options=runtime_options(os.environ))
    print_json({**report, "run": run}) if json_out else print_suite(report)
