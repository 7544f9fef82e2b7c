"""tools/gpu_busy.py's arithmetic: busy time as the union of kernel intervals, the gaps between them, and the
steps of a window summarised by kind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from gpu_busy import busy_report, step_summary  # noqa: E402


def test_overlapping_kernels_count_once_and_gaps_between_them_are_idle(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100},
              {"ph": "X", "cat": "kernel", "name": "attention", "ts": 50, "dur": 100},  # overlaps: busy to 150
              {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 160, "dur": 10},  # a 10 us gap: not counted
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 270, "dur": 30},  # a 100 us gap
              {"ph": "X", "cat": "cpu_op", "name": "host", "ts": 0, "dur": 1000}]  # not GPU activity
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    report = busy_report(trace, 1.0)
    assert report["span_ms"] == 0.3 and report["busy_ms"] == 0.19 and report["kernels"] == 4
    assert report["gaps_over_20us"] == 1 and report["longest_gaps_us"] == [100.0]
    assert report["heaviest_kernels_ms"] == {"gemm": 0.13, "attention": 0.1, "copy": 0.01}


def test_a_window_s_steps_are_summarised_by_kind():
    def step(prefill, duration, seqs):
        return {"num_prefill_seqs": prefill, "duration_s": duration, "execute_s": duration / 2, "num_seqs": seqs,
                "num_batched_tokens": seqs}

    summary = step_summary([step(0, 0.040, 2048), step(0, 0.042, 2048), step(3, 0.120, 2000)])
    assert summary["steps"] == {"decode": 2, "mixed": 1}
    assert summary["decode_step"]["duration_ms"] == 41.0 and summary["mixed_step"]["execute_ms"] == 60.0
