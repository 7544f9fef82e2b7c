"""The quantize stage: calibrate in rounds until the statistics settle, gate on held-out data, fall back, export.

    report = quantize_checkpoint(model_dir, recipe, out_dir)

writes out_dir as ``calibration.layout.QuantizedCheckpoint`` lays it out (hf/, trtllm/, the calibration report and
curves) and returns the report. On any error nothing it wrote is left in out_dir.
"""

from __future__ import annotations

import copy
import re
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from kiln.calibration.batching import BatchRunner
from kiln.calibration.checkpoint_checks import check_quantizable
from kiln.calibration.convergence import ConvergenceMonitor
from kiln.calibration.datasets import CalibrationData, load_calibration_data
from kiln.calibration.errors import CalibrationError
from kiln.calibration.export import (
    checkpoint_dtype,
    copy_checkpoint,
    export_hf,
    export_trtllm,
)
from kiln.calibration.gate import check_gate
from kiln.calibration.layout import QuantizedCheckpoint
from kiln.calibration.metrics import HeldoutReference, evaluate
from kiln.calibration.modelopt_quantize import (
    fuse_shared_inputs,
    int4_incompatible_linears,
    quant_config,
    quiet,
    rounds_calibrator,
    tie_shared_input_scales,
    use_gated_fp8_weights,
)
from kiln.calibration.plot import plot_curves
from kiln.calibration.recipe import QuantizeRecipe, modelopt_version, recipe_material
from kiln.calibration.report import Attempt, RoundRecord, build_report, outcomes_text, unsettled_text, write_report

Progress = Callable[[str, float], None]

__all__ = ["quantize_checkpoint", "recipe_material"]


def quantize_checkpoint(model_dir: Path, recipe: QuantizeRecipe, out_dir: Path, *, device: str = "cpu",
                        dtype: str = "float32", dataset_root: Path | None = None,
                        progress: Progress | None = None) -> dict:
    """Calibrate, gate, fall back and export into out_dir (created if missing); return the report dict.

    `dtype` is the compute dtype of calibration (float32 on CPU); the exported checkpoint keeps the input
    checkpoint's dtype for the layers that stay unquantized. Raises CalibrationError, leaving out_dir as it was.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # callers draw their own progress; keep stderr readable
    hf_logging.set_verbosity_error()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    existing = set(out_dir.iterdir())
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _Stage(model_dir, recipe, out_dir, device, getattr(torch, dtype), dataset_root, progress).run()
    except BaseException:
        if created:
            shutil.rmtree(out_dir)
        else:
            for path in set(out_dir.iterdir()) - existing:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        raise
    finally:
        torch.use_deterministic_algorithms(deterministic)


class _Stage:
    """One run of the quantize stage; its methods are the steps, in the order `run` calls them."""

    def __init__(self, model_dir: Path, recipe: QuantizeRecipe, out_dir: Path, device: str, dtype: torch.dtype,
                 dataset_root: Path | None, progress: Progress | None):
        self.model_dir, self.recipe, self.out_dir = model_dir, recipe, out_dir
        self.output = QuantizedCheckpoint(out_dir)
        self.device, self.dtype, self.dataset_root = device, dtype, dataset_root
        self.progress = progress or (lambda message, fraction: None)
        self.times: dict[str, float] = {}
        self.notes: list[str] = []
        self.started = time.perf_counter()

    def run(self) -> dict:
        check_quantizable(self.model_dir)
        torch.manual_seed(self.recipe.seed)
        if self.recipe.format == "none":
            return self._ship_unquantized([Attempt("none", converged=True, outcome="requested")], None)
        self.progress("loading model and data", 0.0)
        reference = self._timed("load_s", self._load_model)
        tokenizer = _load_tokenizer(self.model_dir)
        data = self._timed("data_s", lambda: load_calibration_data(
            self.recipe, tokenizer, self.dataset_root, embedding_rows=reference.get_input_embeddings().num_embeddings))
        self.notes.extend(data.notes)
        runner = BatchRunner(self.recipe.batch_size, self.device, self.recipe.round_samples)
        heldout = self._timed("reference_s", lambda: runner.with_backoff(
            lambda: HeldoutReference(reference, data.heldout, runner)))

        attempts: list[Attempt] = []
        for index, fmt in enumerate(self.recipe.chain):
            if fmt == "none":
                attempts.append(Attempt("none", converged=True, outcome=self._fallback_reason(attempts)))
                return self._ship_unquantized(attempts, data, runner, reference)
            attempt, shipped = self._attempt(fmt, index, reference, data, runner, heldout)
            attempts.append(attempt)
            if shipped is not None:
                attempt.outcome = self._fallback_reason(attempts[:-1]) if index else "requested"
                del reference, heldout
                return self._ship_quantized(attempts, data, runner, *shipped)
        raise CalibrationError(self._gate_failed_message(attempts), {"attempts": [a.as_dict() for a in attempts]})

    def _attempt(self, fmt: str, index: int, reference: nn.Module, data: CalibrationData, runner: BatchRunner,
                 heldout: HeldoutReference) -> tuple[Attempt, tuple[nn.Module, nn.Module] | None]:
        """Calibrate and gate one format; return the attempt and, if it passed, (model, unfused copy for TRT-LLM)."""
        attempt, model = self._calibrate(fmt, index, reference, data, runner, heldout)
        if not attempt.converged and self.recipe.on_failure == "fail":
            attempt.outcome = "did not converge"
            raise CalibrationError(self._not_converged_message(attempt, data), {"attempts": [attempt.as_dict()]})
        tie_shared_input_scales(model)  # FP8 q/k/v and gate/up: the scales of the one GEMM they are exported as
        unfused = copy.deepcopy(model)  # TensorRT-LLM takes AWQ pre-quant scales per linear, not folded in the norm
        fuse_shared_inputs(model)
        metrics = self._timed("gate_s", lambda: runner.with_backoff(lambda: evaluate(model, heldout, f"{fmt} gate")))
        attempt.gate = check_gate(metrics, self.recipe.gate.for_format(fmt) if self.recipe.gate else None)
        if attempt.gate.passed:
            return attempt, (model, unfused)
        unconverged = "" if attempt.converged else "did not converge and "
        attempt.outcome = unconverged + "failed the gate: " + "; ".join(attempt.gate.failures)
        return attempt, None

    def _timed(self, key: str, step: Callable):
        started = time.perf_counter()
        try:
            return step()
        finally:
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - started

    def _load_model(self, dtype: torch.dtype | None = None) -> nn.Module:
        from transformers import AutoModelForCausalLM

        try:
            # safetensors only: a pickle beside them (pytorch_model.bin) is never loaded, nor in the cache key
            model, loading = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype or self.dtype,
                                                                  use_safetensors=True, output_loading_info=True)
        except Exception as exc:  # transformers raises many kinds for unloadable checkpoints
            raise CalibrationError(f"{self.model_dir}: cannot load the checkpoint with transformers "
                                   f"({type(exc).__name__}: {str(exc).splitlines()[0]}); check its files") from exc
        _refuse_incomplete(self.model_dir, loading)
        model.requires_grad_(False)
        return model.to(self.device).eval()

    def _calibrate(self, fmt: str, index: int, reference: nn.Module, data: CalibrationData, runner: BatchRunner,
                   heldout: HeldoutReference) -> tuple[Attempt, nn.Module]:
        """Calibrate `fmt` round by round until every statistic has settled or the sample budget is spent."""
        if fmt == "int4_awq":
            _check_int4_shapes(reference, self.model_dir)
        rounds = data.rounds(self.recipe.round_samples)
        calibrator = rounds_calibrator(fmt, reference, quant_config(fmt, self.recipe.algorithm,
                                                                    self.recipe.kv_cache_dtype))
        monitor = ConvergenceMonitor(self.recipe.tolerance, self.recipe.patience)
        attempt = Attempt(fmt)

        def forward(model: nn.Module, rows: torch.Tensor) -> None:
            runner.forward(model, rows, f"{fmt} calibration")

        for k in range(len(rounds)):
            started = time.perf_counter()
            model, snapshot = runner.with_backoff(partial(self._modelopt, fmt, partial(
                calibrator.calibrate, rounds, k, forward)))
            metrics = runner.with_backoff(partial(evaluate, model, heldout, f"{fmt} model on held-out data"))
            max_change, most_changed = monitor.observe({**snapshot, "heldout.kl": torch.tensor(metrics.kl)})
            attempt.rounds.append(RoundRecord(
                round=k + 1, samples=sum(len(r) for r in rounds[: k + 1]), max_rel_change=max_change,
                most_changed=most_changed, kl=metrics.kl, top1_agreement=metrics.top1_agreement,
                output_mae=metrics.output_mae, seconds=round(time.perf_counter() - started, 3)))
            change = "" if max_change is None else f", max change {max_change:.2%}"
            self.progress(f"{fmt} round {k + 1}: {attempt.samples} samples{change}, KL {metrics.kl:.2g}",
                          0.9 * (index + (k + 1) / len(rounds)) / len(self.recipe.chain))
            if monitor.converged:
                break
        attempt.converged = monitor.converged
        attempt.unsettled = monitor.unsettled()
        attempt.seconds = sum(r.seconds for r in attempt.rounds)
        self.times["calibration_s"] = self.times.get("calibration_s", 0.0) + attempt.seconds
        return attempt, model

    def _modelopt(self, fmt: str, step: Callable):
        """Run a modelopt step quietly; its failures become a CalibrationError (a GPU OOM passes for back-off)."""
        try:
            with quiet(self.notes):
                return step()
        except (CalibrationError, torch.cuda.OutOfMemoryError):
            raise
        except Exception as exc:  # modelopt raises assertions, runtime and value errors for unsupported models
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if re.search(r"\b(nan|inf)\b", detail, re.IGNORECASE):
                raise CalibrationError(f"{self.model_dir}: non-finite activations (NaN/Inf) during {fmt} "
                                       f"calibration ({detail}); check the checkpoint's weights") from exc
            raise CalibrationError(f"{self.model_dir}: modelopt cannot quantize this model to {fmt} "
                                   f"({type(exc).__name__}: {detail}); try another quantize.format") from exc

    def _fallback_reason(self, failed: list[Attempt]) -> str:
        return "fallback after " + outcomes_text(failed)

    def _not_converged_message(self, attempt: Attempt, data: CalibrationData) -> str:
        recipe = self.recipe
        if attempt.unsettled:
            count = len(attempt.unsettled)
            why = f"{count} statistic{'s' if count > 1 else ''} still moving: {unsettled_text(attempt)}"
        else:
            why = f"every statistic is under the tolerance, but not yet for {recipe.patience} rounds"
        if len(attempt.rounds) <= recipe.patience:
            why += f" (patience {recipe.patience} needs at least {recipe.patience + 1} rounds)"
        return (f"quantize: {attempt.format} calibration did not converge within quantize.num_samples="
                f"{len(data.calibration)} ({len(attempt.rounds)} rounds of {recipe.round_samples}, tolerance "
                f"{recipe.tolerance:g}, patience {recipe.patience}); {why}; raise quantize.num_samples or set "
                "quantize.on_failure: warn")

    def _gate_failed_message(self, attempts: list[Attempt]) -> str:
        return (f"quantize: no format passed the accuracy gate on {self.recipe.heldout_samples} held-out samples "
                f"({outcomes_text(attempts)}); relax quantize.gate or add a format (e.g. none) to quantize.fallback")

    def _ship_quantized(self, attempts: list[Attempt], data: CalibrationData, runner: BatchRunner,
                        model: nn.Module, exported_form: nn.Module) -> dict:
        self.progress(f"exporting {attempts[-1].format} checkpoint", 0.95)
        dtype = checkpoint_dtype(self.model_dir)

        def export() -> None:
            use_gated_fp8_weights(exported_form, model)  # the FP8 codes the gate measured, ties rounded as it did
            with quiet([]):  # the exporters' warnings are benign: no tensorrt_llm here, a lm_head notice
                self._note(export_trtllm(exported_form, self.output.trtllm, dtype))
                export_hf(model, self.model_dir, self.output.hf, dtype)

        self._timed("export_s", export)
        return self._finish(attempts, data, runner)

    def _ship_unquantized(self, attempts: list[Attempt], data: CalibrationData | None,
                          runner: BatchRunner | None = None, reference: nn.Module | None = None) -> dict:
        """Copy the checkpoint as it is (hf/) and export it unquantized for TensorRT-LLM (trtllm/)."""
        self.progress("exporting unquantized checkpoint", 0.95)
        dtype = checkpoint_dtype(self.model_dir)

        def export() -> None:
            copy_checkpoint(self.model_dir, self.output.hf)
            model = reference.to(dtype) if reference is not None else self._load_model(dtype)
            with quiet([]):
                self._note(export_trtllm(model, self.output.trtllm, dtype))

        self._timed("export_s", export)
        return self._finish(attempts, data, runner)

    def _note(self, note: str | None) -> None:
        if note is not None:
            self.notes.append(note)

    def _finish(self, attempts: list[Attempt], data: CalibrationData | None, runner: BatchRunner | None) -> dict:
        recipe, shipped = self.recipe, attempts[-1].format
        self.times["total_s"] = time.perf_counter() - self.started
        context = {
            "kv_cache_dtype": recipe.kv_cache_dtype if shipped != "none" else "auto",
            "algorithm": recipe.algorithm if shipped == "int4_awq" else None,
            "num_samples": recipe.num_samples,
            "round_samples": recipe.round_samples,
            "heldout_samples": recipe.heldout_samples,
            "seq_len": recipe.seq_len,
            "seed": recipe.seed,
            "tolerance": recipe.tolerance,
            "patience": recipe.patience,
            "on_failure": recipe.on_failure,
            "batch_size": runner.batch_size if runner else None,
            "dataset_sha256": data.calibration_sha256 if data else None,
            "heldout_sha256": data.heldout_sha256 if data else None,
            "device": self.device,
            "compute_dtype": str(self.dtype).removeprefix("torch."),
            "modelopt_version": modelopt_version(recipe.format),
            "notes": self.notes,
            "times": {k: round(v, 3) for k, v in self.times.items()},
        }
        report = build_report(attempts, recipe.format, context, recipe.tolerance)
        write_report(report, self.output.report_path)
        plot_curves(attempts, recipe.tolerance, self.output.curves_path)
        self.progress(report["summary"], 1.0)
        return report


def _refuse_incomplete(model_dir: Path, loading: dict) -> None:
    """A checkpoint transformers loaded only by initialising missing weights at random (or skipping tensors it does
    not know) would be calibrated, gated against that same random fill and shipped: refused instead."""
    problems = {
        "lacks": sorted(loading["missing_keys"]),
        "has weights of another shape for": sorted(str(m) for m in loading["mismatched_keys"]),
        "has tensors its model does not use:": sorted(n for n in loading["unexpected_keys"]
                                                      if not n.endswith("rotary_emb.inv_freq")),
    }
    for kind, names in problems.items():
        if names:
            raise CalibrationError(f"{model_dir}: the checkpoint {kind} {', '.join(names[:5])}"
                                   f"{' ...' if len(names) > 5 else ''}; it is incomplete or not of the architecture "
                                   "its config.json names, re-export it")


def _check_int4_shapes(model: nn.Module, model_dir: Path) -> None:
    bad = int4_incompatible_linears(model)
    if bad:
        raise CalibrationError(f"{model_dir}: int4_awq needs in-features divisible by 128, but {bad[0]}"
                               f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''} are not; use format fp8")


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many kinds for missing or broken tokenizer files
        raise CalibrationError(f"{model_dir}: cannot load the tokenizer ({type(exc).__name__}); the checkpoint "
                               "needs its tokenizer files (tokenizer.json, tokenizer_config.json)") from exc
