"""What a policy may keep (issue 28 H): strictly increasing row indices in range, checked once in
``Policy.keep`` before any row is gathered or stored; the error names the policy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from kvdrop.errors import PolicyOutputError
from kvdrop.policy import Policy
from kvdrop_sdk import CacheKind
from kvdrop_sdk.query_capture import QueryNeed


class _Fixed(Policy):
    """A plugin-like policy that keeps exactly ``index``."""

    name = "fixed-plugin"
    rerotate = False

    def __init__(self, index: Any) -> None:
        self.index = index

    @property
    def queries(self) -> QueryNeed:
        return QueryNeed.NONE

    def select_indices(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], *, context: Any = None
    ) -> tuple[torch.Tensor, Any]:
        return tensors[CacheKind.KV], self.index


def _inputs(n: int = 8) -> tuple[dict[Any, torch.Tensor], list[int]]:
    kv = torch.randn(2, 2, n, 16, generator=torch.Generator().manual_seed(0))
    return {CacheKind.KV: kv}, list(range(100, 100 + n))


@pytest.mark.parametrize(
    ("index", "match"),
    [
        (torch.tensor([0, 1, 1, 2]), r"1 at position 2 a duplicate \(after 1\)"),
        (torch.tensor([0, 2, 1, 3]), r"1 at position 2 out of order \(after 2\)"),
        (torch.tensor([0, 8]), r"8 at position 1, outside \[0, 8\)"),
        (torch.tensor([-1, 2]), r"-1 at position 0, outside"),
        (torch.tensor([0.0, 1.0]), "expected a 1-D integer tensor"),
        (torch.tensor([[0, 1]]), "expected a 1-D integer tensor"),
        ([0, 1], "expected a 1-D integer tensor"),
        (torch.tensor([], dtype=torch.int64), "keep nothing"),
    ],
)
def test_bad_kept_indices_are_refused_naming_the_policy(index: Any, match: str) -> None:
    tensors, tokens = _inputs()
    with pytest.raises(PolicyOutputError, match=match) as info:
        _Fixed(index)(tensors, tokens)
    assert "policy 'fixed-plugin' returned kept indices" in str(info.value)


def test_good_kept_indices_gather_those_rows() -> None:
    tensors, tokens = _inputs()
    kv, kept = _Fixed(torch.tensor([0, 3, 7]))(tensors, tokens)
    assert kept == [100, 103, 107]
    assert torch.equal(kv, tensors[CacheKind.KV][:, :, [0, 3, 7]])
