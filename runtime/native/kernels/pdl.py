"""Programmatic dependent launch (PDL, compute capability 9.0 and later) for the runtime's kernels.

Launched with PDL, a kernel may be scheduled while the one before it on the stream is still finishing. Its first
statement, ``wait_for_previous_kernel``, waits for that kernel to complete with its writes visible
(``griddepcontrol.wait``), so nothing is read or written early; it then lets the next kernel be scheduled as this
one's last programs start (``griddepcontrol.launch_dependents``), or, where the next kernel's waiting programs
would take room this one needs, once its main loop is done (``launch_next_kernel``). What this saves is the gap
between consecutive kernels, inside CUDA graphs too, where a small-batch decode step is about 350 kernels of a few
microseconds each.
A kernel not launched with PDL (cuBLAS, PyTorch's) is waited for as usual. Every launcher takes ``pdl``
(``RuntimeOptions.pdl``, passed down by the layers) to turn it off.

Only launches over at most ``PDL_MAX_TOKENS`` tokens use it. On an H200 (Llama-3-8B shape, CUDA-graph replays)
it made an FP8 decode step at batch 1 4.8 % faster (3.53 -> 3.36 ms; bf16 2 %) but one at batch 256 2.6 % slower
(11.16 -> 11.45 ms), where the kernels are long and the next kernel's waiting programs only take up room.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.runtime.native.kernels import device_limits


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """With PDL: wait until the previous kernel has completed, then let the next one launch (unless not
    ``LAUNCH_NEXT``: the kernel calls ``launch_next_kernel`` later)."""
    if PDL:
        gdc_wait()
        if LAUNCH_NEXT:
            gdc_launch_dependents()


@triton.jit
def launch_next_kernel(PDL: tl.constexpr):
    """With PDL: let the next kernel be scheduled from here on (after ``wait_for_previous_kernel`` without
    ``LAUNCH_NEXT``)."""
    if PDL:
        gdc_launch_dependents()


PDL_MAX_TOKENS = 16


def pdl_options(x: torch.Tensor, enabled: bool = True) -> dict[str, bool]:
    """The launch keywords of a kernel over the tokens of ``x`` (its first dim): the kernel's ``PDL`` constexpr and
    triton's ``launch_pdl``, both on when ``enabled``, for at most PDL_MAX_TOKENS tokens on a CUDA device that has PDL;
    triton's interpreter runs without."""
    on = enabled and x.shape[0] <= PDL_MAX_TOKENS and x.is_cuda and device_limits.supports_pdl(x.device)
    return {"PDL": on, "launch_pdl": on}
