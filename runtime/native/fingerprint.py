"""What an engine is tied to: the device kind, GPU model and compute capability, and the torch/triton versions."""

from __future__ import annotations

from typing import Any

import torch

from kiln.runtime.errors import DeviceUnavailableError, FingerprintMismatchError
from kiln.runtime.version import package_version


def machine_fingerprint(device: str) -> dict[str, Any]:
    """Fingerprint of ``device`` ("cpu", "cuda" or "cuda:N") on this machine; never imports triton.
    DeviceUnavailableError when it names a GPU the machine does not have."""
    torch_version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    dev = torch.device(device)
    if dev.type == "cpu":
        return {"device": "cpu", "gpu_name": None, "compute_capability": None, "torch": torch_version,
                "triton": None, "cuda": None}
    if dev.type != "cuda":
        raise ValueError(f"unsupported device {device!r}: expected 'cpu' or 'cuda[:N]'")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (dev.index or 0) >= count:
        have = (f"{count} CUDA device{'s' if count > 1 else ''}" if count
                else "no CUDA device (no GPU visible, or torch built without CUDA)")
        raise DeviceUnavailableError(f"device {device!r}: this machine has {have}; use cpu or a device it has")
    major, minor = torch.cuda.get_device_capability(dev)
    return {
        "device": "cuda",
        "gpu_name": torch.cuda.get_device_name(dev),
        "compute_capability": f"{major}.{minor}",
        "torch": torch_version,
        "triton": package_version("triton"),
        "cuda": torch.version.cuda,
    }


def resolve_device(device: str | None, engine_fp: dict[str, Any]) -> torch.device:
    """The requested device, else CUDA when the engine was built for CUDA and one is present, else CPU."""
    if device is not None:
        return torch.device(device)
    cuda = engine_fp.get("device") == "cuda" and torch.cuda.is_available()
    return torch.device("cuda" if cuda else "cpu")


def check_fingerprint(engine_fp: dict[str, Any], machine_fp: dict[str, Any]) -> None:
    """Raise FingerprintMismatchError naming each difference between the engine's build machine and this one."""
    differences = []
    if any(engine_fp.get(k) != machine_fp.get(k) for k in ("device", "gpu_name", "compute_capability")):
        differences.append(f"engine built for {_describe_device(engine_fp)}, this machine has "
                           f"{_describe_device(machine_fp)}")
    if engine_fp.get("torch") != machine_fp.get("torch"):
        differences.append(f"engine built with torch {engine_fp.get('torch')}, this machine has torch "
                           f"{machine_fp.get('torch')}")
    if engine_fp.get("triton") is not None and engine_fp.get("triton") != machine_fp.get("triton"):
        differences.append(f"engine built with triton {engine_fp['triton']}, this machine has "
                           f"{'triton ' + machine_fp['triton'] if machine_fp.get('triton') else 'no triton'}")
    if differences:
        raise FingerprintMismatchError("; ".join(differences) + "; rebuild the engine on this machine")


def _describe_device(fp: dict[str, Any]) -> str:
    if fp.get("device") != "cuda":
        return str(fp.get("device"))
    return f"{fp.get('gpu_name')} (sm {fp.get('compute_capability')})"
