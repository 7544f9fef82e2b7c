"""Config validation: good files load; bad ones name file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.pipeline.config import CONFIGS_DIR, ConfigError, find_config, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kiln.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", sorted(CONFIGS_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    assert load_config(path).config.model.path


def test_bare_name_resolves_under_the_bundled_configs():
    assert find_config("tiny-llama-fp8.yaml") == CONFIGS_DIR / "tiny-llama-fp8.yaml"
    assert find_config("tiny-llama-fp8") == CONFIGS_DIR / "tiny-llama-fp8.yaml"
    assert find_config("llama3-8b") == CONFIGS_DIR / "models" / "llama3-8b.json"  # an architecture file
    assert find_config("no-such-config") is None and find_config("configs/no/such.yaml") is None


def test_a_bare_name_finds_a_copy_in_the_current_folder_before_the_bundled_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-llama-fp8.yaml").write_text("model:\n  path: ./edited\n")  # copied here to edit
    assert find_config("tiny-llama-fp8") == tmp_path / "tiny-llama-fp8.yaml"  # before: the bundled one, unedited
    assert find_config("tiny-llama-int4-awq") == CONFIGS_DIR / "tiny-llama-int4-awq.yaml"
    (tmp_path / "tiny-llama-int4-awq.json").write_text("{}")  # a saved --json report is no config
    assert find_config("tiny-llama-int4-awq") == CONFIGS_DIR / "tiny-llama-int4-awq.yaml"


def test_a_configs_path_as_the_docs_write_it_resolves_to_the_bundled_file_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config("configs/models/llama3-8b.json") == CONFIGS_DIR / "models" / "llama3-8b.json"
    assert find_config("configs/tiny-llama-fp8.yaml") == CONFIGS_DIR / "tiny-llama-fp8.yaml"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-llama-fp8.yaml").write_text("model:\n  path: ./mine\n")
    assert find_config("configs/tiny-llama-fp8.yaml") == tmp_path.resolve() / "configs" / "tiny-llama-fp8.yaml"


def test_defaults_fill_every_section_but_the_model(tmp_path):
    config = load_config(write(tmp_path, "model:\n  path: org/some-model\n")).config
    assert config.model.dtype == "bfloat16"
    assert config.quantize.format == "none"
    assert config.build.backend == "auto"
    assert config.serve.host == "127.0.0.1"


def test_relative_model_path_is_taken_from_the_config_folder(tmp_path):
    config = load_config(write(tmp_path, "model:\n  path: ./weights\n")).config
    assert config.model.path == str((tmp_path / "weights").resolve())


def test_unknown_key_names_file_line_and_field(tmp_path):
    path = write(tmp_path, "model:\n  path: org/m\nbuild:\n  max_batch_size: 4\n  max_bach_size: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}:5: build.max_bach_size: unknown key 'max_bach_size'")


def test_wrong_type_names_the_field_and_value(tmp_path):
    path = write(tmp_path, "model:\n  path: org/m\nbuild:\n  max_seq_len: lots\n")
    with pytest.raises(ConfigError, match=r"kiln.yaml:4: build.max_seq_len: .*integer.*'lots'"):
        load_config(path)


def test_impossible_lengths_point_at_the_offending_field(tmp_path):
    path = write(tmp_path, "model:\n  path: org/m\nbuild:\n  max_seq_len: 8192\n  max_input_len: 16384\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:5: build.max_input_len (16384) must not exceed build.max_seq_len (8192)"


def test_bad_dtype_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r":3: model.dtype: .*'bfloat16'.*'int3'"):
        load_config(write(tmp_path, "model:\n  path: org/m\n  dtype: int3\n"))


def test_missing_model_section_is_required(tmp_path):
    with pytest.raises(ConfigError, match=r"kiln.yaml:1: model: is required"):
        load_config(write(tmp_path, "build:\n  max_batch_size: 4\n"))


def test_missing_file_and_bad_yaml_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="a folder, not a config file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"kiln.yaml:\d+: not valid YAML"):
        load_config(write(tmp_path, "model:\n  path: [unclosed\n"))


def test_unknown_quantize_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r":4: quantize.formatt: unknown key"):
        load_config(write(tmp_path, "model:\n  path: org/m\nquantize:\n  formatt: fp8\n"))


def test_a_model_path_that_is_a_link_loop_loads_and_is_reported_where_it_is_used(tmp_path):
    from kiln.pipeline.model_source import ModelNotFoundError, resolve_model

    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "kiln.yaml").write_text("model:\n  path: ./loop\n")
    loaded = load_config(tmp_path / "kiln.yaml")  # resolving the link would raise RuntimeError: Symlink loop
    assert loaded.config.model.path == str(tmp_path / "loop")
    with pytest.raises(ModelNotFoundError, match="is not a directory"):
        resolve_model(loaded.config.model)


def test_a_bundled_config_copied_elsewhere_is_told_where_the_bundled_model_is(tmp_path):
    from kiln.pipeline.model_source import ModelNotFoundError, resolve_model

    copy = tmp_path / "tiny-llama-fp8.yaml"
    copy.write_text((CONFIGS_DIR / "tiny-llama-fp8.yaml").read_text())  # its model.path: ../models/tiny-llama
    bundled = CONFIGS_DIR.parent / "models" / "tiny-llama"
    with pytest.raises(ModelNotFoundError, match=f"Kiln's bundled model is {bundled}: point model.path there"):
        resolve_model(load_config(copy).config.model)


@pytest.mark.parametrize(("files", "problem"), [
    ({}, "has no config.json"),
    ({"config.json": "{}", "pytorch_model.bin": ""}, r"holds pickle weights \(\*.bin / \*.pt\) only"),
    ({"config.json": "{}"}, r"has no \*.safetensors weights"),
    ({"config.json": "{}", "model-00001-of-00002.safetensors": ""}, "shards but no model.safetensors.index.json"),
    ({"config.json": "{}", "model-00001-of-00002.safetensors": "", "model.safetensors.index.json":
      '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'},
     r"naming 1 shard\(s\) not on disk \(model-00002-of-00002.safetensors\): an interrupted download"),
    ({"config.json": "{}", "model.safetensors": "", "model.safetensors.index.json": '{"weight_map": {}}'},
     r"has both model.safetensors and model.safetensors.index.json, which tools read differently .*; remove the "
     r"stale one$"),
])
def test_a_local_model_folder_kiln_cannot_read_is_refused_naming_what_is_missing(tmp_path, files, problem):
    from kiln.pipeline.model_source import ModelNotFoundError, resolve_model

    model = tmp_path / "model"
    model.mkdir()
    for name, text in files.items():
        (model / name).write_text(text)
    (tmp_path / "kiln.yaml").write_text("model:\n  path: ./model\n")
    with pytest.raises(ModelNotFoundError, match=problem):
        resolve_model(load_config(tmp_path / "kiln.yaml").config.model)


def test_a_build_refuses_a_folder_with_both_a_single_file_save_and_a_shard_index_in_one_line(tmp_path):
    import json

    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_text("")
    (model / "model-00001-of-00001.safetensors").write_text("")
    (model / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00001.safetensors"}}')
    (tmp_path / "kiln.yaml").write_text(f"model:\n  path: ./model\ncache:\n  dir: {tmp_path / 'cache'}\n")
    result = CliRunner().invoke(app, ["build", str(tmp_path / "kiln.yaml"), "--json"])
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]["message"]
    assert error.startswith(f"model.path {model} has both model.safetensors and model.safetensors.index.json")


def test_a_hugging_face_cache_snapshot_with_a_shard_still_downloading_is_named_as_such(tmp_path, monkeypatch):
    from kiln.pipeline.config import ModelSection
    from kiln.pipeline.model_source import ModelNotFoundError, resolve_model

    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d.incomplete").write_text("")  # huggingface_hub links it into the snapshot once whole
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model-00001-of-00002.safetensors").write_text("")
    (snapshot / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(ModelSection(path="acme/tiny"))
    assert str(err.value) == (
        f"model 'acme/tiny' in the Hugging Face cache ({snapshot}) has model.safetensors.index.json naming 1 shard(s) "
        "not on disk (model-00002-of-00002.safetensors): an interrupted download? fetch them with "
        "`hf download acme/tiny`")


def test_limits_left_to_their_defaults_are_fitted_to_the_model_and_explicit_ones_are_kept(tmp_path):
    from kiln.pipeline.config import BuildSection
    from kiln.runtime.plan import PlanError

    fitted = BuildSection().fitted_to_model(512)
    assert (fitted.max_seq_len, fitted.max_input_len) == (512, 256)
    assert BuildSection().fitted_to_model(8192) == BuildSection()  # the model holds the defaults
    explicit = BuildSection(max_seq_len=1024, max_input_len=512)
    assert explicit.fitted_to_model(512) is explicit  # the build's own check then names the conflict
    only_input = BuildSection(max_input_len=100).fitted_to_model(512)
    assert (only_input.max_seq_len, only_input.max_input_len) == (512, 100)
    with pytest.raises(PlanError, match=r"build.tokens_per_block \(1024\) must not exceed build.max_seq_len, fitted"):
        BuildSection(tokens_per_block=1024).fitted_to_model(512)
    alone = BuildSection(max_seq_len=512)  # before: refused for the default max_input_len of 1024 it never wrote
    assert (alone.max_seq_len, alone.max_input_len) == (512, 256)
    assert BuildSection(max_seq_len=1536).max_input_len == 1024  # a max_seq_len that holds the default keeps it
    with pytest.raises(ValueError, match=r"build.max_input_len \(600\) must not exceed build.max_seq_len \(512\)"):
        BuildSection(max_seq_len=512, max_input_len=600)


def test_config_show_prints_the_values_in_force(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    tiny = Path(__file__).resolve().parents[1] / "models" / "tiny-llama"
    (tmp_path / "kiln.yaml").write_text(f"model:\n  path: {tiny}\nquantize:\n  format: int4_awq\n"
                                        f"  fallback: [fp8, none]\n  gate:\n    max_kl: 0.5\n")
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("KILN_CACHE_REMOTE", (tmp_path / "team").as_uri())
    result = CliRunner().invoke(app, ["config", "show", str(tmp_path / "kiln.yaml"), "--json"])
    shown = json.loads(result.stdout)
    assert shown["cache"]["dir"] == str(tmp_path / "elsewhere")
    assert shown["cache"]["remote"] == (tmp_path / "team").as_uri()
    int4 = {"max_ppl_increase": 0.08, "max_kl": 0.5, "min_top1_agreement": 0.88}  # the default, but the set max_kl
    assert shown["quantize"]["gate"]["int4_awq"] == int4
    assert shown["quantize"]["gate"]["fp8"]["min_top1_agreement"] == 0.94
    assert (shown["build"]["max_seq_len"], shown["build"]["max_input_len"]) == (512, 256)  # fitted to the model


@pytest.mark.parametrize("name", ["tiny-llama-fp8.yaml", "tiny-llama-int4-awq.yaml", "tiny-llama-bf16.yaml"])
def test_what_config_show_prints_is_a_config_that_means_the_same(tmp_path, name, capsys):
    from typer.testing import CliRunner

    from kiln.calibration.recipe import recipe_material
    from kiln.pipeline.cli import app
    from kiln.pipeline.runner import prepare
    from kiln.runtime.options import RuntimeOptions

    shown = CliRunner().invoke(app, ["config", "show", name]).stdout
    (tmp_path / "shown.yaml").write_text(shown)
    again = load_config(tmp_path / "shown.yaml").config
    original = load_config(name).config
    assert recipe_material(again.quantize) == recipe_material(original.quantize)
    assert again.build == original.build.fitted_to_model(512)
    prepare(tmp_path / "shown.yaml", backend=None, force=False, dry_run=True, options=RuntimeOptions())
    assert "warning" not in capsys.readouterr().err  # no setting shown that this build would not use


def test_a_gate_for_one_format_wins_over_the_chains_and_one_the_chain_never_tries_is_refused(tmp_path):
    tiny = Path(__file__).resolve().parents[1] / "models" / "tiny-llama"
    (tmp_path / "kiln.yaml").write_text(f"model:\n  path: {tiny}\nquantize:\n  format: int4_awq\n  fallback: [fp8]\n"
                                        "  gate:\n    max_kl: 0.5\n    fp8:\n      max_kl: 0.01\n")
    gate = load_config(tmp_path / "kiln.yaml").config.quantize.gate
    assert gate.for_format("fp8") == {"max_ppl_increase": 0.02, "max_kl": 0.01, "min_top1_agreement": 0.94}
    assert gate.for_format("int4_awq")["max_kl"] == 0.5
    (tmp_path / "kiln.yaml").write_text(f"model:\n  path: {tiny}\nquantize:\n  format: fp8\n"
                                        "  gate:\n    int4_awq:\n      max_kl: 0.1\n")
    with pytest.raises(ConfigError, match="quantize.gate.int4_awq sets thresholds for a format the chain never"):
        load_config(tmp_path / "kiln.yaml")
    (tmp_path / "kiln.yaml").write_text(f"model:\n  path: {tiny}\nquantize:\n  format: fp8\n  gate: null\n"
                                        "  fallback: [none]\n")
    with pytest.raises(ConfigError, match="gate: null gates nothing"):
        load_config(tmp_path / "kiln.yaml")


def test_an_unknown_backend_is_one_line_and_exit_2(tmp_path):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    result = CliRunner().invoke(app, ["build", "tiny-llama-fp8.yaml", "--backend", "vllm", "--dry-run"])
    assert result.exit_code == 2 and result.stderr.startswith("error: --backend must be auto, native or trtllm")
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_dry_run_warns_of_a_model_the_build_would_not_find(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "kiln.yaml").write_text("model:\n  path: ./typo\n")
    result = CliRunner().invoke(app, ["build", str(tmp_path / "kiln.yaml"), "--dry-run"])
    assert result.exit_code == 0 and "unknown until the model is on disk" in result.stdout  # the plan
    assert f"warning: model.path {tmp_path / 'typo'} is not a directory" in result.stderr
    assert "the build would stop here" in result.stderr
    shown = CliRunner().invoke(app, ["build", str(tmp_path / "kiln.yaml"), "--dry-run", "--json"])
    plan = json.loads(shown.stdout)  # the reason the key is unknown, for a reader of the JSON alone (before: none)
    assert plan["engine_key"] is None and "the build would stop here" in plan["warnings"][0]


@pytest.mark.parametrize(("backend", "setting", "words"), [
    ("native", "tp_size: 3", "build.tp_size 3 cannot split this model"),
    ("trtllm", "tp_size: 3", "build.tp_size 3 cannot split this model"),  # before: a plan, at TensorRT-LLM's mercy
    ("native", "pp_size: 2", "build.pp_size 2: the native backend has no pipeline"),
    ("native", "max_seq_len: 9999", "build.max_seq_len (9999) exceeds the model's")])
def test_a_plan_the_model_or_backend_refuses_is_named_at_its_line(tmp_path, monkeypatch, backend, setting, words):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    tiny = Path(__file__).resolve().parents[1] / "models" / "tiny-llama"
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "kiln.yaml").write_text(f"model:\n  path: {tiny}\nbuild:\n  backend: {backend}\n  {setting}\n")
    result = CliRunner().invoke(app, ["build", str(tmp_path / "kiln.yaml"), "--dry-run"])
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {tmp_path / 'kiln.yaml'}:5: {words}")


def test_a_token_budget_below_the_batch_is_refused_for_new_plans_only(tmp_path):
    from kiln.runtime.plan import BuildPlan

    (tmp_path / "kiln.yaml").write_text("model:\n  path: ./m\nbuild:\n  max_batch_size: 8\n  max_num_tokens: 7\n")
    with pytest.raises(ConfigError, match=r"build.max_num_tokens \(7\) must be at least build.max_batch_size \(8\)"):
        load_config(tmp_path / "kiln.yaml")
    # an engine built before the rule still loads its plan
    assert BuildPlan(max_batch_size=8, max_input_len=8, max_seq_len=16, max_num_tokens=7, tokens_per_block=4)


def test_misspellings_get_a_did_you_mean(tmp_path):
    (tmp_path / "kiln.yaml").write_text("model:\n  path: ./m\nquantize:\n  fromat: fp8\nbuild:\n  zzz: 1\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "kiln.yaml")
    assert "unknown key 'fromat' in quantize; did you mean 'format'?" in str(error.value)
    assert "unknown key 'zzz' in build; it takes backend, device, max_batch_size" in str(error.value)
    with pytest.raises(ConfigError, match="config file not found; did you mean tiny-llama-fp8"):
        load_config("tiny-llama-fp9")


@pytest.mark.parametrize(("text", "expected"), [
    ("build:\n  max_batch_size: 4\nmodl:\n  path: ./m\n",
     "3: modl: unknown key 'modl' in the top level; did you mean 'model'? (model: is required)"),
    ("model:\n  pth: ./m\n",
     "2: model.pth: unknown key 'pth' in model; did you mean 'path'? (model.path: is required)"),
])
def test_a_misspelt_required_key_is_told_once_at_its_own_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"{path}:{expected}"  # before: "model: is required" first, at the section's line


def test_a_key_of_another_section_is_told_where_it_belongs_beside_any_look_alike_here(tmp_path):
    (tmp_path / "kiln.yaml").write_text("model:\n  path: ./m\nquantize:\n  max_seq_len: 256\nbuild:\n  format: fp8\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "kiln.yaml")
    assert "unknown key 'max_seq_len' in quantize; did you mean 'seq_len'? (max_seq_len is a setting of build)" \
        in str(error.value)  # before: the look-alike alone, another setting
    assert "unknown key 'format' in build; format belongs under quantize" in str(error.value)


def test_vllm_names_are_told_kilns_instead_of_a_look_alike(tmp_path):
    (tmp_path / "kiln.yaml").write_text("model:\n  path: ./m\nbuild:\n  max_num_seqs: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'max_num_seqs' in build; vLLM's max_num_seqs is Kiln's "
                                          "build.max_batch_size"):
        load_config(tmp_path / "kiln.yaml")  # difflib would have said max_num_tokens, vLLM's max_num_batched_tokens
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    result = CliRunner().invoke(app, ["serve", "x", "--max-model-len", "128"])
    assert result.exit_code == 2
    assert "--max-model-len (vLLM's; Kiln takes it as build.max_seq_len in the build config)" in result.stderr


@pytest.mark.parametrize("text,where", [
    ("quantize:\n  format: fp8\n  gate:\n    max_kl: .inf\n", ":6: quantize.gate.max_kl: must be a finite number"),
    ("cache:\n  max_size_gb: .nan\n", ":4: cache.max_size_gb: must be a finite number"),
])
def test_infinite_and_nan_numbers_are_refused_naming_the_field(tmp_path, text, where):
    with pytest.raises(ConfigError, match=where):
        load_config(write(tmp_path, f"model:\n  path: org/m\n{text}"))


@pytest.mark.parametrize("text,problem", [
    ("quantize:\n  format: fp8\nquantize:\n  format: none\n", r":5: quantize is given twice \(first on line 3\)"),
    ("build:\n  max_seq_len: 512\n  max_seq_len: 64\n", r":5: build.max_seq_len is given twice \(first on line 4\)"),
])
def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path, text, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(write(tmp_path, f"model:\n  path: org/m\n{text}"))


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    bomb = "".join(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n"
                   for prev, name in zip("abcdefgh", "bcdefghi", strict=True))  # 9**8 items expanded
    with pytest.raises(ConfigError, match=r"kiln.yaml:2: YAML alias \*a: a Kiln config takes no aliases"):
        load_config(write(tmp_path, f"a: &a [x, x]\n{bomb}model:\n  path: org/m\n"))


def test_a_config_not_in_utf8_or_a_link_loop_is_one_line(tmp_path):
    (tmp_path / "kiln.yaml").write_bytes("model:\n  path: org/m\n".encode("utf-16"))
    with pytest.raises(ConfigError, match="not UTF-8 text .*; save the config as UTF-8"):
        load_config(tmp_path / "kiln.yaml")
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="loop.yaml: a symbolic link that leads to no file"):
        load_config(tmp_path / "loop.yaml")


@pytest.mark.parametrize("text,problem", [
    ("build:\n  max_batch_size: true\n", r"build.max_batch_size: .*integer \(got True\)"),
    ("build:\n  max_batch_size: '8'\n", r"build.max_batch_size: .*integer \(got '8'\); write a whole number without"),
    ("build:\n  max_batch_size: 8.0\n", r"build.max_batch_size: .*integer \(got 8.0\)"),
    ("quantize:\n  batch_size: '8'\n", r"quantize.batch_size: .*integer or 'auto' \(got '8'\)"),
    ("model:\n  allow_download: 'yes'\n", r"model.allow_download: .*boolean \(got 'yes'\); write true or false"),
])
def test_wrong_types_are_refused_not_coerced(tmp_path, text, problem):
    section, body = text.split("\n", 1)
    text = f"model:\n  path: org/m\n{body}" if section == "model:" else f"model:\n  path: org/m\n{text}"
    with pytest.raises(ConfigError, match=problem):
        load_config(write(tmp_path, text))


def test_an_integer_is_taken_where_a_number_is_expected(tmp_path):
    config = load_config(write(tmp_path, "model:\n  path: org/m\ncache:\n  max_size_gb: 50\n")).config
    assert config.cache.max_size_gb == 50.0


@pytest.mark.parametrize("text,problem", [
    ("model:\n  path: ./m\n  revision: v2\n", r":3: model.revision \(v2\) picks a revision on the Hugging Face hub"),
    ("model:\n  path: org/m\nquantize:\n  format: fp8\n  algorithm: awq_full\n",
     r":5: quantize.algorithm \(awq_full\) sets how INT4-AWQ is calibrated, and the formats tried \(fp8\)"),
    ("model:\n  path: org/m\nquantize:\n  algorithm: awq_clip\n", r"formats tried \(none\) have no int4_awq"),
    ("model:\n  path: org/m\nquantize:\n  gate:\n    max_kl: 0.5\n", r":4: quantize.gate: format none is neither"),
    ("model:\n  path: org/m\nquantize:\n  format: none\n  seed: 3\n  num_samples: 16\n  on_failure: warn\n",
     r":6: quantize.num_samples, quantize.seed, quantize.on_failure: format none is neither calibrated nor gated; "
     r"remove them"),
    ("model:\n  path: org/m\nquantize:\n  dataset: ./calib.jsonl\n", r":4: quantize.dataset: format none is neither"),
    ("model:\n  path: org/m\nquantize:\n  format: fp8\n  text_field: zzz\n",
     r":5: quantize.text_field \(zzz\) names the JSONL field or parquet column that holds the text, and "
     r"quantize.dataset \(bundled\) and quantize.heldout \(bundled\) read no such file"),
    ("model:\n  path: org/m\nquantize:\n  format: fp8\n  seed: 18446744073709551616\n",
     r":5: quantize.seed: Input should be less than or equal to 18446744073709551614"),
    ("model:\n  path: org/m\nbuild:\n  max_seq_len: 512\n  max_input_len: 256\n  tokens_per_block: 4096\n",
     r":6: build.tokens_per_block \(4096\) must not exceed build.max_seq_len \(512\)"),
    ("model:\n  path: org/m\ncache:\n  dir: ''\n", r":4: cache.dir is empty"),
    ("model:\n  path: org/m\ncache:\n  remote: s3://kiln/p\n  remote_endpoint: http://h:99999\n",
     r":5: cache.remote_endpoint 'http://h:99999': the port must be a number from 1 to 65535"),
    ("model:\n  path: org/m\ncache:\n  remote: s3://kiln/p\n  remote_endpoint: http://h:0\n", "the port must be"),
    ("model:\n  path: org/m\ncache:\n  remote: s3://kiln/p\n  remote_endpoint: http://minio_1:9000\n",
     r"'minio_1' is not a host name"),
    ("model:\n  path: org/m\nbuild:\n  backend: native\n  trtllm:\n    context_fmha: false\n",
     r":6: build.trtllm.context_fmha: for the TensorRT-LLM backend only, and build.backend is native; remove it"),
])
def test_settings_that_cannot_apply_are_refused(tmp_path, text, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(write(tmp_path, text))


def test_the_same_settings_load_where_they_apply(tmp_path):
    load_config(write(tmp_path, "model:\n  path: org/m\n  revision: v2\n"))
    load_config(write(tmp_path, "model:\n  path: org/m\nquantize:\n  format: fp8\n  fallback: [int4_awq]\n"
                                "  algorithm: awq_full\n"))
    load_config(write(tmp_path, "model:\n  path: org/m\nbuild:\n  backend: trtllm\n  workers: 4\n"))
    load_config(write(tmp_path, "model:\n  path: org/m\nquantize:\n  format: fp8\n  dataset: ./calib.jsonl\n"
                                "  text_field: body\n  seed: 18446744073709551614\n"))
    load_config(write(tmp_path, "model:\n  path: org/m\nquantize:\n  format: none\n  kv_cache_dtype: auto\n"))
    load_config(write(tmp_path, "model:\n  path: org/m\nbuild:\n  max_seq_len: 64\n  max_input_len: 32\n"
                                "  tokens_per_block: 64\n"))
    for endpoint in ("http://minio.local:9000", "https://[::1]:9000", "http://10.0.0.1", "http://s3.example.com."):
        load_config(write(tmp_path, f"model:\n  path: org/m\ncache:\n  remote: s3://kiln/p\n"
                                    f"  remote_endpoint: '{endpoint}'\n"))


def test_a_sample_budget_that_can_never_converge_is_refused_with_the_arithmetic(tmp_path):
    text = "model:\n  path: org/m\nquantize:\n  format: fp8\n  num_samples: 16\n  round_samples: 8\n"
    with pytest.raises(ConfigError, match=r":5: quantize.num_samples \(16\) is 2 rounds of quantize.round_samples "
                                          r"\(8\), and quantize.patience \(2\) needs at least 3 .* "
                                          r"raise num_samples to 24 "):
        load_config(write(tmp_path, text))
    load_config(write(tmp_path, text + "  on_failure: warn\n"))  # one round on purpose: warned, not refused
    load_config(write(tmp_path, text.replace("16", "17")))


@pytest.mark.parametrize("text,problem", [
    ("smoke:\n  prompt: ''\n", r":4: smoke.prompt: String should have at least 1 character"),
    ("build:\n  max_seq_len: 16\n  max_input_len: 8\n",
     r"smoke.max_tokens \(16\) \+ at least one prompt token = 17 exceeds build.max_seq_len \(16\)"),
    ("smoke:\n  max_tokens: 9000\n",  # before the model fits the limit left out: its default is all that is known
     r"exceeds build.max_seq_len \(2048 by default, or the model's positions where fewer\)"),
])
def test_a_smoke_request_the_plan_cannot_hold_is_refused_at_load(tmp_path, text, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(write(tmp_path, f"model:\n  path: org/m\n{text}"))


def plan(tmp_path: Path, text: str, backend: str | None = None):
    """``kiln build --dry-run``'s plan of the tiny model with ``text`` appended to its config."""
    from kiln.pipeline import runner
    from kiln.runtime.options import RuntimeOptions

    tiny = Path(__file__).resolve().parents[1] / "models" / "tiny-llama"
    path = write(tmp_path, f"model:\n  path: {tiny}\ncache:\n  dir: {tmp_path / 'cache'}\n{text}")
    return runner.decide(runner.prepare(path, backend=backend, force=False, dry_run=True, options=RuntimeOptions()))


def test_a_dry_run_fails_as_the_build_would_on_a_required_remote_it_cannot_reach(tmp_path, monkeypatch):
    from kiln.engines.cache.remote import RemoteUnavailableError

    monkeypatch.delenv("KILN_CACHE_REMOTE", raising=False)
    remote = f"file://{tmp_path}/not-mounted"
    with pytest.raises(RemoteUnavailableError, match=r"no such folder .* \(cache.remote_required is set\)"):
        plan(tmp_path, f"  remote: {remote}\n  remote_required: true\n")  # more of the plan's cache section


def test_the_smoke_prompt_is_counted_with_the_models_tokenizer_at_plan_time(tmp_path):
    with pytest.raises(ConfigError, match=r":6: smoke.max_tokens \(16\) \+ the smoke.prompt's 4 tokens = 20 "
                                          r"exceeds build.max_seq_len \(19\)"):
        plan(tmp_path, "build:\n  max_seq_len: 19\n  max_input_len: 8\n")  # 17 at load: 16 + at least one
    with pytest.raises(ConfigError, match=r"smoke.prompt is 4 tokens, more than build.max_input_len \(2\)"):
        plan(tmp_path, "build:\n  max_input_len: 2\n")


def test_limits_and_calibration_rows_the_model_cannot_hold_are_refused_at_plan_time(tmp_path):
    with pytest.raises(ConfigError, match=r":6: build.max_input_len \(1000\) must not exceed build.max_seq_len, "
                                          r"fitted to the model's max_position_embeddings \(512\)"):
        plan(tmp_path, "build:\n  max_input_len: 1000\n")
    with pytest.raises(ConfigError, match=r":7: quantize.seq_len \(1024\) exceeds the model's "
                                          r"max_position_embeddings \(512\)"):
        plan(tmp_path, "quantize:\n  format: fp8\n  seq_len: 1024\n")


def test_tensorrt_llm_settings_on_a_native_build_are_warned_about(tmp_path, capsys):
    plan(tmp_path, "build:\n  log_level: debug\n", backend="native")
    assert "warning: build.log_level: for the TensorRT-LLM backend only" in capsys.readouterr().err


def test_a_cuda_device_on_a_machine_without_cuda_is_one_line_even_in_a_dry_run(tmp_path, monkeypatch):
    from kiln.pipeline.backend import BackendUnavailableError
    from kiln.runtime.errors import DeviceUnavailableError
    from kiln.runtime.native.fingerprint import machine_fingerprint

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="build.device is cuda, but CUDA is not available"):
        plan(tmp_path, "build:\n  device: cuda\n")
    with pytest.raises(DeviceUnavailableError, match="device 'cuda': this machine has no CUDA device"):
        machine_fingerprint("cuda")


def test_yaml_numbers_read_as_yaml_1_2_and_control_characters_are_one_line(tmp_path):
    config = load_config(write(tmp_path, "model:\n  path: m\nquantize:\n  format: fp8\n  tolerance: 1e-2\n")).config
    assert config.quantize.tolerance == 0.01  # YAML 1.1 read it as the string "1e-2"
    with pytest.raises(ConfigError, match=r"kiln.yaml:4: .*016: a number with a leading zero .* write 16"):
        load_config(write(tmp_path, "model:\n  path: m\nbuild:\n  tokens_per_block: 016\n"))  # octal 14 in 1.1
    assert load_config(write(tmp_path, "model:\n  path: m\nbuild:\n  tokens_per_block: 0o20\n")).config.build \
        .tokens_per_block == 16  # YAML 1.2's octal (refused as a string before)
    for text in ("1:30", "1_0"):  # YAML 1.1's 90 and 10, before: taken silently
        with pytest.raises(ConfigError, match=f"build.timeout_s: .*got '{text}'\\); write a whole number$"):
            load_config(write(tmp_path, f"model:\n  path: m\nbuild:\n  timeout_s: {text}\n"))  # no "without quotes"
    with pytest.raises(ConfigError, match=r"kiln.yaml:3: control character U\+0007"):
        load_config(write(tmp_path, "model:\n  path: m\n  \x07\n"))


def test_a_home_relative_path_is_the_home_folder_and_a_path_that_is_no_model_id_is_named(tmp_path, monkeypatch):
    from kiln.pipeline.model_source import ModelNotFoundError, resolve_model

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "m1").mkdir(parents=True)
    config = load_config(write(tmp_path, "model:\n  path: ~/m1\nquantize:\n  format: fp8\n  dataset: ~/d.txt\n"))
    assert config.config.model.path == str(tmp_path / "home" / "m1")
    assert config.config.quantize.dataset == str(tmp_path / "home" / "d.txt")
    for path, words in (("models/llama/8b", "neither a folder"), ("$HOME/m2", "not environment variables")):
        model = load_config(write(tmp_path, f"model:\n  path: '{path}'\n  allow_download: true\n")).config.model
        with pytest.raises(ModelNotFoundError, match=words):
            resolve_model(model)


def test_a_relative_path_found_only_from_the_current_folder_is_named_in_the_miss(tmp_path, monkeypatch):
    from kiln.pipeline.model_source import ModelNotFoundError, resolve_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "sub" / "tiny").mkdir(parents=True)
    (tmp_path / "configs").mkdir()
    monkeypatch.chdir(tmp_path)  # the config in configs/, the model beside it in the current folder
    model = load_config(write(tmp_path / "configs", "model:\n  path: sub/tiny\n")).config.model
    with pytest.raises(ModelNotFoundError, match="sub/tiny is a folder, but a relative model.path is read from the "
                                                 "config file's folder"):  # before: only "hf download sub/tiny"
        resolve_model(model)


def test_text_that_rich_would_turn_into_emoji_is_printed_as_written(capsys):
    from kiln.pipeline.console import stdout

    stdout.print("sk-:fire:-x")
    assert capsys.readouterr().out.strip() == "sk-:fire:-x"


@pytest.mark.parametrize("env", [{"XDG_CACHE_HOME": "/x/xdg"}, {"XDG_CACHE_HOME": "/x/xdg", "HF_HOME": "/x/hf"},
                                 {"HUGGINGFACE_HUB_CACHE": "/x/old"}, {"HF_HUB_CACHE": "/x/hub", "HF_HOME": "/x/hf"}])
def test_the_hugging_face_cache_is_where_huggingface_hub_puts_models(env):
    import subprocess
    import sys

    from tests.subprocess_env import REPO, repo_env

    code = ("from huggingface_hub import constants; from kiln.pipeline.model_source import hf_hub_cache; "
            "print(constants.HF_HUB_CACHE); print(hf_hub_cache())")
    unset = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")
    environ = {name: value for name, value in repo_env().items() if name not in unset}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                            env={**environ, **env})
    theirs, ours = result.stdout.split()
    assert ours == theirs


def test_text_a_terminal_cannot_show_is_escaped_rather_than_failing_the_command(tmp_path):
    import subprocess
    import sys

    from tests.subprocess_env import REPO, repo_env

    config = (REPO / "configs" / "tiny-llama-bf16.yaml").read_text(encoding="utf-8")
    config = config.replace('prompt: "Monday, Tuesday,"', 'prompt: "Lundi → mardi,"')
    (tmp_path / "c.yaml").write_text(config.replace("../models/tiny-llama", str(REPO / "models" / "tiny-llama")),
                                     encoding="utf-8")
    environ = {name: value for name, value in repo_env().items() if name != "PYTHONIOENCODING"}
    result = subprocess.run([sys.executable, "-m", "kiln", "config", "show", str(tmp_path / "c.yaml")], cwd=REPO,
                            capture_output=True, env={**environ, "LC_ALL": "C", "PYTHONUTF8": "0"})
    assert result.returncode == 0, result.stderr
    assert b"prompt: Lundi \\u2192 mardi," in result.stdout


def test_an_architecture_file_given_as_a_config_points_at_kiln_bench_in_one_line():
    architecture = CONFIGS_DIR / "models" / "llama3-8b.json"
    with pytest.raises(ConfigError, match=r"is a model's config.json \(an architecture file\), not a Kiln config: "
                                          r"`kiln bench` takes it") as error:
        load_config(architecture)
    assert "\n" not in str(error.value)  # before: a line for each of its 24 fields
