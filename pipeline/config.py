"""The Kiln config file: schema (pydantic, strict), loading, and errors that name file, line and field."""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from kiln.calibration.recipe import QuantizeRecipe
from kiln.calibration.sources import RANDOM
from kiln.engines.cache.engine_cache import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_SIZE_BYTES
from kiln.engines.cache.errors import CacheRootError
from kiln.engines.cache.remote.spec import RemoteSpec, endpoint_problem, url_problem
from kiln.engines.cache.store import VerifyOnLoad
from kiln.engines.trtllm.options import GEMM_PLUGINS, KV_CACHE_TYPES, LOG_LEVELS, PLUGIN_DTYPES
from kiln.pipeline.vllm_names import kiln_setting_for
from kiln.pipeline.yaml_source import ConfigError, line_of, load_yaml_with_lines
from kiln.runtime.plan import BuildPlan, PlanError
from kiln.runtime.server_defaults import DEFAULT_HOST, DEFAULT_MAX_QUEUE, DEFAULT_PORT

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the kiln package: a checkout's root, or site-packages/kiln
CONFIGS_DIR = PACKAGE_DIR / "configs"  # bundled configs; architecture files under models/
DEFAULT_CACHE_DIR = "~/.cache/kiln"
UNCALIBRATED_FIELDS = ("format", "kv_cache_dtype", "fallback")  # the quantize fields a format none build reads
_HOST_LABEL = re.compile(r"(?!-)[a-z\d-]{1,63}(?<!-)", re.IGNORECASE)  # botocore's rule for an endpoint's host


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelSection(_Section):
    """Where the checkpoint comes from and the dtype the engine computes in."""

    path: str = Field(description="A local directory (relative to the config file) or a Hugging Face model id.")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    revision: str | None = Field(None, description="Hub revision when path is a model id.")
    allow_download: bool = Field(False, description="Fetch from the hub when the model is not on disk.")

    @model_validator(mode="after")
    def _path_and_its_revision(self) -> ModelSection:
        if not self.path.strip():
            raise ValueError("model.path is empty: give the checkpoint's folder or a Hugging Face model id")
        if self.revision is not None and is_local_path(self.path):
            raise ValueError(f"model.revision ({self.revision}) picks a revision on the Hugging Face hub, and "
                             f"model.path is the local folder {self.path}; remove revision, or give a model id")
        return self


class TrtllmSection(_Section):
    """TensorRT-LLM engine features (backend trtllm). The defaults are what in-flight batching with KV block reuse
    needs; turning one off is refused before any build, saying why."""

    kv_cache_type: Literal[KV_CACHE_TYPES] = "paged"
    remove_input_padding: bool = True
    gpt_attention_plugin: Literal[PLUGIN_DTYPES] = "auto"
    gemm_plugin: Literal[GEMM_PLUGINS] | None = Field(
        None, description="None: chosen from quantize.format (auto; FP8: disable, or fp8 for max_batch_size <= 4).")
    context_fmha: bool = True
    use_paged_context_fmha: bool = True


TRTLLM_ONLY = ("workers", "timeout_s", "log_level", "trtllm")  # the build fields the native backend does not use


class BuildSection(_Section):
    """Engine build plan. Only the semantic fields enter the engine cache key."""

    backend: Literal["auto", "native", "trtllm"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: PositiveInt = 8
    max_input_len: PositiveInt = 1024
    max_seq_len: PositiveInt = 2048
    max_num_tokens: PositiveInt = 2048
    tokens_per_block: PositiveInt = 32
    tp_size: PositiveInt = 1
    pp_size: PositiveInt = 1
    workers: PositiveInt = Field(1, description="Parallel build workers (not part of the cache key).")
    timeout_s: PositiveInt = Field(7200, description="Build timeout in seconds (not part of the cache key).")
    log_level: Literal[LOG_LEVELS] = "info"
    trtllm: TrtllmSection = Field(default_factory=TrtllmSection)

    @model_validator(mode="after")
    def _check_plan(self) -> BuildSection:
        if "max_input_len" not in self.model_fields_set and self.max_input_len > self.max_seq_len:
            self.max_input_len = max(1, self.max_seq_len // 2)  # a max_seq_len below the default's: half of it
        self.plan()  # the plan's own checks (PlanError is a ValueError: pydantic names the file, line and field)
        if self.max_num_tokens < self.max_batch_size:  # a new plan only: engines built before still load and run
            raise ValueError(f"build.max_num_tokens ({self.max_num_tokens}) must be at least build.max_batch_size "
                             f"({self.max_batch_size}): a step decodes one token for every sequence in flight, so "
                             "the rest of the batch could never run (vLLM refuses it too)")
        if "tokens_per_block" in self.model_fields_set and self.tokens_per_block > self.max_seq_len:
            raise ValueError(_block_problem(self.tokens_per_block, f"build.max_seq_len ({self.max_seq_len})"))
        if self.backend == "native" and (unused := self.trtllm_settings()):
            raise ValueError(f"{', '.join(unused)}: for the TensorRT-LLM backend only, and build.backend is native; "
                             f"remove {'it' if len(unused) == 1 else 'them'}, or set build.backend to trtllm or auto")
        return self

    def trtllm_settings(self) -> list[str]:
        """The settings given here that only the TensorRT-LLM backend uses (the native build has no workers, timeout,
        log level or plugins)."""
        named = [f"build.{name}" for name in TRTLLM_ONLY if name != "trtllm" and name in self.model_fields_set]
        if "trtllm" in self.model_fields_set:
            named += [f"build.trtllm.{name}" for name in self.trtllm.model_fields_set] or ["build.trtllm"]
        return named

    def plan(self, kv_cache_dtype: str = "auto") -> BuildPlan:
        """The build plan of these limits, with the KV cache dtype the quantize stage asks for."""
        return BuildPlan(max_batch_size=self.max_batch_size, max_input_len=self.max_input_len,
                         max_seq_len=self.max_seq_len, max_num_tokens=self.max_num_tokens,
                         tokens_per_block=self.tokens_per_block, kv_cache_dtype=kv_cache_dtype)

    def fitted_to_model(self, max_position_embeddings: int) -> BuildSection:
        """These limits, with those the config leaves to their defaults fitted to the model: ``max_seq_len`` at most
        its ``max_position_embeddings``, and ``max_input_len`` at most half of a ``max_seq_len`` so lowered. PlanError
        when a ``max_input_len`` the config sets, or ``tokens_per_block``, does not fit the lowered ``max_seq_len``."""
        if "max_seq_len" in self.model_fields_set or self.max_seq_len <= max_position_embeddings:
            return self
        if "tokens_per_block" in self.model_fields_set and self.tokens_per_block > max_position_embeddings:
            fitted_len = f"build.max_seq_len, fitted to the model's max_position_embeddings ({max_position_embeddings})"
            raise PlanError(_block_problem(self.tokens_per_block, fitted_len))
        fitted = {"max_seq_len": max_position_embeddings}
        if "max_input_len" not in self.model_fields_set:
            fitted["max_input_len"] = min(self.max_input_len, max(1, max_position_embeddings // 2))
        elif self.max_input_len > max_position_embeddings:
            raise PlanError(f"build.max_input_len ({self.max_input_len}) must not exceed build.max_seq_len, fitted to "
                            f"the model's max_position_embeddings ({max_position_embeddings}); lower max_input_len")
        return self.model_copy(update=fitted)  # the plan's checks hold: only max_seq_len and max_input_len went down

    def semantic(self, backend: str) -> dict:
        """The fields that change what the engine computes or how it is laid out (the cache key's part)."""
        excluded = {"backend", "device", "workers", "timeout_s", "log_level"}
        return self.model_dump(exclude=excluded if backend == "trtllm" else excluded | {"trtllm"})


def _block_problem(tokens_per_block: int, max_seq_len: str) -> str:
    """Why a KV block of ``tokens_per_block`` tokens is larger than the longest sequence, ``max_seq_len``."""
    return (f"build.tokens_per_block ({tokens_per_block}) must not exceed {max_seq_len}: no sequence fills a block, so "
            "most of the KV cache would go unused and prefix caching, which shares full blocks, could never hit; "
            "lower tokens_per_block")


class CacheSection(_Section):
    """The engine cache; ``$KILN_CACHE`` overrides ``dir`` and ``$KILN_CACHE_REMOTE`` overrides ``remote``."""

    dir: str = DEFAULT_CACHE_DIR
    max_size_gb: float = Field(DEFAULT_MAX_SIZE_BYTES / 10**9, gt=0)
    max_entries: PositiveInt = DEFAULT_MAX_ENTRIES
    verify_on_load: VerifyOnLoad = Field(
        "changed", description="How a cache hit's files are checked against its manifest: size (sizes only), "
        "changed (sha256 of each file changed since it was last hashed, else a stat) or hash (sha256 every time).")
    remote: str | None = Field(
        None, description="A team's shared tier: s3://bucket/prefix (credentials from the AWS chain) or "
        "file:///shared/folder. Local misses are pulled from it and new builds pushed to it.")
    remote_endpoint: str | None = Field(
        None, description="The http(s)://host:port of an S3-compatible service other than AWS (MinIO, Ceph, R2); "
        "default: the AWS chain's (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL).")
    remote_required: bool = Field(
        False, description="An unreachable remote fails the build; by default it warns and builds locally.")

    @field_validator("dir")
    @classmethod
    def _dir_not_empty(cls, folder: str) -> str:
        if not folder.strip():
            raise ValueError(f"cache.dir is empty; give the cache's folder, or leave it out for {DEFAULT_CACHE_DIR}")
        return folder

    @field_validator("remote")
    @classmethod
    def _remote_url(cls, url: str | None) -> str | None:
        if url is not None and (problem := url_problem(url)):
            raise ValueError(problem)
        return url

    @field_validator("remote_endpoint")
    @classmethod
    def _remote_endpoint(cls, endpoint: str | None) -> str | None:
        if problem := endpoint_problem(endpoint) or _address_problem(endpoint):
            raise ValueError(problem)
        return endpoint

    @model_validator(mode="after")
    def _endpoint_of_an_s3_remote(self) -> CacheSection:
        if self.remote_endpoint is not None and self.remote is not None and not self.remote.startswith("s3://"):
            raise ValueError(f"cache.remote_endpoint names an S3-compatible service, which the file remote "
                             f"{self.remote!r} does not use; leave it out, or give an s3://bucket/prefix remote")
        return self

    def root(self) -> Path:
        """The cache root in force: ``$KILN_CACHE`` when set, else ``dir``."""
        return cache_root(self.dir)

    def remote_spec(self) -> RemoteSpec | None:
        """The remote tier in force: ``$KILN_CACHE_REMOTE`` when set, else ``remote`` (None: local only)."""
        return remote_spec(self.remote, self.remote_endpoint, self.remote_required)


def _address_problem(endpoint: str | None) -> str | None:
    """Why the host or port of an http(s) ``endpoint`` (one ``endpoint_problem`` passed: no credentials) cannot be
    connected to, which botocore would say only when the remote is used; None when they can."""
    if endpoint is None:
        return None
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:  # out of range, or not a number
        port = 0
    if port is not None and not 1 <= port <= 65535:
        return f"cache.remote_endpoint {endpoint!r}: the port must be a number from 1 to 65535"
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        labels = host.removesuffix(".").split(".")
        if any(char.isspace() for char in endpoint) or not all(_HOST_LABEL.fullmatch(label) for label in labels):
            return (f"cache.remote_endpoint {endpoint!r}: {host!r} is not a host name (dot-separated letters, digits "
                    "and hyphens) or an IP address")
    return None


class ServeSection(_Section):
    """The OpenAI-compatible server."""

    host: str = DEFAULT_HOST
    port: int = Field(DEFAULT_PORT, ge=1, le=65535)
    api_key: str | None = None
    max_queue: PositiveInt = DEFAULT_MAX_QUEUE

    @field_validator("api_key")
    @classmethod
    def _api_key_not_blank(cls, key: str | None) -> str | None:
        if key is not None and not key.strip():
            raise ValueError("the API key is blank; give the key clients must send, or leave it out (null) to serve "
                             "without one")
        return key


class SmokeSection(_Section):
    """What the smoke stage generates after loading the engine."""

    prompt: str = Field("Once upon a time", min_length=1)
    max_tokens: PositiveInt = 16


class KilnConfig(_Section):
    """A whole Kiln config file."""

    model: ModelSection
    quantize: QuantizeRecipe = Field(default_factory=QuantizeRecipe)
    build: BuildSection = Field(default_factory=BuildSection)
    cache: CacheSection = Field(default_factory=CacheSection)
    serve: ServeSection = Field(default_factory=ServeSection)
    smoke: SmokeSection = Field(default_factory=SmokeSection)

    @model_validator(mode="after")
    def _check_across_fields(self) -> KilnConfig:
        if problem := _quantize_problem(self.quantize) or self.smoke_problem():
            raise ValueError(problem)
        return self

    def smoke_problem(self, prompt_tokens: int | None = None) -> str | None:
        """Why the smoke request (``smoke.prompt`` of ``prompt_tokens`` tokens, None: not counted, at least one; then
        ``smoke.max_tokens`` new ones) does not fit the build plan, naming the field first; None when it fits."""
        smoke, build = self.smoke, self.build
        if prompt_tokens == 0:
            return "smoke.prompt encodes to no tokens; give the smoke stage some text to generate from"
        if prompt_tokens is not None and prompt_tokens > build.max_input_len:
            return (f"smoke.prompt is {prompt_tokens} tokens, more than build.max_input_len ({build.max_input_len}); "
                    "shorten it")
        total = smoke.max_tokens + (prompt_tokens or 1)
        if total > build.max_seq_len:
            prompt = f"the smoke.prompt's {prompt_tokens} tokens" if prompt_tokens else "at least one prompt token"
            limit = (f"{build.max_seq_len}" if "max_seq_len" in build.model_fields_set
                     else f"{build.max_seq_len} by default, or the model's positions where fewer")
            return (f"smoke.max_tokens ({smoke.max_tokens}) + {prompt} = {total} exceeds build.max_seq_len "
                    f"({limit}); lower smoke.max_tokens or raise build.max_seq_len")
        return None


def _quantize_problem(recipe: QuantizeRecipe) -> str | None:
    """What a config's quantize section asks beyond what the recipe checks itself and calibration cannot do: an
    INT4-AWQ algorithm or gate thresholds for a chain that never uses them, calibration settings for format none, a
    sample budget that cannot converge."""
    calibrated = [fmt for fmt in recipe.chain if fmt != "none"]
    if "algorithm" in recipe.model_fields_set and "int4_awq" not in calibrated:
        return (f"quantize.algorithm ({recipe.algorithm}) sets how INT4-AWQ is calibrated, and the formats tried "
                f"({', '.join(recipe.chain)}) have no int4_awq; remove algorithm, or use format int4_awq")
    unused = [f"quantize.{name}" for name in QuantizeRecipe.model_fields
              if name in recipe.model_fields_set and name not in UNCALIBRATED_FIELDS]
    if unused and not calibrated:
        return (f"{', '.join(unused)}: format none is neither calibrated nor gated; remove "
                f"{'it' if len(unused) == 1 else 'them'}, or set a quantized quantize.format")
    if recipe.gate is None and recipe.fallback:
        return (f"quantize.fallback ({', '.join(recipe.fallback)}) is tried when a format fails the accuracy gate, "
                "and gate: null gates nothing; remove one of them")
    if recipe.gate is not None and (unused := [fmt for fmt in recipe.gate.formats_set() if fmt not in calibrated]):
        return (f"quantize.gate.{unused[0]} sets thresholds for a format the chain never tries "
                f"({', '.join(recipe.chain)}); remove it, or add {unused[0]} to quantize.format or quantize.fallback")
    rounds = -(-recipe.num_samples // recipe.round_samples)
    if calibrated and recipe.on_failure == "fail" and rounds <= recipe.patience:
        return (f"quantize.num_samples ({recipe.num_samples}) is {rounds} round{'s' if rounds > 1 else ''} of "
                f"quantize.round_samples ({recipe.round_samples}), and quantize.patience ({recipe.patience}) needs "
                f"at least {recipe.patience + 1} to converge (a change is measured from the second round on); "
                f"raise num_samples to {recipe.round_samples * (recipe.patience + 1)} (whole rounds: a short last "
                f"round adds little evidence), lower patience, or set "
                "on_failure: warn")
    return None


class LoadedConfig(BaseModel):
    """A validated config, where it came from, and the line of each key in it."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    path: Path
    config: KilnConfig
    lines: dict[tuple[str, ...], int] = {}

    def refusal(self, message: str) -> ConfigError:
        """``message``, which names its field first (``smoke.max_tokens (…) …``), as a ConfigError at the line of
        the first field it names that the file sets."""
        line = _mentioned_line(self.lines, message)
        return ConfigError(f"{self.path}:{line}: {message}" if line else f"{self.path}: {message}")

    def fit_to_model(self, max_position_embeddings: int) -> None:
        """Fit the build limits the config leaves out to the model (``BuildSection.fitted_to_model``) and refuse
        calibration rows longer than the model's positions; a ConfigError names file, line and field."""
        try:
            self.config.build = self.config.build.fitted_to_model(max_position_embeddings)
        except PlanError as exc:
            raise self.refusal(str(exc)) from None
        recipe = self.config.quantize
        if recipe.format != "none" and recipe.seq_len > max_position_embeddings:
            raise self.refusal(f"quantize.seq_len ({recipe.seq_len}) exceeds the model's max_position_embeddings "
                               f"({max_position_embeddings}); calibration rows must fit the model: lower seq_len")


def cache_root(configured: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """The engine cache in force: ``$KILN_CACHE`` when set, else ``configured`` (a config's ``cache.dir``); a path
    whose links loop is a CacheRootError naming it."""
    path = Path(os.environ.get("KILN_CACHE") or configured).expanduser()
    try:
        return path.resolve()
    except RuntimeError:  # Python 3.11's "Symlink loop from ..."
        where = "$KILN_CACHE" if os.environ.get("KILN_CACHE") else "cache.dir"
        raise CacheRootError(f"{where} {path}: its symbolic links loop; point it at a folder") from None


def remote_spec(configured: str | None = None, endpoint: str | None = None,
                required: bool = False) -> RemoteSpec | None:
    """The remote tier in force: ``$KILN_CACHE_REMOTE`` when set (an empty value turns the remote off), else
    ``configured``; a bad URL in the environment is a ConfigError naming the variable."""
    url = os.environ.get("KILN_CACHE_REMOTE", configured)
    if url is None and (endpoint is not None or required):  # (an empty $KILN_CACHE_REMOTE turned it off on purpose)
        setting = "remote_required" if required else "remote_endpoint"
        raise ConfigError(f"cache.{setting} is set, but no remote cache is: give cache.remote (or "
                          f"$KILN_CACHE_REMOTE), or leave cache.{setting} out")
    if not url:
        return None
    try:
        return RemoteSpec(url, endpoint, required)
    except ValueError as exc:
        where = "$KILN_CACHE_REMOTE" if "KILN_CACHE_REMOTE" in os.environ else "cache.remote"
        raise ConfigError(f"{where}: {exc}") from None


def remote_turned_off() -> bool:
    """Whether ``$KILN_CACHE_REMOTE`` is set empty: no remote tier, not even the one a cache recorded."""
    return os.environ.get("KILN_CACHE_REMOTE") == ""


def find_config(name_or_path: str | Path) -> Path | None:
    """A config (``.yaml``) or architecture file (``.json``): the path as given, else a bare name
    (``tiny-llama-fp8.yaml``, ``tiny-llama-fp8``, ``llama3-8b``) as a ``.yaml`` in the current folder (a bundled
    config copied here to edit; not a ``.json``, which may be a saved report), then under the bundled ``configs/``
    or ``configs/models/``, else a ``configs/...`` path as the docs write it, in the bundled ``configs/``; None
    when there is no such file."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path.resolve()
    if path.parent != Path("."):
        bundled = PACKAGE_DIR / path
        return bundled if path.parts[0] == "configs" and bundled.is_file() else None
    if local := next((here for suffix in (".yaml", ".yml") if (here := Path(path.name + suffix)).is_file()), None):
        return local.resolve()
    return next((candidate for folder in (CONFIGS_DIR, CONFIGS_DIR / "models")
                 for suffix in ("", ".yaml", ".yml", ".json")
                 if (candidate := folder / f"{path.name}{suffix}").is_file()), None)


def load_config(name_or_path: str | Path) -> LoadedConfig:
    """Read and validate a config (a path, or a name ``find_config`` knows) strictly: a quoted ``'8'`` or ``'yes'``
    is not a number or a boolean. Raise ConfigError naming ``file:line: field`` on the first problem."""
    path = find_config(name_or_path)
    if path is None:
        raise ConfigError(_not_found(Path(name_or_path).expanduser()))
    data, lines = load_yaml_with_lines(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with a 'model' section at the top level")
    if "model" not in data and data.keys() & {"architectures", "model_type"}:
        raise ConfigError(f"{path} is a model's config.json (an architecture file), not a Kiln config: `kiln bench` "
                          f"takes it (random weights); a build takes a YAML config whose model.path is the "
                          f"checkpoint folder that holds it")
    if found := _non_finite(data):
        loc, value = found
        raise ConfigError(f"{path}:{line_of(lines, loc)}: {'.'.join(loc)}: must be a finite number (got {value})")
    _empty_sections_as_defaults(data, KilnConfig)
    _absolutise_paths(data, path.parent)
    try:
        config = KilnConfig.model_validate(data, strict=True)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path, lines)) from None
    return LoadedConfig(path=path, config=config, lines=lines)


def _not_found(given: Path) -> str:
    """Why ``given`` names no config, and what to give instead."""
    if given.is_symlink():
        return f"{_absolute(given)}: a symbolic link that leads to no file (a link loop or a missing target)"
    if given.is_dir():
        return f"{_absolute(given)}: a folder, not a config file; give the config's path (a .yaml file)"
    bundled = sorted(p.stem for p in CONFIGS_DIR.iterdir() if p.suffix in (".yaml", ".yml"))
    guess = difflib.get_close_matches(given.stem, bundled, n=1) if given.parent == Path(".") else []
    hint = (f"did you mean {guess[0]}?" if guess
            else "give a path, or the name of a bundled config such as tiny-llama-fp8")
    return f"{_absolute(given)}: config file not found; {hint}"


def _non_finite(data: Any, loc: tuple[str, ...] = ()) -> tuple[tuple[str, ...], float] | None:
    """The first ``.inf`` or ``.nan`` in a config's data and where it is (no setting takes one)."""
    if isinstance(data, float) and not math.isfinite(data):
        return loc, data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    return next((found for key, value in items if (found := _non_finite(value, (*loc, str(key))))), None)


def _empty_sections_as_defaults(data: dict, model: type[BaseModel]) -> None:
    """Take a section left empty (``build:`` with nothing under it, which YAML reads as null) as ``build: {}``: its
    defaults. A field where null means something (``quantize.gate: null``) is no section and keeps it."""
    for name, value in data.items():
        field = model.model_fields.get(name) if isinstance(name, str) else None
        section = field.annotation if field is not None else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue
        if value is None:
            data[name] = {}
        elif isinstance(value, dict):
            _empty_sections_as_defaults(value, section)


def is_local_path(path: str) -> bool:
    """Whether ``model.path`` names a local folder (absolute, or ``./…``) rather than a Hugging Face model id."""
    return Path(path).expanduser().is_absolute() or path.startswith(".")


def _absolute(path: Path) -> str:
    """``path`` made absolute without resolving links (a link loop is reported where the path is used)."""
    return os.path.abspath(path.expanduser())


def _absolutise_paths(data: dict, base: Path) -> None:
    """Make relative local paths absolute against the config file's folder (hub ids and keywords stay)."""
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("path"), str) and model["path"].strip():
        candidate = base / Path(model["path"]).expanduser()  # "~/models/x": the home folder, not base/"~"
        if model["path"].startswith((".", "/", "~")) or candidate.exists():
            model["path"] = _absolute(candidate)
    quantize = data.get("quantize")
    if isinstance(quantize, dict):
        for field in ("dataset", "heldout"):
            value = quantize.get(field)
            if isinstance(value, str) and value not in ("bundled", RANDOM) and not value.startswith("hf:"):
                quantize[field] = _absolute(base / Path(value).expanduser())
    cache = data.get("cache")
    if isinstance(cache, dict) and isinstance(cache.get("dir"), str) and cache["dir"].strip() \
            and not cache["dir"].startswith(("/", "~")):
        cache["dir"] = _absolute(base / cache["dir"])


def _section_fields(loc: tuple[str, ...]) -> list[str]:
    """The keys a config section takes (the section at ``loc``: ``()`` is the top level)."""
    model: type[BaseModel] = KilnConfig
    for name in loc:
        annotation = model.model_fields[name].annotation if name in model.model_fields else None
        inner = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)
                 and issubclass(a, BaseModel)]
        if not inner:
            return []
        model = inner[0]
    return list(model.model_fields)


_NOT_A_SECTION = ("model_type", "model_attributes_type", "dataclass_type")  # "... instance of BuildSection"
# what a field of each type takes, and the text of one such value that quotes made a string ("8", "true")
_UNQUOTED = {"int_type": ("a whole number", re.compile(r"[-+]?[0-9]+")),
             "float_type": ("a number", re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")),
             "bool_type": ("true or false", re.compile(r"true|false", re.IGNORECASE))}


def _describe(exc: ValidationError, path: Path, lines: dict[tuple[str, ...], int]) -> str:
    """One line per field with a problem: ``file:line: field: message``; a required field that is missing beside an
    unknown key that looks like it (``modl:`` for ``model:``) is told once, at the unknown key's line."""
    errors = exc.errors()
    missing = {_loc(error) for error in errors if error["type"] == "missing"}
    misspelt: dict[tuple[str, ...], tuple[str, ...]] = {}  # an unknown key -> the missing field it looks like
    for error in errors:
        loc = _loc(error)
        if error["type"] == "extra_forbidden" and not kiln_setting_for(loc[-1]) and (guess := _look_alike(loc)):
            meant = (*loc[:-1], guess)
            if meant in missing and meant not in misspelt.values():
                misspelt[loc] = meant
    by_field: dict[tuple[str, ...], list[dict]] = {}
    for error in errors:
        if not (error["type"] == "missing" and _loc(error) in misspelt.values()):
            by_field.setdefault(_field_of(error, lines), []).append(error)
    return "\n".join(_problem(loc, errors, path, lines, misspelt.get(loc)) for loc, errors in by_field.items())


def _loc(error: dict) -> tuple[str, ...]:
    """Where pydantic puts ``error``, as the config's key path."""
    return tuple(str(part) for part in error["loc"])


def _look_alike(loc: tuple[str, ...]) -> str | None:
    """The key of its section that the unknown key at ``loc`` looks like (a misspelling), None when none does."""
    return next(iter(difflib.get_close_matches(loc[-1], _section_fields(loc[:-1]), n=1)), None)


def _field_of(error: dict, lines: dict[tuple[str, ...], int]) -> tuple[str, ...]:
    """The field an error is about: the one a check names first, else the error's location less the names pydantic
    gives the members of a union (``quantize.batch_size.int``)."""
    loc = _loc(error)
    if error["type"] == "value_error":
        named = _named_field(error["msg"].removeprefix("Value error, "))
        return named if named[0] in KilnConfig.model_fields else loc
    while error["type"] != "missing" and len(loc) > 1 and loc not in lines:
        loc = loc[:-1]
    return loc


def _problem(loc: tuple[str, ...], errors: list[dict], path: Path, lines: dict[tuple[str, ...], int],
             required: tuple[str, ...] | None = None) -> str:
    """``file:line: field: message`` for the errors of one field (those of a union's members joined by "or"); an
    unknown key that looks like the missing field ``required`` says that field is required too."""
    error, kind = errors[0], errors[0]["type"]
    line = (kind == "value_error" and _mentioned_line(lines, error["msg"])) or line_of(lines, loc)
    where = f"{path}:{line}" if line else str(path)
    text = " or ".join([_message(error), *(_message(e).removeprefix("Input should be ") for e in errors[1:])])
    if kind == "extra_forbidden":
        section = ".".join(loc[:-1]) or "the top level"
        known = _section_fields(loc[:-1])
        guess = _look_alike(loc)
        elsewhere = " or ".join(name for name in _section_fields(()) if name != ".".join(loc[:-1])
                                and loc[-1] in _section_fields((name,)))
        if kiln_name := kiln_setting_for(loc[-1]):
            hint = f"vLLM's {loc[-1]} is Kiln's {kiln_name}"
        elif guess:  # a look-alike here, and where the key itself is a setting of another section, that too
            notes = [f"{loc[-1]} is a setting of {elsewhere}"] if elsewhere else []
            if required:
                notes.append(f"{'.'.join(required)}: is required")
            hint = f"did you mean '{guess}'?" + (f" ({'; '.join(notes)})" if notes else "")
        elif elsewhere:  # build's max_batch_size under quantize
            hint = f"{loc[-1]} belongs under {elsewhere}"
        else:
            hint = f"it takes {', '.join(known)}"
        text = f"unknown key '{loc[-1]}' in {section}; {hint}"
    elif kind == "missing":
        text = "is required"
    elif kind == "value_error":
        text = text.removeprefix("Value error, ")
        if _named_field(text) == loc:  # the message starts with the field
            return f"{where}: {text}"
    elif "input" in error and kind != "assertion_error":
        text += f" (got {error['input']!r})"
        if kind == "string_type" and error["input"] is None:  # `path: ~` or `path:` with nothing after it
            text += "; YAML reads ~ and an empty value as null: quote the value ('~/models/x' for the home folder)"
        if isinstance(error["input"], str) and kind in _UNQUOTED:
            wanted, quoted = _UNQUOTED[kind]
            text += f"; write {wanted}" + (" without quotes" if quoted.fullmatch(error["input"].strip()) else "")
    return f"{where}: {'.'.join(loc) or '(top level)'}: {text}"


def _message(error: dict) -> str:
    """pydantic's message for ``error``, without the names of Kiln's classes (a section given a value)."""
    if error["type"] in _NOT_A_SECTION:
        return "Input should be a mapping of settings"
    return error["msg"]


def _named_field(message: str) -> tuple[str, ...]:
    """The field a check's message names first: ``build.max_input_len (…) must …`` → ``("build", "max_input_len")``."""
    return tuple(message.split(" ", 1)[0].rstrip(",:").split("."))


def _mentioned_line(lines: dict[tuple[str, ...], int], message: str) -> int | None:
    """The line of the first field ``message`` names that the file sets, else of the first one's section."""
    sections = "|".join(KilnConfig.model_fields)
    named = [tuple(field.split(".")) for field in re.findall(rf"\b(?:{sections})(?:\.\w+)+", message)]
    return next((lines[field] for field in named if field in lines), line_of(lines, named[0]) if named else None)
