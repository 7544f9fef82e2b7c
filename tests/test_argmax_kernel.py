"""The sampler's greedy argmax kernel against ``torch.argmax``: on CPU through triton's interpreter, and on a CUDA
GPU (``-m gpu``). Ties, NaNs and rows of -inf are where a reduction split over programs can differ."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.native.kernels.argmax import argmax_rows  # noqa: E402

BLOCK = 32  # logits a program loads at once in these tests: small, for the interpreter

@pytest.fixture
def device(kernel_device: str) -> str:
    return kernel_device


def hard_rows(vocab: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rows whose argmax a careless split gets wrong: ties across chunks, NaNs, infinities, -inf throughout."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 8, (9, vocab), generator=generator).to(dtype)  # many ties within and across chunks
    x[1, [vocab - 1, 3, BLOCK + 5]] = 100.0  # the first of three equal maxima, in different chunks
    x[2, [vocab // 2, vocab - 2]] = float("nan")  # the first NaN wins over every number
    x[3, [7, 2 * BLOCK]] = float("inf")
    x[3, vocab - 1] = float("nan")
    x[4] = float("-inf")  # all -inf: index 0
    x[5, :] = 1.0  # all equal: index 0
    x[6, vocab - 1] = 9.0  # the last column, in the last (partial) chunk
    x[7, BLOCK] = 9.0  # the first column of the second chunk
    x[8, 0] = float("nan")
    return x.to(device)


@pytest.mark.parametrize(("dtype", "max_programs"), [(torch.bfloat16, 9), (torch.bfloat16, 27), (torch.float32, 1000)],
                         ids=["bf16-one-chunk", "bf16-two-chunks", "fp32-a-chunk-a-load"])
def test_argmax_rows_is_torch_argmax(device, dtype, max_programs):
    vocab = 3 * BLOCK + 7  # the last chunk is partial
    x = hard_rows(vocab, dtype, device)
    assert argmax_rows(x, max_programs, block=BLOCK).tolist() == x.argmax(-1).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_argmax_rows_at_a_llama3_vocabulary():
    x = hard_rows(128256, torch.bfloat16, "cuda")
    for rows in (1, 9):
        assert argmax_rows(x[:rows]).tolist() == x[:rows].argmax(-1).tolist()
    big = torch.randn(512, 128256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(argmax_rows(big), big.argmax(-1))


def test_argmax_rows_takes_a_row_view_and_no_rows(device):
    x = torch.randn(4, 2 * BLOCK + 3, generator=torch.Generator().manual_seed(1)).to(device)
    assert argmax_rows(x[1:3, :], block=BLOCK).tolist() == x[1:3].argmax(-1).tolist()  # rows a stride apart
    assert argmax_rows(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match="contiguous rows"):
        argmax_rows(x.t())
