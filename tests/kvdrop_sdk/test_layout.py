"""CacheLayout: shapes, JSON, and the RoPE parameters an engine registers with it."""

from __future__ import annotations

import pytest
import torch

from kvdrop_rope import RopeConfig
from kvdrop_sdk.layout import CacheLayout, check_rope

ROPE = RopeConfig(head_dim=64, theta=100000.0, rotary_dim=32).to_json()


def test_rope_round_trips_through_json_and_back_into_a_rope_config() -> None:
    layout = CacheLayout(2, 3, 64, torch.bfloat16, rope=ROPE)
    again = CacheLayout.from_json(layout.to_json())
    assert again.rope == ROPE and RopeConfig.from_json(again.rope) == RopeConfig.from_json(ROPE)
    assert "rope" not in CacheLayout(2, 3, 64, torch.bfloat16).to_json()  # old readers unchanged


def test_rope_is_not_part_of_equality_and_merges_in() -> None:
    bare = CacheLayout(2, 3, 64, torch.float32)
    with_rope = CacheLayout(2, 3, 64, torch.float32, rope=ROPE)
    assert bare == with_rope and hash(bare) == hash(with_rope)
    assert bare.merged(with_rope).rope == ROPE and with_rope.merged(bare).rope == ROPE
    other = CacheLayout(2, 3, 64, torch.float32, rope={**ROPE, "theta": 10000.0})
    with pytest.raises(ValueError, match="RoPE parameters differ"):
        with_rope.merged(other)
    with pytest.raises(ValueError, match="layouts differ"):
        bare.merged(CacheLayout(2, 3, 32, torch.float32))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"theta": -1.0}, "theta"),
        ({"rotary_dim": 65}, "rotary_dim"),
        ({"interleaved": 1}, "interleaved"),
        ({"scaling": "linear"}, "scaling"),
        ({"extra": 1}, "unexpected"),
    ],
)
def test_bad_rope_fields_are_named(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_rope({**ROPE, **change})
    with pytest.raises(ValueError, match=match):
        CacheLayout.from_json(
            {**CacheLayout(1, 1, 64, torch.float32).to_json(), "rope": {**ROPE, **change}}
        )
