"""The `quantize:` recipe: defaults, validation messages that name the field, and cache-key material."""

from __future__ import annotations

import shutil

import pytest
from pydantic import ValidationError

from kiln.calibration import QuantizeRecipe, recipe_material
from kiln.calibration.recipe import GATE_DEFAULTS, MATERIAL_VERSION, MAX_SEED
from tests.calibration_factories import REPO, corpus, write_jsonl


def test_recipe_needs_no_fields_and_defaults_to_no_quantization():
    recipe = QuantizeRecipe()
    assert recipe.format == "none" and recipe.on_failure == "fail" and recipe.fallback == []
    assert recipe.round_samples <= recipe.num_samples and recipe.patience >= 1


@pytest.mark.parametrize(("fields", "named"), [
    ({"round_samples": 64, "num_samples": 32}, "quantize.round_samples"),
    ({"patience": 0}, "patience"),
    ({"num_samples": -1}, "num_samples"),
    ({"tolerance": 0}, "tolerance"),
    ({"batch_size": 0}, "quantize.batch_size"),
    ({"format": "fp8", "fallback": ["fp8"]}, "primary format"),
    ({"format": "int4_awq", "fallback": ["fp8", "fp8"]}, "repeats fp8"),
    ({"format": "int4_awq", "fallback": ["none", "fp8"]}, "only come last"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"gate": {"min_top1_agreement": 1.5}}, "min_top1_agreement"),
    ({"gate": {"max_kl": -0.1}}, "max_kl"),
    ({"rounds": 3}, "rounds"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
])
def test_impossible_values_are_rejected_naming_the_field(fields, named):
    with pytest.raises(ValidationError, match=named):
        QuantizeRecipe(**fields)


def test_gate_thresholds_default_per_format_and_explicit_values_win():
    gate = QuantizeRecipe(format="int4_awq", gate={"max_kl": 0.5}).gate
    assert gate.for_format("fp8") == {**GATE_DEFAULTS["fp8"], "max_kl": 0.5}
    assert gate.for_format("int4_awq")["max_ppl_increase"] == GATE_DEFAULTS["int4_awq"]["max_ppl_increase"]
    assert GATE_DEFAULTS["fp8"]["max_ppl_increase"] < GATE_DEFAULTS["int4_awq"]["max_ppl_increase"]


def test_material_holds_content_hashes_not_paths(tmp_path):
    data = write_jsonl(tmp_path / "a" / "calib.jsonl", corpus(20))
    material = recipe_material(QuantizeRecipe(format="fp8", dataset=str(data)))
    assert str(tmp_path) not in repr(material)
    assert len(material["dataset_sha256"]) == 64 and material["modelopt"]

    moved = tmp_path / "b" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.copy(data, moved)
    assert recipe_material(QuantizeRecipe(format="fp8", dataset=str(moved))) == material

    write_jsonl(moved, corpus(21))
    changed = recipe_material(QuantizeRecipe(format="fp8", dataset=str(moved)))
    assert changed["dataset_sha256"] != material["dataset_sha256"]


def test_heldout_equal_to_the_dataset_is_recorded_as_a_split(tmp_path):
    data = write_jsonl(tmp_path / "calib.jsonl", corpus(20))
    split = recipe_material(QuantizeRecipe(format="fp8", dataset=str(data), heldout=str(data)))
    assert split["heldout_split_from_dataset"] and split["heldout_sha256"] == split["dataset_sha256"]


def test_material_changes_with_what_changes_the_checkpoint_only(tmp_path):
    base = recipe_material(QuantizeRecipe(format="int4_awq"))
    assert recipe_material(QuantizeRecipe(format="int4_awq", seed=1)) != base
    assert recipe_material(QuantizeRecipe(format="int4_awq", algorithm="awq_clip")) != base
    assert recipe_material(QuantizeRecipe(format="fp8", algorithm="awq_clip")) == recipe_material(
        QuantizeRecipe(format="fp8"))
    assert recipe_material(QuantizeRecipe(format="none", dataset="/nowhere")) == {
        "material_version": MATERIAL_VERSION, "format": "none"}


def test_relative_dataset_paths_resolve_against_the_dataset_root(tmp_path):
    write_jsonl(tmp_path / "calib.jsonl", corpus(5))
    material = recipe_material(QuantizeRecipe(format="fp8", dataset="calib.jsonl"), dataset_root=tmp_path)
    assert len(material["dataset_sha256"]) == 64


def test_random_data_is_for_both_sets_or_neither_and_a_null_gate_is_measured_not_applied():
    with pytest.raises(ValidationError, match="set both to random, or neither"):
        QuantizeRecipe(format="fp8", dataset="random")
    recipe = QuantizeRecipe(format="fp8", dataset="random", heldout="random", gate=None)
    material = recipe_material(recipe)
    assert material["gate"] is None and material["dataset_sha256"] == material["heldout_sha256"]
    assert recipe_material(QuantizeRecipe(format="fp8", dataset="random", heldout="random"))["gate"] is not None


def test_a_gate_without_thresholds_passes_and_says_it_was_not_applied():
    from kiln.calibration.gate import check_gate
    from kiln.calibration.metrics import HeldoutMetrics

    metrics = HeldoutMetrics(kl=4.0, top1_agreement=0.1, ppl=9.0, reference_ppl=2.0, ppl_increase=3.5, output_mae=1.0)
    result = check_gate(metrics, None)
    assert result.passed and not result.applied and result.as_dict()["applied"] is False
    assert result.as_dict()["passed"] is None  # a report reader does not take it for a checkpoint that passed
    assert not check_gate(metrics, {"max_ppl_increase": 0.1, "max_kl": 0.1, "min_top1_agreement": 0.9}).passed


def test_the_largest_seed_draws_random_rows_and_calibration_seeds_torch_with_it():
    import torch

    from kiln.calibration.datasets import load_calibration_data

    recipe = QuantizeRecipe(format="fp8", dataset="random", heldout="random", num_samples=2, round_samples=2,
                            heldout_samples=2, seq_len=4, seed=MAX_SEED)
    torch.manual_seed(recipe.seed)  # as the quantize stage does first
    data = load_calibration_data(recipe, tokenizer=range(50))  # held-out rows come from seed + 1
    assert data.calibration.shape == data.heldout.shape == (2, 4)


@pytest.mark.parametrize("sources", [{}, {"dataset": "random", "heldout": "random"}])
def test_a_text_field_no_source_reads_is_refused_naming_it(sources):
    with pytest.raises(ValidationError, match=r"quantize.text_field \(body\) names the JSONL field"):
        QuantizeRecipe(format="fp8", text_field="body", **sources)
    assert QuantizeRecipe(format="fp8", dataset="calib.jsonl", text_field="body").text_field == "body"
    assert QuantizeRecipe(format="fp8", heldout="hf:org/data", text_field="body").text_field == "body"


def test_a_quantized_format_without_modelopt_installed_is_one_line_saying_how_to_install_it(tmp_path, monkeypatch):
    import json
    from importlib.metadata import PackageNotFoundError

    from typer.testing import CliRunner

    from kiln.calibration import recipe
    from kiln.pipeline.cli import app

    def not_installed(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(recipe, "version", not_installed)  # as after `pip install --no-deps`
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["build", str(REPO / "configs" / "tiny-llama-fp8.yaml"), "--dry-run", "--json"])
    assert result.exit_code == 4, result.output
    error = json.loads(result.stdout)["error"]
    assert error["message"] == ("quantize.format fp8 needs NVIDIA modelopt, which is not installed; pip install "
                                "'nvidia-modelopt==0.47.0', or set quantize.format: none")


def test_the_modelopt_install_hint_names_the_version_pyproject_pins():
    import tomllib

    from kiln.calibration.recipe import MODELOPT_REQUIREMENT

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert MODELOPT_REQUIREMENT in pyproject["project"]["dependencies"]
