"""What the quantized-checkpoint key and the engine key are made of (canonical JSON, hashed by engines.cache), and
the model folder as they took it (``CheckpointState``)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from kiln.calibration.unread_files import TOKENIZER_CONFIG, UNREAD_TOKENIZER_CONFIG_KEYS, calibration_reads
from kiln.engines.cache import checkpoint_files
from kiln.engines.cache.hashing import checkpoint_digests, merkle_hash
from kiln.engines.cache.keys import canonical_json
from kiln.engines.native.tuning import tuning_material
from kiln.pipeline.backend import BackendChoice
from kiln.pipeline.config import KilnConfig
from kiln.pipeline.source_hash import engine_sources_hash, quantized_sources_hash
from kiln.runtime.native.engine_format import ENGINE_FORMAT_VERSION
from kiln.runtime.native.fingerprint import machine_fingerprint
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.trtllm.engine_info import ENGINE_FORMAT_VERSION as TRTLLM_ENGINE_FORMAT_VERSION
from kiln.runtime.trtllm.toolchain import trtllm_machine_fingerprint
from kiln.runtime.version import kiln_version, package_version

KEY_SCHEMA = 1
# 2: a quantized checkpoint's ``checkpoint`` is the hash of its calibration inputs only (``calibration_inputs_hash``);
# under 1 it was the whole folder's, so the checkpoints keyed so are never looked up again
QUANTIZED_KEY_SCHEMA = 2

FileIdentity = tuple[bytes, int, int, int, int]  # real path, size, mtime and ctime in ns, inode


@dataclass(frozen=True)
class CheckpointState:
    """A model folder as the keys took it: its content hash (``checkpoint_hash``: the engine's), the hash of what
    calibration reads of it (``calibration_inputs_hash``: the quantized checkpoint's), and the identity of each file
    the content hash covers, stat'ed before the hash read it."""

    path: Path
    hash: str
    calibration_hash: str
    identities: dict[str, FileIdentity | None]

    def changed_files(self) -> list[str]:
        """The files rewritten (back to the same bytes too: the ctime or inode moves), added or removed since the
        folder was hashed. None changed is the folder still hashing as its keys say: ``checkpoint_hash`` would give
        the same digests from its memo, keyed by these identities, without reading a byte; like it, this only stats."""
        now = _identities(self.path)
        return sorted(rel for rel in now.keys() | self.identities.keys() if now.get(rel) != self.identities.get(rel))


def checkpoint_state(path: Path, memo_path: Path | None = None) -> CheckpointState:
    """``path``'s content hash and calibration inputs' hash (its files read once, through the hash memo at
    ``memo_path``), and its files' identities, taken first: a file written while it is read is a changed file."""
    identities = _identities(path)
    digests = checkpoint_digests(path, memo_path)
    return CheckpointState(path, merkle_hash(digests), calibration_inputs_hash(path, digests), identities)


def calibration_inputs_hash(path: Path, digests: dict[str, str]) -> str:
    """The Merkle hash of what calibration reads of the model folder at ``path`` (``digests``: its files' sha256,
    ``checkpoint_digests``): weights, config.json and the tokenizer, not the files it never reads
    (``calibration_reads``: the chat templates and the generation config, so that an edit of them builds a new engine
    from the cached quantized checkpoint and never recalibrates), and tokenizer_config.json as JSON without its
    chat_template."""
    calibrated = {rel: digest for rel, digest in digests.items() if calibration_reads(rel)}
    if TOKENIZER_CONFIG in calibrated:
        calibrated[TOKENIZER_CONFIG] = _as_calibration_reads(path / TOKENIZER_CONFIG, calibrated[TOKENIZER_CONFIG])
    return merkle_hash(calibrated)


def _as_calibration_reads(path: Path, digest: str) -> str:
    """sha256 of the canonical JSON of tokenizer_config.json without the keys calibration never reads (its
    ``chat_template``); ``digest`` (its bytes') for one that is not a JSON object, which calibration refuses anyway."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        read = {k: v for k, v in config.items() if k not in UNREAD_TOKENIZER_CONFIG_KEYS}
        return hashlib.sha256(canonical_json(read)).hexdigest()
    except (OSError, UnicodeDecodeError, AttributeError, ValueError):  # not a JSON object, or NaN in it, which
        return digest  # canonical JSON refuses


def _identities(path: Path) -> dict[str, FileIdentity | None]:
    """The identity of each file ``checkpoint_hash`` covers under ``path``; None for one gone since it was listed."""
    files = checkpoint_files(path)
    identities: dict[str, FileIdentity | None] = {}
    for rel in files.hashed:
        try:
            st = (files.root / rel).stat()
        except FileNotFoundError:
            identities[rel] = None
            continue
        real = os.fsencode(os.path.realpath(files.root / rel))
        identities[rel] = real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino
    return identities


def quantized_material(calibration_hash: str, recipe: dict, device: str, compute_dtype: str) -> dict:
    """Key material of a quantized checkpoint: what calibration reads of the input (``calibration_inputs_hash``:
    not its chat templates nor generation config), the effective recipe (``recipe_material``),
    where it is calibrated (CPU float32 and GPU bf16 calibration give different bytes), and the Kiln that calibrates
    it (its version and the hash of its calibration code, and transformers' version, which loads the model); build
    options never enter it."""
    return {"key_schema": QUANTIZED_KEY_SCHEMA, "kind": "quantized", "checkpoint": calibration_hash, "recipe": recipe,
            "calibration": {"device": device, "compute_dtype": compute_dtype},
            "toolchain": {"kiln": kiln_version(), "kiln_sources": quantized_sources_hash(),
                          "transformers": package_version("transformers")}}


def engine_material(checkpoint_hash: str, quantized_key: str | None, config: KilnConfig, choice: BackendChoice,
                    recipe: dict, options: RuntimeOptions) -> dict:
    """Key material of an engine: checkpoint, recipe (``recipe_material``), semantic build options, the runtime
    options that change what the build writes (native: ``tuning_material``), backend, toolchain (Kiln's own version
    and the hash of its build code too: its builders decide how a checkpoint's config.json and tensors become the
    engine), hardware."""
    if choice.backend == "trtllm":
        machine = trtllm_machine_fingerprint()
        toolchain = {name: machine.get(name) for name in ("tensorrt_llm", "tensorrt", "cuda")}
        format_version = TRTLLM_ENGINE_FORMAT_VERSION
        backend_options = {}
    else:
        machine = machine_fingerprint(choice.device)
        toolchain = {name: machine.get(name) for name in ("torch", "triton", "cuda")}
        format_version = ENGINE_FORMAT_VERSION
        backend_options = {"tuning": tuning_material(choice.device, options.kernels)}
    return {
        "key_schema": KEY_SCHEMA,
        "kind": "engine",
        "checkpoint": checkpoint_hash,
        "quantization": {"recipe": recipe, "quantized_key": quantized_key},
        "model_dtype": config.model.dtype,
        "build": config.build.semantic(choice.backend),
        **backend_options,
        "backend": choice.backend,
        "engine_format_version": format_version,
        # transformers: the build stage writes the engine's tokenizer.json as it reads the checkpoint's
        "toolchain": {"kiln": kiln_version(), "kiln_sources": engine_sources_hash(choice.backend),
                      "transformers": package_version("transformers"), **toolchain},
        "hardware": {
            "device": machine["device"],
            "gpu_name": machine.get("gpu_name"),
            "compute_capability": machine.get("compute_capability"),
            "tp_size": config.build.tp_size,
            "pp_size": config.build.pp_size,
        },
    }
