"""RoPE re-rotation of kept keys: equals keys computed directly at the new positions."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.combinators.rerotate import Rerotate, rerotate_keys, rerotated
from kvdrop_rope import RopeConfig
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext

HEAD_DIM = 16
CONFIGS: dict[str, RopeConfig] = {
    "neox": RopeConfig(HEAD_DIM, theta=10000.0),
    "interleaved": RopeConfig(HEAD_DIM, theta=500000.0, interleaved=True),
    "partial": RopeConfig(HEAD_DIM, rotary_dim=8),
    "linear": RopeConfig(HEAD_DIM, scaling={"rope_type": "linear", "factor": 4.0}),
    "dynamic": RopeConfig(
        HEAD_DIM, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64
    ),
    "llama3": RopeConfig(
        HEAD_DIM,
        theta=500000.0,
        scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "yarn": RopeConfig(
        HEAD_DIM,
        scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        max_position_embeddings=256,
    ),
}


def ref_rope(x: torch.Tensor, pos: torch.Tensor, cfg: RopeConfig, seq_len: int) -> torch.Tensor:
    """float64 RoPE of ``x [T, H, d]`` at ``pos``, written out (frequencies as the config defines
    them, angles and rotation in float64)."""
    inv, attn = cfg.inv_freq(seq_len)
    angle = pos.double()[:, None] * inv.double()[None, :]  # [T, rd/2]
    cos, sin = (angle.cos() * attn)[:, None, :], (angle.sin() * attn)[:, None, :]
    rd = int(cfg.rotary_dim)  # type: ignore[arg-type]
    x = x.double()
    rot, rest = x[..., :rd], x[..., rd:]
    if cfg.interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = rot[..., : rd // 2], rot[..., rd // 2 :]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([out, rest], dim=-1)


def raw_keys(seed: int, layers: int, t: int, heads: int) -> torch.Tensor:
    return torch.randn(layers, t, heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def keys_at(raw: torch.Tensor, pos: torch.Tensor, cfg: RopeConfig, seq_len: int) -> torch.Tensor:
    """``[L, T, H * d]`` float64 keys rotated at ``pos``."""
    return torch.stack([ref_rope(layer, pos, cfg, seq_len).flatten(1) for layer in raw])


def tolerance(dtype: torch.dtype, ref: torch.Tensor) -> float:
    # Input rounding + one output rounding, each <= eps/2 of the pair's norm; float32 angles add
    # ~1e-4 rad at positions ~1000.
    return (2 * torch.finfo(dtype).eps + 2e-4) * float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_rotating_p_to_new_equals_keys_computed_at_new(kind: str, dtype: torch.dtype) -> None:
    cfg = CONFIGS[kind]
    t = 300
    raw = raw_keys(1, 2, t, 2)
    old = torch.sort(torch.randperm(t, generator=torch.Generator().manual_seed(2))[:120]).values
    new = torch.arange(120)
    cached = keys_at(raw, torch.arange(t), cfg, t).to(dtype)  # what the cache holds
    got = rerotate_keys(cached[:, old], old, new, cfg, old_seq_len=t, new_seq_len=120)
    ref = keys_at(raw[:, old], new, cfg, 120)
    assert got.dtype == dtype and got.shape == ref.shape
    assert float((got.double() - ref).abs().max()) <= tolerance(dtype, ref)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_round_trip_error_is_recorded(kind: str, record_property: Any) -> None:
    """p -> p' -> p: bf16 storage with float32 math loses at most a couple of bf16 ulps."""
    cfg = CONFIGS[kind]
    t = 512
    raw = raw_keys(3, 1, t, 2)
    pos = torch.arange(t)
    cached = keys_at(raw, pos, cfg, t).to(torch.bfloat16)
    new = torch.arange(0, t, 2)
    moved = rerotate_keys(cached[:, new], new, new // 2, cfg, old_seq_len=t, new_seq_len=t // 2)
    back = rerotate_keys(moved, new // 2, new, cfg, old_seq_len=t // 2, new_seq_len=t)
    err = float((back.double() - cached[:, new].double()).abs().max())
    scale = float(cached.abs().max())
    record_property(f"round_trip_max_abs_err_{kind}", err)
    print(
        f"rope round trip ({kind}, bf16 storage, fp32 math): max abs err {err:.3g} "
        f"(max |k| {scale:.3g}, relative {err / scale:.3g})"
    )
    assert err <= 4 * torch.finfo(torch.bfloat16).eps * scale


def test_unmoved_keys_are_bit_identical() -> None:
    cfg = CONFIGS["neox"]
    kv = torch.randn(2, 2, 64, 32).to(torch.bfloat16)
    same = torch.arange(64)
    assert torch.equal(rerotate_keys(kv[0], same, same, cfg), kv[0])

    def keep_first_half(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> Any:
        return tensors[CacheKind.KV][:, :, :32], list(tokens[:32])

    out, kept = rerotated(keep_first_half, cfg)({CacheKind.KV: kv}, list(range(64)))
    assert torch.equal(out, kv[:, :, :32]) and kept == list(range(32))


def test_within_budget_returns_the_input_unchanged() -> None:
    fn = kvdrop.get("knorm", keep_ratio=1.0, chunk_size=16, rerotate=CONFIGS["neox"])
    kv = torch.randn(2, 1, 64, 32)
    out, kept = fn({CacheKind.KV: kv}, list(range(64)))
    assert out is kv and kept == list(range(64))


@pytest.mark.parametrize("name", ["snapkv", "streaming", "knorm"])
def test_policy_with_rerotate_keeps_the_same_tokens_and_moves_keys(name: str) -> None:
    cfg = CONFIGS["llama3"]
    t, heads = 128, 2
    raw = raw_keys(5, 2, t, heads)
    kv = torch.stack([keys_at(raw, torch.arange(t), cfg, t), torch.randn(2, t, heads * HEAD_DIM)])
    kv = kv.to(torch.bfloat16)
    q = torch.randn(1, 2, t, 2 * heads * HEAD_DIM).to(torch.bfloat16)
    tensors = {CacheKind.KV: kv, CacheKind.QUERY: q}
    params: dict[str, Any] = {"keep_tokens": 48, "chunk_size": 16}
    if "head_dim" in {p.name for p in kvdrop.describe(name).params}:
        params["head_dim"] = HEAD_DIM
    plain_out, plain_kept = kvdrop.get(name, **params)(tensors, list(range(t)))
    fn = kvdrop.get(name, **params, rerotate=cfg)
    assert isinstance(fn, Rerotate)
    out, kept = fn(tensors, list(range(t)))
    assert kept == plain_kept
    assert torch.equal(out[1], plain_out[1]), "values are only gathered"
    ref = keys_at(raw[:, kept], torch.arange(48), cfg, 48)
    assert float((out[0].double() - ref).abs().max()) <= tolerance(torch.bfloat16, ref)


def test_explicit_positions_of_an_already_edited_prefix() -> None:
    cfg = CONFIGS["yarn"]
    positions = torch.tensor([0, 1, 2, 3, *range(40, 100)])  # an earlier edit left a gap
    raw = raw_keys(6, 1, 64, 2)
    kv = torch.stack([keys_at(raw, positions, cfg, 100), torch.randn(1, 64, 2 * HEAD_DIM)])
    fn = kvdrop.get("streaming", n_sink=4, keep_tokens=32, chunk_size=8, rerotate=cfg)
    out, kept = fn({CacheKind.KV: kv.float()}, list(range(64)), positions=positions)
    assert kept == [0, 1, 2, 3, *range(36, 64)]
    ref = keys_at(raw[:, kept], torch.arange(32), cfg, 32)
    assert float((out[0].double() - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    with pytest.raises(kvdrop.PolicyInputError, match="positions must be 64 ints"):
        fn({CacheKind.KV: kv.float()}, list(range(64)), positions=[0, 1])


def test_plain_function_with_repeated_token_ids_is_matched_by_key_rows() -> None:
    cfg = CONFIGS["neox"]
    raw = raw_keys(7, 1, 12, 1)
    kv = torch.stack([keys_at(raw, torch.arange(12), cfg, 12), torch.randn(1, 12, HEAD_DIM)])
    tokens = [5] * 12  # every id the same: only the key rows tell the kept rows apart

    def keep_odd(tensors: Mapping[Any, torch.Tensor], toks: Sequence[int]) -> Any:
        return tensors[CacheKind.KV][:, :, 1::2], list(toks[1::2])

    out, kept = rerotated(keep_odd, cfg)({CacheKind.KV: kv.float()}, tokens)
    ref = keys_at(raw[:, 1::2], torch.arange(6), cfg, 6)
    assert kept == [5] * 6
    assert float((out[0].double() - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


def test_built_from_an_hf_config_dict() -> None:
    hf = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "max_position_embeddings": 4096,
    }
    fn = kvdrop.get("streaming", keep_tokens=16, chunk_size=16, rerotate=hf)
    assert isinstance(fn, Rerotate)
    assert fn.rope.head_dim == HEAD_DIM and fn.rope.rope_type == "linear"
    assert math.isclose(fn.rope.theta, 1e6)


def test_bad_rerotate_arguments() -> None:
    with pytest.raises(kvdrop.PolicyParamError, match="rerotate"):
        kvdrop.get("knorm", rerotate="neox")
    with pytest.raises(kvdrop.PolicyParamError, match="partial_rotary_factor"):
        kvdrop.get("knorm", rerotate={"head_dim": 16, "partial_rotary_factor": 2.0})
    fn = kvdrop.get("knorm", keep_tokens=8, chunk_size=8, rerotate=RopeConfig(12))
    with pytest.raises(kvdrop.PolicyInputError, match="head_dim=12"):
        fn({CacheKind.KV: torch.randn(2, 1, 32, 16)}, list(range(32)))


@pytest.mark.parametrize("name", kvdrop.available())
def test_every_registered_policy_accepts_rerotate(name: str) -> None:
    """Same kept tokens and values as without re-rotation; keys equal at the new positions."""
    cfg = CONFIGS["neox"]
    t = 96
    raw = raw_keys(8, 2, t, 2)
    kv = torch.stack([keys_at(raw, torch.arange(t), cfg, t), torch.randn(2, t, 2 * HEAD_DIM)])
    tensors = {CacheKind.KV: kv.float(), CacheKind.QUERY: torch.randn(1, 2, t, 4 * HEAD_DIM)}
    params: dict[str, Any] = {**kvdrop.describe(name).example, "keep_tokens": 32, "chunk_size": 8}
    if "head_dim" in {p.name for p in kvdrop.describe(name).params}:
        params["head_dim"] = HEAD_DIM
    plain = kvdrop.get(name, **params)
    # Policies that read the engine's reconstruction scores (kvzip) get them in the context.
    scores = torch.rand(2, 2, t, generator=torch.Generator().manual_seed(0))
    context = EditContext.of(t, token_scores=scores) if plain.token_scores else None
    plain_out, plain_kept = plain(tensors, list(range(t)), context=context)
    out, kept = kvdrop.get(name, **params, rerotate=cfg)(tensors, list(range(t)), context=context)
    assert list(kept) == list(plain_kept) and torch.equal(out[1], plain_out[1])
    ref = keys_at(raw[:, list(kept)], torch.arange(len(kept)), cfg, len(kept))
    assert float((out[0].double() - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


def test_compositions_can_be_rerotated(inputs: Callable[..., dict[Any, torch.Tensor]]) -> None:
    cfg = RopeConfig(8)
    tensors = inputs(64, seed=6)
    for spec in ["streaming+snapkv", "budget(policy=snapkv, tiers='*:0.25')"]:
        plain = kvdrop.get(spec, chunk_size=8, head_dim=8)(tensors, list(range(64)))
        fn = kvdrop.get(spec, chunk_size=8, head_dim=8, rerotate=cfg)
        assert isinstance(fn, Rerotate)
        out, kept = fn(tensors, list(range(64)))
        assert kept == plain[1] and torch.equal(out[1], plain[0][1])


@pytest.mark.parametrize(
    ("spec", "needs_query"),
    [
        ("streaming+snapkv", True),
        ("streaming+knorm", False),
        ("chunk(policy=tova)", True),
        ("budget(policy='streaming+snapkv')", True),
        ("budget(policy=knorm)", False),
    ],
)
def test_rerotate_needs_queries_exactly_when_its_policy_does(spec: str, needs_query: bool) -> None:
    fn = kvdrop.get(spec, head_dim=8, rerotate=RopeConfig(8))
    assert isinstance(fn, Rerotate)
    assert (
        kvdrop.needs_of(fn).reads_queries
        is needs_query
        is kvdrop.describe(spec).needs.reads_queries
    )
    if needs_query:
        with pytest.raises(kvdrop.MissingQueryError):
            fn({CacheKind.KV: torch.randn(2, 1, 600, 16)}, list(range(600)))
