"""Inputs shared by the combinator tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvdrop_sdk import CacheKind


def make_inputs(t: int, seed: int = 0, layers: int = 2) -> dict[Any, torch.Tensor]:
    """Random KV ``[2, layers, t, 16]`` and queries ``[1, layers, t, 32]`` (head_dim 8: 2 KV
    heads, 4 query heads)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        CacheKind.KV: torch.randn(2, layers, t, 16, generator=gen),
        CacheKind.QUERY: torch.randn(1, layers, t, 32, generator=gen),
    }


@pytest.fixture
def inputs() -> Callable[..., dict[Any, torch.Tensor]]:
    """``inputs(t, seed=0, layers=2)``: see :func:`make_inputs`."""
    return make_inputs
