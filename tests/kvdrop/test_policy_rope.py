"""Re-rotation by default: every policy moves the keys it keeps to positions 0..k-1 with the RoPE
parameters of the edit context (the ones the engine registered), unless told otherwise."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.rope import rerotate_keys
from kvdrop_rope import RopeConfig, apply_rope
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext

ROPE = RopeConfig(head_dim=16, theta=10000.0)
T = 64


def rotated_kv(seed: int = 0) -> torch.Tensor:
    """A KV whose keys are post-RoPE at positions 0..T-1 (two heads of 16)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(2, 2, T, 2, 16, generator=gen)
    keys = apply_rope(raw[0], torch.arange(T), ROPE)  # [L, T, H, d]
    return torch.stack([keys, raw[1]]).reshape(2, 2, T, 32)


def test_context_rope_rerotates_kept_keys_to_contiguous_positions() -> None:
    kv = rotated_kv()
    fn = kvdrop.get("knorm", keep_tokens=32, chunk_size=16)  # no rerotate argument at all
    ctx = EditContext.of(T, rope=ROPE.to_json())
    out, kept = fn({CacheKind.KV: kv}, list(range(T)), context=ctx)
    index = torch.tensor(kept)
    expected = rerotate_keys(kv[0][:, index], index, torch.arange(32), ROPE)
    torch.testing.assert_close(out[0], expected)
    assert torch.equal(out[1], kv[1][:, index])  # values are only gathered
    # Explicit configs win over the context's; rerotate=False keeps the old positions.
    other = RopeConfig(head_dim=16, theta=500.0)
    out2, _ = kvdrop.get("knorm", keep_tokens=32, chunk_size=16, rerotate=other)(
        {CacheKind.KV: kv}, list(range(T)), context=ctx
    )
    torch.testing.assert_close(
        out2[0], rerotate_keys(kv[0][:, index], index, torch.arange(32), other)
    )
    off = kvdrop.get("knorm", keep_tokens=32, chunk_size=16, rerotate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out3, _ = off({CacheKind.KV: kv}, list(range(T)), context=ctx)
    assert torch.equal(out3, kv[:, :, index])


def test_no_rope_known_warns_why_and_how_to_fix() -> None:
    kv = rotated_kv(1)
    fn = kvdrop.get("streaming", keep_tokens=32, chunk_size=16)
    with pytest.warns(kvdrop.PolicyWarning, match=r"old RoPE positions.*rerotate=") as rec:
        out, kept = fn({CacheKind.KV: kv}, list(range(T)))
    assert len(rec) == 1
    assert torch.equal(out, kv[:, :, kept])
    # Nothing moves (the budget keeps everything): nothing to warn about.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvdrop.get("streaming", keep_ratio=1.0, chunk_size=16)({CacheKind.KV: kv}, list(range(T)))


def test_plain_functions_are_rerotated_too_and_context_takers_decide_alone() -> None:
    kv = rotated_kv(2)

    def keep_odd(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple:
        rows = list(range(1, len(tokens), 2))
        return tensors[CacheKind.KV][:, :, rows], [tokens[i] for i in rows]

    from kvdrop.function_policy import FunctionPolicy

    ctx = EditContext.of(T, rope=ROPE.to_json())
    out, _ = FunctionPolicy("odd", keep_odd)({CacheKind.KV: kv}, list(range(T)), context=ctx)
    index = torch.arange(1, T, 2)
    torch.testing.assert_close(
        out[0], rerotate_keys(kv[0][:, index], index, torch.arange(32), ROPE)
    )

    def own(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], *, context: Any) -> tuple:
        assert context is ctx
        return keep_odd(tensors, tokens)

    own.accepts_edit_context = True  # type: ignore[attr-defined]
    out, _ = FunctionPolicy("own", own)({CacheKind.KV: kv}, list(range(T)), context=ctx)
    assert torch.equal(out, kv[:, :, index])  # its own choice of positions


def test_positions_of_an_earlier_edit_are_respected() -> None:
    kv = rotated_kv(3)
    fn = kvdrop.get("streaming", keep_tokens=16, chunk_size=16, n_sink=0)
    gappy = torch.arange(T) * 2  # keys that sit at even positions
    ctx = EditContext(positions=gappy, rope=ROPE.to_json())
    out, kept = fn({CacheKind.KV: kv}, list(range(T)), context=ctx)
    index = torch.tensor(kept)
    torch.testing.assert_close(
        out[0], rerotate_keys(kv[0][:, index], gappy[index], torch.arange(16), ROPE)
    )
