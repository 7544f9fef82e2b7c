"""Running token rows through a model in batches: finite-output checks and out-of-memory back-off on a GPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn

from kiln.calibration.errors import CalibrationError

T = TypeVar("T")

AUTO_BATCH = {"cpu": 8, "cuda": 32}


class BatchRunner:
    """Forwards rows of token ids in batches of `batch_size`; `with_backoff` halves the size after a GPU OOM."""

    def __init__(self, batch_size: int | str, device: str, rows_per_round: int):
        kind = torch.device(device).type
        self.device = device
        self.batch_size = min(AUTO_BATCH.get(kind, 8), rows_per_round) if batch_size == "auto" else int(batch_size)

    def spans(self, rows: int) -> Iterator[slice]:
        """Row ranges of consecutive batches."""
        for start in range(0, rows, self.batch_size):
            yield slice(start, min(start + self.batch_size, rows))

    @torch.no_grad()
    def logits(self, model: nn.Module, ids: torch.Tensor, what: str) -> torch.Tensor:
        """Float32 logits [batch, seq, vocab]; CalibrationError naming the first culprit if any are NaN or infinite."""
        ids = ids.to(self.device)
        logits = model(input_ids=ids, use_cache=False).logits.float()
        if not torch.isfinite(logits).all():
            raise CalibrationError(
                f"{what}: non-finite activations (NaN/Inf), first at {_first_non_finite_module(model, ids)}; check "
                "the checkpoint's weights, or calibrate in a wider dtype (float32)"
            )
        return logits

    def forward(self, model: nn.Module, rows: torch.Tensor, what: str) -> None:
        """Run every row through the model (a calibration forward loop)."""
        for span in self.spans(len(rows)):
            self.logits(model, rows[span], what)

    def with_backoff(self, step: Callable[[], T]) -> T:
        """Run `step`; after a CUDA out-of-memory error halve the batch size and run it again."""
        while True:
            try:
                return step()
            except torch.cuda.OutOfMemoryError:
                if self.batch_size == 1:
                    raise CalibrationError("quantize: out of GPU memory even at batch size 1; lower quantize.seq_len "
                                           "or free the GPU") from None
                self.batch_size //= 2
                torch.cuda.empty_cache()


def _first_non_finite_module(model: nn.Module, ids: torch.Tensor) -> str:
    """The name of the first module (in execution order) whose output holds a NaN or an infinity."""
    found: list[str] = []

    def hook(name: str):
        def check(_module, _inputs, output):
            tensor = output[0] if isinstance(output, tuple) else output
            if (not found and isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
                    and not torch.isfinite(tensor).all()):
                found.append(name)
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else "the logits"
