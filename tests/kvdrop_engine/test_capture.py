"""WindowCapture: which rows a request keeps (last W computed positions + every S-th), in order."""

from __future__ import annotations

import math

import pytest
import torch

from kvdrop_engine.capture import WindowCapture, log_normalisers


def rows(positions: list[int]) -> torch.Tensor:
    """Query rows ``[L=2, r, Hq=1, d=2]`` whose values are their positions."""
    p = torch.tensor(positions, dtype=torch.float32)
    return p.view(1, -1, 1, 1).expand(2, -1, 1, 2).clone()


def test_wanted_rows_of_prefill_chunks_and_decode_steps() -> None:
    cap = WindowCapture(num_prompt=100, window=8, stride=32)
    assert cap.wanted(0, 40) == [0, 32]
    assert cap.wanted(40, 60) == [24, *range(52, 60)]  # 64 is offset 24; 92..99 the last 8
    assert cap.wanted(100, 1) == [0]  # a decode step: always its one row
    assert WindowCapture(10, 4, 0).wanted(0, 10) == [6, 7, 8, 9]  # stride 0: no sample


def test_record_keeps_the_last_window_over_decode_steps_and_the_strided_sample() -> None:
    cap = WindowCapture(num_prompt=20, window=4, stride=8)
    for start, n in ((0, 12), (12, 8)):
        offsets = cap.wanted(start, n)
        cap.add([start + o for o in offsets], rows([start + o for o in offsets]))
    for pos in range(20, 26):  # six decode steps
        cap.add([pos], rows([pos]))
    kept = cap.rows()
    assert kept is not None
    positions, queries = kept
    # 17..21 left the window and are not multiples of 8; 24 is both, kept once.
    assert positions.tolist() == [0, 8, 16, 22, 23, 24, 25]
    assert queries.shape == (2, 7, 1, 2) and queries[0, :, 0, 0].tolist() == positions.tolist()
    assert cap.num_rows == 7


def test_rows_must_come_in_order() -> None:
    cap = WindowCapture(num_prompt=10, window=4, stride=0)
    cap.add([7, 8], rows([7, 8]))
    with pytest.raises(ValueError, match="position order"):
        cap.add([8], rows([8]))
    assert WindowCapture(5, 2, 0).rows() is None
    with pytest.raises(ValueError, match="window >= 1"):
        WindowCapture(5, 0, 0)


def test_log_normalisers_are_the_causal_logsumexp_over_every_key() -> None:
    gen = torch.Generator().manual_seed(0)
    n, hkv, group, d = 40, 2, 3, 8
    keys = torch.randn(3, n, hkv, d, generator=gen)  # 3 layers
    queries = torch.randn(3, 5, hkv * group, d, generator=gen)
    positions = torch.tensor([0, 7, 20, 38, 39])
    import kvdrop_engine.capture as capture

    for tile in (capture.LSE_TILE_BYTES, 1):  # one tile, and one row per tile
        old, capture.LSE_TILE_BYTES = capture.LSE_TILE_BYTES, tile
        try:
            got = log_normalisers(queries, positions, lambda layer: keys[layer], d**-0.5)
        finally:
            capture.LSE_TILE_BYTES = old
        for layer in range(3):
            k = keys[layer].repeat_interleave(group, dim=1).double()  # [n, Hq, d]
            for r, p in enumerate(positions.tolist()):
                logits = torch.einsum("hd,khd->hk", queries[layer, r].double(), k[: p + 1])
                ref = torch.logsumexp(logits / math.sqrt(d), dim=-1)
                torch.testing.assert_close(got[layer, r].double(), ref, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("tile", [1, 4 * 6 * 100, 64 << 20])
def test_log_normalisers_in_any_row_order_and_block_size(
    tile: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows in no particular order, more of them than one block holds: each row's own causal
    logsumexp (blocks of 1 row, of a few, of at most 64)."""
    import kvdrop_engine.capture as capture

    monkeypatch.setattr(capture, "LSE_TILE_BYTES", tile)
    gen = torch.Generator().manual_seed(1)
    n, hkv, group, d = 100, 2, 3, 8
    keys = torch.randn(2, n, hkv, d, generator=gen)
    positions = torch.randperm(n, generator=gen)[:70]
    queries = torch.randn(2, 70, hkv * group, d, generator=gen)
    got = log_normalisers(queries, positions, lambda layer: keys[layer], d**-0.5)
    for layer in range(2):
        k = keys[layer].repeat_interleave(group, dim=1).double()
        for r, p in enumerate(positions.tolist()):
            logits = torch.einsum("hd,khd->hk", queries[layer, r].double(), k[: p + 1])
            ref = torch.logsumexp(logits / math.sqrt(d), dim=-1)
            torch.testing.assert_close(got[layer, r].double(), ref, atol=1e-5, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_log_normalisers_on_the_gpu_from_bf16() -> None:
    """The tensor-core path (bf16 inputs, float32 products) against float64 on the same values."""
    gen = torch.Generator().manual_seed(2)
    n, hkv, group, d = 3000, 2, 4, 128
    keys = torch.randn(2, n, hkv, d, generator=gen).bfloat16()
    positions = torch.tensor([0, 5, 1000, 2990, 2999])
    queries = torch.randn(2, 5, hkv * group, d, generator=gen).bfloat16()
    got = log_normalisers(queries.cuda(), positions, lambda layer: keys[layer].cuda(), d**-0.5)
    for layer in range(2):
        k = keys[layer].repeat_interleave(group, dim=1).double()
        for r, p in enumerate(positions.tolist()):
            logits = torch.einsum("hd,khd->hk", queries[layer, r].double(), k[: p + 1])
            ref = torch.logsumexp(logits / math.sqrt(d), dim=-1)
            torch.testing.assert_close(got[layer, r].double().cpu(), ref, atol=1e-4, rtol=1e-5)
