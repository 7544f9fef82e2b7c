"""The memory-bandwidth floor of batch-1 decode: bytes one step must read, and the bandwidth to read them with.

A decode step at batch 1 streams every weight the step multiplies by once (the embedding table is gathered, one row
per token, so it is left out unless it doubles as the LM head) and the KV of the whole context. The floor is
``bandwidth / bytes per step`` tokens per second; ``floor_fraction_batch1`` is the measured rate over it. Of a
tensor-parallel engine, the bytes are those of the ranks that share the memory: rank 0's on GPUs, all on a CPU.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.pipeline.bench.common import sync
from kiln.runtime.errors import KilnError
from kiln.runtime.native.engine_format import EngineConfig, weights_file
from kiln.runtime.native.kv_cache import kv_bytes_per_block
from kiln.runtime.native.parallel.sharding import rank_config

GB = 10**9
# The bandwidth of a recognised GPU (by ``gpu_variant``; anything else is measured), GB/s read + written: the
# device-to-device copy rate where one was measured (an H200 SXM copies 4.3 TB/s: DESIGN.md, "Performance method"),
# else the datasheet's peak, which a copy does not reach. Each form factor has its own memory: an H100 PCIe's HBM2e
# reads 2.0 TB/s, an H100 NVL's 3.9 against the SXM card's 3.35; a GH200 (HBM3 or HBM3e) is measured.
NOMINAL_COPY_GBS = {"H200": 4300.0}
DATASHEET_GBS = {"H200 NVL": 4800.0, "H100": 3350.0, "H100 PCIe": 2000.0, "H100 NVL": 3900.0}
HOPPER_MODELS = ("H100", "H200", "GH200")
FORM_FACTORS = ("PCIe", "NVL")  # a card's name says these; the SXM card's says neither ("NVIDIA H100 80GB HBM3")
EMBEDDING = "embed_tokens.weight"


class BenchFloorError(KilnError):
    """The engine's weights cannot be sized for the floor."""


@dataclass(frozen=True)
class Bandwidth:
    """Memory bandwidth in GB/s (10^9 bytes, read + written) and where the figure came from."""

    gbs: float
    source: str


def tensor_bytes(weights_file: Path) -> dict[str, int]:
    """Bytes of each tensor in a safetensors file, read from its header (no tensor data is loaded)."""
    try:
        with open(weights_file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
    except (OSError, struct.error, ValueError) as e:
        raise BenchFloorError(f"{weights_file}: unreadable safetensors header ({e}); rebuild the engine") from None
    sizes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        sizes[name] = end - start
    return sizes


def kv_bytes_per_token(config: EngineConfig) -> int:
    """K and V bytes of one token across all layers, in the engine's KV cache dtype."""
    return kv_bytes_per_block(config) // config.plan.tokens_per_block


def ranks_sharing_memory(device: str, tp_size: int) -> int:
    """How many ranks of a ``tp_size`` engine read through the memory whose bandwidth the floor uses: every rank on
    a CPU (its ranks are processes of one host, on one memory bus), one on GPUs (each rank reads its own memory, all
    at once)."""
    return tp_size if torch.device(device).type == "cpu" else 1


def decode_step_bytes(engine_dir: Path, input_len: int, output_len: int, ranks: int = 1) -> dict:
    """Bytes one batch-1 decode step reads through one memory: streamed weights plus the KV of the mean decode
    context, of ranks ``0 .. ranks - 1`` of a tensor-parallel engine together (``ranks_sharing_memory``).

    The decode steps of a request see contexts ``input_len + 1 .. input_len + output_len - 1``; their mean,
    ``input_len + output_len / 2``, is the context length used."""
    engine_dir = Path(engine_dir)
    config = EngineConfig.load(engine_dir)
    gathered = None if config.architecture.tie_word_embeddings else EMBEDDING
    weight_bytes = embedding_bytes = 0
    for rank in range(ranks):  # each rank streams its own shard, replicated norms included
        sizes = tensor_bytes(engine_dir / weights_file(rank))
        embedding_bytes += sizes.get(gathered, 0)
        weight_bytes += sum(size for name, size in sizes.items() if name != gathered)
    context = input_len + output_len / 2
    kv_token = kv_bytes_per_token(rank_config(config)) * ranks
    kv_bytes = int(kv_token * context)
    return {"weight_bytes": weight_bytes, "embedding_bytes_excluded": embedding_bytes,
            "kv_bytes_per_token": kv_token, "mean_context_len": context, "kv_bytes": kv_bytes,
            "bytes_per_step": weight_bytes + kv_bytes, "tp_size": config.tp_size, "ranks_counted": ranks}


def floor_tokens_per_s(bytes_per_step: int, bandwidth_gbs: float) -> float:
    """Batch-1 decode tokens per second when every step is limited by reading its bytes once."""
    return bandwidth_gbs * GB / bytes_per_step


def gpu_variant(gpu_name: str) -> str | None:
    """A Hopper GPU's model and form factor from its device name: ``H100`` or ``H200`` for the SXM card
    (``NVIDIA H100 80GB HBM3``), ``H100 PCIe``, ``H100 NVL``, ``H200 NVL``, ``GH200``; None for any other GPU."""
    words = gpu_name.upper().split()
    model = next((model for model in HOPPER_MODELS if model in words), None)
    if model is None:
        return None
    form = next((form for form in FORM_FACTORS if form.upper() in words), None)
    return f"{model} {form}" if form else model


def known_bandwidth(gpu_name: str) -> Bandwidth | None:
    """The bandwidth of a recognised GPU, its source saying whether it is a measured copy rate or the datasheet's
    peak; None for a GPU to measure."""
    variant = gpu_variant(gpu_name)
    if variant in NOMINAL_COPY_GBS:
        return Bandwidth(NOMINAL_COPY_GBS[variant], f"measured device-to-device copy rate of an {variant} "
                                                    f"({gpu_name})")
    if variant in DATASHEET_GBS:
        return Bandwidth(DATASHEET_GBS[variant], f"datasheet peak of the {variant} ({gpu_name}; no measured copy "
                                                 "rate, which would be lower)")
    return None


def resolve_bandwidth(device: str, given_gbs: float | None) -> Bandwidth:
    """The bandwidth for the floor: ``--bandwidth-gbs`` if given, a recognised GPU's figure, else measured."""
    if given_gbs is not None:
        return Bandwidth(given_gbs, "--bandwidth-gbs")
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
        if (known := known_bandwidth(name)) is not None:
            return known
        return Bandwidth(measure_copy_gbs(device), f"measured device-to-device copy on {name}")
    return Bandwidth(measure_copy_gbs("cpu"), "measured memcpy on the CPU (torch copy_, 256 MB)")


def measure_copy_gbs(device: str, nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Best copy rate of ``repeats`` copies of ``nbytes`` on ``device``: (bytes read + bytes written) / time."""
    dev = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and allocation are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        sync(dev)
        start = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        best = min(best, time.perf_counter() - start)
    return round(2 * src.numel() * 4 / best / GB, 1)
