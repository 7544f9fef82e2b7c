"""Every flag and Python name Kiln uses exists in TensorRT-LLM 1.2.1, as recorded in engines/trtllm/contract."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from kiln.engines.trtllm.command import trtllm_build_command
from kiln.engines.trtllm.contract import load_contract, option_spec
from kiln.pipeline.config import BuildSection, load_config
from kiln.pipeline.stages import trtllm_build_options
from kiln.runtime.plan import BuildPlan
from kiln.runtime.trtllm.engine import FINISH_REASONS

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


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None, reason="TensorRT-LLM is not installed here")
def test_fixture_matches_installed_tensorrt_llm():  # pragma: no cover - runs only where TensorRT-LLM is installed
    import tensorrt_llm
    import tensorrt_llm.bindings.executor as executor
    from tensorrt_llm.commands.build import parse_arguments

    contract = load_contract()
    assert tensorrt_llm.__version__ == contract["version"]
    parser_flags = {s for action in parse_arguments()._actions for s in action.option_strings}
    for flag, spec in contract["trtllm_build"]["options"].items():
        assert {flag, *spec.get("aliases", ())} <= parser_flags, flag
    for name, spec in contract["python"][EXECUTOR].items():
        cls = getattr(executor, name)
        for value in spec.get("values", ()):
            assert hasattr(cls, value), f"{name}.{value}"
        for method in spec.get("methods", ()):
            assert hasattr(cls, method), f"{name}.{method}"


def test_enum_values_the_adapter_uses_are_recorded():
    recorded = load_contract()["python"][EXECUTOR]
    source = (REPO / "runtime" / "trtllm" / "engine.py").read_text()
    used = set(re.findall(r"trtllm\.(\w+)\.([A-Z_]+)\b", source))
    assert used, "the adapter names no enum values"
    for enum, value in used:
        assert value in recorded[enum]["values"], f"{enum}.{value}"
    assert set(FINISH_REASONS) <= set(recorded["FinishReason"]["values"])
