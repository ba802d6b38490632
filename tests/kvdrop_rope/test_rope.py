"""RoPE: exact inverse, partial rotary, layouts, HF config parsing, equality with transformers."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kvdrop_rope import RopeConfig, apply_rope

SCALINGS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def _cfg(kind: str, rotary_dim: int | None = None, interleaved: bool = False) -> RopeConfig:
    return RopeConfig(
        head_dim=32,
        theta=10000.0,
        rotary_dim=rotary_dim,
        interleaved=interleaved,
        scaling=SCALINGS[kind],
        max_position_embeddings=256,
    )


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("rotary_dim", [None, 16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_inverse_undoes_rotation(kind: str, rotary_dim: int | None, interleaved: bool) -> None:
    cfg = _cfg(kind, rotary_dim, interleaved)
    x = torch.randn(2, 50, 3, 32, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(50) * 7 + 100  # past max_position_embeddings too (dynamic kicks in)
    y = apply_rope(x, pos, cfg)
    assert (y - x).abs().max() > 0.1  # it really rotated
    back = apply_rope(y, pos, cfg, inverse=True)
    torch.testing.assert_close(back, x, atol=2e-5, rtol=1e-5)


def test_rerotation_equals_direct_rotation() -> None:
    """inverse at old positions then forward at new ones == rotating the raw key at new ones."""
    cfg = _cfg("yarn", rotary_dim=24)
    x = torch.randn(40, 2, 32)
    old, new = torch.arange(40) * 3 + 5, torch.arange(40)
    moved = apply_rope(apply_rope(apply_rope(x, old, cfg), old, cfg, inverse=True), new, cfg)
    torch.testing.assert_close(moved, apply_rope(x, new, cfg), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_leaves_tail_untouched(interleaved: bool) -> None:
    cfg = _cfg("default", rotary_dim=8, interleaved=interleaved)
    x = torch.randn(10, 4, 32)
    y = apply_rope(x, torch.arange(10) + 3, cfg)
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert not torch.equal(y[..., :8], x[..., :8])


def test_layouts_rotate_the_documented_pairs() -> None:
    """NeoX pairs channel i with i + d/2; GPT-J (interleaved) pairs 2i with 2i+1."""
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [T=1, H=1, d=4]
    pos = torch.tensor([5])
    theta = 100.0
    f0, f1 = 5 * 1.0, 5 * theta ** (-2 / 4)  # angles of pair 0 and pair 1
    neox = apply_rope(x, pos, RopeConfig(head_dim=4, theta=theta))[0, 0]
    a, b, c, d = 1.0, 2.0, 3.0, 4.0
    expect = [
        a * math.cos(f0) - c * math.sin(f0),
        b * math.cos(f1) - d * math.sin(f1),
        c * math.cos(f0) + a * math.sin(f0),
        d * math.cos(f1) + b * math.sin(f1),
    ]
    torch.testing.assert_close(neox, torch.tensor(expect))
    gptj = apply_rope(x, pos, RopeConfig(head_dim=4, theta=theta, interleaved=True))[0, 0]
    expect = [
        a * math.cos(f0) - b * math.sin(f0),
        b * math.cos(f0) + a * math.sin(f0),
        c * math.cos(f1) - d * math.sin(f1),
        d * math.cos(f1) + c * math.sin(f1),
    ]
    torch.testing.assert_close(gptj, torch.tensor(expect))


def test_bfloat16_input_is_rotated_in_float32_and_returned_in_bfloat16() -> None:
    cfg = _cfg("default")
    x = torch.randn(30, 2, 32).to(torch.bfloat16)
    pos = torch.arange(30) * 100
    y = apply_rope(x, pos, cfg)
    assert y.dtype == torch.bfloat16
    ref = apply_rope(x.float(), pos, cfg)
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.01)  # one rounding only


def _hf_config(kind: str, partial: float, max_pos: int = 256) -> Any:
    from transformers import LlamaConfig

    params: dict[str, Any] = {"rope_type": "default", **(SCALINGS[kind] or {}), "rope_theta": 5e4}
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=32,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("length", [40, 600])
def test_matches_transformers_rotary_embedding(kind: str, partial: float, length: int) -> None:
    """Same cos/sin (incl. yarn's attention factor and dynamic NTK's seq_len) and same rotation
    as HF's rotary embedding + apply_rotary_pos_emb on the first rotary_dim channels."""
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

    hf_cfg = _hf_config(kind, partial)
    ours = RopeConfig.from_hf_config(hf_cfg.to_dict())
    assert ours.rotary_dim == int(32 * partial) and ours.rope_type == kind
    rotary = PhiRotaryEmbedding(hf_cfg)  # honours partial_rotary_factor for every rope type
    q = torch.randn(1, 4, length, 32, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(length)[None]
    cos, sin = rotary(q, pos)
    rd = ours.rotary_dim
    ref, _ = apply_rotary_pos_emb(q[..., :rd], q[..., :rd], cos, sin)
    ref = torch.cat([ref, q[..., rd:]], dim=-1)
    got = apply_rope(q.transpose(1, 2), pos[0], ours).transpose(1, 2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_interleaved_partial_matches_transformers_glm() -> None:
    pytest.importorskip("transformers")
    from transformers import GlmConfig
    from transformers.models.glm.modeling_glm import GlmRotaryEmbedding, apply_rotary_pos_emb

    hf_cfg = GlmConfig(
        hidden_size=128, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.5
    )
    rotary = GlmRotaryEmbedding(hf_cfg)
    q = torch.randn(1, 4, 70, 32)
    pos = torch.arange(70)[None] + 11
    cos, sin = rotary(q, pos)
    ref, _ = apply_rotary_pos_emb(q, q, cos, sin)
    theta = hf_cfg.rope_parameters["rope_theta"]
    ours = RopeConfig(head_dim=32, theta=theta, rotary_dim=16, interleaved=True)
    got = apply_rope(q.transpose(1, 2), pos[0], ours).transpose(1, 2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_from_hf_config_reads_both_spellings() -> None:
    old = {
        "hidden_size": 256,
        "num_attention_heads": 8,
        "rope_theta": 5e5,
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 4096,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    a = RopeConfig.from_hf_config(old)
    assert (a.head_dim, a.rotary_dim, a.theta, a.rope_type) == (32, 16, 5e5, "linear")
    new = {
        "head_dim": 64,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    }
    b = RopeConfig.from_hf_config(new)
    assert (b.head_dim, b.rotary_dim, b.rope_type) == (64, 64, "llama3")
    assert b.scaling is not None and b.scaling["original_max_position_embeddings"] == 8192
    plain = RopeConfig.from_hf_config({"head_dim": 16, "rope_theta": 1e4})
    assert plain.scaling is None and plain.rope_type == "default"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"head_dim": 7}, "head_dim"),
        ({"head_dim": 16, "rotary_dim": 18}, "rotary_dim"),
        ({"head_dim": 16, "theta": -1.0}, "theta"),
        ({"head_dim": 16, "scaling": {"rope_type": "longrope"}}, "rope_type"),
        ({"head_dim": 16, "scaling": {"rope_type": "linear"}}, "factor"),
        ({"head_dim": 16, "scaling": {"type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ],
)
def test_invalid_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RopeConfig(**kwargs)


def test_from_hf_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RopeConfig.from_hf_config({"head_dim": 16, "partial_rotary_factor": 1.5})
    with pytest.raises(ValueError, match="hidden_size"):
        RopeConfig.from_hf_config({"rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_scaling"):
        RopeConfig.from_hf_config({"head_dim": 16, "rope_scaling": "yarn"})


def test_apply_rope_rejects_bad_shapes() -> None:
    cfg = RopeConfig(head_dim=16)
    with pytest.raises(ValueError, match="head_dim=16"):
        apply_rope(torch.zeros(4, 2, 8), torch.arange(4), cfg)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(torch.zeros(4, 2, 16), torch.arange(5), cfg)
    with pytest.raises(ValueError, match="integer"):
        apply_rope(torch.zeros(4, 2, 16), torch.arange(4).float(), cfg)
