"""The convergence monitor, and what a run does when the sample budget runs out before calibration settles."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kiln.calibration import CalibrationError
from kiln.calibration.convergence import ConvergenceMonitor, change
from kiln.calibration.quantize import quantize_checkpoint
from tests.calibration_factories import make_checkpoint, small_recipe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")


def test_monitor_converges_after_patience_rounds_under_tolerance():
    monitor = ConvergenceMonitor(tolerance=0.05, patience=2)
    rounds = [{"a": torch.tensor(1.0), "b": torch.tensor([1.0, 2.0])},
              {"a": torch.tensor(1.5), "b": torch.tensor([1.0, 2.01])},
              {"a": torch.tensor(1.52), "b": torch.tensor([1.0, 2.01])},
              {"a": torch.tensor(1.53), "b": torch.tensor([1.0, 2.01])}]
    assert monitor.observe(rounds[0]) == (None, None)
    assert monitor.unsettled() == [("a", None), ("b", None)]  # nothing measured yet
    assert monitor.observe(rounds[1]) == (pytest.approx(0.5), "a")
    assert not monitor.converged and monitor.unsettled() == [("a", pytest.approx(0.5))]
    monitor.observe(rounds[2])
    assert not monitor.converged and monitor.unsettled() == [("a", pytest.approx(0.5))]
    monitor.observe(rounds[3])
    assert monitor.converged and monitor.unsettled() == []


def test_a_statistic_quiet_from_the_start_settles_after_exactly_patience_measured_rounds():
    monitor = ConvergenceMonitor(tolerance=0.05, patience=2)
    monitor.observe({"a": torch.tensor(1.0)})
    monitor.observe({"a": torch.tensor(1.0)})
    assert not monitor.converged
    monitor.observe({"a": torch.tensor(1.0)})
    assert monitor.converged


def test_a_statistic_that_moves_again_starts_its_streak_over():
    monitor = ConvergenceMonitor(tolerance=0.05, patience=2)
    for value in (1.0, 1.0, 2.0, 2.0):  # quiet, then a move, then quiet for one round only
        monitor.observe({"a": torch.tensor(value)})
    assert not monitor.converged and [name for name, _ in monitor.unsettled()] == ["a"]
    monitor.observe({"a": torch.tensor(2.0)})
    assert monitor.converged


def test_only_the_heldout_kl_curve_has_a_floor_under_its_change():
    kl_name = ".".join(["heldout", "kl"])  # built at run time, as the quantizer builds its names
    assert change(kl_name, torch.tensor([1e-6]), torch.tensor([2e-6])) == pytest.approx(1e-6 / 1e-3)
    for other in ("attention.amax", "model.layers.0.mlp.amax"):  # names sorting before and after it
        assert change(other, torch.tensor([1e-6]), torch.tensor([2e-6])) == pytest.approx(1.0)


def test_a_statistic_whose_shape_changes_has_not_settled():
    monitor = ConvergenceMonitor(tolerance=0.1, patience=1)
    monitor.observe({"a": torch.ones(2)})
    assert monitor.observe({"a": torch.ones(3)}) == (float("inf"), "a")
    assert monitor.observe({"a": torch.ones(2)})[0] == float("inf") and not monitor.converged


def test_unsettled_statistics_come_largest_change_first():
    monitor = ConvergenceMonitor(tolerance=0.01, patience=2)
    monitor.observe({"small": torch.tensor([1.0]), "large": torch.tensor([1.0]), "still": torch.tensor([1.0])})
    monitor.observe({"small": torch.tensor([1.1]), "large": torch.tensor([2.0]), "still": torch.tensor([1.0])})
    assert [name for name, _ in monitor.unsettled()] == ["large", "small"]


def test_a_search_loss_changes_by_the_regret_of_the_previous_choice():
    previous, current = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.5, 1.2, 3.0])
    assert change("layer.search_loss", previous, current) == pytest.approx((1.5 - 1.2) / 1.2)


def test_a_change_of_exactly_the_tolerance_is_movement():
    monitor = ConvergenceMonitor(tolerance=0.5, patience=1)
    monitor.observe({"a": torch.tensor([1.0])})
    monitor.observe({"a": torch.tensor([1.5])})
    assert not monitor.converged and monitor.unsettled() == [("a", 0.5)]


def test_a_statistic_that_appears_later_settles_after_its_own_patience():
    monitor = ConvergenceMonitor(tolerance=0.1, patience=2)
    monitor.observe({"a": torch.tensor([1.0])})
    assert monitor.observe({"a": torch.tensor([1.0]), "b": torch.tensor([1.0])}) == (float("inf"), "b")
    monitor.observe({"a": torch.tensor([1.0]), "b": torch.tensor([1.0])})
    assert not monitor.converged  # b has been under the tolerance for one round only
    monitor.observe({"a": torch.tensor([1.0]), "b": torch.tensor([1.0])})
    assert monitor.converged


def test_unsettled_reports_the_largest_change_of_the_last_patience_rounds():
    monitor = ConvergenceMonitor(tolerance=0.1, patience=2)
    for value in (1.0, 6.0, 7.2, 9.36):  # changes 5.0, then 0.2 and 0.3: the 5.0 is older than the patience
        monitor.observe({"a": torch.tensor([value])})
    assert monitor.unsettled() == [("a", pytest.approx(0.3))]


def test_alpha_flip_between_near_equal_search_losses_is_a_small_change():
    previous = torch.tensor([3.0, 1.000, 1.001, 5.0])  # alpha 1 chosen
    near_tie = torch.tensor([3.0, 1.002, 1.000, 5.0])  # alpha 2 chosen now, alpha 1 only 0.2 % worse
    moved = torch.tensor([3.0, 2.000, 1.000, 5.0])  # alpha 1 is now twice as bad
    assert change("x.awq_lite.search_loss", previous, near_tie) == pytest.approx(0.002, rel=1e-4)
    assert change("x.awq_lite.search_loss", previous, moved) == pytest.approx(1.0)
    assert change("x.input_quantizer", torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])) == pytest.approx(0.1)


@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_budget_too_small_fails_naming_unsettled_quantizers_and_writes_nothing(checkpoint, tmp_path, fmt):
    recipe = small_recipe(format=fmt, num_samples=8, round_samples=4, tolerance=1e-6, patience=2)
    with pytest.raises(CalibrationError) as failure:
        quantize_checkpoint(checkpoint, recipe, tmp_path)
    message = str(failure.value)
    assert "did not converge within quantize.num_samples=8 (2 rounds of 4" in message
    assert "model.layers." in message and "recent change" in message and "on_failure: warn" in message
    assert "\n" not in message and failure.value.exit_code == 4
    assert list(tmp_path.iterdir()) == []
    [attempt] = failure.value.details["attempts"]  # what --json reports: never gated, not "passed"
    assert attempt["gate"] is None and attempt["outcome"] == "did not converge"


def test_too_few_rounds_for_the_patience_is_named_even_when_nothing_moves(checkpoint, tmp_path):
    recipe = small_recipe(format="fp8", num_samples=8, round_samples=4, tolerance=10.0, patience=2)
    with pytest.raises(CalibrationError, match=r"every statistic is under the tolerance, but not yet for 2 rounds "
                                               r"\(patience 2 needs at least 3 rounds\)"):
        quantize_checkpoint(checkpoint, recipe, tmp_path / "out")


def test_on_failure_warn_ships_and_says_not_converged(checkpoint, tmp_path):
    recipe = small_recipe(format="fp8", num_samples=8, round_samples=4, tolerance=1e-6, patience=2,
                          on_failure="warn")
    report = quantize_checkpoint(checkpoint, recipe, tmp_path)
    assert report["converged"] is False and report["verdict"] == "not converged"
    assert "not converged" in report["summary"] and report["format"] == "fp8"
    assert report["unsettled"] and all(u["statistic"].startswith(("model.layers.", "heldout.kl"))
                                       for u in report["unsettled"])
    assert json.loads((tmp_path / "calibration_report.json").read_text())["converged"] is False
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_fallback_reason_says_the_failed_format_also_did_not_converge(checkpoint, tmp_path):
    recipe = small_recipe(format="fp8", num_samples=8, round_samples=4, tolerance=1e-6, patience=2,
                          on_failure="warn", fallback=["none"], gate={"max_kl": 0.0})
    report = quantize_checkpoint(checkpoint, recipe, tmp_path)
    assert report["format"] == "none"
    assert report["reason"].startswith("fallback after fp8 did not converge and failed the gate: KL")
    assert "fp8 did not converge and failed the gate" in report["summary"]


def test_fp8_rounds_accumulate_to_the_same_amax_as_one_pass(checkpoint):
    from transformers import AutoModelForCausalLM

    import kiln.calibration.modelopt_quantize as mq

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rows = torch.randint(0, model.config.vocab_size, (6, 16), generator=torch.Generator().manual_seed(0))
    config = mq.quant_config("fp8", "awq_lite", "auto")

    def forward(m, r):
        with torch.no_grad():
            m(input_ids=r)

    rounds = mq.MaxRounds(model, config)
    with mq.quiet([]):
        for k in range(3):
            _, by_rounds = rounds.calibrate(list(rows.split(2)), k, forward)
        at_once = copy.deepcopy(model)
        mq.mtq.quantize(at_once, config, lambda m: forward(m, rows))
    one_pass = mq.amax_snapshot(at_once)
    assert by_rounds.keys() == one_pass.keys() and len(one_pass) > 10
    assert all(torch.equal(by_rounds[name], one_pass[name]) for name in one_pass)
