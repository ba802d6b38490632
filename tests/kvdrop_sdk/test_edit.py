"""EditContext (what the SDK tells an edit function beyond its tensors) and the marker that asks
for it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from kvdrop_sdk.edit import (
    EDIT_CONTEXT_ATTR,
    EditContext,
    accepts_edit_context,
    takes_edit_context,
)


def test_marker_is_declared_once_not_guessed_from_signatures() -> None:
    def plain(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], context: Any = None):
        return tensors, tokens

    assert not takes_edit_context(plain)  # a `context` parameter alone does not count

    @accepts_edit_context
    def marked(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], *, context: Any):
        return tensors, tokens

    assert takes_edit_context(marked) and getattr(marked, EDIT_CONTEXT_ATTR) is True

    class Callable_:
        accepts_edit_context = "yes"  # only True counts

    assert not takes_edit_context(Callable_())


def test_defaults_describe_a_fresh_prefix() -> None:
    ctx = EditContext.of(8)
    assert ctx.positions.tolist() == list(range(8)) and ctx.positions.dtype == torch.int64
    assert ctx.prompt_tokens == 8 and ctx.num_tokens == 8
    assert ctx.query_positions is None and ctx.rope is None and ctx.protected == 0
    ctx = EditContext.of(8, prompt_tokens=11, query_positions=[6, 9, 10], protected=2)
    assert ctx.prompt_tokens - ctx.num_tokens == 3 and ctx.query_positions.tolist() == [6, 9, 10]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"positions": torch.zeros(2, 2, dtype=torch.long)}, "1-D integer"),
        ({"positions": torch.tensor([0.0, 1.0])}, "1-D integer"),
        ({"positions": [0, -1]}, "non-negative"),
        ({"positions": [0, 1], "query_positions": [3, 3]}, "strictly increasing"),
        ({"positions": [0, 1], "prompt_tokens": 1}, "prompt_tokens"),
        ({"positions": [0, 1], "protected": -1}, "protected"),
        ({"positions": [0, 1], "rope": "neox"}, "rope"),
        ({"positions": [0, 1], "head_dim": 0}, "head_dim"),
        (
            {"positions": [0, 1], "query_positions": [0, 1], "query_lse": torch.zeros(1, 1, 3, 2)},
            "query_lse",
        ),
    ],
)
def test_bad_fields_are_named(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EditContext(**fields)
