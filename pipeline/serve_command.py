"""``kiln serve CONFIG | ENGINE_DIR | KEY``: build a config through the cache (a hit is instant), then serve the
engine over the OpenAI-compatible HTTP API until SIGTERM."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.markup import escape

from kiln.pipeline.config import LoadedConfig, ServeSection, cache_root, remote_spec, remote_turned_off
from kiln.pipeline.console import (
    friendly_errors,
    give_stdout_back,
    log_lines_instead,
    logged_instead,
    stage_progress,
    stderr,
)
from kiln.pipeline.float_flags import finite_float
from kiln.pipeline.runtime_env import runtime_options
from kiln.pipeline.serve_flags import (
    check_cors_wildcards,
    check_model_names,
    check_tool_call_parser,
    cors_origins,
    fallback_api_key,
    given_api_key,
    keep_alive_seconds,
    read_chat_template,
)
from kiln.pipeline.targets import Target, TargetError, resolve_target
from kiln.runtime.errors import KilnError, TensorParallelError
from kiln.runtime.options import DEFAULT_SCHEDULER_POLICY, RuntimeOptions, is_ascii_number
from kiln.runtime.server_defaults import DEFAULT_HOST, DEFAULT_KEEP_ALIVE_S, DEFAULT_MAX_QUEUE, DEFAULT_PORT

if TYPE_CHECKING:
    from kiln.engines.cache import EngineCache
    from kiln.runtime.llm import LLM
    from kiln.runtime.native.parallel.group import Rendezvous
    from kiln.runtime.server import ServerSettings, ServerThread

logger = logging.getLogger("kiln.pipeline")
LogLevel = Literal["trace", "debug", "info", "warning", "error", "critical"]  # uvicorn's; trace is debug for Kiln
class ServeExtraMissingError(KilnError):
    """The serve extra (fastapi, uvicorn, prometheus-client, jinja2) is not installed."""


@dataclass
class ServeTarget:
    """An engine ready to load, with what the config (if any) says about serving it."""

    engine_dir: Path
    model_name: str
    device: str | None = None  # where a config's engine was built for; None: the engine's own
    serve: ServeSection = field(default_factory=ServeSection)  # the config's; an engine without one: its defaults
    engine_cache: dict = field(default_factory=dict)
    record_load: Callable[[float], None] | None = None
    release_build: Callable[[], None] | None = None  # the build's hold on the engine, let go once it is loaded

    def loader(self, options: RuntimeOptions, settings: ServerSettings | None = None) -> Callable[[], LLM]:
        """Loads the engine with ``options`` (on this target's device unless they name one), recording the load with
        the cache when it came from one and, given the server's ``settings``, logging what is served
        (``log_serving``), then freezes the heap of this process, which serves from then on."""
        options = replace(options, device=options.device or self.device)

        def load() -> LLM:
            from kiln.runtime.heap import freeze_startup_heap
            from kiln.runtime.llm import LLM

            llm = LLM.load(self.engine_dir, options)
            if self.release_build is not None:  # the LLM holds the entry now
                self.release_build()
            if self.record_load is not None:
                self.record_load(llm.load_ms)
            if settings is not None:
                log_serving(llm, self, options, settings)
            freeze_startup_heap()
            return llm

        return load

    def settings(self, api_key: str | tuple[str, ...] | None = None, **given: object) -> ServerSettings:
        """The server's settings for this engine: ``given`` ServerSettings fields (None: not given) over the config's
        serve fields that ServerSettings has too (max_queue; ``api_key``, when none or empty is given), over this
        target's model name and engine cache facts, over ServerSettings' defaults."""
        from kiln.runtime.server import ServerSettings

        configured = self.serve.model_dump(include={f.name for f in fields(ServerSettings)})
        taken = {name: value for name, value in given.items() if value is not None}
        return ServerSettings(**{"model_name": self.model_name, "engine_cache": self.engine_cache, **configured,
                                 "api_key": api_key or self.serve.api_key, **taken})


def log_serving(llm: LLM, target: ServeTarget, options: RuntimeOptions, settings: ServerSettings) -> None:
    """Log what tells an operator which build, limits and scheduler policy are live (never the API key), and warn of an
    engine without a tokenizer, which serves prompts of token ids only."""
    from kiln.runtime.engine import engine_facts
    from kiln.runtime.version import kiln_version

    facts, limits = engine_facts(target.engine_dir, options), llm.limits
    key = target.engine_cache.get("key")
    gpu = f" ({facts['gpu_name']})" if facts["gpu_name"] else ""
    logger.info("engine %s, Kiln %s: %s on %s%s, quantization %s, KV cache %s, tp_size %d",
                f"{key[:12]} (cache key)" if key else target.engine_dir, kiln_version() or "unknown",
                facts["backend"], facts["device"], gpu, facts["quantization"], facts["kv_cache_dtype"],
                facts["tp_size"])
    blocks = (llm.stats().get("kv_cache") or {}).get("num_blocks")
    pool = f"{blocks} blocks ({limits.kv_pool_tokens} tokens)" if limits.kv_pool_tokens is not None \
        else "sized by the backend"
    default = DEFAULT_SCHEDULER_POLICY[facts["backend"]]
    policy = options.scheduler_policy or f"{default} (the {facts['backend']} backend's default)"
    logger.info("limits: max_seq_len %d, max_input_len %d, max_batch_size %d, max_num_tokens %d, KV pool %s, "
                "max_queue %d, scheduler_policy %s; %s", limits.max_seq_len, limits.max_input_len,
                limits.max_batch_size, limits.max_num_tokens, pool, settings.max_queue, policy,
                "API key required" if settings.api_keys else "no API key required")
    if llm.tokenizer is None:
        logger.warning("%s has no tokenizer (tokenizer.json): only prompts of token ids can be served, and text "
                       "prompts, chats and stop strings get 400", target.engine_dir)


def torchrun_rendezvous(environ: Mapping[str, str]) -> Rendezvous | None:
    """The rendezvous of a ``kiln serve`` that torchrun started as one of several ranks, else None."""
    world_size = environ.get("WORLD_SIZE", "1")
    if not is_ascii_number(world_size.strip()):
        raise TensorParallelError(f"WORLD_SIZE={world_size!r} is not a whole number; torchrun sets it: start the "
                                  f"ranks with torchrun, or unset it to serve from this process alone")
    if int(world_size) <= 1 or "RANK" not in environ:
        return None
    from kiln.runtime.native.parallel.group import Rendezvous

    return Rendezvous.from_environment(environ)


def log_to_stderr(level: LogLevel = "info", config: Path | None = None) -> None:
    """Kiln's own log lines (the engine loaded, a request that failed, the engine stopping) from ``level`` up on
    stderr, in the format uvicorn's get (time, level, logger, request id); the engine process logs from the same
    level in the same format. With a logging configuration file ``config``, every process logs as it says instead
    (a bad one stops the command in one line, exit 2), and stdout is stdout again (``ext://sys.stdout`` there), as
    it is under vLLM: the lines this command prints are log lines then (``log_lines_instead``)."""
    from kiln.runtime import logs
    from kiln.runtime.server.serve import stderr_log_handler

    if config is None:
        logs.log_to_stderr("DEBUG" if level == "trace" else level.upper(), stderr_log_handler())
        return
    give_stdout_back()
    try:
        logs.apply_log_config(config)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--log-config'") from None
    log_lines_instead()


def serve_as_worker(text: str, options: RuntimeOptions, rendezvous: Rendezvous, local_rank: int) -> None:
    """Run rank ``rendezvous.rank`` of the engine ``text`` names (a folder or a cache key: every rank must find
    the same build, so a config is refused) on this host's GPU ``local_rank`` until rank 0's server stops."""
    from kiln.runtime.engine_process.lifetime import leave_stop_signals_to_parent, stop_at_once_on_stop_signals
    from kiln.runtime.native.engine_format import EngineConfig
    from kiln.runtime.native.fingerprint import resolve_device
    from kiln.runtime.native.parallel.worker import rank_device, run_worker

    target = resolve_target(text, cache_root())
    if target.kind != "engine":
        raise TargetError(f"{text}: under torchrun every rank serves one engine that is already built; give its "
                          f"directory or cache key (kiln build the config first)")
    device = resolve_device(options.device, EngineConfig.load(target.path).fingerprint)
    logger.info("rank %d of %d: joining rank 0 at %s", rendezvous.rank, rendezvous.size, rendezvous.address())
    # stop signals end this rank until it has joined: rank 0 (failed, or never started) has nothing to drain yet
    stop_at_once_on_stop_signals()
    run_worker(target.path, options, rendezvous, rank_device(device, local_rank),
               on_joined=leave_stop_signals_to_parent)


def serve_target(text: str, options: RuntimeOptions, *, backend: str | None = None, progress: bool = True,
                 before_build: Callable[[LoadedConfig, Path | None], None] | None = None) -> ServeTarget:
    """What ``kiln serve TARGET`` serves: an engine directory, a cached engine by key or key prefix, or a config
    (built through the cache first; a hit runs nothing; ``before_build`` sees the config and its checkpoint
    directory first). ``backend`` is checked in every case: an engine already built must have been built by it."""
    if backend is not None:
        from kiln.pipeline.backend import choose_backend

        choose_backend(backend, "cpu")  # the name, refused as a config's build refuses it
    target = resolve_target(text, cache_root())
    if target.kind == "config":
        return _config_target(target.path, options, backend=backend, progress=progress, before_build=before_build)
    if target.kind == "architecture":
        raise TargetError(f"{text}: an architecture file has no weights to serve; give a config, an engine "
                          f"directory or a cache key (kiln bench runs architecture files with random weights)")
    _check_engine_backend(text, target, backend)
    return _engine_target(target)


def _check_engine_backend(text: str, target: Target, backend: str | None) -> None:
    """Refuse a --backend other than auto and the one that built the engine ``target`` names."""
    from kiln.runtime.trtllm.engine_info import is_trtllm_engine

    built = "trtllm" if is_trtllm_engine(target.path) else "native"
    if backend in (None, "auto", built):
        return
    if target.hold is not None:
        target.hold.release()
    raise TargetError(f"{text}: a {built} engine, already built, so --backend {backend} cannot apply; give "
                      f"--backend {built} or leave the flag out (it chooses a config's build)")


def _engine_target(target: Target) -> ServeTarget:
    if target.cache_key is None:
        return ServeTarget(engine_dir=target.path, model_name=target.name)
    from kiln.engines.cache import EngineCache

    # the remote as the target's resolution found it: $KILN_CACHE_REMOTE first, else the one the cache recorded
    cache = EngineCache.open_configured(target.cache_root, remote=remote_spec(),
                                        recorded_remote=not remote_turned_off())
    key = target.cache_key
    return ServeTarget(engine_dir=target.path, model_name=target.name, engine_cache=engine_cache_info(cache, key, True),
                       record_load=lambda ms: cache.record_load(key, ms))


def _config_target(config: Path, options: RuntimeOptions, *, backend: str | None, progress: bool,
                   before_build: Callable[[LoadedConfig, Path | None], None] | None = None) -> ServeTarget:
    from kiln.pipeline import runner
    from kiln.pipeline.stages import not_loaded_here

    ctx = runner.prepare(config, backend=backend, force=False, dry_run=False, options=options)
    if (why := not_loaded_here(ctx)) is not None:  # before a build of minutes
        raise TargetError(f"{config}: {why}")
    if before_build is not None:
        before_build(ctx.loaded, ctx.model_dir)
    decisions = runner.decide(ctx, smoke=False)
    for stage, decision in decisions:  # why a server expected to start at once quantizes or builds first
        if decision.action == "run" and stage.name != "publish" and \
                not logged_instead(logging.INFO, f"{stage.name}: {decision.reason}"):
            stderr.print(f"{stage.name:<9} {escape(decision.reason)}", highlight=False)
    with stage_progress(enabled=progress) as bars:
        runner.run(ctx, decisions, bars, keep_engine_hold=True)  # until LLM.load holds it (ServeTarget.loader)
    key = ctx.engine_key
    return ServeTarget(engine_dir=ctx.engine_dir, model_name=ctx.loaded.path.stem, device=ctx.choice.device,
                       serve=ctx.config.serve, engine_cache=engine_cache_info(ctx.cache, key, ctx.cache_hit),
                       record_load=lambda ms: ctx.cache.record_load(key, ms), release_build=ctx.release_engine)


def engine_cache_info(cache: EngineCache, key: str, hit: bool) -> dict:
    """What ``/metrics`` reports of the engine cache: whether the served engine was a hit, the hit rate and the
    remote tier's figures (None without one, and both None where the cache's statistics cannot be read: they are
    expendable, and serving goes on without them)."""
    from kiln.engines.cache.errors import CacheDatabaseError
    from kiln.engines.cache.inspect import remote_report

    try:
        hit_rate, remote = cache.stats.summary("entries")["hit_rate"], remote_report(cache)
    except CacheDatabaseError as exc:
        logger.warning("%s; /metrics leaves out the engine cache's hit rate and remote figures", exc)
        hit_rate = remote = None
    return {"hit": hit, "hit_rate": hit_rate, "key": key, "remote": remote}


def require_serve_extra() -> None:
    """Raise a clear error when the server's dependencies are missing."""
    try:
        import fastapi  # noqa: F401
        import jinja2  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        from kiln.runtime.version import SERVE_EXTRA_INSTALL

        raise ServeExtraMissingError(f"serving needs the serve extra ({exc.name} is missing): "
                                     f"{SERVE_EXTRA_INSTALL}") from None


@friendly_errors
def serve(
    target: Annotated[str, typer.Argument(help="A config (built through the cache first), an engine directory, or "
                                               "a cache key.")],
    host: Annotated[str | None, typer.Option(help="Interface to listen on (default: the config's serve.host, "
                                                  f"else {DEFAULT_HOST}).")] = None,
    port: Annotated[int | None, typer.Option(min=0, max=65535, help="Port (default: the config's serve.port, else "
                                                                    f"{DEFAULT_PORT}; 0 picks a free one).")] = None,
    api_keys: Annotated[list[str] | None, typer.Option(
        "--api-key", help="Require 'Authorization: Bearer KEY' on the API's routes (/v1/, /invocations, /tokenize, "
                          "/detokenize, /tokenizer_info); repeatable, any one is accepted (vLLM's "
                          "--api-key k1 k2) (default: $KILN_API_KEY, the config's serve.api_key, else vLLM's "
                          "$VLLM_API_KEY).")] = None,
    max_queue: Annotated[int | None, typer.Option(min=1, help="Sequences (prompts x n) that may wait beyond the "
                                                              "engine's batch before new requests get 503 (default: "
                                                              "the config's serve.max_queue, else "
                                                              f"{DEFAULT_MAX_QUEUE}).")] = None,
    model_names: Annotated[list[str] | None, typer.Option(
        "--model-name", "--served-model-name", help="Model id clients send (--served-model-name, as in vLLM; "
                                                    "default: the config's name); repeatable: responses name the "
                                                    "first, requests may send any.")
    ] = None,
    chat_template: Annotated[str | None, typer.Option(help="A Jinja chat template file to use instead of the "
                                                           "engine's (as transformers renders it), or the template "
                                                           "itself, as vLLM takes it.")] = None,
    max_body_mb: Annotated[float | None, typer.Option(
        **finite_float(0.001), help="Largest request body in MiB; larger ones get 413 before they are read "
                                    "(default 16).")] = None,
    allowed_origins: Annotated[list[str] | None, typer.Option(
        "--allowed-origins", help="An origin browsers may call the API from (CORS), repeatable, or a JSON list of "
                                  "them (vLLM's form); default any ('*', as vLLM); '' alone turns CORS off.")] = None,
    allowed_methods: Annotated[str | None, typer.Option(
        help="vLLM's; Kiln's CORS allows every method, so only its default, '[\"*\"]', is taken.")] = None,
    allowed_headers: Annotated[str | None, typer.Option(
        help="vLLM's; Kiln's CORS allows every header, so only its default, '[\"*\"]', is taken.")] = None,
    allow_credentials: Annotated[bool, typer.Option(
        help="CORS responses let browsers send cookies and credentials (Access-Control-Allow-Credentials), as "
             "vLLM's flag does.")] = False,
    generation_config: Annotated[Literal["auto", "vllm"], typer.Option(
        help="Sampling defaults of requests that leave them unset: the model's generation_config.json (auto, as "
             "vLLM) or vLLM's own (vllm).")] = "auto",
    reasoning_parser: Annotated[Literal["deepseek_r1", "qwen3"] | None, typer.Option(
        help="Chat completions carry the model's <think> text as message.reasoning (and reasoning_content) apart from "
             "its content, as vLLM's parsers of these names do.")] = None,
    backend: Annotated[str | None, typer.Option(help="Build backend for a config: auto, native or trtllm (an engine "
                                                     "already built: only its own).")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N (default: the engine's).")] = None,
    num_kv_blocks: Annotated[int | None, typer.Option(min=1, help="KV pool size in blocks (default: from free "
                                                                  "memory).")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        **finite_float(0.01, 1.0), help="Share of the GPU's memory the native engine may hold; the KV pool takes "
                                        "what the weights and activations leave of it (default: "
                                        "$KILN_GPU_MEMORY_UTILIZATION or 0.9).")] = None,
    enable_prefix_caching: Annotated[bool | None, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse the KV of prompt prefixes earlier requests "
        "computed, as vLLM (default: $KILN_PREFIX_CACHING, else on); off, no request's output depends on what ran "
        "before it.")] = None,
    shutdown_timeout: Annotated[float, typer.Option(
        **finite_float(0), help="Seconds in-flight requests get to finish after SIGTERM; what is left then gets a "
                                "503.")] = 25.0,
    timeout_keep_alive: Annotated[float | None, typer.Option(
        **finite_float(0.001), help="Seconds an idle connection stays open; above a load balancer's idle timeout "
                                    "(AWS ALB: 60) (default: vLLM's $VLLM_HTTP_TIMEOUT_KEEP_ALIVE, else "
                                    f"{DEFAULT_KEEP_ALIVE_S:g}).")] = None,
    engine_process: Annotated[bool, typer.Option(help="Run the engine in a process of its own (its host work and the "
                                                     "HTTP server's then do not share one GIL), or on a thread of "
                                                     "the server's.")] = True,
    access_log: Annotated[bool, typer.Option(
        "--access-log/--no-access-log", " /--disable-uvicorn-access-log",
        help="Log a line per HTTP request (uvicorn's access log, which vLLM keeps on; off here: at hundreds of "
             "requests a second the lines cost the server's event loop); --disable-uvicorn-access-log: vLLM's "
             "name of --no-access-log.")] = False,
    log_level: Annotated[LogLevel, typer.Option(
        "--log-level", "--uvicorn-log-level", envvar=["KILN_LOG_LEVEL", "VLLM_LOGGING_LEVEL"], case_sensitive=False,
        help="The least level of the log lines, Kiln's and uvicorn's (--uvicorn-log-level: vLLM's name; "
             "$VLLM_LOGGING_LEVEL, vLLM's, after $KILN_LOG_LEVEL).")] = "info",
    log_config: Annotated[Path | None, typer.Option(
        "--log-config", "--log-config-file", envvar=["KILN_LOGGING_CONFIG_PATH", "VLLM_LOGGING_CONFIG_PATH"],
        help="A JSON logging configuration (logging.config.dictConfig's schema: JSON lines, files, levels) that "
             "every process of the server logs as, uvicorn's lines included, instead of Kiln's lines on stderr and "
             "--log-level (--log-config-file and $VLLM_LOGGING_CONFIG_PATH: vLLM's names).")] = None,
    vllm_no_ops: Annotated[bool, typer.Option(
        "--disable-log-requests", "--no-enable-log-requests", "--disable-log-stats", "--enable-request-id-headers",
        "--enable-chunked-prefill",
        help="vLLM's, accepted as what Kiln does anyway: it logs no line per request and no periodic stats, always "
             "echoes X-Request-Id, and always chunks a long prompt's prefill.")] = False,
    enable_auto_tool_choice: Annotated[bool, typer.Option(
        "--enable-auto-tool-choice", help="vLLM's, accepted: Kiln always parses the tool calls the chat template "
                                          "teaches.")] = False,
    tool_call_parser: Annotated[str | None, typer.Option(
        help="vLLM's: taken where it names the format Kiln detects from the chat template (hermes, llama3_json, "
             "llama4_json or mistral), refused otherwise.")] = None,
    max_log_len: Annotated[int | None, typer.Option(
        help="vLLM's, accepted and ignored: Kiln logs no prompt to truncate.")] = None,
    disable_fastapi_docs: Annotated[bool, typer.Option(
        "--disable-fastapi-docs", help="Serve no /docs, /redoc nor /openapi.json, as vLLM's flag.")] = False,
) -> None:
    """Serve an engine over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/responses,
    /health, /metrics); SIGTERM stops accepting, lets in-flight requests finish, and exits 0."""
    require_serve_extra()
    log_to_stderr(log_level, log_config)
    if not engine_process:  # before torch loads OpenMP: threads that spin between its CPU ops take the event loop's
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # cores, as the engine process's child is spared them
    from kiln.runtime.server import create_app, run_server
    from kiln.runtime.server.errors import served_paths
    from kiln.runtime.server.serve import UnknownHostError, listening_socket

    template = read_chat_template(chat_template) if chat_template is not None else None  # before any build
    origins = cors_origins(allowed_origins) if allowed_origins is not None else None  # refused before any build too
    check_cors_wildcards(allowed_methods, allowed_headers)
    check_tool_call_parser(tool_call_parser, template, None)  # the name; the format too, given a template
    keys = given_api_key(api_keys, os.environ)  # blank: refused before any build too
    keep_alive_s = keep_alive_seconds(timeout_keep_alive, os.environ)
    check_model_names(model_names)
    options = runtime_options(os.environ, device=device, num_kv_blocks=num_kv_blocks,
                              gpu_memory_utilization=gpu_memory_utilization, engine_process=engine_process,
                              prefix_caching=enable_prefix_caching)
    if (rendezvous := torchrun_rendezvous(os.environ)) is not None:  # one rank of an engine split across hosts
        if rendezvous.rank != 0:
            return serve_as_worker(target, options, rendezvous, int(os.environ.get("LOCAL_RANK", "0")))
        options = replace(options, tp_rendezvous=rendezvous.address())

    def bind_address(section: ServeSection) -> tuple[str, int]:
        return host or section.host, section.port if port is None else port

    def api_key_for(section: ServeSection) -> tuple[str, ...] | None:  # vLLM's variable last: a deployment
        return keys or fallback_api_key(section.api_key, os.environ)  # migrated from vLLM keeps its key

    def check_before_build(loaded: LoadedConfig, model_dir: Path | None) -> None:  # not after a build of minutes
        section = loaded.config.serve
        try:
            listening_socket(*bind_address(section)).close()  # a port in use
        except UnknownHostError as exc:
            if host is not None:  # --host's
                raise
            raise loaded.refusal(f"serve.host: {exc}") from None
        api_key_for(section)  # a blank serve.api_key, which would be used
        check_tool_call_parser(tool_call_parser, template, model_dir)  # the checkpoint's template, the engine's

    resolved = serve_target(target, options, backend=backend, before_build=check_before_build)
    if rendezvous is not None and (resolved.engine_dir / "engine.json").is_file():  # a native engine: rank 0
        from kiln.runtime.native.parallel.worker import require_ranks  # says what the others say, in torchrun's terms

        require_ranks(resolved.engine_dir, rendezvous)
    check_tool_call_parser(tool_call_parser, template, resolved.engine_dir)  # the template the engine serves
    names = model_names or [resolved.model_name]
    settings = resolved.settings(
        model_name=names[0], model_aliases=tuple(names[1:]), api_key=api_key_for(resolved.serve), max_queue=max_queue,
        chat_template=template, max_body_bytes=int(max_body_mb * (1 << 20)) if max_body_mb is not None else None,
        allowed_origins=origins, allow_credentials=allow_credentials, generation_config=generation_config,
        reasoning_parser=reasoning_parser, fastapi_docs=not disable_fastapi_docs)
    app = create_app(resolved.loader(options, settings), resolved.engine_dir, settings)
    bind_host, bind_port = bind_address(resolved.serve)
    loopback = bind_host in ("127.0.0.1", "localhost", "::1")
    if not loopback and not settings.api_key:
        unguarded = (f"listening on {bind_host} without an API key: anyone who can reach this port can use the "
                     f"engine (pass --api-key)")
        if not logged_instead(logging.WARNING, unguarded):
            stderr.print(f"[yellow]warning:[/] {escape(unguarded)}", markup=True, highlight=False)
    if loopback:  # vLLM listens on every interface by default: a manifest moved from it probes the pod's address
        local = (f"listening on {bind_host} only, so other machines cannot reach it (vLLM listens on every interface "
                 f"by default): pass --host 0.0.0.0 to serve them")
        if not logged_instead(logging.INFO, local):
            stderr.print(escape(local), highlight=False)

    def announce(thread: ServerThread) -> None:
        serving = (f"serving {settings.model_name} ({resolved.engine_dir}) on {thread.url}: {served_paths(app)}; "
                   f"SIGTERM or Ctrl-C drains and stops")
        if not logged_instead(logging.INFO, serving):
            stderr.print(serving, highlight=False, soft_wrap=True)

    run_server(app, bind_host, bind_port, shutdown_timeout_s=shutdown_timeout, on_started=announce,
               access_log=access_log, log_level=log_level, keep_alive_s=keep_alive_s,
               kiln_log_format=log_config is None)
    if app.state.server.load_abandoned:  # its thread may be inside torch, which an interpreter's teardown aborts
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
