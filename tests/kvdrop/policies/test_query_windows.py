"""Query policies on a query WINDOW: rows at explicit positions, possibly past the cached KV (the
uncached tail), with the rows' attention log-normalisers -- the lean mode of the engine."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.policy import ScorerPolicy
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import QueryNeed

L, HKV, HQ, D = 2, 2, 4, 16
GROUP = HQ // HKV


def make(total: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """KV ``[2, L, total, HKV*D]`` and queries ``[1, L, total, HQ*D]`` of a whole sequence."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, L, total, HKV * D, generator=gen)
    q = torch.randn(1, L, total, HQ * D, generator=gen)
    return kv, q


def lse_of(kv: torch.Tensor, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[1, L, r, HQ]``: log-sum-exp of each row's causal logits over the WHOLE sequence."""
    total = kv.shape[2]
    out = torch.empty(1, L, rows.numel(), HQ)
    for layer in range(L):
        k = kv[0, layer].view(total, HKV, D).repeat_interleave(GROUP, dim=1)
        qq = q[0, layer, rows].view(-1, HQ, D)
        logits = torch.einsum("rhd,khd->rhk", qq, k) / math.sqrt(D)
        hidden = torch.arange(total)[None, None, :] > rows[:, None, None]
        out[0, layer] = torch.logsumexp(logits.masked_fill(hidden, -math.inf), dim=-1)
    return out


def scores_of(policy: kvdrop.Policy, tensors: dict, tokens: list[int], **ctx: Any) -> torch.Tensor:
    assert isinstance(policy, ScorerPolicy)
    from kvdrop.inputs import edit_inputs

    context = EditContext.of(len(tokens), **ctx) if ctx else None
    need = policy.queries
    inputs = edit_inputs(tensors, tokens, policy=policy.name, queries=need, context=context)
    return policy.scores(inputs.kv, inputs.query, None, inputs=inputs)


@pytest.mark.parametrize(
    ("name", "params", "rows"),
    [
        ("snapkv", {"window": 8}, torch.arange(56, 64)),
        ("rkv", {"window": 8}, torch.arange(56, 64)),
        ("tova", {"num_queries": 3}, torch.arange(61, 64)),
        ("h2o", {"num_queries": 8}, torch.linspace(0, 63, 8).round().long()),
    ],
)
def test_a_window_of_the_rows_read_scores_like_the_dense_queries(
    name: str, params: dict[str, Any], rows: torch.Tensor
) -> None:
    """Without a tail, handing only the rows a policy reads (at their positions) changes nothing."""
    kv, q = make(64)
    tokens = list(range(64))
    policy = kvdrop.get(name, keep_tokens=16, chunk_size=8, head_dim=D, rerotate=False, **params)
    dense = scores_of(policy, {CacheKind.KV: kv, CacheKind.QUERY: q}, tokens)
    window = {CacheKind.KV: kv, CacheKind.QUERY: q[:, :, rows]}
    sparse = scores_of(policy, window, tokens, query_positions=rows)
    torch.testing.assert_close(sparse, dense, atol=1e-6, rtol=1e-5)
    assert (
        policy(window, tokens, context=EditContext.of(64, query_positions=rows))[1]
        == (policy({CacheKind.KV: kv, CacheKind.QUERY: q}, tokens)[1])
    )


def test_snapkv_window_in_the_tail_observes_every_cached_key_with_true_attention() -> None:
    """The question sits in the uncached tail: its queries see all T cached keys; with the rows'
    log-normalisers their attention is the true one (the tail's keys count in the softmax)."""
    total, t, w = 80, 48, 8
    kv, q = make(total, seed=1)
    rows = torch.arange(total - w, total)
    lse = lse_of(kv, q, rows)
    tensors = {CacheKind.KV: kv[:, :, :t], CacheKind.QUERY: q[:, :, rows]}
    policy = kvdrop.get(
        "snapkv", window=w, kernel=1, keep_tokens=40, chunk_size=8, head_dim=D, rerotate=False
    )
    got = scores_of(
        policy, tensors, list(range(t)), query_positions=rows, query_lse=lse, prompt_tokens=total
    )
    ref = torch.zeros(t, dtype=torch.float64)
    for layer in range(L):
        k = kv[0, layer].view(total, HKV, D).repeat_interleave(GROUP, dim=1).double()
        qq = q[0, layer, rows].view(w, HQ, D).double()
        logits = torch.einsum("rhd,khd->hrk", qq, k) / math.sqrt(D)
        hidden = torch.arange(total)[None, None, :] > rows[None, :, None]  # causal in the tail
        p = torch.softmax(logits.masked_fill(hidden, -math.inf), dim=-1)
        ref += p[..., :t].sum(1).mean(0) / L  # every window query sees every cached key
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)
    # Without log-normalisers the softmax runs over the cached keys only: other numbers.
    alone = scores_of(policy, tensors, list(range(t)), query_positions=rows, prompt_tokens=total)
    assert not torch.allclose(alone, got)
    # The budget is of the cached part; its forced window is empty (the tail holds all of it).
    policy = kvdrop.get(
        "snapkv", window=w, kernel=1, keep_tokens=8, chunk_size=8, head_dim=D, rerotate=False
    )
    _, kept = policy(
        tensors,
        list(range(t)),
        context=EditContext.of(t, query_positions=rows, query_lse=lse, prompt_tokens=total),
    )
    assert len(kept) == 8 and kept == sorted(torch.topk(got, 8).indices.tolist())


def test_forced_window_counts_the_tail() -> None:
    """SnapKV's always-kept window is the last `window` tokens of the whole prompt: with a tail
    of 5 and window 8 only the last 3 cached tokens are forced."""
    kv, q = make(40, seed=2)
    rows = torch.arange(32, 40)
    policy = kvdrop.get("snapkv", window=8, keep_tokens=4, chunk_size=1, head_dim=D)
    policy.rerotate = False
    _, kept = policy(
        {CacheKind.KV: kv[:, :, :35], CacheKind.QUERY: q[:, :, rows]},
        list(range(35)),
        context=EditContext.of(35, query_positions=rows, prompt_tokens=40),
    )
    assert len(kept) == 4 and kept[-3:] == [32, 33, 34] and kept[0] < 32


def test_short_window_warns_and_uses_what_exists() -> None:
    kv, q = make(64, seed=3)
    rows = torch.tensor([0, 32, 60, 61, 62, 63])  # only 4 of the last 16 positions
    policy = kvdrop.get("snapkv", window=16, keep_tokens=16, chunk_size=8, head_dim=D)
    with pytest.warns(kvdrop.PolicyWarning, match="cover only part of the last 16"):
        policy(
            {CacheKind.KV: kv, CacheKind.QUERY: q[:, :, rows]},
            list(range(64)),
            context=EditContext.of(64, query_positions=rows, rope=None),
        )


def test_a_full_query_scorer_refuses_a_window() -> None:
    kv, q = make(32, seed=4)
    rows = torch.arange(24, 32)
    policy = kvdrop.get("last-queries", keep_tokens=8, chunk_size=8, head_dim=D, window=4)
    with pytest.raises(kvdrop.PolicyInputError, match=r"queries = QueryNeed\.WINDOW"):
        policy.select_indices(
            {CacheKind.KV: kv, CacheKind.QUERY: q[:, :, rows]},
            list(range(32)),
            context=EditContext.of(32, query_positions=rows),
        )
    # Dense queries with a context still work for it (rows 0..T-1 are all there).
    dense = {CacheKind.KV: kv, CacheKind.QUERY: q}
    _, index = policy.select_indices(dense, list(range(32)), context=EditContext.of(32))
    assert index.numel() == 8


def test_head_dim_comes_from_the_context() -> None:
    kv, q = make(32, seed=5)
    tensors = {CacheKind.KV: kv, CacheKind.QUERY: q}
    policy = kvdrop.get("snapkv", keep_tokens=16, chunk_size=8, window=4, rerotate=False)
    with pytest.raises(kvdrop.PolicyInputError, match="head_dim=128"):
        policy(tensors, list(range(32)))  # 128 without a context: D=32 is not a multiple
    _, kept = policy(tensors, list(range(32)), context=EditContext.of(32, head_dim=D))
    explicit = kvdrop.get("snapkv", keep_tokens=16, chunk_size=8, window=4, head_dim=D)
    assert kept == explicit(tensors, list(range(32)), context=EditContext.of(32))[1]


def test_device_resolution() -> None:
    from kvdrop.device import resolve_device

    cpu = torch.zeros(1)
    assert resolve_device("cpu", "cuda", cpu) == torch.device("cpu")  # explicit wins
    assert resolve_device("auto", "cpu", cpu) == torch.device("cpu")  # then the context's
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto", None, cpu).type == expected
    with pytest.raises(kvdrop.PolicyParamError, match="device"):
        kvdrop.get("snapkv", device="gpu-please")


@pytest.mark.parametrize("name", sorted(set(kvdrop.available()) - {"compose", "budget", "chunk"}))
def test_every_policy_scores_on_the_requested_device_and_returns_cpu_indices(name: str) -> None:
    """CPU here (and CUDA tensors with a CPU index were the h2o crash); the GPU run of this test
    is below. Results do not depend on where scores are computed."""
    kv, q = make(96, seed=7)
    rows = torch.tensor([0, 16, *range(32, 96)])  # a strided sample and the last 64
    tensors = {CacheKind.KV: kv, CacheKind.QUERY: q[:, :, rows]}
    info = kvdrop.describe(name)
    params = {**info.example, "keep_tokens": 32, "chunk_size": 8}
    ctx = EditContext.of(96, query_positions=rows, head_dim=D)
    if "head_dim" in {p.name for p in info.params}:
        params["head_dim"] = D
    if info.needs.queries is QueryNeed.FULL:  # a dense-only scorer: hand it every query
        tensors[CacheKind.QUERY], ctx = q, EditContext.of(96, head_dim=D)
    here = kvdrop.get(name, device="cpu", rerotate=False, **params)
    if here.token_scores:  # kvzip: the engine's reconstruction scores come in the context
        scores = torch.rand(kv.shape[1], 2, 96, generator=torch.Generator().manual_seed(7))
        ctx = dataclasses.replace(ctx, token_scores=scores)
    kv_out, index = here.select_indices(tensors, list(range(96)), context=ctx)
    assert index.device.type == "cpu" and index.dtype == torch.int64 and kv_out is kv
    if torch.cuda.is_available():
        there = kvdrop.get(name, device="cuda", rerotate=False, **params)
        assert there.select_indices(tensors, list(range(96)), context=ctx)[1].tolist() == (
            index.tolist()
        )
        on_gpu = {k: v.cuda() for k, v in tensors.items()}
        out, kept = there(on_gpu, list(range(96)), context=ctx)
        assert out.is_cuda and kept == index.tolist()
