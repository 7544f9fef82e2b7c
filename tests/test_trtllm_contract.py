"""Every flag and Python name Kiln uses exists in TensorRT-LLM 1.2.1, as recorded in engines/trtllm/contract; and, where
TensorRT-LLM is installed, every checkable entry of that record matches it."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import mmap
import re
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from kiln.engines.trtllm.command import trtllm_build_command
from kiln.engines.trtllm.contract import load_contract, option_spec
from kiln.pipeline.config import BuildSection, load_config
from kiln.pipeline.stages import trtllm_build_options
from kiln.runtime.plan import BuildPlan
from kiln.runtime.trtllm.engine import FINISH_REASONS
from kiln.runtime.trtllm.toolchain import is_supported_trtllm

REPO = Path(__file__).resolve().parents[1]
EXECUTOR = "tensorrt_llm.bindings.executor"


def flags_and_values(argv: list[str]) -> list[tuple[str, str | None]]:
    """(flag, value) pairs of an argv after the executable; a flag without a value gets None."""
    pairs, args = [], argv[1:]
    while args:
        flag, args = args[0], args[1:]
        value = None
        if args and not args[0].startswith("--"):
            value, args = args[0], args[1:]
        pairs.append((flag, value))
    return pairs


def llama3_fp8_command() -> list[str]:
    config = load_config(REPO / "configs" / "llama3-8b-fp8.yaml").config
    options = trtllm_build_options(config.build, config.build.plan(config.quantize.kv_cache_dtype))
    return trtllm_build_command(Path("/ckpt"), Path("/out"), options, quant_format=config.quantize.format,
                                kv_cache_dtype=config.quantize.kv_cache_dtype, timing_cache=Path("/cache/t.cache"))


COMMANDS = {
    "llama3-8b-fp8.yaml": llama3_fp8_command,
    "bf16, fp8 KV off, tp 2": lambda: trtllm_build_command(
        Path("/c"), Path("/o"), trtllm_build_options(BuildSection(tp_size=2, workers=2, log_level="debug"),
                                                  BuildPlan(8, 256, 512, 512, 16)),
        quant_format="none", kv_cache_dtype="auto", timing_cache=Path("/t")),
    "int4_awq": lambda: trtllm_build_command(
        Path("/c"), Path("/o"), trtllm_build_options(BuildSection(), BuildPlan(2, 128, 256, 256, 64)),
        quant_format="int4_awq", kv_cache_dtype="auto", timing_cache=Path("/t")),
    "fp8 small batch, fp8 KV": lambda: trtllm_build_command(
        Path("/c"), Path("/o"), trtllm_build_options(BuildSection(), BuildPlan(4, 128, 256, 256, 32)),
        quant_format="fp8", kv_cache_dtype="fp8", timing_cache=Path("/t")),
}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_emitted_flag_and_value_exists_in_trtllm_build_1_2_1(name):
    argv = COMMANDS[name]()
    assert argv[0] == load_contract()["trtllm_build"]["executable"]
    for flag, value in flags_and_values(argv):
        spec = option_spec(flag)
        assert spec is not None, f"{flag} is not a trtllm-build 1.2.1 option"
        if spec["kind"] == "flag":
            assert value is None, f"{flag} takes no value"
            continue
        assert value is not None, f"{flag} needs a value"
        if spec.get("type") == "int":
            assert int(value) > 0
        if "choices" in spec:
            assert (value.lower() if spec.get("case_insensitive") else value) in spec["choices"], (flag, value)


def test_parallel_sizes_are_never_passed_to_trtllm_build_which_reads_them_from_the_checkpoint():
    argv = COMMANDS["bf16, fp8 KV off, tp 2"]()
    not_options = load_contract()["trtllm_build"]["not_options"]
    assert not set(argv) & set(not_options)


def test_llama3_fp8_plan_carries_every_inflight_batching_prerequisite():
    pairs = dict(flags_and_values(llama3_fp8_command()))
    contract = load_contract()["inflight_batching"]
    assert pairs["--kv_cache_type"] == contract["requires"]["--kv_cache_type"] == "paged"
    assert pairs["--remove_input_padding"] == contract["requires"]["--remove_input_padding"] == "enable"
    assert pairs["--gpt_attention_plugin"] not in (None, "disable")
    for flag, value in contract["kv_block_reuse_and_chunked_context_require"].items():
        assert pairs[flag] == value
    assert pairs["--tokens_per_block"] == "32"
    assert (pairs["--max_batch_size"], pairs["--max_input_len"], pairs["--max_seq_len"], pairs["--max_num_tokens"]) \
        == ("256", "4096", "8192", "8192")
    assert pairs["--gemm_plugin"] == "disable"  # FP8 at batch 256: TensorRT's FP8 GEMMs, per NVIDIA's guidance


def _attribute_uses(path: Path, base: str) -> dict[str, set[str]]:
    """For each `<base>.<Name>(...)` call in a source file, the keyword names passed; bare uses get an empty set."""
    uses: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _is_base(node.value, base):
            uses.setdefault(node.attr, set())
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_base(node.func.value, base):
            uses.setdefault(node.func.attr, set()).update(k.arg for k in node.keywords if k.arg)
    return uses


def _is_base(node: ast.AST, base: str) -> bool:
    """`trtllm` or `self.trtllm`."""
    return (isinstance(node, ast.Name) and node.id == base) or (
        isinstance(node, ast.Attribute) and node.attr == base and isinstance(node.value, ast.Name))


def test_every_executor_name_and_keyword_the_adapter_uses_is_recorded():
    recorded = load_contract()["python"][EXECUTOR]
    uses = _attribute_uses(REPO / "runtime" / "trtllm" / "engine.py", "trtllm")
    assert {"Executor", "ExecutorConfig", "KvCacheConfig", "SchedulerConfig", "Request", "SamplingConfig",
            "OutputConfig", "ModelType"} <= set(uses)
    for name, keywords in uses.items():
        assert name in recorded, f"tensorrt_llm.bindings.executor.{name} is not recorded for 1.2.1"
        assert keywords <= set(recorded[name].get("kwargs", ())), (name, keywords - set(recorded[name]["kwargs"]))


def test_every_executor_method_the_adapter_calls_is_recorded():
    methods = load_contract()["python"][EXECUTOR]["Executor"]["methods"]
    uses = _attribute_uses(REPO / "runtime" / "trtllm" / "engine.py", "executor")
    assert {"enqueue_request", "await_responses", "cancel_request", "shutdown"} <= set(uses)
    for name, keywords in uses.items():
        assert name in methods, f"Executor.{name} is not recorded for 1.2.1"
        assert keywords <= set(methods[name]), (name, keywords)


def test_the_fixture_says_where_it_comes_from():
    provenance = load_contract()["provenance"]
    assert provenance["repository"] == "https://github.com/NVIDIA/TensorRT-LLM"
    assert provenance["tag"] == "v1.2.1"
    assert provenance["caveat"]
    for entry in provenance["files"]:
        assert entry["path"] and entry["what"]
        assert entry["commit"] is None or len(entry["commit"]) == 40


def binding_overloads(func: Any, name: str) -> list[set[str]]:
    """The parameter names of each overload of a callable, as a caller may pass them by keyword ("*args" and
    "**kwargs" for its catch-alls; self, cls and positional-only ones left out): from ``inspect.signature`` where
    Python gives one, and from the signatures nanobind and pybind11 write into ``__doc__`` (one per overload; a
    binding often has no ``__text_signature__``)."""
    overloads = doc_overloads(getattr(func, "__doc__", None) or "", name)
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return overloads
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [{stars.get(p.kind, "") + p.name for p in signature.parameters.values()
             if p.kind is not inspect.Parameter.POSITIONAL_ONLY} - {"self", "cls"}, *overloads]


def doc_overloads(doc: str, name: str) -> list[set[str]]:
    """The parameter names of every ``name(...)`` signature in a docstring (nanobind: ``name(self, x: int = 1, /)``;
    pybind11: ``name(self: T, x: int = 1)``, numbered after "Overloaded function."); brackets, quotes and defaults
    that hold commas or parentheses are skipped over."""
    overloads = []
    for match in re.finditer(rf"(?<!\w){re.escape(name)}\(", doc):
        if (params := _top_level_split(doc, match.end())) is not None:
            overloads.append(_parameter_names(params))
    return overloads


def _top_level_split(text: str, start: int) -> list[str] | None:
    """The comma-separated parts of the parenthesised list that opens just before ``start``; None if it never closes."""
    parts, depth, quote, begin = [], 0, "", start
    for i in range(start, len(text)):
        char = text[i]
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{<":
            depth += 1
        elif char in ")]}>" and not (char == ">" and text[i - 1] == "-"):
            if depth == 0:
                return [*parts, text[begin:i]] if char == ")" else None
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[begin:i])
            begin = i + 1
    return None


def _parameter_names(params: list[str]) -> set[str]:
    names: set[str] = set()
    for param in map(str.strip, params):
        if param == "/":  # the ones before it are positional-only
            names.clear()
        elif match := re.match(r"\*{0,2}[A-Za-z_]\w*", param):
            names.add(match.group())
    return names - {"self", "cls"}


SPEC_KEYS = ("values", "attributes", "methods", "classmethods", "kwargs", "init", "notes")
LOAD_ERROR = "then_at_load_with_chunked_context"  # what the executor says at load of a build switched off


def python_mismatches(python: dict[str, dict], import_module: Callable[[str], Any] = importlib.import_module
                      ) -> list[str]:
    """Every entry of the contract's ``python`` section that the modules ``import_module`` gives do not have: a
    module, class, enum value, attribute (on the class, else on one constructed without arguments) or method that
    is missing, a keyword no overload of a constructor or method takes, or a record key this check does not know."""
    problems = []
    for module_name, entries in python.items():
        try:
            module = import_module(module_name)
        except ImportError as e:
            problems.append(f"{module_name} does not import: {e}")
            continue
        for name, spec in entries.items():
            if name in SPEC_KEYS:  # the module's own entry (tensorrt_llm.__version__)
                problems += _spec_mismatches(module_name, module, {name: spec})
            elif not hasattr(module, name):
                problems.append(f"{module_name}.{name} is missing")
            else:
                problems += _spec_mismatches(f"{module_name}.{name}", getattr(module, name), spec)
    return problems


def _spec_mismatches(where: str, obj: Any, spec: dict[str, Any]) -> list[str]:
    problems = []
    for key, recorded in spec.items():
        if key in ("values", "attributes"):
            instance = _constructed(obj) if key == "attributes" else None
            problems += [f"{where}.{name} is missing" for name in recorded
                         if not (hasattr(obj, name) or hasattr(instance, name))]
        elif key in ("methods", "classmethods"):
            methods = recorded.items() if isinstance(recorded, dict) else ((m, ()) for m in recorded)
            for method, keywords in methods:
                if not hasattr(obj, method):
                    problems.append(f"{where}.{method} is missing")
                else:
                    problems += _keyword_mismatches(f"{where}.{method}", getattr(obj, method), method, keywords)
        elif key in ("kwargs", "init"):
            problems += _keyword_mismatches(where, obj.__init__, "__init__", recorded)
        elif key != "notes":
            problems.append(f"{where}: the record's {key!r} is not one this test checks ({', '.join(SPEC_KEYS)})")
    return problems


def _constructed(cls: Any) -> Any:
    """An instance made without arguments, None when the class needs some (or is not a class)."""
    try:
        return cls() if isinstance(cls, type) else None
    except Exception:
        return None


def _keyword_mismatches(where: str, func: Any, name: str, keywords: Iterable[str]) -> list[str]:
    wanted = set(keywords)
    if not wanted:
        return []
    overloads = binding_overloads(func, name)
    if any(wanted <= names for names in overloads):
        return []
    closest = max(overloads, key=lambda names: len(wanted & names), default=set())
    return [f"{where} takes no {sorted(wanted - closest)} (the overloads it shows: {[sorted(o) for o in overloads]})"]


def build_option_mismatches(options: dict[str, dict], not_options: Iterable[str],
                            parser: argparse.ArgumentParser) -> list[str]:
    """Every recorded trtllm-build option whose flag, aliases, kind (flag, value, values), int type or choices the
    parser does not have, and every option the record says it lacks that it has. A choice counts when the parser
    takes it (through its ``type``, as an enum's from-string converter, and its ``choices``)."""
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    problems = [f"{flag} is an option, though the record says it is not" for flag in not_options if flag in actions]
    kinds = {"flag": (0,), "value": (None, "?"), "values": ("+", "*")}
    for flag, spec in options.items():
        action = actions.get(flag)
        if action is None:
            problems.append(f"{flag} is not an option")
            continue
        problems += [f"{alias} is not an alias of {flag}" for alias in spec.get("aliases", ())
                     if actions.get(alias) is not action]
        if action.nargs not in kinds[spec["kind"]]:
            problems.append(f"{flag} takes nargs {action.nargs!r}, not a {spec['kind']}")
        if spec.get("type") == "int" and action.type is not int:
            problems.append(f"{flag} is not an int option")
        problems += [f"{flag} does not take {choice!r}" for choice in spec.get("choices", ())
                     if not _takes(action, choice)]
    return problems


def _takes(action: argparse.Action, value: str) -> bool:
    try:
        converted = action.type(value) if callable(action.type) else value
    except Exception:  # whatever the converter raises (an enum's from_string: a C++ exception's RuntimeError)
        return False
    return action.choices is None or converted in action.choices


def missing_messages(messages: Iterable[str], texts: Iterable[Any]) -> list[str]:
    """The messages found in none of ``texts`` (bytes, or a mapped file)."""
    texts = list(texts)
    return [m for m in messages if not any(text.find(m.encode()) != -1 for text in texts)]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None, reason="TensorRT-LLM is not installed here")
def test_fixture_matches_installed_tensorrt_llm():  # pragma: no cover - runs only where TensorRT-LLM is installed
    import tensorrt_llm
    from tensorrt_llm.commands.build import parse_arguments

    contract = load_contract()
    assert is_supported_trtllm(tensorrt_llm.__version__), (tensorrt_llm.__version__, contract["supported"])
    build = contract["trtllm_build"]
    problems = build_option_mismatches(build["options"], build["not_options"], parse_arguments())
    problems += python_mismatches(contract["python"])
    scripts = [s.value for s in importlib.metadata.entry_points(group="console_scripts", name=build["executable"])]
    if scripts != [build["entry_point"]]:
        problems.append(f"{build['executable']} runs {scripts}, not {build['entry_point']}")
    switches = contract["build_switches_off"]
    builder = Path(importlib.util.find_spec("tensorrt_llm.builder").origin)
    warnings = [s["warning"] for s in switches if "warning" in s]
    problems += [f"{builder} does not say {m!r}" for m in missing_messages(warnings, [builder.read_bytes()])]
    library = next(Path(tensorrt_llm.__file__).parent.rglob("libtensorrt_llm.so"), None)
    if library is None:
        problems.append("libtensorrt_llm.so is not in the tensorrt_llm package: the executor's messages are unchecked")
    else:
        load_errors = {contract["inflight_batching"]["load_error"],
                       *(s[LOAD_ERROR] for s in switches if LOAD_ERROR in s)}
        with library.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as text:
            problems += [f"{library} does not say {m!r}" for m in missing_messages(sorted(load_errors), [text])]
    assert not problems, "\n".join(problems)


class _Binding:
    """A nanobind function as Python sees it: its signatures in ``__doc__``, none that ``inspect`` can read."""

    def __init__(self, name: str, params: Iterable[str]) -> None:
        rendered = ", ".join(p if p.startswith("*") else f"{p}: object = None" for p in params)
        self.__name__, self.__doc__ = name, f"{name}(self, {rendered}) -> None"


def fake_bindings(python: dict[str, dict]) -> dict[str, types.ModuleType]:
    """Modules that have exactly what the ``python`` record lists, built as nanobind builds them."""
    modules = {}
    for module_name, entries in python.items():
        module = modules[module_name] = types.ModuleType(module_name)
        for name, spec in entries.items():
            if name in SPEC_KEYS:
                module.__dict__.update(dict.fromkeys(spec, "1.2.1"))
                continue
            members: dict[str, Any] = dict.fromkeys([*spec.get("values", ()), *spec.get("attributes", ())])
            members["__init__"] = _Binding("__init__", spec.get("kwargs", spec.get("init", ())))
            for key in ("methods", "classmethods"):
                methods = spec.get(key, {})
                members.update({m: _Binding(m, methods[m] if isinstance(methods, dict) else ()) for m in methods})
            setattr(module, name, type(name, (), members))
    return modules


def test_signatures_are_read_from_python_and_from_nanobind_and_pybind11_docstrings():
    def python(self, a, /, b, *args, c=1, **kw):
        pass

    assert binding_overloads(python, "python") == [{"b", "*args", "c", "**kw"}]
    nanobind = ("__init__(self, arg: int, /, top_k: int | None = None, seed: dict[str, tuple[int, int]] = {'a': (1, 2)}"
                ", timeout: datetime.timedelta = datetime.timedelta(seconds=1), name: str = 'a,b)') -> None")
    assert doc_overloads(nanobind, "__init__") == [{"top_k", "seed", "timeout", "name"}]
    pybind11 = ("__init__(*args, **kwargs)\nOverloaded function.\n\n1. __init__(self: executor.Executor, model_path: "
                "os.PathLike, cb: Callable[[int], None], config: std::map<std::string, int, std::less<void>> = {})"
                " -> None\n\n2. __init__(self: executor.Executor, engine_buffer: buffer) -> None\n\nmy__init__(x)")
    assert doc_overloads(pybind11, "__init__") == [{"*args", "**kwargs"}, {"model_path", "cb", "config"},
                                                   {"engine_buffer"}]


def test_the_installed_check_passes_the_record_itself_and_names_each_difference():
    python = load_contract()["python"]
    modules = fake_bindings(python)
    assert python_mismatches(python, modules.__getitem__) == []
    executor = modules[EXECUTOR]
    executor.SamplingConfig.__init__ = _Binding("__init__", ["top_k", "top_p"])
    lacking = sorted(set(python[EXECUTOR]["SamplingConfig"]["kwargs"]) - {"top_k", "top_p"})
    del executor.FinishReason.END_ID, executor.Result.is_final
    executor.Executor.await_responses = _Binding("await_responses", ["id"])
    del modules["tensorrt_llm.mapping"].Mapping
    broken = {**python, EXECUTOR: {**python[EXECUTOR], "ModelType": {"fields": ["x"]}}}
    problems = python_mismatches(broken, modules.__getitem__)
    assert problems[0] == "tensorrt_llm.mapping.Mapping is missing"
    assert [p.split(" (")[0] for p in problems[1:]] == [
        f"{EXECUTOR}.Executor.await_responses takes no ['timeout']",
        f"{EXECUTOR}.ModelType: the record's 'fields' is not one this test checks",
        f"{EXECUTOR}.FinishReason.END_ID is missing",
        f"{EXECUTOR}.SamplingConfig takes no {lacking}",
        f"{EXECUTOR}.Result.is_final is missing"]
    assert missing_messages(["in", "out"], [b"a message in"]) == ["out"]


def kv_cache_type_from_string(value: str) -> str:
    """What 1.2's ``enum_type(KVCacheType)`` does: upper-case, and refuse (a C++ exception) a name it lacks."""
    if value.upper() not in ("CONTINUOUS", "PAGED", "DISABLED"):
        raise RuntimeError(f"Invalid KV cache type: {value}")
    return value.upper()


def test_the_installed_build_options_check_passes_the_record_itself_and_names_each_difference():
    build = load_contract()["trtllm_build"]

    def parser(drop: str = "", extra: str = "") -> argparse.ArgumentParser:
        made = argparse.ArgumentParser()
        for flag, spec in build["options"].items():
            if flag == drop:
                continue
            if spec["kind"] == "flag":
                made.add_argument(flag, *spec.get("aliases", ()), action="store_true")
            elif flag == "--kv_cache_type":  # as 1.2 does it: an enum's from_string, no choices
                made.add_argument(flag, type=kv_cache_type_from_string)
            else:
                made.add_argument(flag, *spec.get("aliases", ()), type=int if spec.get("type") == "int" else str,
                                  nargs="+" if spec["kind"] == "values" else None, choices=spec.get("choices"))
        if extra:
            made.add_argument(extra)
        return made

    assert build_option_mismatches(build["options"], build["not_options"], parser()) == []
    options = {**build["options"], "--log_level": {**build["options"]["--log_level"], "choices": ["chatty"]}}
    assert build_option_mismatches(options, build["not_options"], parser(drop="--workers", extra="--tp_size")) == [
        "--tp_size is an option, though the record says it is not", "--workers is not an option",
        "--log_level does not take 'chatty'"]
    assert build_option_mismatches({"--kv_cache_type": {"kind": "value", "choices": ["pagged"]}}, (), parser()) == [
        "--kv_cache_type does not take 'pagged'"]


def test_enum_values_the_adapter_uses_are_recorded():
    recorded = load_contract()["python"][EXECUTOR]
    source = (REPO / "runtime" / "trtllm" / "engine.py").read_text()
    used = set(re.findall(r"trtllm\.(\w+)\.([A-Z_]+)\b", source))
    assert used, "the adapter names no enum values"
    for enum, value in used:
        assert value in recorded[enum]["values"], f"{enum}.{value}"
    assert set(FINISH_REASONS) <= set(recorded["FinishReason"]["values"])
