"""The engine weight loader: safetensors bytes into parameters, chunked, cast where the dtypes differ, refused with a
clear error when the file does not match or is damaged."""

import pytest
import torch
from safetensors.torch import save_file

from kiln.runtime.errors import EngineFormatError
from kiln.runtime.native import weight_loading
from kiln.runtime.native.weight_loading import load_weights_into, read_header


def stored_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(67, 33, generator=gen).to(torch.bfloat16),
        "b.weight": torch.randn(40, 16, generator=gen).to(torch.float8_e4m3fn),
        "b.scale": torch.tensor(0.25),
        "c.packed": torch.randint(-2**31, 2**31 - 1, (9, 5), generator=gen, dtype=torch.int32),
    }


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu().reshape(-1).view(torch.uint8)


def empty_params(tensors: dict[str, torch.Tensor], device: str = "cpu") -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, 7, device=device) if t.dtype != torch.float8_e4m3fn else
            torch.zeros_like(t, device=device) for name, t in tensors.items()}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 100 bytes, so that every tensor but the scalar spans several and readers interleave."""
    monkeypatch.setattr(weight_loading, "CHUNK_BYTES", 100)


def test_every_tensor_lands_bit_exact_across_chunks(tmp_path, small_chunks):
    tensors = stored_tensors()
    save_file(tensors, tmp_path / "w.safetensors")
    params = empty_params(tensors)
    load_weights_into(tmp_path / "w.safetensors", params)
    for name, tensor in tensors.items():
        assert torch.equal(raw(params[name]), raw(tensor)), name


def test_a_tensor_stored_in_another_dtype_is_cast_to_its_parameter(tmp_path):
    stored = torch.linspace(-3, 3, 50).reshape(5, 10)
    save_file({"w": stored}, tmp_path / "w.safetensors")
    params = {"w": torch.zeros(5, 10, dtype=torch.bfloat16)}
    load_weights_into(tmp_path / "w.safetensors", params)
    assert torch.equal(params["w"], stored.to(torch.bfloat16))


def test_header_gives_absolute_byte_ranges(tmp_path):
    tensors = stored_tensors()
    save_file(tensors, tmp_path / "w.safetensors")
    header = read_header(tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    a = header["a.weight"]
    assert a.dtype == torch.bfloat16 and a.shape == (67, 33)
    assert data[a.begin:a.end] == raw(tensors["a.weight"]).numpy().tobytes()


def test_a_weight_file_this_user_may_not_read_is_refused_naming_it(tmp_path, monkeypatch):
    def denied(path, mode):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(weight_loading, "open", denied, raising=False)  # as root, chmod 000 denies nothing
    with pytest.raises(EngineFormatError, match=r"w.safetensors: Permission denied; give this user read access"):
        read_header(tmp_path / "w.safetensors")


@pytest.mark.parametrize("params, match", [
    ({"a.weight": torch.zeros(67, 33, dtype=torch.bfloat16)}, "weights do not match.*unexpected"),
    ({**empty_params(stored_tensors()), "extra": torch.zeros(1)}, "weights do not match.*missing .'extra'"),
    ({**empty_params(stored_tensors()), "a.weight": torch.zeros(33, 67, dtype=torch.bfloat16)},
     r"a.weight has shape \[67, 33\], expected \[33, 67\]"),
])
def test_a_mismatching_file_is_refused_before_anything_is_read(tmp_path, params, match):
    save_file(stored_tensors(), tmp_path / "w.safetensors")
    before = {name: p.clone() for name, p in params.items()}
    with pytest.raises(EngineFormatError, match=match):
        load_weights_into(tmp_path / "w.safetensors", params)
    assert all(torch.equal(raw(params[name]), raw(before[name])) for name in params)


def test_damaged_files_are_refused_with_the_reason(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(stored_tensors(), path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(EngineFormatError, match="truncated or damaged"):
        load_weights_into(path, empty_params(stored_tensors()))
    path.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(EngineFormatError, match="not a safetensors file"):
        load_weights_into(path, empty_params(stored_tensors()))
    path.write_bytes(data[:8] + b"{" * (len(data) - 8))
    with pytest.raises(EngineFormatError, match="unreadable safetensors header"):
        load_weights_into(path, empty_params(stored_tensors()))
    with pytest.raises(EngineFormatError, match="missing; the engine is incomplete"):
        load_weights_into(tmp_path / "absent.safetensors", {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_readers_copy_every_chunk_to_the_device(tmp_path, small_chunks):
    tensors = stored_tensors()
    save_file(tensors, tmp_path / "w.safetensors")
    params = empty_params(tensors, "cuda")
    load_weights_into(tmp_path / "w.safetensors", params)
    for name, tensor in tensors.items():
        assert torch.equal(raw(params[name]), raw(tensor)), name
