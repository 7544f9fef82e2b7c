"""The stages of ``kiln build``: quantize → build → publish → smoke.

Each stage declares its inputs (key material), its output (a cache entry or a measurement) and a fingerprint (the
key of that output), and decides from the cache whether it must run (``decide``), always saying why; the runner runs
the stages in order and reports their decisions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from kiln.calibration.layout import QuantizedCheckpoint
from kiln.calibration.recipe import recipe_material
from kiln.engines.cache import ContentStore, EngineCache, EntryHold, LookupResult, engine_key
from kiln.engines.cache.layout import entry_of_payload, entry_path, payload_path, require_creatable
from kiln.engines.cache.manifest import read_manifest
from kiln.engines.cache.remote import RemoteTier, RemoteUnavailableError
from kiln.engines.cache.units import format_bytes
from kiln.engines.cache.verify import nearest_entry
from kiln.pipeline.backend import BackendChoice
from kiln.pipeline.config import BuildSection, KilnConfig, LoadedConfig
from kiln.pipeline.console import warn
from kiln.pipeline.key_material import CheckpointState, engine_material, quantized_material
from kiln.pipeline.tokenizer_files import write_transformers_tokenizer
from kiln.runtime.errors import KilnError
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.plan import BuildPlan
from kiln.runtime.tokenizer_files import partial_tokenizer_files
from kiln.runtime.trtllm.engine_info import ENGINE_FORMAT as TRTLLM_ENGINE_FORMAT
from kiln.runtime.trtllm.engine_info import ranks_not_loaded

if TYPE_CHECKING:
    from kiln.engines.trtllm.options import TrtllmBuildOptions

Action = Literal["run", "skip"]
Progress = Callable[[str, float], None]


@dataclass
class Decision:
    """What the runner will do with a stage, and why; ``hit`` is the cache entry a planning lookup found, which the
    stage then takes up without checking it again."""

    name: str
    action: Action
    reason: str
    hit: LookupResult | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "action": self.action, "reason": self.reason, **self.extra}


@dataclass
class BuildContext:
    """Everything the stages share: inputs resolved up front, outputs filled in as stages run."""

    loaded: LoadedConfig
    choice: BackendChoice
    options: RuntimeOptions
    cache: EngineCache | None
    model_dir: Path | None
    checkpoint_state: CheckpointState | None  # the model folder as the keys took it
    force: bool = False
    warnings: list[str] = field(default_factory=list)  # what planning warned of (a model not on disk, say)
    quantized_key: str | None = None
    engine_key: str | None = None
    material: dict | None = None
    checkpoint_dir: Path | None = None
    fetch_checkpoint: Callable[[Progress], None] | None = None  # a deferred quantize stage (QuantizeStage)
    calibration: dict | None = None
    engine_dir: Path | None = None
    cache_hit: bool = False
    cache_reason: str = ""
    build_seconds: float = 0.0
    quantize_seconds: float = 0.0  # the calibration that made the quantized checkpoint (its entry's build time)
    seconds_saved: float = 0.0  # the build time of what the cache had: the engine, else the quantized checkpoint
    load_ms: float | None = None
    sample: dict | None = None
    engine_hold: EntryHold | None = None  # the engine's cache entry, held from its publish or hit to the build's end

    @property
    def config(self) -> KilnConfig:
        return self.loaded.config

    @functools.cached_property
    def cache_root(self) -> Path:
        """The engine cache's root: the open cache's, else (a dry run before it exists) the one the config names."""
        return self.cache.root if self.cache is not None else self.config.cache.root()

    @functools.cached_property
    def remote(self) -> RemoteTier | None:
        """The remote tier: the cache's, else (a dry run before the local cache exists) the one the config names."""
        if self.cache is not None:
            return self.cache.remote
        spec = self.config.cache.remote_spec()
        return RemoteTier(spec) if spec is not None else None

    @property
    def checkpoint_hash(self) -> str | None:
        return self.checkpoint_state.hash if self.checkpoint_state is not None else None

    @property
    def calibration_dtype(self) -> str:
        """The compute dtype of calibration: float32 on CPU, the model dtype on a GPU."""
        return "float32" if self.choice.device == "cpu" else self.config.model.dtype

    @functools.cached_property
    def recipe_material(self) -> dict:
        """The effective quantize recipe (its data hashed once per build)."""
        return recipe_material(self.config.quantize)

    def quantized_material(self) -> dict:
        return quantized_material(self.checkpoint_state.calibration_hash, self.recipe_material, self.choice.device,
                                  self.calibration_dtype)

    @property
    def model_name(self) -> str:
        """How cache listings name the model: its folder's name, or the name a checkpoint generated into the cache
        (``kiln bench``'s random weights) was stored under, in whichever cache root holds it."""
        in_cache = entry_of_payload(self.model_dir)
        if in_cache is None:
            return self.model_dir.name
        manifest = read_manifest(entry_path(*in_cache)) or {}
        return manifest.get("describe", {}).get("model", self.model_dir.name)

    @property
    def load_options(self) -> RuntimeOptions:
        """The runtime options to load the built engine with: on the device it was built for, unless they say."""
        return replace(self.options, device=self.options.device or self.choice.device)

    def use_quantized(self, checkpoint: QuantizedCheckpoint, build_seconds: float) -> None:
        """Build from a quantized checkpoint of the cache (the quantize stage's output), with its report and its
        entry's build time (the engine's build time includes it)."""
        self.checkpoint_dir, self.calibration = checkpoint.hf, checkpoint.report()
        self.quantize_seconds = build_seconds

    def release_engine(self) -> None:
        """Let the engine's cache entry be evicted again: the build is over (``runner.run``)."""
        if self.engine_hold is not None:
            self.engine_hold.release()
            self.engine_hold = None

    def count_engine_hit(self, build_seconds: float) -> None:
        """Count a hit of the engine as time saved: its recorded build time, which includes its checkpoint's
        calibration, less what this build already counted of that (a checkpoint it took before the engine turned
        up, built by another process meanwhile). The checkpoint, not looked up, is marked used all the same: LRU
        eviction keeps what an engine in use would be rebuilt from (after an upgrade of the build code, say)."""
        self.seconds_saved += max(0.0, build_seconds - self.quantize_seconds)
        if self.quantized_key and self.cache is not None:
            self.cache.quantized.touch(self.quantized_key)

    def ensure_checkpoint(self, progress: Progress) -> None:
        """Run the quantize stage now when it was deferred to the engine (which has to be built after all)."""
        if self.checkpoint_dir is None and self.fetch_checkpoint is not None:
            self.fetch_checkpoint(progress)

    def take_calibration_from(self, manifest: dict | None) -> None:
        """Without a quantize stage that ran, report the calibration the engine's build record holds."""
        if self.calibration is None and manifest is not None:
            self.calibration = (manifest.get("build") or {}).get("calibration")

    def compute_keys(self) -> None:
        """Fill in the quantized and engine keys from the inputs (needs the checkpoint hash)."""
        if self.checkpoint_hash is None:
            return
        if self.config.quantize.format != "none":
            self.quantized_key = engine_key(self.quantized_material())
        self.material = engine_material(self.checkpoint_hash, self.quantized_key, self.config, self.choice,
                                        self.recipe_material, self.options)
        self.engine_key = engine_key(self.material)


class Stage(Protocol):
    """A step of ``kiln build`` with declared inputs, outputs and a fingerprint (the key of its output). It holds no
    state: what a run needs travels in the ``BuildContext`` and the ``Decision``."""

    name: str
    inputs: tuple[str, ...]
    outputs: str

    def fingerprint(self, ctx: BuildContext) -> str | None:
        """The key of the stage's output, when it has one."""

    def decide(self, ctx: BuildContext, earlier: Mapping[str, Decision]) -> Decision:
        """Run or skip, and why (``earlier``: the decisions of the stages before, by name)."""

    def run(self, ctx: BuildContext, decision: Decision, progress: Progress) -> None:
        """Produce the stage's outputs."""

    def adopt(self, ctx: BuildContext, decision: Decision) -> None:
        """Take up the outputs that already exist (the stage was skipped)."""


def _being_built(ctx: BuildContext, store: str, key: str) -> str:
    """What a plan adds to a miss that another process is building now."""
    if ctx.cache is None or not ctx.cache.stores[store].is_being_built(key):
        return ""
    return "; another process is building it now: this build will wait and reuse it"


def _on_remote(ctx: BuildContext, store: str, key: str) -> str:
    """What a plan adds to a local miss about the remote tier: whether the entry will be pulled from it."""
    if ctx.remote is None:
        return ""
    found, unasked = _remote_has(ctx.remote, store, key)
    if unasked is not None:
        return f"; the remote cache could not be asked ({unasked})"
    return f"; {ctx.remote.url} has it: it will be pulled" if found else f"; not on {ctx.remote.url} either"


def _remote_has(remote: RemoteTier, store: str, key: str) -> tuple[bool, str | None]:
    """Whether ``remote`` has the entry, and why it could not be asked (None when it was); a required remote that
    cannot be asked raises, as the build would."""
    try:
        return remote.has(store, key), None
    except RemoteUnavailableError as exc:
        if remote.required:
            remote.failed(exc)  # raises
        return False, str(exc)


def _refuse_read_only(ctx: BuildContext, store: str, key: str) -> None:
    """Refuse, when it is planned (a dry run too), to build ``key`` of ``store`` into a cache this user cannot write,
    in the words the build would be refused in (``ContentStore.get_or_build``)."""
    if ctx.cache is not None:
        content = ctx.cache.stores[store]
        content.require_writable(f"{content.label} {key[:12]} cannot be built into the cache")
        return
    require_creatable(ctx.cache_root)  # no cache yet


def _transfer_progress(store: ContentStore, progress: Progress) -> Callable[[str, int, int], None]:
    """The stage's progress told of a remote transfer: one message per direction, the bar at the bytes moved."""
    url = store.remote.url if store.remote is not None else ""

    def told(verb: str, done: int, total: int) -> None:
        where = "from" if verb == "pull" else "to"
        progress(f"{verb}ing {store.label} {where} {url} ({format_bytes(total)})", done / total if total else 1.0)

    return told


def _engine_available(ctx: BuildContext) -> str | None:
    """Where the engine of this build already is without building: ``in the cache``, ``on <remote>``; else None."""
    if ctx.cache is not None and ctx.cache.entries.lookup(ctx.engine_key, ctx.material, record=False).hit:
        return "in the cache"
    if ctx.remote is None or not _remote_has(ctx.remote, "entries", ctx.engine_key)[0]:
        return None
    return f"on {ctx.remote.url}"


def _lookup(ctx: BuildContext, store: str, key: str, material: dict | None = None) -> LookupResult | None:
    """The local cache's answer for ``key`` (not counted in its statistics); None when there is no cache yet (a
    dry run creates none)."""
    return None if ctx.cache is None else ctx.cache.stores[store].lookup(key, material, record=False)


MISS_FIELDS_NAMED = 3  # a new key that differs from its nearest entry in more fields is just "new"


def _miss(lookup: LookupResult | None, ctx: BuildContext, store: str, material: dict | None) -> str:
    """Why a lookup missed; for a new key, the nearest entry and the fields of the key material that differ from its
    (``toolchain.kiln_sources`` after an upgrade of Kiln), as ``kiln cache explain`` says them."""
    if lookup is None:
        return "new: the cache is empty"
    if lookup.reason != "new" or material is None:
        return lookup.reason
    key, fields = nearest_entry(ctx.cache.stores[store], material)
    if key is None or not fields or len(fields) > MISS_FIELDS_NAMED:
        return "new"
    return f"new: entry {key[:12]} differs in {', '.join(fields)}"


def _require_model_unchanged(ctx: BuildContext, built: str) -> None:
    """Refuse what was just built from the model folder when a file of it changed since the keys were taken: its key
    would name other files than it holds (a chat template edited during calibration, then served for the original
    folder's key, to a remote cache's peers too). Run inside the store's fill, so nothing of it is left."""
    if changed := ctx.checkpoint_state.changed_files():
        raise KilnError(f"the model folder {ctx.model_dir} changed while {built} was built ({', '.join(changed)}): "
                        f"nothing was cached; build again")


def _no_model(ctx: BuildContext) -> str | None:
    path = ctx.config.model.path
    return None if ctx.model_dir else f"model files not found, or refused (above), for model.path {path}"


class QuantizeStage:
    """Calibrate, gate and export the checkpoint (content-addressed in the cache's ``quantized/`` part).

    ``defer_to_engine``: when the engine the checkpoint feeds is in the cache or on the remote, skip for now, not
    looking the checkpoint up (the engine's hit saves its calibration); the build stage fetches the checkpoint only
    if it has to build the engine after all."""

    name = "quantize"
    inputs = ("hash of what calibration reads of the checkpoint (not its chat templates nor generation config)",
              "quantize recipe (incl. calibration data hashes)", "calibration device")
    outputs = "v1/quantized/<key>/checkpoint (hf/, trtllm/, calibration report)"

    def __init__(self, defer_to_engine: bool = False) -> None:
        self.defer_to_engine = defer_to_engine

    def fingerprint(self, ctx: BuildContext) -> str | None:
        return ctx.quantized_key

    def decide(self, ctx: BuildContext, earlier: Mapping[str, Decision]) -> Decision:
        decision = self._decide(ctx)
        if decision.action == "run" and ctx.quantized_key is not None:
            _refuse_read_only(ctx, "quantized", ctx.quantized_key)
        return decision

    def _decide(self, ctx: BuildContext) -> Decision:
        fmt = ctx.config.quantize.format
        if fmt == "none":
            return Decision(self.name, "skip", "format none: the checkpoint is used as it is")
        if missing := _no_model(ctx):
            return Decision(self.name, "run", f"{missing}; nothing to look up")
        if ctx.force:
            return Decision(self.name, "run", "--force")
        lookup = _lookup(ctx, "quantized", ctx.quantized_key)
        held = None
        if lookup is not None and lookup.hit:
            shipped = ((lookup.manifest or {}).get("describe") or {}).get("format", fmt)  # a fallback's, maybe
            held = (f"{shipped} checkpoint {ctx.quantized_key[:12]} is in the cache"
                    f"{f' (fell back from {fmt})' if shipped != fmt else ''}")
        if self.defer_to_engine and (where := _engine_available(ctx)):
            reason = (f"{held}, not needed: the engine it feeds is {where}; it is used only if the engine has to be "
                      f"built" if held else f"no {fmt} checkpoint here, but the engine it feeds is {where}: it is "
                      f"fetched only if the engine has to be built")
            return Decision(self.name, "skip", reason, extra={"deferred": True})
        if held:
            return Decision(self.name, "skip", held, lookup)
        return Decision(self.name, "run", f"no {fmt} checkpoint for this model and recipe "
                        f"({_miss(lookup, ctx, 'quantized', ctx.quantized_material())})"
                        f"{_on_remote(ctx, 'quantized', ctx.quantized_key)}"
                        f"{_being_built(ctx, 'quantized', ctx.quantized_key)}")

    def run(self, ctx: BuildContext, decision: Decision, progress: Progress) -> None:
        from kiln.calibration.quantize import quantize_checkpoint

        material = ctx.quantized_material()
        describe = {"model": ctx.model_name, "format": ctx.config.quantize.format,
                    "kv_cache_dtype": ctx.config.quantize.kv_cache_dtype, "backend": None, "gpu": None}

        def build(tmp: Path) -> dict:
            report = quantize_checkpoint(ctx.model_dir, ctx.config.quantize, tmp, device=ctx.choice.device,
                                         dtype=ctx.calibration_dtype, progress=progress)
            describe["format"] = report["format"]  # a fallback's, where the gate sent the chain on
            describe["kv_cache_dtype"] = report["kv_cache_dtype"]  # auto where it fell back to none
            _require_model_unchanged(ctx, "the quantized checkpoint")
            return {"calibration": report_summary(report)}

        result = ctx.cache.quantized.get_or_build(ctx.quantized_key, material, build, force=ctx.force,
                                                   describe=describe, on_wait=lambda msg: progress(msg, 0.0),
                                                   on_transfer=_transfer_progress(ctx.cache.quantized, progress))
        ctx.seconds_saved += result.build_seconds if result.hit else 0.0
        ctx.use_quantized(QuantizedCheckpoint(result.payload_dir), result.build_seconds)

    def adopt(self, ctx: BuildContext, decision: Decision) -> None:
        if ctx.config.quantize.format == "none":
            ctx.checkpoint_dir = ctx.model_dir
            return
        if decision.extra.get("deferred"):
            ctx.fetch_checkpoint = lambda progress: self.run(ctx, decision, progress)
            return
        store = ctx.cache.quantized
        lookup = store.record_hit(decision.hit, ctx.quantized_key)
        ctx.seconds_saved += lookup.build_seconds if lookup.hit else 0.0
        ctx.use_quantized(QuantizedCheckpoint(store.payload_dir(ctx.quantized_key)), lookup.build_seconds)


class BuildStage:
    """Build the engine from the (quantized) checkpoint into a temporary folder of the cache."""

    name = "build"
    inputs = ("engine key material: checkpoint, recipe, semantic build options, backend, toolchain, hardware",)
    outputs = "v1/tmp/<build> (the engine directory, not yet visible)"

    def fingerprint(self, ctx: BuildContext) -> str | None:
        return ctx.engine_key

    def decide(self, ctx: BuildContext, earlier: Mapping[str, Decision]) -> Decision:
        decision = self._decide(ctx)
        if decision.action == "run" and ctx.engine_key is not None:
            _refuse_read_only(ctx, "entries", ctx.engine_key)
        if ctx.choice.backend == "trtllm":
            decision.extra.update(trtllm_plan_extra(ctx))  # the exact argv; raises when preflight refuses
        return decision

    def _decide(self, ctx: BuildContext) -> Decision:
        if missing := _no_model(ctx):
            return Decision(self.name, "run", f"{missing}; the engine key cannot be computed")
        if ctx.force:
            return Decision(self.name, "run", "--force")
        lookup = _lookup(ctx, "entries", ctx.engine_key, ctx.material)
        if lookup is not None and lookup.hit:
            return Decision(self.name, "skip", f"engine {ctx.engine_key[:12]} is in the cache", lookup)
        return Decision(self.name, "run", f"cache miss ({_miss(lookup, ctx, 'entries', ctx.material)})"
                        f"{_on_remote(ctx, 'entries', ctx.engine_key)}"
                        f"{_being_built(ctx, 'entries', ctx.engine_key)}")

    def run(self, ctx: BuildContext, decision: Decision, progress: Progress) -> None:
        trtllm = ctx.choice.backend == "trtllm"
        build = self._trtllm_build(ctx, progress) if trtllm else self._native_build(ctx, progress)
        # ``prepare`` sets the format once the checkpoint is there (a deferred quantize stage may run in it)
        hardware = ctx.material["hardware"]
        devices = hardware["tp_size"] * hardware["pp_size"]  # the devices one engine runs on: "NVIDIA H200 x2"
        described_format, described_kv = _described_quantization(ctx)
        describe = {"model": ctx.model_name, "format": described_format,
                    "kv_cache_dtype": described_kv, "backend": ctx.choice.backend,
                    "gpu": (hardware["gpu_name"] or "cpu") + (f" x{devices}" if devices > 1 else "")}
        result = ctx.cache.entries.get_or_build(ctx.engine_key, ctx.material, self._holding_checkpoint(ctx, build),
                                                 force=ctx.force, describe=describe,
                                                 on_wait=lambda msg: progress(msg, 0.0),
                                                 on_transfer=_transfer_progress(ctx.cache.entries, progress),
                                                 prepare=self._checkpoint_ready(ctx, describe, progress), hold=True)
        ctx.engine_hold = result.hold  # from before its publish: no process's eviction takes it before the smoke load
        ctx.engine_dir, ctx.cache_hit, ctx.cache_reason = result.payload_dir, result.hit, result.reason
        if result.pulled:
            ctx.cache_reason = f"pulled from the remote cache {ctx.cache.entries.remote.url}"
        elif result.hit and result.waited:
            ctx.cache_reason = "built by another process while this one waited"
        ctx.build_seconds = result.build_seconds
        if result.hit:
            ctx.count_engine_hit(result.build_seconds)
        ctx.take_calibration_from(ctx.cache.entries.read_manifest(ctx.engine_key) if result.hit else None)
        if result.replaced_in_use:
            warn(f"engine {ctx.engine_key[:12]} was in use by a running process (a kiln serve?) when --force "
                 f"replaced it: that process keeps serving the old build until it is restarted")

    @staticmethod
    def _checkpoint_ready(ctx: BuildContext, describe: dict, progress: Progress) -> Callable[[], float]:
        """What the store runs once the engine has to be built: fetch the checkpoint (a deferred quantize stage runs
        now), describe what it ships, and return its calibration's seconds, which the engine's build time includes
        (so a hit of the engine saves them, wherever the checkpoint came from)."""

        def ready() -> float:
            ctx.ensure_checkpoint(progress)
            describe["format"], describe["kv_cache_dtype"] = _described_quantization(ctx)
            return ctx.quantize_seconds

        return ready

    @staticmethod
    def _holding_checkpoint(ctx: BuildContext, build: Callable[[Path], dict]) -> Callable[[Path], dict]:
        """``build``, holding the checkpoint while it is read (a quantized checkpoint of the cache is kept from being
        evicted by any process meanwhile), then the engine's tokenizer written from the model folder, which the
        builders take the tokenizer, chat templates and generation config from (a quantized checkpoint's key does
        not cover the templates and generation config); refused if the model folder changed meanwhile."""

        def build_from_checkpoint(tmp: Path) -> dict:
            quantized = ctx.quantized_key and ctx.checkpoint_dir != ctx.model_dir
            with EntryHold(ctx.cache.quantized.entry_dir(ctx.quantized_key)) if quantized else nullcontext():
                record = build(tmp)
                write_transformers_tokenizer(ctx.model_dir, tmp)
                if partial := partial_tokenizer_files(tmp):  # LLM.load refuses an engine with part of a tokenizer
                    raise KilnError(f"{ctx.model_dir}: {', '.join(partial)} but no tokenizer.json, and "
                                    f"transformers makes none from them; save the tokenizer with save_pretrained (a "
                                    f"fast one writes tokenizer.json)")
                _require_model_unchanged(ctx, "the engine")
                return record

        return build_from_checkpoint

    @staticmethod
    def _native_build(ctx: BuildContext, progress: Progress) -> Callable[[Path], dict]:
        """The native backend's build into a temporary folder; returns its build record."""
        from kiln.engines.native.builder import build_native_engine

        cfg = ctx.config
        plan = cfg.build.plan(_kv_dtype(ctx))

        def build(tmp: Path) -> dict:
            progress("building native engine", 0.0)
            engine = build_native_engine(ctx.checkpoint_dir, tmp, plan, cfg.model.dtype, device=ctx.choice.device,
                                         options=ctx.options, tp_size=cfg.build.tp_size, tokenizer_dir=ctx.model_dir)
            return {"engine": {"format": engine["format"], "quantization": engine["quantization"]},
                    "calibration": report_summary(ctx.calibration) if ctx.calibration else None}

        return build

    @staticmethod
    def _trtllm_build(ctx: BuildContext, progress: Progress) -> Callable[[Path], dict]:
        """The TensorRT-LLM build (checkpoint conversion when needed, then trtllm-build); returns its build record."""
        from kiln.engines.trtllm.builder import build_trtllm_engine

        def build(tmp: Path) -> dict:
            inputs = trtllm_inputs(ctx)  # after the checkpoint is there (its shipped format)
            progress("running trtllm-build", 0.0)
            record = build_trtllm_engine(tmp, timeout_s=ctx.config.build.timeout_s, tokenizer_dir=ctx.model_dir,
                                         **inputs)
            return {"engine": {"format": TRTLLM_ENGINE_FORMAT, "quantization": {"format": inputs["quant_format"]}},
                    "trtllm": record, "calibration": report_summary(ctx.calibration) if ctx.calibration else None}

        return build

    def adopt(self, ctx: BuildContext, decision: Decision) -> None:
        store = ctx.cache.entries
        held = store.hold(ctx.engine_key)  # before its use is recorded: no eviction takes it before the smoke load
        lookup = store.record_hit(decision.hit, ctx.engine_key, ctx.material) \
            if held is not None or store.read_only is not None else None
        if lookup is None or not lookup.hit:  # vanished since the plan was made: build after all
            if held is not None:
                held.release()
            self.run(ctx, decision, lambda *_: None)
            return
        ctx.engine_hold = held
        ctx.engine_dir, ctx.cache_hit, ctx.cache_reason = store.payload_dir(ctx.engine_key), True, "hit"
        ctx.build_seconds = lookup.build_seconds
        ctx.count_engine_hit(lookup.build_seconds)
        ctx.take_calibration_from(lookup.manifest)


class PublishStage:
    """Make the new engine visible under its final path: the store's fsync-manifest-rename, checked here."""

    name = "publish"
    inputs = ("the built engine directory",)
    outputs = "v1/entries/<key>/ (manifest last, one rename)"

    def fingerprint(self, ctx: BuildContext) -> str | None:
        return ctx.engine_key

    def decide(self, ctx: BuildContext, earlier: Mapping[str, Decision]) -> Decision:
        if earlier["build"].action == "skip":
            return Decision(self.name, "skip", "the engine is already published in the cache")
        return Decision(self.name, "run", "publish the new engine atomically (manifest last, one rename)")

    def run(self, ctx: BuildContext, decision: Decision, progress: Progress) -> None:
        ctx.cache.entries.read_manifest(ctx.engine_key)  # raises when the entry is not published whole

    def adopt(self, ctx: BuildContext, decision: Decision) -> None:
        return None


def not_loaded_here(ctx: BuildContext) -> str | None:
    """Why Kiln's runtime does not load the engine this build makes (a TensorRT-LLM engine of several ranks, which
    it builds for trtllm-serve), or None."""
    why = ranks_not_loaded(ctx.config.build.tp_size, ctx.config.build.pp_size)
    return f"built here, not loaded: {why}" if ctx.choice.backend == "trtllm" and why else None


class SmokeStage:
    """Load the engine through ``runtime`` (timing the load) and generate a few tokens."""

    name = "smoke"
    inputs = ("the published engine",)
    outputs = "load latency (recorded in the cache stats) and a sample generation"

    def fingerprint(self, ctx: BuildContext) -> str | None:
        return None

    def decide(self, ctx: BuildContext, earlier: Mapping[str, Decision]) -> Decision:
        if (why := not_loaded_here(ctx)) is not None:
            return Decision(self.name, "skip", why)
        return Decision(self.name, "run", "always: loads the engine and generates a few tokens")

    def run(self, ctx: BuildContext, decision: Decision, progress: Progress) -> None:
        from kiln.runtime import LLM, SamplingParams

        smoke = ctx.config.smoke
        progress("loading engine", 0.0)
        llm = LLM.load(ctx.engine_dir, ctx.load_options)  # holds the cache entry until closed
        ctx.load_ms = llm.load_ms
        ctx.cache.record_load(ctx.engine_key, ctx.load_ms)
        try:
            progress("generating", 0.5)
            out = llm.generate([smoke.prompt], SamplingParams(max_tokens=smoke.max_tokens, temperature=0.0))[0]
        finally:
            llm.close()
        ctx.sample = {"prompt": smoke.prompt, "text": out.text, "tokens": len(out.token_ids)}

    def adopt(self, ctx: BuildContext, decision: Decision) -> None:
        return None


BUILD_STAGES: tuple[Stage, ...] = (QuantizeStage(defer_to_engine=True), BuildStage(), PublishStage())
SMOKE_STAGE: Stage = SmokeStage()


def trtllm_inputs(ctx: BuildContext) -> dict:
    """The TensorRT-LLM builder's inputs: options from the config, the checkpoints, the timing cache."""
    from kiln.engines.trtllm.command import timing_cache_path
    from kiln.runtime.trtllm.toolchain import trtllm_machine_fingerprint

    cfg = ctx.config
    fingerprint = trtllm_machine_fingerprint()
    quant_format = _shipped_format(ctx)
    hf_dir, trtllm_checkpoint = ctx.model_dir, None
    if quant_format != "none":
        hf_dir = None
        if ctx.quantized_key:  # where the quantize stage puts it (a dry run shows where it will be)
            quantized = QuantizedCheckpoint(payload_path(ctx.cache_root, "quantized", ctx.quantized_key))
            hf_dir, trtllm_checkpoint = quantized.hf, quantized.trtllm
    kv_cache_dtype = _shipped_kv_cache_dtype(ctx)  # the plan's too: auto after a fallback to format none
    return {"options": trtllm_build_options(cfg.build, cfg.build.plan(kv_cache_dtype)), "quant_format": quant_format,
            "kv_cache_dtype": kv_cache_dtype, "model_dtype": cfg.model.dtype, "fingerprint": fingerprint,
            "timing_cache": timing_cache_path(ctx.cache_root, fingerprint), "hf_dir": hf_dir,
            "trtllm_checkpoint_dir": trtllm_checkpoint}


def trtllm_build_options(build: BuildSection, plan: BuildPlan) -> TrtllmBuildOptions:
    """The TensorRT-LLM builder's options of a ``build`` section, for ``plan``."""
    from kiln.engines.trtllm.options import TrtllmBuildOptions

    return TrtllmBuildOptions(plan=plan, tp_size=build.tp_size, pp_size=build.pp_size, workers=build.workers,
                              log_level=build.log_level, **build.trtllm.model_dump())


def trtllm_plan_extra(ctx: BuildContext) -> dict:
    """Dry-run fields of the build stage (the exact trtllm-build argv); raises TrtllmPreflightError when refused."""
    from kiln.engines.trtllm.builder import plan_trtllm_build

    inputs = trtllm_inputs(ctx)
    plan = plan_trtllm_build(inputs.pop("options"), **inputs)
    return {k: v for k, v in plan.items() if v is not None}


def _kv_dtype(ctx: BuildContext) -> str:
    """fp8 when the recipe calibrates an FP8 KV cache (and the format shipped is calibrated); for a checkpoint built
    as it is (format none), whatever it carries (FP8 when it has KV scales, as modelopt exports them); else the
    model dtype."""
    if _shipped_kv_cache_dtype(ctx) == "fp8":
        return "fp8"
    return "auto" if ctx.config.quantize.format == "none" else ctx.config.model.dtype


def _shipped_format(ctx: BuildContext) -> str:
    return (ctx.calibration or {}).get("format", ctx.config.quantize.format)


def _described_quantization(ctx: BuildContext) -> tuple[str, str]:
    """The format and KV cache dtype an engine entry is described by (``kiln cache ls``): what the recipe shipped,
    or for a checkpoint built as it is (format none), what it declares: a modelopt FP8 export is an FP8 engine."""
    shipped = _shipped_format(ctx), _shipped_kv_cache_dtype(ctx)
    if ctx.config.quantize.format != "none" or ctx.checkpoint_dir is None:
        return shipped
    from kiln.engines.native.checkpoint import read_json, read_quantization

    try:
        declared = read_quantization(ctx.checkpoint_dir, read_json(ctx.checkpoint_dir / "config.json"))
    except KilnError:  # a quantization the native builder refuses: the build names it, not the description
        return shipped
    return declared.format, "fp8" if declared.fp8_kv_cache else "auto"


def _shipped_kv_cache_dtype(ctx: BuildContext) -> str:
    """The recipe's KV cache dtype, unless the gate fell back to format none, which has no KV scales (as the
    calibration report records it)."""
    return "auto" if _shipped_format(ctx) == "none" else ctx.config.quantize.kv_cache_dtype


def report_summary(report: dict) -> dict:
    """The part of a calibration report that belongs in build records and summaries (``kiln build --json``'s
    ``quantization``): what shipped, and why (``reason`` and ``summary`` name each format a fallback passed over)."""
    keys = ("format", "converged", "gate", "fallback_from", "reason", "summary", "samples_used", "unsettled")
    return {k: report.get(k) for k in keys}
