"""Fixtures shared by the test modules."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch

# The suite sets Kiln's options itself: a user's exported KILN_CACHE, KILN_CACHE_REMOTE or runtime option would
# otherwise outrank what a test configures (a cache directory, a policy) and fail it.
for _name in [name for name in os.environ if name.startswith("KILN_")]:
    del os.environ[_name]

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through triton's interpreter. This must be set before anything imports triton
    # (modelopt does, at import), since triton decides at decoration time whether a kernel is interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _let_the_interpreter_take_numpy2_loop_bounds() -> None:
    """triton 3.6's interpreter turns scalars (1-element arrays) into loop bounds with ``int(array)``, which
    NumPy >= 2.4 refuses; use ``.item()`` instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_for_numpy2(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_for_numpy2


if os.environ.get("TRITON_INTERPRET") == "1":
    _let_the_interpreter_take_numpy2_loop_bounds()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's model tests on one torch thread: on a small shared machine more threads are slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter runs without CUDA")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
])
def kernel_device(request) -> str:
    """Where a Triton kernel test runs: Triton's interpreter on a machine without CUDA, else the GPU (marked gpu)."""
    return request.param


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Make every output buffer the kernels allocate start as NaN, so an element they never write shows."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: real_empty(*args, **kwargs).fill_(float("nan")))


@pytest.fixture(scope="session")
def fp8_engine(tmp_path_factory):
    """A tiny FP8 engine (``QUANT_SHAPE``, the tiny plan) built on the GPU when there is one (so its build measured
    the FP8 crossover), else on the CPU in float32."""
    from kiln.engines.native.builder import build_native_engine
    from tests.model_factories import QUANT_SHAPE, make_fp8_checkpoint, tiny_plan

    root = tmp_path_factory.mktemp("fp8-engine")
    checkpoint = make_fp8_checkpoint(root / "hf", **QUANT_SHAPE)
    (root / "engine").mkdir()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    build_native_engine(checkpoint, root / "engine", tiny_plan(), "bfloat16" if device == "cuda" else "float32",
                        device=device)
    return root / "engine"


@pytest.fixture(scope="module")
def llm():
    """The tiny test engine (bundled tokenizer, seeded random weights) loaded once per module; a module that needs
    another engine defines its own ``llm``."""
    from kiln.runtime import LLM
    from tests.test_server_support import tiny_engine

    with LLM.load(tiny_engine()) as loaded:
        yield loaded


@pytest.fixture(autouse=True)
def kiln_logging_restored() -> Iterator[None]:
    """`kiln serve` run in this process sends Kiln's log lines to the stderr of its run (a CliRunner's, closed once
    it returns): the next test gets the logger as it was."""
    kiln_logger = logging.getLogger("kiln")
    handlers, level = list(kiln_logger.handlers), kiln_logger.level
    yield
    kiln_logger.handlers[:] = handlers
    kiln_logger.setLevel(level)
