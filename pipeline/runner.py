"""Plan and run ``kiln build``: resolve inputs, decide each stage, run what is not up to date."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.calibration.checkpoint_checks import check_quantizable
from kiln.engines.cache import EngineCache, checkpoint_hash
from kiln.engines.cache.layout import layout_root
from kiln.engines.native.builder import preflight_native_plan, preflight_tensor_parallel, refuse_parallelism
from kiln.pipeline.backend import choose_backend, require, require_device
from kiln.pipeline.config import LoadedConfig, is_local_path, load_config
from kiln.pipeline.console import warn
from kiln.pipeline.key_material import checkpoint_state
from kiln.pipeline.model_source import ModelNotFoundError, find_model, model_max_positions, resolve_model
from kiln.pipeline.stages import (
    BUILD_STAGES,
    SMOKE_STAGE,
    BuildContext,
    Decision,
    QuantizeStage,
    Stage,
    report_summary,
)
from kiln.pipeline.tokenizer_files import checkpoint_tokenizer
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.plan import PlanError

ProgressFactory = Callable[[str], Callable[[str, float], None]]
Plan = list[tuple[Stage, Decision]]

GB = 10**9  # the CLI's "50GB" is 10^9 bytes too


def open_cache(loaded: LoadedConfig, *, create: bool) -> EngineCache | None:
    """The engine cache the config names, its limits and remote recorded for the cache commands; without
    ``create`` (a dry run, ``kiln cache explain``) read only: None when it does not exist yet, and nothing recorded."""
    section = loaded.config.cache
    root = section.root()
    if not create and not layout_root(root).is_dir():
        return None
    settings = dict(max_size_bytes=int(section.max_size_gb * GB), max_entries=section.max_entries,
                    verify_on_load=section.verify_on_load, remote=section.remote_spec(), warn=warn)
    return EngineCache.open(root, **settings) if create else EngineCache(root, **settings)


def _hash_checkpoint(model_dir: Path, cache: EngineCache | None) -> str:
    return checkpoint_hash(model_dir, memo_path=cache.hash_memo_path if cache else None)


@contextmanager
def _at_its_line(loaded: LoadedConfig) -> Iterator[None]:
    """A plan that the model or the backend refuses, as a ConfigError at the line of the field it names."""
    try:
        yield
    except PlanError as exc:
        raise loaded.refusal(str(exc)) from None


def prepare(config: str | Path, *, backend: str | None, force: bool, dry_run: bool,
            options: RuntimeOptions) -> BuildContext:
    """Resolve config, backend, model and keys; ``options`` are the runtime's (the builder's kernels, the smoke
    stage's load). A dry run tolerates a missing model, with a warning where the build would not download it; a
    real run does not."""
    loaded = load_config(config)
    choice = choose_backend(backend or loaded.config.build.backend, loaded.config.build.device)
    require_device(choice)
    warnings: list[str] = []  # said on stderr, and kept for the plan's JSON

    def note(message: str) -> None:
        warn(message)
        warnings.append(message)

    # settings the engine would refuse at its load (the smoke stage's), refused before anything is built
    options.check_applies((options.device or choice.device).partition(":")[0], loaded.config.build.tp_size)
    if choice.backend == "native":
        with _at_its_line(loaded):
            refuse_parallelism(loaded.config.build.pp_size)
        if unused := loaded.config.build.trtllm_settings():  # with backend native in the config, refused at load
            note(f"{', '.join(unused)}: for the TensorRT-LLM backend only, unused by this build's native backend "
                 f"({choice.reason})")
    model = loaded.config.model
    if dry_run:
        model_dir = find_model(model)
        if model_dir is None and (is_local_path(model.path) or not model.allow_download):
            try:  # the plan is shown, keyed as far as it can be; the build would stop here, not download
                resolve_model(model)
            except ModelNotFoundError as exc:
                note(f"{exc} (the build would stop here)")
    else:
        require(choice)
        model_dir = resolve_model(loaded.config.model)
    if model_dir is not None:  # the same checks in a dry run as in a build, before the cache is touched
        if loaded.config.quantize.format != "none":
            check_quantizable(model_dir)
        if (positions := model_max_positions(model_dir)) is not None:
            loaded.fit_to_model(positions)
        with _at_its_line(loaded):
            if choice.backend == "native":
                preflight_native_plan(model_dir, loaded.config.build.plan(), loaded.config.model.dtype,
                                      loaded.config.build.tp_size, loaded.config.quantize.int4_group_size,
                                      loaded.config.quantize.chain)
            else:
                preflight_tensor_parallel(model_dir, loaded.config.build.tp_size)
    cache = open_cache(loaded, create=not dry_run)
    state = checkpoint_state(model_dir, memo_path=cache.hash_memo_path if cache else None) if model_dir else None
    ctx = BuildContext(loaded=loaded, choice=choice, options=options, cache=cache, model_dir=model_dir,
                       checkpoint_state=state, force=force, warnings=warnings)
    ctx.compute_keys()
    return ctx


def decide(ctx: BuildContext, *, smoke: bool = True) -> Plan:
    """The stages with the runner's decision for each; ``smoke=False`` leaves out the smoke stage (for a caller
    that loads the engine itself)."""
    if smoke:
        check_smoke(ctx)
    plan: Plan = []
    earlier: dict[str, Decision] = {}
    for stage in (*BUILD_STAGES, SMOKE_STAGE) if smoke else BUILD_STAGES:
        decision = earlier[stage.name] = stage.decide(ctx, earlier)
        decision.extra.update(fingerprint=stage.fingerprint(ctx), inputs=list(stage.inputs), outputs=stage.outputs)
        plan.append((stage, decision))
    return plan


def check_smoke(ctx: BuildContext) -> None:
    """Refuse a smoke request the build plan cannot serve before anything is built: its prompt counted with the
    model's tokenizer when the model is on disk (a model without one is refused), else taken as one token."""
    prompt_tokens = None
    if ctx.model_dir is not None:
        prompt_tokens = len(checkpoint_tokenizer(ctx.model_dir).encode(ctx.config.smoke.prompt))
    if problem := ctx.config.smoke_problem(prompt_tokens):
        raise ctx.loaded.refusal(problem)


def plan_json(ctx: BuildContext, decisions: Plan) -> dict:
    """The plan as printed by ``--dry-run --json``."""
    return {
        "config": str(ctx.loaded.path),
        "backend": ctx.choice.backend,
        "backend_reason": ctx.choice.reason,
        "device": ctx.choice.device,
        "stages": [d.to_json() for _, d in decisions],
        "engine_key": ctx.engine_key,
        "quantized_key": ctx.quantized_key,
        "key_material": ctx.material,
        "warnings": ctx.warnings,
    }


def run(ctx: BuildContext, decisions: Plan, progress: ProgressFactory | None = None, *,
        keep_engine_hold: bool = False) -> dict:
    """Run the stages in order and return the plan plus the run's results; the engine's cache entry is held from
    its publish or hit until they are done (``BuildContext.engine_hold``), or, with ``keep_engine_hold``, until the
    caller that loads it next calls ``ctx.release_engine()`` (a failed run releases it)."""
    try:
        timings = {stage.name: _execute(stage, decision, ctx, progress) for stage, decision in decisions}
    except BaseException:
        ctx.release_engine()
        raise
    if not keep_engine_hold:
        ctx.release_engine()
    result = plan_json(ctx, decisions)
    result.update({
        "engine_dir": str(ctx.engine_dir.resolve()),
        "cache": {"hit": ctx.cache_hit, "reason": ctx.cache_reason},
        "load_ms": round(ctx.load_ms, 2) if ctx.load_ms is not None else None,
        "build_seconds": round(ctx.build_seconds, 3),
        "build_seconds_saved": round(ctx.seconds_saved, 3),
        "stage_seconds": timings,
        "quantization": report_summary(ctx.calibration) if ctx.calibration else None,
        "sample": ctx.sample,
    })
    return result


def quantize_only(ctx: BuildContext, progress: ProgressFactory | None = None) -> dict:
    """Run (or reuse) the quantize stage alone; the ``kiln quantize --json`` object."""
    stage = QuantizeStage()
    decision = stage.decide(ctx, {})
    _execute(stage, decision, ctx, progress)
    calibration = ctx.calibration or {}
    return {
        "config": str(ctx.loaded.path),
        "action": decision.action,
        "reason": decision.reason,
        "format": calibration.get("format", ctx.config.quantize.format),
        "converged": calibration.get("converged", True),
        "rounds": [{k: r.get(k) for k in ("samples", "max_rel_change", "kl", "top1_agreement", "output_mae")}
                   for r in calibration.get("rounds", [])],
        "gate": calibration.get("gate"),
        "fallback_from": calibration.get("fallback_from"),
        "summary": calibration.get("summary"),
        "quantized_key": ctx.quantized_key,
        "checkpoint_dir": str(ctx.checkpoint_dir),
        "checkpoint_hash": _hash_checkpoint(ctx.checkpoint_dir, ctx.cache),
    }


def _execute(stage: Stage, decision: Decision, ctx: BuildContext, progress: ProgressFactory | None) -> float:
    """Run a stage or adopt its cached outputs, as decided; returns the seconds it took."""
    report = progress(stage.name) if progress else (lambda *_: None)
    start = time.perf_counter()
    if decision.action == "run":
        stage.run(ctx, decision, report)
        report("done", 1.0)
    else:
        stage.adopt(ctx, decision)
        report("skipped", 1.0)
    return round(time.perf_counter() - start, 3)
