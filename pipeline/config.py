"""The Kiln config file: schema (pydantic, strict), loading, and errors that name file, line and field."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from kiln.calibration.recipe import QuantizeRecipe
from kiln.calibration.sources import RANDOM
from kiln.engines.cache.remote.spec import RemoteSpec, endpoint_problem, url_problem
from kiln.engines.cache.store import VerifyOnLoad
from kiln.engines.trtllm.options import GEMM_PLUGINS, KV_CACHE_TYPES, LOG_LEVELS, PLUGIN_DTYPES
from kiln.pipeline.yaml_source import ConfigError, line_of, load_yaml_with_lines
from kiln.runtime.plan import BuildPlan

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the kiln package: a checkout's root, or site-packages/kiln
CONFIGS_DIR = PACKAGE_DIR / "configs"  # bundled configs; architecture files under models/
DEFAULT_CACHE_DIR = "~/.cache/kiln"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelSection(_Section):
    """Where the checkpoint comes from and the dtype the engine computes in."""

    path: str = Field(description="A local directory (relative to the config file) or a Hugging Face model id.")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    revision: str | None = Field(None, description="Hub revision when path is a model id.")
    allow_download: bool = Field(False, description="Fetch from the hub when the model is not on disk.")


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
        self.plan()  # the plan's own checks (PlanError is a ValueError: pydantic names the file, line and field)
        return self

    def plan(self, kv_cache_dtype: str = "auto") -> BuildPlan:
        """The build plan of these limits, with the KV cache dtype the quantize stage asks for."""
        return BuildPlan(max_batch_size=self.max_batch_size, max_input_len=self.max_input_len,
                         max_seq_len=self.max_seq_len, max_num_tokens=self.max_num_tokens,
                         tokens_per_block=self.tokens_per_block, kv_cache_dtype=kv_cache_dtype)

    def fitted_to_model(self, max_position_embeddings: int) -> BuildSection:
        """These limits, with those the config leaves to their defaults fitted to the model: ``max_seq_len`` at most
        its ``max_position_embeddings``, and ``max_input_len`` at most half of a ``max_seq_len`` so lowered."""
        values = self.model_dump()
        if "max_seq_len" not in self.model_fields_set and self.max_seq_len > max_position_embeddings:
            values["max_seq_len"] = max_position_embeddings
            if "max_input_len" not in self.model_fields_set:
                values["max_input_len"] = min(self.max_input_len, max(1, max_position_embeddings // 2))
        if values == self.model_dump():
            return self
        return BuildSection.model_validate(values)

    def semantic(self, backend: str) -> dict:
        """The fields that change what the engine computes or how it is laid out (the cache key's part)."""
        excluded = {"backend", "device", "workers", "timeout_s", "log_level"}
        return self.model_dump(exclude=excluded if backend == "trtllm" else excluded | {"trtllm"})


class CacheSection(_Section):
    """The engine cache; ``$KILN_CACHE`` overrides ``dir`` and ``$KILN_CACHE_REMOTE`` overrides ``remote``."""

    dir: str = DEFAULT_CACHE_DIR
    max_size_gb: float = Field(100.0, gt=0)
    max_entries: PositiveInt = 64
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

    @field_validator("remote")
    @classmethod
    def _remote_url(cls, url: str | None) -> str | None:
        if url is not None and (problem := url_problem(url)):
            raise ValueError(problem)
        return url

    @field_validator("remote_endpoint")
    @classmethod
    def _remote_endpoint(cls, endpoint: str | None) -> str | None:
        if problem := endpoint_problem(endpoint):
            raise ValueError(problem)
        return endpoint

    def root(self) -> Path:
        """The cache root in force: ``$KILN_CACHE`` when set, else ``dir``."""
        return cache_root(self.dir)

    def remote_spec(self) -> RemoteSpec | None:
        """The remote tier in force: ``$KILN_CACHE_REMOTE`` when set, else ``remote`` (None: local only)."""
        return remote_spec(self.remote, self.remote_endpoint, self.remote_required)


class ServeSection(_Section):
    """The OpenAI-compatible server."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_key: str | None = None
    max_queue: PositiveInt = 256


class SmokeSection(_Section):
    """What the smoke stage generates after loading the engine."""

    prompt: str = "Once upon a time"
    max_tokens: PositiveInt = 16


class KilnConfig(_Section):
    """A whole Kiln config file."""

    model: ModelSection
    quantize: QuantizeRecipe = Field(default_factory=QuantizeRecipe)
    build: BuildSection = Field(default_factory=BuildSection)
    cache: CacheSection = Field(default_factory=CacheSection)
    serve: ServeSection = Field(default_factory=ServeSection)
    smoke: SmokeSection = Field(default_factory=SmokeSection)


class LoadedConfig(BaseModel):
    """A validated config and where it came from."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    path: Path
    config: KilnConfig


def cache_root(configured: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """The engine cache in force: ``$KILN_CACHE`` when set, else ``configured`` (a config's ``cache.dir``)."""
    return Path(os.environ.get("KILN_CACHE") or configured).expanduser().resolve()


def remote_spec(configured: str | None = None, endpoint: str | None = None,
                required: bool = False) -> RemoteSpec | None:
    """The remote tier in force: ``$KILN_CACHE_REMOTE`` when set (an empty value turns the remote off), else
    ``configured``; a bad URL in the environment is a ConfigError naming the variable."""
    url = os.environ.get("KILN_CACHE_REMOTE", configured)
    if not url:
        return None
    try:
        return RemoteSpec(url, endpoint, required)
    except ValueError as exc:
        where = "$KILN_CACHE_REMOTE" if "KILN_CACHE_REMOTE" in os.environ else "cache.remote"
        raise ConfigError(f"{where}: {exc}") from None


def find_config(name_or_path: str | Path) -> Path | None:
    """A config (``.yaml``) or architecture file (``.json``): the path as given, else a bare name
    (``tiny-llama-fp8.yaml``, ``tiny-llama-fp8``, ``llama3-8b``) under the bundled ``configs/`` or
    ``configs/models/``; None when there is no such file."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path.resolve()
    if path.parent != Path("."):
        return None
    return next((candidate for folder in (CONFIGS_DIR, CONFIGS_DIR / "models")
                 for suffix in ("", ".yaml", ".yml", ".json")
                 if (candidate := folder / f"{path.name}{suffix}").is_file()), None)


def load_config(name_or_path: str | Path) -> LoadedConfig:
    """Read and validate a config (a path, or a name ``find_config`` knows); raise ConfigError naming
    ``file:line: field`` on the first problem."""
    path = find_config(name_or_path)
    if path is None:
        given = Path(name_or_path).expanduser()
        bundled = sorted(p.stem for p in CONFIGS_DIR.iterdir() if p.suffix in (".yaml", ".yml"))
        guess = difflib.get_close_matches(given.stem, bundled, n=1) if given.parent == Path(".") else []
        hint = (f"; did you mean {guess[0]}?" if guess
                else "; give a path, or the name of a bundled config such as tiny-llama-fp8")
        raise ConfigError(f"{given.resolve()}: config file not found{hint}")
    data, lines = load_yaml_with_lines(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with a 'model' section at the top level")
    _absolutise_paths(data, path.parent)
    try:
        config = KilnConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path, lines)) from None
    return LoadedConfig(path=path, config=config)


def _absolute(path: Path) -> str:
    """``path`` made absolute without resolving links (a link loop is reported where the path is used)."""
    return os.path.abspath(path.expanduser())


def _absolutise_paths(data: dict, base: Path) -> None:
    """Make relative local paths absolute against the config file's folder (hub ids and keywords stay)."""
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("path"), str):
        candidate = base / model["path"]
        if model["path"].startswith((".", "/", "~")) or candidate.exists():
            model["path"] = _absolute(candidate)
    quantize = data.get("quantize")
    if isinstance(quantize, dict):
        for field in ("dataset", "heldout"):
            value = quantize.get(field)
            if isinstance(value, str) and value not in ("bundled", RANDOM) and not value.startswith("hf:"):
                quantize[field] = _absolute(base / value)
    cache = data.get("cache")
    if isinstance(cache, dict) and isinstance(cache.get("dir"), str) and not cache["dir"].startswith(("/", "~")):
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


def _describe(exc: ValidationError, path: Path, lines: dict[tuple[str, ...], int]) -> str:
    """One line per problem: ``file:line: field: message``."""
    messages = []
    for error in exc.errors():
        loc = tuple(str(part) for part in error["loc"])
        if error["type"] == "value_error":
            loc = _narrow_to_field(loc, error["msg"].removeprefix("Value error, "), lines)
        field = ".".join(loc) or "(top level)"
        line = line_of(lines, loc)
        where = f"{path}:{line}" if line else str(path)
        kind = error["type"]
        if kind == "extra_forbidden":
            section = ".".join(loc[:-1]) or "the top level"
            known = _section_fields(loc[:-1])
            guess = difflib.get_close_matches(loc[-1], known, n=1)
            text = (f"unknown key '{loc[-1]}' in {section}; "
                    + (f"did you mean '{guess[0]}'?" if guess else f"it takes {', '.join(known)}"))
        elif kind == "missing":
            text = "is required"
        else:
            text = error["msg"].removeprefix("Value error, ")
            if "input" in error and kind not in ("value_error", "assertion_error"):
                text += f" (got {error['input']!r})"
        section = ".".join(loc[:-1])
        if kind == "value_error" and loc and text.startswith((f"{loc[-1]} ", f"{section}.{loc[-1]} ")):
            text = text.removeprefix(f"{section}.")  # the message already starts with the field
            messages.append(f"{where}: {section}.{text}")
        else:
            messages.append(f"{where}: {field}: {text}")
    return "\n".join(messages)


def _narrow_to_field(loc: tuple[str, ...], message: str, lines: dict[tuple[str, ...], int]) -> tuple[str, ...]:
    """A section-level check names its field first (``max_input_len (…) must …``): point at that field's line."""
    field = message.split(" ", 1)[0].split(".")[-1]
    return (*loc, field) if (*loc, field) in lines else loc
