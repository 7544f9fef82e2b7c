"""calibration_curves.png's panels (every round's change shows, a round that changed nothing too) and the report's
summary line."""

import matplotlib.pyplot as plt

from kiln.calibration.plot import curves_figure
from kiln.calibration.report import Attempt, RoundRecord


def test_a_round_that_changed_nothing_stays_on_the_change_panel():
    rounds = [RoundRecord(round=k + 1, samples=4 * (k + 1), max_rel_change=change, most_changed="w", kl=0.1,
                          top1_agreement=0.9, output_mae=0.01, seconds=1.0)
              for k, change in enumerate([None, 0.2, 0.0])]
    fig = curves_figure([Attempt("fp8", rounds=rounds, converged=True)], tolerance=0.01)
    ax_change = fig.axes[0]
    (line,) = ax_change.get_lines()[:1]
    assert list(line.get_ydata()) == [0.2, 0.0]
    low, high = ax_change.get_ylim()
    assert low <= 0.0 < 0.2 <= high
    plt.close(fig)


def test_the_summary_counts_one_round_in_the_singular():
    from kiln.calibration.gate import GateResult
    from kiln.calibration.metrics import HeldoutMetrics
    from kiln.calibration.report import summary_line

    rounds = [RoundRecord(round=1, samples=8, max_rel_change=None, most_changed=None, kl=0.1, top1_agreement=0.9,
                          output_mae=0.01, seconds=1.0)]
    gate = GateResult(True, HeldoutMetrics(0.1, 0.9, 10.0, 9.9, 0.01, 0.01), None, [])
    attempt = Attempt("fp8", rounds=rounds, gate=gate)
    assert "not converged after 1 round (8 samples" in summary_line(attempt, [attempt], 0.01)
