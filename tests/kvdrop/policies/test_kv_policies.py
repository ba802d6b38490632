"""What each KV-only policy keeps, on inputs built so the right answer is known."""

from __future__ import annotations

import torch

import kvdrop
from kvdrop_sdk import CacheKind


def run(name: str, kv: torch.Tensor, **params: object) -> list[int]:
    _, kept = kvdrop.get(name, **params)({CacheKind.KV: kv}, list(range(kv.shape[2])))
    return list(kept)


def chunks_of(kept: list[int], size: int) -> list[int]:
    return sorted({t // size for t in kept})


def test_chunk_halving_drops_the_middle_half_of_the_chunks() -> None:
    kv = torch.randn(2, 2, 8 * 16, 8)
    kept = run("chunk-halving", kv, chunk_size=16)
    assert chunks_of(kept, 16) == [0, 1, 6, 7]  # 8 chunks: the middle n//2 = 4 dropped
    assert len(kept) == 64


def test_chunk_halving_keeps_first_and_last_chunk_at_any_ratio() -> None:
    kv = torch.randn(2, 1, 10 * 16, 4)
    for ratio in (0.2, 0.3, 0.5, 0.8):
        got = chunks_of(run("chunk-halving", kv, chunk_size=16, keep_ratio=ratio), 16)
        assert got[0] == 0 and got[-1] == 9, (ratio, got)


def test_random_is_seeded_and_keeps_the_top_of_its_draws() -> None:
    kv = torch.randn(2, 1, 512, 4)
    a = run("random", kv, chunk_size=64, seed=1)
    b = run("random", kv, chunk_size=64, seed=1)
    c = run("random", kv, chunk_size=64, seed=2)
    assert a == b and a != c
    # kvpress's RandomPress(seed=1) on its first KV head: the highest of torch.rand(T) drawn from
    # a generator seeded with 1; no chunk is forced (kvpress forces none).
    draws = torch.rand(512, generator=torch.Generator().manual_seed(1))
    assert a == sorted(draws.topk(256).indices.tolist())


def test_streaming_keeps_sinks_and_most_recent() -> None:
    kv = torch.randn(2, 1, 100, 4)
    kept = run("streaming", kv, chunk_size=10, keep_tokens=30, n_sink=4)
    assert kept == [0, 1, 2, 3, *range(74, 100)]


def test_knorm_keeps_the_lowest_norm_keys() -> None:
    kv = torch.ones(2, 2, 64, 8)
    low = [3, 17, 40, 41]
    kv[0, :, low] = 0.01  # small keys in every layer
    kv[1] = 100.0  # values are irrelevant to knorm
    assert run("knorm", kv, chunk_size=4, keep_tokens=4) == low


def test_keydiff_keeps_keys_unlike_the_mean() -> None:
    kv = torch.zeros(2, 1, 32, 4)
    kv[0, 0, :, 0] = 1.0  # all keys point along x ...
    odd = [5, 9, 30, 31]
    kv[0, 0, odd] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # ... except these
    assert run("keydiff", kv, chunk_size=4, keep_tokens=4) == odd


def test_chunked_selection_keeps_whole_chunks_by_summed_score() -> None:
    kv = torch.ones(2, 1, 64, 4)
    kv[0, 0, 20:24] = 0.01  # chunk 2 (tokens 16..23 of size 8) holds the 4 lowest-norm keys
    kv[0, 0, 40:48] = 0.5  # chunk 5 is uniformly lower than the rest
    kept = run("knorm", kv, chunk_size=8, keep_tokens=16, chunked=True)
    assert kept == [*range(16, 24), *range(40, 48)]


def test_window_and_sinks_are_always_kept() -> None:
    kv = torch.ones(2, 1, 64, 4)
    kv[0, 0, 10:20] = 0.01
    kept = run("knorm", kv, chunk_size=4, keep_tokens=16, n_sink=2, window=4)
    assert kept[:2] == [0, 1] and kept[-4:] == [60, 61, 62, 63]
    assert set(range(10, 20)) <= set(kept)


def test_within_budget_returns_the_input_unchanged() -> None:
    kv = torch.randn(2, 1, 200, 4)
    fn = kvdrop.get("knorm", keep_ratio=1.0, chunk_size=256)
    out, kept = fn({CacheKind.KV: kv}, list(range(200)))
    assert out is kv and kept == list(range(200))


def test_head_dim_must_divide_width() -> None:
    fn = kvdrop.get("knorm", keep_tokens=4, chunk_size=4, head_dim=3)
    kv = torch.randn(2, 1, 16, 8)
    try:
        fn({CacheKind.KV: kv}, list(range(16)))
    except kvdrop.PolicyInputError as exc:
        assert "head_dim=3" in str(exc) and "D=8" in str(exc)
    else:
        raise AssertionError("expected PolicyInputError")
