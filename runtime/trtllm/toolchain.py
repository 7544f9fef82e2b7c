"""The TensorRT-LLM toolchain on this machine: which versions are installed (package metadata only, nothing is
imported), what an engine is tied to, and the executor module once a 1.2.x engine is loaded."""

from __future__ import annotations

import importlib
from typing import Any

from kiln.runtime.errors import FingerprintMismatchError, TrtllmUnavailableError
from kiln.runtime.version import package_version

SUPPORTED_TRTLLM = (1, 2)
INSTALL_HINT = ("install TensorRT-LLM 1.2.x on a GPU machine: pip install 'tensorrt-llm>=1.2,<1.3' "
                "--extra-index-url https://pypi.nvidia.com (see docs/tensorrt-llm.md)")
FINGERPRINT_FIELDS = ("gpu_name", "compute_capability", "tensorrt_llm", "tensorrt")
_TENSORRT_DISTRIBUTIONS = ("tensorrt", "tensorrt_cu13", "tensorrt_cu12", "tensorrt_cu11")


def trtllm_version() -> str | None:
    """The installed tensorrt_llm version (package metadata only: nothing is imported)."""
    return package_version("tensorrt_llm")


def trtllm_versions() -> dict[str, str | None]:
    """Installed tensorrt_llm and tensorrt versions (package metadata only: nothing is imported)."""
    return {"tensorrt_llm": trtllm_version(),
            "tensorrt": next(filter(None, map(package_version, _TENSORRT_DISTRIBUTIONS)), None)}


def trtllm_machine_fingerprint() -> dict[str, Any]:
    """What a TensorRT-LLM engine is tied to on this machine: GPU name and compute capability, CUDA, and the
    tensorrt_llm and tensorrt versions (None where absent)."""
    import torch

    gpu = {"device": "cpu", "gpu_name": None, "compute_capability": None, "cuda": None}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        gpu = {"device": "cuda", "gpu_name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}",
               "cuda": torch.version.cuda}
    return {**gpu, **trtllm_versions()}


def check_trtllm_fingerprint(engine_fp: dict[str, Any], machine_fp: dict[str, Any]) -> None:
    """Raise FingerprintMismatchError naming each field in which this machine differs from the build machine:
    a TensorRT engine runs only with the TensorRT and TensorRT-LLM it was built with, on the GPU it was built for."""
    if machine_fp.get("device") != "cuda":
        raise TrtllmUnavailableError("TensorRT-LLM engines run on NVIDIA GPUs and no CUDA GPU is visible; load this "
                                     "engine on the GPU machine it was built on, or build a native engine")
    differences = [f"{name} {engine_fp.get(name)!r} at build time, {machine_fp.get(name)!r} here"
                   for name in FINGERPRINT_FIELDS if engine_fp.get(name) != machine_fp.get(name)]
    if differences:
        raise FingerprintMismatchError(f"TensorRT-LLM engine built for another GPU or toolchain: "
                                       f"{'; '.join(differences)}; rebuild it here with `kiln build --backend trtllm`")


def is_supported_trtllm(version: str) -> bool:
    """Whether a TensorRT-LLM version string is a supported release (1.2.x)."""
    return tuple(int(p) for p in version.split(".")[:2] if p.isdecimal()) == SUPPORTED_TRTLLM


def import_executor_module() -> Any:
    """`tensorrt_llm.bindings.executor`, after checking the installed version is 1.2.x."""
    version = package_version("tensorrt_llm")
    if version is None:
        raise TrtllmUnavailableError(f"this engine needs TensorRT-LLM, which is not installed; {INSTALL_HINT}")
    if not is_supported_trtllm(version):
        raise TrtllmUnavailableError(f"TensorRT-LLM {version} is installed but Kiln supports 1.2.x only (the TensorRT "
                                     f"engine path left TensorRT-LLM after 1.3.0rc20); {INSTALL_HINT}")
    try:
        return importlib.import_module("tensorrt_llm.bindings.executor")
    except ImportError as e:
        raise TrtllmUnavailableError(f"tensorrt_llm.bindings.executor does not import ({e}); {INSTALL_HINT}") from None

