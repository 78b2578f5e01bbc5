"""The torch device a stage runs on: the params key `device` (auto | cpu | cuda) resolved.

Torch only (no transformers): the flow imports it to record the resolved device beside each
stage run's params."""
from __future__ import annotations

import torch

from tasks.core.errors import InputError

Device = torch.device | str


class DeviceError(InputError):
    """`device: cuda` where torch sees no CUDA device."""


def resolve_device(name: str) -> torch.device:
    """auto = cuda when torch sees a CUDA device, else cpu; cuda without one is an InputError
    (one line, not a traceback deep in a stage; the params loader refuses it first)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device: cuda, but torch sees no CUDA device "
                          "(torch.cuda.is_available() is False); use device: auto or cpu")
    return torch.device(name)


def device_of(model: torch.nn.Module) -> torch.device:
    """Where a model's weights live (its first parameter's device)."""
    return next(model.parameters()).device
