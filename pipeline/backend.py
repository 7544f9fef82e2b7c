"""Choose the backend and the device a build targets, and say why."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.errors import KilnError
from kiln.runtime.trtllm.toolchain import INSTALL_HINT, is_supported_trtllm, trtllm_version


class BackendUnavailableError(KilnError):
    """The requested backend cannot run on this machine."""


TRTLLM_INSTALL_HINT = f"{INSTALL_HINT}, or use --backend native"


@dataclass(frozen=True)
class BackendChoice:
    """The backend and device in force, and the reason they were chosen."""

    backend: str
    device: str
    reason: str


def trtllm_available() -> bool:
    """True when TensorRT-LLM 1.2.x is installed (checked from package metadata, without importing it: that is slow)."""
    version = trtllm_version()
    return version is not None and is_supported_trtllm(version)


BACKENDS = ("auto", "native", "trtllm")


class UnknownBackendError(KilnError):
    """A backend Kiln does not have."""


def choose_backend(requested: str, device: str) -> BackendChoice:
    """Resolve ``auto`` for backend and device (availability is checked by :func:`require`); UnknownBackendError
    for a name Kiln does not know."""
    if requested not in BACKENDS:
        raise UnknownBackendError(f"--backend must be auto, native or trtllm, not {requested!r} (vLLM and SGLang are "
                                  f"peers Kiln measures against, not backends it builds for)")
    has_cuda = torch.cuda.is_available()
    resolved_device = ("cuda" if has_cuda else "cpu") if device == "auto" else device
    if requested == "native":
        return BackendChoice("native", resolved_device, "backend native requested")
    has_trtllm = trtllm_available()
    missing = ("TensorRT-LLM 1.2.x is not installed" if not has_trtllm else None if has_cuda
               else "no CUDA GPU is present")  # what keeps TensorRT-LLM from building here
    if requested == "trtllm":
        cannot = (f", but {missing}: a build here is refused, and this plan's key (device {resolved_device}) is not "
                  "a GPU machine's") if missing else ""
        return BackendChoice("trtllm", resolved_device, f"backend trtllm requested{cannot}")
    if missing is None:
        return BackendChoice("trtllm", "cuda", "auto: tensorrt_llm is installed and a GPU is present")
    return BackendChoice("native", resolved_device, f"auto: {missing}, so Kiln's native engine")


def require_device(choice: BackendChoice) -> None:
    """Raise a clear error when the chosen device is not on this machine (a dry run too: the key needs its GPU)."""
    if choice.device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("build.device is cuda, but CUDA is not available on this machine (no GPU "
                                      "visible, or torch built without CUDA); set build.device to auto or cpu")


def require(choice: BackendChoice) -> None:
    """Raise a clear error when the chosen backend cannot run here (``require_device`` checks the device)."""
    if choice.backend == "trtllm" and not trtllm_available():
        raise BackendUnavailableError(
            f"backend trtllm needs TensorRT-LLM, which is not installed; {TRTLLM_INSTALL_HINT}"
        )
    if choice.backend == "trtllm" and not torch.cuda.is_available():
        raise BackendUnavailableError("backend trtllm needs a CUDA GPU and none is visible; use --backend native")
