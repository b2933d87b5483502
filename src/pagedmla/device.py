"""Device names made comparable: "cuda" means the current CUDA device, with its index."""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """torch.device with an explicit index for CUDA, so that "cuda" == "cuda:0" here."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
