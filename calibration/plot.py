"""calibration_curves.png: the largest statistic change, the held-out KL and top-1 agreement, round by round."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot is imported)
from matplotlib.figure import Figure  # noqa: E402

from kiln.calibration.report import Attempt  # noqa: E402


def plot_curves(attempts: list[Attempt], tolerance: float, path: Path) -> None:
    """Write ``curves_figure`` as a PNG to ``path``."""
    fig = curves_figure(attempts, tolerance)
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def curves_figure(attempts: list[Attempt], tolerance: float) -> Figure:
    """Three panels, one line per calibrated format: largest change (the tolerance dashed; linear below a tenth of
    it, so that a round that changed nothing still shows), held-out KL, top-1."""
    fig, (ax_change, ax_kl, ax_top1) = plt.subplots(1, 3, figsize=(14, 4), dpi=100)
    calibrated = [a for a in attempts if a.rounds]
    for index, attempt in enumerate(calibrated):
        style = {"color": f"C{index}", "marker": "o", "label": f"{attempt.format} ({attempt.verdict})"}
        changes = [(r.samples, r.max_rel_change) for r in attempt.rounds if r.max_rel_change is not None]
        if changes:
            ax_change.plot(*zip(*changes, strict=True), **style)
        samples = [r.samples for r in attempt.rounds]
        ax_kl.plot(samples, [r.kl for r in attempt.rounds], **style)
        ax_top1.plot(samples, [r.top1_agreement for r in attempt.rounds], **style)
    ax_change.axhline(tolerance, color="grey", linestyle="--", label=f"tolerance {tolerance:g}")
    ax_change.set(title="largest round-to-round change", xlabel="calibration samples", ylabel="relative change")
    ax_change.set_yscale("symlog", linthresh=tolerance / 10)
    ax_kl.set(title="held-out KL vs unquantized", xlabel="calibration samples", ylabel="mean KL (nats/token)")
    ax_kl.set_ylim(bottom=0)
    ax_top1.set(title="held-out top-1 agreement", xlabel="calibration samples", ylabel="share of tokens")
    if not calibrated:
        ax_change.text(0.5, 0.5, "no calibration (format none)", ha="center", va="center",
                       transform=ax_change.transAxes)
    for ax in (ax_change, ax_kl, ax_top1):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
