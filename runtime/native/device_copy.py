"""Host values to the device without stalling the host behind the work already queued there."""

from __future__ import annotations

import numpy as np
import torch


def device_tensor(values: list | np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` on ``device`` without waiting for the work queued there: through pinned memory on CUDA (a copy
    from pageable memory synchronises with the stream first, so a step queued ahead would wait for the one in
    flight). Converted through numpy: a step's ~8k token ids 4x faster than by ``torch.tensor``."""
    device = torch.device(device)
    host = torch.from_numpy(np.asarray(values)).to(dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
