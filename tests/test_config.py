"""Config validation: good files load; bad ones name file, line and field."""

from __future__ import annotations

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


def test_limits_left_to_their_defaults_are_fitted_to_the_model_and_explicit_ones_are_kept(tmp_path):
    from kiln.pipeline.config import BuildSection

    fitted = BuildSection().fitted_to_model(512)
    assert (fitted.max_seq_len, fitted.max_input_len) == (512, 256)
    assert BuildSection().fitted_to_model(8192) == BuildSection()  # the model holds the defaults
    explicit = BuildSection(max_seq_len=1024, max_input_len=512)
    assert explicit.fitted_to_model(512) is explicit  # the build's own check then names the conflict
    only_input = BuildSection(max_input_len=100).fitted_to_model(512)
    assert (only_input.max_seq_len, only_input.max_input_len) == (512, 100)


def test_config_show_prints_the_values_in_force(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    tiny = Path(__file__).resolve().parents[1] / "models" / "tiny-llama"
    (tmp_path / "kiln.yaml").write_text(f"model:\n  path: {tiny}\nquantize:\n  format: int4_awq\n"
                                        f"  fallback: [fp8, none]\n  gate:\n    max_kl: 0.5\n")
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "elsewhere"))
    result = CliRunner().invoke(app, ["config", "show", str(tmp_path / "kiln.yaml"), "--json"])
    shown = json.loads(result.stdout)
    assert shown["cache"]["dir"] == str(tmp_path / "elsewhere")
    int4 = {"max_ppl_increase": 0.08, "max_kl": 0.5, "min_top1_agreement": 0.88}  # the default, but the set max_kl
    assert shown["quantize"]["gate"]["int4_awq"] == int4
    assert shown["quantize"]["gate"]["fp8"]["min_top1_agreement"] == 0.94
    assert (shown["build"]["max_seq_len"], shown["build"]["max_input_len"]) == (512, 256)  # fitted to the model


def test_an_unknown_backend_is_one_line_and_exit_2(tmp_path):
    from typer.testing import CliRunner

    from kiln.pipeline.cli import app

    result = CliRunner().invoke(app, ["build", "tiny-llama-fp8.yaml", "--backend", "vllm", "--dry-run"])
    assert result.exit_code == 2 and result.stderr.startswith("error: --backend must be auto, native or trtllm")
    assert len(result.stderr.strip().splitlines()) == 1


def test_misspellings_get_a_did_you_mean(tmp_path):
    (tmp_path / "kiln.yaml").write_text("model:\n  path: ./m\nquantize:\n  fromat: fp8\nbuild:\n  zzz: 1\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "kiln.yaml")
    assert "unknown key 'fromat' in quantize; did you mean 'format'?" in str(error.value)
    assert "unknown key 'zzz' in build; it takes backend, device, max_batch_size" in str(error.value)
    with pytest.raises(ConfigError, match="config file not found; did you mean tiny-llama-fp8"):
        load_config("tiny-llama-fp9")
