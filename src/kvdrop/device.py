"""Where a policy scores: the one place that picks a torch device for scoring."""

from __future__ import annotations

import torch

__all__ = ["device_ok", "resolve_device"]


def device_ok(name: str) -> bool:
    """Whether ``name`` is "auto" or a string torch can parse as a device."""
    if name == "auto":
        return True
    try:
        torch.device(name)
    except (RuntimeError, ValueError):
        return False
    return True


def resolve_device(requested: str, hint: str | None, tensor: torch.Tensor) -> torch.device:
    """Where to score: ``requested`` unless "auto"; then the context's ``hint``; then CUDA when
    available; else ``tensor``'s device."""
    if requested != "auto":
        return torch.device(requested)
    if hint:
        return torch.device(hint)
    if tensor.device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda")
    return tensor.device
