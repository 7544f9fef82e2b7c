"""What the quantized-checkpoint key and the engine key are made of (canonical JSON, hashed by engines.cache)."""

from __future__ import annotations

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


def quantized_material(checkpoint_hash: str, recipe: dict, device: str, compute_dtype: str) -> dict:
    """Key material of a quantized checkpoint: the input's content, the effective recipe (``recipe_material``),
    where it is calibrated (CPU float32 and GPU bf16 calibration give different bytes), and the Kiln that calibrates
    it (its version and the hash of its calibration code, and transformers' version, which loads the model); build
    options never enter it."""
    return {"key_schema": KEY_SCHEMA, "kind": "quantized", "checkpoint": checkpoint_hash, "recipe": recipe,
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
