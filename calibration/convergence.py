"""Convergence monitor: how much every calibration statistic moved between rounds, and whether it has settled.

The change of a statistic from one round to the next is its relative L2 change, |a_k - a_(k-1)| / |a_(k-1)|
(for a per-tensor amax simply the relative change). AWQ's search parameter (alpha, the argmin of a search loss)
is discrete and may flip between near-equal candidates, so its change is the regret of the previous choice: how
much worse, relatively, the previous round's alpha does on this round's search loss than the new best alpha.
The held-out KL curve is one more statistic ("heldout.kl"); its change is taken relative to at least KL_FLOOR,
so that changes far below anything a gate can resolve do not count as movement.
A statistic has settled when its change stayed under the tolerance for `patience` consecutive rounds;
calibration has converged when every statistic has settled.
"""

from __future__ import annotations

import torch

TINY = 1e-12
KL_FLOOR = 1e-3  # nats/token: 20x below the strictest default gate (fp8 max_kl 0.02)


def change(name: str, previous: torch.Tensor, current: torch.Tensor) -> float:
    """Round-to-round change of one statistic (see the module docstring)."""
    if name.endswith(".search_loss"):
        best = current.min().item()
        return max(current[int(previous.argmin())].item() - best, 0.0) / max(best, TINY)
    delta = torch.linalg.vector_norm((current - previous).flatten()).item()
    floor = KL_FLOOR if name == "heldout.kl" else TINY
    return delta / max(torch.linalg.vector_norm(previous.flatten()).item(), floor)


class ConvergenceMonitor:
    """Feed one snapshot per round with `observe`; read `converged` and `unsettled`."""

    def __init__(self, tolerance: float, patience: int):
        self.tolerance = tolerance
        self.patience = patience
        self.previous: dict[str, torch.Tensor] | None = None
        self.history: dict[str, list[float]] = {}
        self.streak: dict[str, int] = {}

    def observe(self, snapshot: dict[str, torch.Tensor]) -> tuple[float | None, str | None]:
        """Record a round; return its largest change and the statistic that moved most (None for the first round)."""
        previous, self.previous = self.previous, snapshot
        if previous is None:
            self.streak = dict.fromkeys(snapshot, 0)
            return None, None
        changes = {}
        for name, value in snapshot.items():
            before = previous.get(name)
            changes[name] = float("inf") if before is None or before.shape != value.shape else change(name, before,
                                                                                                     value)
            self.history.setdefault(name, []).append(changes[name])
            self.streak[name] = self.streak.get(name, 0) + 1 if changes[name] < self.tolerance else 0
        worst = max(changes, key=changes.get)
        return changes[worst], worst

    @property
    def converged(self) -> bool:
        return bool(self.streak) and all(s >= self.patience for s in self.streak.values())

    def unsettled(self) -> list[tuple[str, float | None]]:
        """Statistics that moved by at least the tolerance within the last `patience` rounds (or whose change could
        not be measured yet: None), with their largest recent change, largest first. When calibration has not
        converged but this is empty, every statistic is under the tolerance, just not yet for `patience` rounds."""
        recent: dict[str, float | None] = {}
        for name, streak in self.streak.items():
            changes = self.history.get(name, [])[-self.patience:]
            if streak < self.patience and (not changes or max(changes) >= self.tolerance):
                recent[name] = max(changes) if changes else None
        return sorted(recent.items(), key=lambda item: -(item[1] if item[1] is not None else float("inf")))
