"""The engine key changes with everything that changes the engine, and with nothing else."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from kiln.engines.native.tuning import tuning_material
from kiln.pipeline import key_material, runner
from kiln.pipeline.source_hash import ENGINE_SOURCES, KILN_ROOT, engine_sources_hash, source_hash
from kiln.runtime.options import RuntimeOptions

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny-llama"

BASE = """model:
  path: {model}
  dtype: bfloat16
quantize:
  format: fp8
build:
  max_seq_len: 512
  max_input_len: 256
  log_level: info
  workers: 1
cache:
  dir: {cache}
"""


@pytest.fixture
def model_copy(tmp_path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    return model


def engine_key(tmp_path: Path, model: Path, *, edit=lambda text: text, name: str = "kiln.yaml",
               options: RuntimeOptions | None = None) -> str:
    config = tmp_path / name
    config.write_text(edit(BASE.format(model=model, cache=tmp_path / "cache")))
    key = runner.prepare(config, backend="native", force=False, dry_run=True,
                         options=options or RuntimeOptions()).engine_key
    assert key is not None and len(key) == 64
    return key


def test_same_inputs_give_the_same_key(tmp_path, model_copy):
    assert engine_key(tmp_path, model_copy) == engine_key(tmp_path, model_copy)


def test_key_changes_when_one_weight_byte_changes(tmp_path, model_copy):
    before = engine_key(tmp_path, model_copy)
    weights = model_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    assert engine_key(tmp_path, model_copy) != before


@pytest.mark.parametrize("old,new", [
    ("format: fp8", "format: int4_awq"),        # the recipe's format
    ("format: fp8", "format: fp8\n  seed: 7"),  # the recipe's seed
    ("dtype: bfloat16", "dtype: float16"),      # the model dtype
    ("max_seq_len: 512", "max_seq_len: 384"),  # a semantic build option
])
def test_key_changes_with_recipe_and_semantic_build_options(tmp_path, model_copy, old, new):
    assert engine_key(tmp_path, model_copy) != engine_key(tmp_path, model_copy, edit=lambda t: t.replace(old, new))


@pytest.mark.parametrize("old,new", [
    ("log_level: info", "log_level: debug"),
    ("workers: 1", "workers: 8"),
    ("cache:\n  dir: ", "cache:\n  max_entries: 3\n  dir: "),
])
def test_key_ignores_log_level_workers_and_cache_settings(tmp_path, model_copy, old, new):
    assert engine_key(tmp_path, model_copy) == engine_key(tmp_path, model_copy, edit=lambda t: t.replace(old, new))


def test_runtime_options_enter_the_key_only_where_they_change_what_the_build_writes(tmp_path, model_copy):
    # a CUDA build times the FP8 kernels only with the Triton kernels on; a CPU build measures nothing
    assert tuning_material("cuda", "triton") != tuning_material("cuda", "torch")
    assert tuning_material("cpu", "triton") == tuning_material("cpu", "torch") == {}
    torch_kernels = engine_key(tmp_path, model_copy, options=RuntimeOptions(kernels="torch"))
    assert (torch_kernels == engine_key(tmp_path, model_copy)) == (not torch.cuda.is_available())
    # (pdl and the Triton kernels' other settings are refused on a CPU, where this build may run)
    assert engine_key(tmp_path, model_copy, options=RuntimeOptions(
        scheduler_policy="guaranteed_no_evict", overlap_steps=False, num_kv_blocks=9, cuda_graphs=False,
        prefix_caching=False)) == engine_key(tmp_path, model_copy)


def test_key_ignores_where_the_checkpoint_and_config_live(tmp_path, model_copy):
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(model_copy, moved)
    assert engine_key(tmp_path, model_copy) == engine_key(tmp_path, moved, name="other-name.yaml")


# values no machine has, so that the key changes wherever the test runs (on an H200, "NVIDIA H200" would not)
@pytest.mark.parametrize("field,value", [("torch", "9.9"), ("triton", "9.9.9"), ("gpu_name", "No Such GPU"),
                                         ("compute_capability", "99.9")])
def test_key_changes_with_toolchain_and_gpu(tmp_path, model_copy, monkeypatch, field, value):
    before = engine_key(tmp_path, model_copy)
    real = key_material.machine_fingerprint
    monkeypatch.setattr(key_material, "machine_fingerprint", lambda device: {**real(device), field: value})
    assert engine_key(tmp_path, model_copy) != before


def real_material(tmp_path: Path, model: Path) -> dict:
    config = tmp_path / "material.yaml"
    config.write_text(BASE.format(model=model, cache=tmp_path / "cache"))
    return runner.prepare(config, backend="native", force=False, dry_run=True, options=RuntimeOptions()).material


def leaves(node: object, path: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        return [leaf for name, child in node.items() for leaf in leaves(child, (*path, name))]
    return [path]


# what must change an engine's key; a field dropped from the pipeline's material fails here
REQUIRED_FIELDS = {"key_schema", "kind", "checkpoint", "model_dtype", "backend", "engine_format_version",
                   "quantization.quantized_key", "quantization.recipe.format", "quantization.recipe.kv_cache_dtype",
                   "quantization.recipe.dataset_sha256", "quantization.recipe.modelopt",
                   "build.max_batch_size", "build.max_input_len", "build.max_seq_len", "build.max_num_tokens",
                   "build.tokens_per_block", "toolchain.kiln", "toolchain.kiln_sources", "toolchain.transformers",
                   "toolchain.torch", "toolchain.triton", "toolchain.cuda",
                   "hardware.device", "hardware.gpu_name", "hardware.compute_capability", "hardware.tp_size",
                   "hardware.pp_size"}


def test_every_field_of_the_pipelines_real_key_material_changes_the_key(tmp_path, model_copy):
    from kiln.engines.cache import engine_key as key_of

    material = real_material(tmp_path, model_copy)
    paths = leaves(material)
    assert {".".join(path) for path in paths} >= REQUIRED_FIELDS
    for path in paths:  # generated from the material itself: a new field is covered without editing this test
        edited = copy.deepcopy(material)
        node = edited
        for name in path[:-1]:
            node = node[name]
        node[path[-1]] = [node[path[-1]], "changed"]
        assert key_of(edited) != key_of(material), ".".join(path)


def test_another_kiln_version_misses_the_engines_of_this_one(tmp_path, model_copy, monkeypatch):
    before = engine_key(tmp_path, model_copy)
    monkeypatch.setattr(key_material, "kiln_version", lambda: "99.0.0")
    assert engine_key(tmp_path, model_copy) != before


@pytest.mark.parametrize("sources", ["engine_sources_hash", "quantized_sources_hash"])
def test_another_revision_of_kilns_build_or_calibration_code_misses_the_engines_of_this_one(tmp_path, model_copy,
                                                                                            monkeypatch, sources):
    before = engine_key(tmp_path, model_copy)  # FP8: the quantized checkpoint's key is part of the engine's
    monkeypatch.setattr(key_material, sources, lambda *backend: "0" * 64)
    assert engine_key(tmp_path, model_copy) != before


@pytest.fixture(scope="module")
def kiln_sources(tmp_path_factory) -> Path:
    """A copy of Kiln's own ``*.py`` files, to edit."""
    copy = tmp_path_factory.mktemp("kiln")
    for path in KILN_ROOT.rglob("*.py"):
        rel = path.relative_to(KILN_ROOT)
        if rel.parts[0] in ("engines", "runtime", "pipeline", "calibration"):
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy / rel)
    return copy


@pytest.mark.parametrize(("backend", "changed", "rekeys"), [
    ("native", "engines/native/builder.py", True), ("native", "runtime/native/model/llama.py", True),
    ("native", "runtime/native/engine_format.py", True), ("native", "runtime/native/parallel/sharding.py", True),
    ("native", "pipeline/stages.py", True), ("native", "pipeline/tokenizer_files.py", True),
    ("native", "runtime/native/engine.py", False), ("native", "runtime/native/scheduler.py", False),
    ("native", "runtime/native/parallel/launch.py", False), ("native", "engines/cache/store.py", False),
    ("native", "runtime/server/app.py", False), ("native", "runtime/llm.py", False),
    ("native", "pipeline/cli.py", False), ("native", "runtime/tokenizer_files.py", True),
    ("native", "runtime/tokenizer.py", False), ("native", "runtime/sampling_params.py", False),  # request-time: a
    ("native", "runtime/structured_output.py", False),  # detokenizer fix rebuilt every engine
    ("trtllm", "runtime/tokenizer_files.py", True), ("trtllm", "runtime/tokenizer.py", False),
    ("trtllm", "engines/trtllm/builder.py", True), ("trtllm", "pipeline/config.py", True),
    ("trtllm", "runtime/native/kernels/fp8_gemv.py", False), ("trtllm", "runtime/trtllm/engine.py", False),
])
def test_the_source_hash_follows_the_code_that_builds_a_backends_engines_not_what_stores_or_serves_them(
        kiln_sources, backend, changed, rekeys):
    before = source_hash(kiln_sources, ENGINE_SOURCES[backend])
    original = (kiln_sources / changed).read_text()
    (kiln_sources / changed).write_text(original + "# edited\n")
    try:
        assert (source_hash(kiln_sources, ENGINE_SOURCES[backend]) != before) is rekeys
    finally:
        (kiln_sources / changed).write_text(original)


def test_a_module_the_builder_comes_to_import_is_hashed_from_then_on(kiln_sources):
    assert source_hash(kiln_sources, ENGINE_SOURCES["native"]) == engine_sources_hash("native")  # as installed
    builder = kiln_sources / "engines/native/builder.py"
    original = builder.read_text()
    (kiln_sources / "engines/native/helper.py").write_text("x = 1\n")
    builder.write_text(original + "from kiln.engines.native.helper import x\n")
    try:
        before = source_hash(kiln_sources, ENGINE_SOURCES["native"])
        (kiln_sources / "engines/native/helper.py").write_text("x = 2\n")
        assert source_hash(kiln_sources, ENGINE_SOURCES["native"]) != before
    finally:
        builder.write_text(original)


def test_a_new_engine_format_version_misses_the_engines_of_the_old_one(tmp_path, model_copy, monkeypatch):
    before = engine_key(tmp_path, model_copy)
    monkeypatch.setattr(key_material, "ENGINE_FORMAT_VERSION", key_material.ENGINE_FORMAT_VERSION + 1)
    assert engine_key(tmp_path, model_copy) != before


def test_a_config_with_only_model_path_gets_limits_the_model_can_hold(tmp_path, model_copy):
    config = tmp_path / "only.yaml"
    config.write_text(f"model:\n  path: {model_copy}\ncache:\n  dir: {tmp_path / 'cache'}\n")
    ctx = runner.prepare(config, backend="native", force=False, dry_run=True, options=RuntimeOptions())
    assert (ctx.material["build"]["max_seq_len"], ctx.material["build"]["max_input_len"]) == (512, 256)


def test_a_dry_run_refuses_a_plan_the_model_cannot_hold_as_the_build_would(tmp_path, model_copy):
    from kiln.runtime.errors import KilnError

    with pytest.raises(KilnError, match=r"max_seq_len \(1024\) exceeds the model's max_position_embeddings \(512\)"):
        engine_key(tmp_path, model_copy, edit=lambda text: text.replace("max_seq_len: 512", "max_seq_len: 1024"))


def test_a_dry_run_refuses_a_checkpoint_the_quantize_stage_cannot_export_as_the_build_would(tmp_path, model_copy):
    from kiln.calibration.errors import CalibrationError

    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    with pytest.raises(CalibrationError, match="no 'architectures' entry"):
        engine_key(tmp_path, model_copy)
    assert engine_key(tmp_path, model_copy, edit=lambda text: text.replace("format: fp8", "format: none"))


def test_a_dry_run_refuses_int4_awq_for_input_features_that_are_not_whole_groups(tmp_path, model_copy):
    from kiln.runtime.errors import KilnError

    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "intermediate_size": 320}))
    with pytest.raises(KilnError, match=r"int4_awq needs in-features divisible by 128, but intermediate_size "
                                        r"\(down_proj input\) 320 are not; make fp8 the primary format"):
        engine_key(tmp_path, model_copy, edit=lambda text: text.replace("format: fp8", "format: int4_awq"))
    fallback = "format: fp8\n  fallback: [int4_awq, none]"
    with pytest.raises(KilnError, match="320 are not; remove int4_awq from quantize.fallback"):  # before: after fp8
        engine_key(tmp_path, model_copy, edit=lambda text: text.replace("format: fp8", fallback))  # calibrated
    assert engine_key(tmp_path, model_copy)  # fp8 takes any width


def test_a_dry_run_refuses_a_tp_size_the_model_cannot_split_and_any_pp_size(tmp_path, model_copy):
    from kiln.runtime.errors import KilnError

    with pytest.raises(KilnError, match=r"build.tp_size 3 cannot split this model: num_attention_heads \(\d+\) is not"):
        engine_key(tmp_path, model_copy, edit=lambda text: text.replace("build:\n", "build:\n  tp_size: 3\n"))
    with pytest.raises(KilnError, match="build.pp_size 2: the native backend has no pipeline parallelism"):
        engine_key(tmp_path, model_copy, edit=lambda text: text.replace("build:\n", "build:\n  pp_size: 2\n"))
    two = engine_key(tmp_path, model_copy, edit=lambda text: text.replace("build:\n", "build:\n  tp_size: 2\n"))
    assert two != engine_key(tmp_path, model_copy)


def test_a_dry_run_refuses_a_tp_size_that_splits_the_int4_groups_the_quantize_stage_will_make(tmp_path, model_copy):
    from kiln.runtime.errors import KilnError

    def int4_over(tp_size: int, fmt: str = "int4_awq"):
        return lambda text: text.replace("format: fp8", f"format: {fmt}").replace(
            "build:\n", f"build:\n  tp_size: {tp_size}\n")

    with pytest.raises(KilnError, match=r"tp_size 4 cannot split this model: the attention output \(256 features\) "
                                        r"over tp_size 4 splits an INT4 group of 128"):
        engine_key(tmp_path, model_copy, edit=int4_over(4))
    with pytest.raises(KilnError, match="splits an INT4 group of 128"):  # a fallback to int4_awq counts too
        engine_key(tmp_path, model_copy, edit=lambda text: int4_over(4, "fp8\n  fallback: [int4_awq]")(text))
    assert engine_key(tmp_path, model_copy, edit=int4_over(2))
