"""Fixtures shared by the test modules."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through triton's interpreter. This must be set before anything imports triton
    # (modelopt does, at import), since triton decides at decoration time whether a kernel is interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's model tests on one torch thread: on a small shared machine more threads are slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
