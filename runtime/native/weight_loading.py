"""An engine's weight file into a model's parameters, at the speed of the page cache and the host-to-device link.

The safetensors header is read as JSON (never a pickle) and checked against the parameters; then each tensor's bytes
are read with ``os.preadv`` straight into the parameter on the CPU, or, on CUDA, into pinned host buffers by several
threads, each copying a filled buffer to the device on its own stream while it reads the next. A memory map read
through ``safetensors`` takes a page fault per 4 KiB and a pageable copy per tensor; this is several times faster
for the gigabytes of an 8B engine.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.runtime.errors import EngineFormatError

SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 << 20
READ_THREADS = 4  # readers on CUDA, each with two pinned buffers: one being read into, one being copied out
CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: its dtype, shape and byte range in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of safetensors file ``path`` by name, with absolute byte ranges, checked against the file's size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (header_len,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
            if size < 8 or header_len > min(MAX_HEADER_BYTES, size - 8):
                raise EngineFormatError(f"{path}: not a safetensors file (header length {header_len}, file "
                                        f"{size} bytes); rebuild the engine")
            header = json.loads(f.read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineFormatError(f"{path}: unreadable safetensors header ({e}); rebuild the engine") from None
    except PermissionError as e:
        raise EngineFormatError(f"{path}: {e.strerror}; give this user read access to the engine's files") from None
    if not isinstance(header, dict):
        raise EngineFormatError(f"{path}: the safetensors header is not a JSON object; rebuild the engine")
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _stored_tensor(path, name, entry, data_start, size)
    return tensors


def _stored_tensor(path: Path, name: str, entry: object, data_start: int, file_size: int) -> StoredTensor:
    try:
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (data_start + int(offset) for offset in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise EngineFormatError(f"{path}: tensor {name} has an unreadable header entry {entry!r}; rebuild the "
                                f"engine") from None
    if end - begin != math.prod(shape) * dtype.itemsize or begin < data_start or end > file_size:
        raise EngineFormatError(f"{path}: tensor {name} ({entry['dtype']} {list(shape)}) has bytes {begin}-{end} "
                                f"of a {file_size}-byte file; the file is truncated or damaged, rebuild the engine")
    return StoredTensor(name, dtype, shape, begin, end)


def load_weights_into(path: Path, params: dict[str, torch.Tensor]) -> None:
    """Copy every tensor of ``path`` into the parameter of its name (all on one device), casting a tensor stored in
    another dtype to its parameter's. The names and shapes must match exactly."""
    if not path.is_file():
        raise EngineFormatError(f"{path}: missing; the engine is incomplete, rebuild it")
    stored = read_header(path)
    if problem := weights_mismatch({name: tensor.shape for name, tensor in stored.items()}, params):
        raise EngineFormatError(f"{path}: weights do not match engine.json ({problem}); rebuild the engine")
    device = next(iter(params.values())).device if params else torch.device("cpu")
    direct = {name: t for name, t in stored.items() if t.dtype == params[name].dtype and params[name].is_contiguous()}
    with open(path, "rb") as f:
        fd = f.fileno()
        for name in stored.keys() - direct.keys():  # a dtype cast: through a host tensor of the stored dtype
            host = torch.empty(stored[name].shape, dtype=stored[name].dtype)
            _read_exact(fd, _bytes_of(host).numpy(), stored[name].begin, path)
            params[name].copy_(host)
        chunks = list(_chunks(direct.values(), params))
        if device.type == "cuda":
            _read_to_device(fd, chunks, device, path)
        else:
            for offset, dest in chunks:
                _read_exact(fd, dest.numpy(), offset, path)


def weights_mismatch(shapes: dict[str, tuple[int, ...]], params: dict[str, torch.Tensor]) -> str | None:
    """What keeps tensors of these names and ``shapes`` from filling ``params`` exactly, or None when they do."""
    if shapes.keys() != params.keys():
        missing, unexpected = sorted(params.keys() - shapes.keys()), sorted(shapes.keys() - params.keys())
        return f"missing {missing[:3]}, unexpected {unexpected[:3]}"
    for name, shape in shapes.items():
        if tuple(shape) != tuple(params[name].shape):
            return f"{name} has shape {list(shape)}, expected {list(params[name].shape)}"
    return None


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


def _chunks(tensors, params: dict[str, torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """(file offset, destination bytes) pieces of at most CHUNK_BYTES, in file order."""
    for tensor in sorted(tensors, key=lambda t: t.begin):
        dest = _bytes_of(params[tensor.name])
        for start in range(0, dest.numel(), CHUNK_BYTES):
            yield tensor.begin + start, dest[start:start + CHUNK_BYTES]


def _read_exact(fd: int, buffer, offset: int, path: Path) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EngineFormatError(f"{path}: ended early at byte {offset + done}; the file is truncated, rebuild "
                                    f"the engine")
        done += n


def _read_to_device(fd: int, chunks: list[tuple[int, torch.Tensor]], device: torch.device, path: Path) -> None:
    """READ_THREADS readers, each taking every READ_THREADS-th chunk: read into one of its two pinned buffers, copy
    it to the device on the reader's stream, and before reusing a buffer wait for its copy."""
    caller = torch.cuda.current_stream(device)

    def reader(first: int) -> None:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(caller)  # the parameters' allocation (and any initialisation) comes first
        buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        copied: list[torch.cuda.Event | None] = [None, None]
        with torch.cuda.stream(stream):
            for i, (offset, dest) in enumerate(chunks[first::READ_THREADS]):
                slot = i % 2
                if copied[slot] is not None:
                    copied[slot].synchronize()
                host = buffers[slot][:dest.numel()]
                _read_exact(fd, host.numpy(), offset, path)
                dest.copy_(host, non_blocking=True)
                copied[slot] = stream.record_event()
        stream.synchronize()

    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kiln-weights") as pool:
        for future in [pool.submit(reader, k) for k in range(READ_THREADS)]:
            future.result()
