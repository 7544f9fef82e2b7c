"""The ``kiln`` command line."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from typing import Annotated, Any, NoReturn

import typer
from rich.markup import escape
from typer.core import TyperGroup

from kiln.pipeline.bench.command import bench
from kiln.pipeline.bench.loadtest import loadtest
from kiln.pipeline.cache_commands import cache_app, print_explain
from kiln.pipeline.config import load_config
from kiln.pipeline.console import (
    friendly_errors,
    print_error_json,
    print_json,
    stage_progress,
    stderr,
    stdout,
    stop_on_sigterm_as_on_ctrl_c,
    warn,
    write_failure,
)
from kiln.pipeline.runtime_env import runtime_options, unknown_variables
from kiln.pipeline.serve_command import serve
from kiln.pipeline.vllm_names import VLLM_SHORT_FLAGS, vllm_flag_advice


class KilnGroup(TyperGroup):
    """``kiln``'s commands: a usage error (an unknown command or option, a missing argument, a bad value) is one red
    line on stderr, as the commands' own errors are, and a command line that asks for ``--json`` gets the error
    object on stdout too."""

    def make_context(self, info_name: str | None, args: list[str], parent: typer.Context | None = None,
                     **extra: Any) -> typer.Context:
        json_out = "--json" in args  # looked for first: parsing consumes ``args``
        try:  # the options of ``kiln`` itself
            return super().make_context(info_name, args, parent, **extra)
        except typer.TyperException as exc:
            _usage_error(exc, json_out, info_name or "kiln")

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        ctx.meta["json_out"] = "--json" in args
        ctx.meta["argv"] = args
        return super().parse_args(ctx, args)

    def invoke(self, ctx: typer.Context) -> Any:
        try:  # the command's name, its arguments and options
            return super().invoke(ctx)
        except typer.TyperException as exc:
            _usage_error(exc, ctx.meta.get("json_out", False), ctx.command_path)


def _usage_error(exc: typer.TyperException, json_out: bool, command: str) -> NoReturn:
    """Print a usage error of ``command`` as one line (and under ``--json`` as an error object) and exit 2; a
    command given nothing to do prints its help instead (on stderr, as click does)."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # typer's vendored click's; typer tests its name too
        print(exc.format_message(), file=sys.stderr)
        raise typer.Exit(2)
    message = exc.format_message()
    option = getattr(exc, "option_name", None) or ""
    if type(exc).__name__ == "NoSuchOption" and (unknown := _unknown_options(exc, option)) is not None:
        message = unknown
    elif option == "--json" and getattr(exc, "ctx", None) is not None and exc.ctx.parent is None:
        message = "No such option: --json (commands take it after their name: kiln build CONFIG --json)"
    message += _one_value_hint(exc, message)
    if json_out:
        print_error_json(type(exc).__name__, message)
    command = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else command
    stderr.print(f"[bold red]error:[/] {escape(message)} (see `{command} -h`)", markup=True, highlight=False,
                 soft_wrap=True)
    raise typer.Exit(getattr(exc, "exit_code", 2)) from None


def _unknown_options(exc: typer.TyperException, option: str) -> str | None:
    """Every option of the command line the command does not take, each with what to do instead where Kiln knows
    (a flag of `vllm serve`, or one of Kiln's written with underscores, as vLLM takes them), so that a command line
    moved from vLLM is mended in one go; None where none is known (click's own message, with its guesses, stands)."""
    ctx = getattr(exc, "ctx", None)
    known = {name for param in ctx.command.params for name in (*param.opts, *param.secondary_opts)} if ctx else set()
    argv = ctx.meta.get("argv", []) if ctx else []
    flags = [flag for token in argv if ((flag := token.split("=", 1)[0]).startswith("--") or flag in VLLM_SHORT_FLAGS)
             and flag not in known]
    advice = {flag: _advice(flag, known) for flag in dict.fromkeys(flags or [option])}
    if not any(advice.values()):
        return None
    listed = "; ".join(f"{flag} ({words})" if words else flag for flag, words in advice.items())
    return f"No such option{'s' if len(advice) > 1 else ''}: {listed}"


def _advice(flag: str, known: set[str]) -> str | None:
    """What to write instead of ``flag``: Kiln's own flag where only its underscores differ, else vLLM's advice."""
    dashed = flag.replace("_", "-")
    return f"write {dashed}" if dashed != flag and dashed in known else vllm_flag_advice(flag)


def _one_value_hint(exc: typer.TyperException, message: str) -> str:
    """For extra arguments after an option's value (vLLM's ``--served-model-name a b``): how Kiln takes them."""
    extra = re.fullmatch(r"Got unexpected extra argument\(s\) \((.*)\)", message)
    ctx = getattr(exc, "ctx", None)
    if extra is None or ctx is None:
        return ""
    argv = ctx.meta.get("argv", [])
    for flag, value, first in reversed(list(zip(argv, argv[1:], argv[2:], strict=False))):
        option = next((p for p in ctx.command.params if flag in p.opts), None)
        if option is not None and not value.startswith("-") and extra[1].startswith(first):
            if option.multiple:
                return f"; {flag} takes one value: repeat it for each ({flag} {value} {flag} {first})"
            return f"; {flag} takes one value"
    return ""


app = typer.Typer(cls=KilnGroup, help="Kiln: a Hugging Face checkpoint to a quantized, cached, served engine.",
                  rich_markup_mode=None, no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
config_app = typer.Typer(rich_markup_mode=None, help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(cache_app, name="cache")

def _print_version(asked: bool) -> None:
    if asked:
        from kiln.runtime.version import version_line

        stdout.print(version_line(), highlight=False)
        raise typer.Exit()


@app.callback()
def kiln(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print Kiln's version and exit.")] = False,
) -> None:
    """Kiln: a Hugging Face checkpoint to a quantized, cached, served engine."""
    for warning in unknown_variables(os.environ):  # before every command: a misspelt KILN_* would do nothing
        warn(warning)


ConfigArg = Annotated[str, typer.Argument(help="A config file, or a name under configs/ (tiny-llama-fp8.yaml).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable object on stdout.")]


@app.command()
@friendly_errors
def build(
    config: ConfigArg,
    backend: Annotated[str | None, typer.Option(help="auto, native or trtllm (default: the config's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even when the cache has the outputs.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and key; run nothing.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Quantize, build, publish and smoke-test an engine, skipping what the cache already has."""
    from kiln.pipeline import runner
    from kiln.pipeline.summary import print_plan, print_result

    ctx = runner.prepare(config, backend=backend, force=force, dry_run=dry_run, options=runtime_options(os.environ))
    decisions = runner.decide(ctx)
    if dry_run:
        plan = runner.plan_json(ctx, decisions)
        print_json(plan) if json_out else print_plan(plan)
        return
    with stage_progress(enabled=not json_out) as progress:
        result = runner.run(ctx, decisions, progress)
    print_json(result) if json_out else print_result(result)


@app.command()
@friendly_errors
def quantize(
    config: ConfigArg,
    force: Annotated[bool, typer.Option("--force", help="Recalibrate even when the cache has the checkpoint.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Run the quantize stage alone: calibration rounds, convergence verdict, accuracy gate, fallback."""
    from kiln.pipeline import runner
    from kiln.pipeline.summary import print_quantize

    ctx = runner.prepare(config, backend=None, force=force, dry_run=False, options=runtime_options(os.environ))
    with stage_progress(enabled=not json_out) as progress:
        result = runner.quantize_only(ctx, progress)
    print_json(result) if json_out else print_quantize(result)


@config_app.command("show")
@friendly_errors
def config_show(config: ConfigArg, json_out: JsonOpt = False) -> None:
    """Print the config as it will be used, itself a config that means the same: every field that applies, defaults
    filled in, paths made absolute, and the values in force where something else decides them ($KILN_CACHE for
    cache.dir, $KILN_CACHE_REMOTE for cache.remote, the model for build limits left out, each format's gate
    thresholds)."""
    from kiln.calibration.recipe import GATE_DEFAULTS
    from kiln.pipeline.backend import choose_backend
    from kiln.pipeline.config import TRTLLM_ONLY, UNCALIBRATED_FIELDS
    from kiln.pipeline.model_source import find_model, model_max_positions

    loaded = load_config(config)
    if (model_dir := find_model(loaded.config.model)) and (positions := model_max_positions(model_dir)):
        loaded.fit_to_model(positions)
    data = loaded.config.model_dump(mode="json")
    data["cache"]["dir"] = str(loaded.config.cache.root())
    remote = loaded.config.cache.remote_spec()  # $KILN_CACHE_REMOTE's (set empty: none), else cache.remote
    data["cache"]["remote"] = None if remote is None else remote.url
    build = loaded.config.build
    if not (model_dir and positions):  # not fitted: a default written out would be kept, and refused, once it is
        for name in ("max_seq_len", "max_input_len"):
            if name not in build.model_fields_set:
                del data["build"][name]
    if choose_backend(build.backend, build.device).backend == "native":  # settings it would not use
        for name in TRTLLM_ONLY:
            del data["build"][name]
    recipe = loaded.config.quantize
    calibrated = [fmt for fmt in recipe.chain if fmt in GATE_DEFAULTS]
    if "int4_awq" not in calibrated:  # it would not apply, and setting it is refused
        del data["quantize"]["algorithm"]
    if not recipe.reads_text_field:  # (the same)
        del data["quantize"]["text_field"]
    if not calibrated:  # format none is never calibrated nor gated, and a setting of either is refused
        data["quantize"] = {name: data["quantize"][name] for name in UNCALIBRATED_FIELDS}
    elif recipe.gate is not None:
        data["quantize"]["gate"] = {fmt: recipe.gate.for_format(fmt) for fmt in calibrated}
    if json_out:
        print_json(data)
        return
    import yaml

    # written as it is: rich would wrap long lines at a terminal's width, and the output must stay valid YAML
    stdout.file.write(f"# {loaded.path}\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=2**16))
    stdout.file.flush()


@cache_app.command("explain")
@friendly_errors
def cache_explain(config: ConfigArg, json_out: JsonOpt = False) -> None:
    """Which fields of CONFIG's engine key material differ from the nearest cached engine (DVC-style)."""
    from kiln.engines.cache import inspect as cache_inspect
    from kiln.pipeline import runner
    from kiln.pipeline.model_source import ModelNotFoundError

    ctx = runner.prepare(config, backend=None, force=False, dry_run=True, options=runtime_options(os.environ))
    if ctx.material is None:
        raise ModelNotFoundError(f"model files not found for model.path {ctx.config.model.path}; "
                                 "the key material needs the checkpoint's content hash")
    if ctx.cache is None:  # no local cache yet: the remote may still have the engine
        remote = cache_inspect.remote_presence(ctx.remote, "entries", ctx.engine_key)
        print_explain({"nearest_key": None, "differences": [], "created": None, "remote": remote}, json_out)
        return
    print_explain(cache_inspect.explain(ctx.cache, ctx.material), json_out)


app.command()(serve)
app.command()(loadtest)
app.command()(bench)


def main() -> None:
    """Console-script entry point. Output a terminal's encoding cannot show (an arrow under LC_ALL=C) is escaped
    rather than failing the command after its work is done."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    stop_on_sigterm_as_on_ctrl_c()
    try:
        app()
    except OSError as exc:  # outside a command (--version, --help) or in the flush after it
        if (message := write_failure(exc)) is None:
            raise
        with contextlib.suppress(OSError):
            stderr.print(f"error: {message}", highlight=False)
        sys.exit(2)
