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


def test_rope_is_part_of_the_identity_and_merges_into_a_bare_layout() -> None:
    bare = CacheLayout(2, 3, 64, torch.float32)
    with_rope = CacheLayout(2, 3, 64, torch.float32, rope=ROPE)
    assert bare != with_rope and bare.same_bytes(with_rope)
    assert with_rope == CacheLayout.from_json(with_rope.to_json())
    assert hash(with_rope) == hash(CacheLayout.from_json(with_rope.to_json()))
    foreign = CacheLayout(2, 3, 64, torch.float32, rope={**ROPE, "theta": 10000.0})
    assert foreign != with_rope
    # A request that assumes no RoPE matches any; one that assumes RoPE only the same RoPE.
    assert with_rope.matches(bare) and with_rope.matches(with_rope)
    assert not with_rope.matches(foreign) and not bare.matches(with_rope)
    with pytest.raises(ValueError, match=r"rope\.head_dim is 32"):
        CacheLayout(2, 3, 64, torch.float32, rope={**ROPE, "head_dim": 32, "rotary_dim": 32})
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
        ({"theta": 1e-300}, "theta"),
        ({"theta": float("inf")}, "theta"),
        ({"theta": float("nan")}, "theta"),
        ({"theta": True}, "theta"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"scaling": {"rope_type": "yarn", "factor": 0}}, "factor"),
        ({"scaling": {"rope_type": "yarn", "factor": -2.0}}, "factor"),
        ({"scaling": {"rope_type": "yarn", "attention_factor": float("nan")}}, "attention_factor"),
        ({"scaling": {"rope_type": "yarn", "beta_fast": 0}}, "beta_fast"),
        ({"scaling": {"rope_type": "yarn", "truncate": 1}}, "truncate"),
        ({"scaling": {"rope_type": "yarn", "factr": 2.0}}, "unknown field"),
        ({"scaling": {"rope_type": "linear", "factor": float("inf")}}, "factor"),
        ({"scaling": {"rope_type": "linear", "factor": "2"}}, "factor"),
        ({"scaling": {"rope_type": "dynamic"}}, "factor"),
        ({"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, "high_freq"),
        (
            {
                "scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                }
            },
            "high_freq_factor",
        ),
        (
            {
                "scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 0.5,
                }
            },
            "original_max_position_embeddings",
        ),
        ({"scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type"),
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
