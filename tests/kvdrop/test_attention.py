"""The blocked attention core and the blocked R-KV redundancy equal plain quadratic references."""

from __future__ import annotations

import math

import pytest
import torch

from kvdrop.attention import (
    attention_mass,
    fp16_filter_margin,
    heads_f32,
    key_redundancy,
    pool1d,
    unit_keys,
)


def ref_mass(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor | None) -> torch.Tensor:
    """float64, per query head, full score matrix, masked softmax, summed over queries."""
    hq, _, d = q.shape
    hkv, t, _ = k.shape
    group = hq // hkv
    out = torch.zeros(hq, t, dtype=torch.float64)
    for h in range(hq):
        scores = q[h].double() @ k[h // group].double().T / math.sqrt(d)  # [n, t]
        if q_pos is not None:
            hidden = torch.arange(t)[None, :] > q_pos[:, None]
            scores = scores.masked_fill(hidden, -math.inf)
        out[h] = torch.softmax(scores, dim=-1).sum(0)
    return out


def ref_redundancy(k: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV's cal_similarity written out: [H, T, T] cosine matrix, float64."""
    kn = k.double() / (k.double().norm(dim=-1, keepdim=True) + 1e-8)
    h, t, _ = kn.shape
    sim = kn @ kn.transpose(1, 2)
    for i in range(h):
        sim[i].fill_diagonal_(0.0)
    mask = sim > threshold
    idx = torch.where(mask, torch.arange(t), torch.zeros_like(mask, dtype=torch.long))
    last = idx.max(dim=-1).values  # [H, T]; 0 when a row has no similar key
    for i in range(h):
        sim[i, torch.arange(t), last[i]] = 0.0
    return torch.softmax(sim.mean(dim=1), dim=-1)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_bytes", [1, 4096, 1 << 26])
def test_attention_mass_causal_matches_reference(group: int, block_bytes: int) -> None:
    gen = torch.Generator().manual_seed(group * 7 + block_bytes % 97)
    hkv, t, d = 2, 53, 16
    k = torch.randn(hkv, t, d, generator=gen)
    q = torch.randn(hkv * group, 11, d, generator=gen) * 2
    q_pos = torch.tensor([0, 3, 9, 20, 30, 31, 40, 41, 50, 51, 52])
    got = attention_mass(q, k, q_pos, block_bytes=block_bytes)
    ref = ref_mass(q, k, q_pos)
    assert got.dtype == torch.float32 and got.shape == (hkv * group, t)
    assert rel_err(got, ref) < 1e-5
    # Each query's row sums to one: the total mass per head is the number of queries.
    torch.testing.assert_close(got.sum(1), torch.full((hkv * group,), 11.0), rtol=1e-5, atol=0)


def test_attention_mass_without_positions_sees_all_keys() -> None:
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1, 40, 8, generator=gen)
    q = torch.randn(3, 5, 8, generator=gen)
    assert rel_err(attention_mass(q, k, None, block_bytes=64), ref_mass(q, k, None)) < 1e-5
    # causal=False ignores the positions.
    pos = torch.zeros(5, dtype=torch.long)
    assert torch.equal(attention_mass(q, k, pos, causal=False), attention_mass(q, k, None))


def test_attention_mass_rejects_bad_gqa() -> None:
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention_mass(torch.randn(3, 2, 4), torch.randn(2, 5, 4))


def test_heads_f32_is_head_major() -> None:
    x = torch.arange(2 * 6, dtype=torch.bfloat16).view(2, 6)  # T=2, 3 heads of 2
    h = heads_f32(x, 2)
    assert h.shape == (3, 2, 2) and h.dtype == torch.float32 and h.is_contiguous()
    assert h[1, 0].tolist() == [2.0, 3.0] and h[2, 1].tolist() == [10.0, 11.0]


def test_pool1d_same_size_avg_counts_padding_and_max_ignores_it() -> None:
    x = torch.tensor([[1.0, 0.0, 0.0, 4.0]])
    torch.testing.assert_close(pool1d(x, 3, "avg"), torch.tensor([[1 / 3, 1 / 3, 4 / 3, 4 / 3]]))
    assert pool1d(x, 3, "max").tolist() == [[1.0, 1.0, 4.0, 4.0]]
    assert pool1d(x, 1, "max") is x
    with pytest.raises(ValueError, match="pooling"):
        pool1d(x, 3, "median")


def clustered_keys(gen: torch.Generator, h: int, t: int, d: int) -> torch.Tensor:
    """Keys drawn around a few directions, so many pairs exceed the threshold (real-key-like)."""
    centres = torch.randn(h, 4, d, generator=gen)
    which = torch.randint(0, 4, (h, t), generator=gen)
    return torch.gather(centres, 1, which[..., None].expand(h, t, d)) + 0.6 * torch.randn(
        h, t, d, generator=gen
    )


#: The scans of key_redundancy: row blocks without / with the bf16 pre-filter, and the
#: all-rows scan with its float16 filter (the GPU's default, run here on the CPU).
SCANS = {
    "row-blocks": {"all_rows": False, "bf16_filter": False},
    "row-blocks-bf16": {"all_rows": False, "bf16_filter": True},
    "all-rows-fp16": {"all_rows": True},
}


@pytest.mark.parametrize("threshold", [0.5, 0.9, 0.0, -0.2])
@pytest.mark.parametrize("blocks", [(256, 4096), (7, 5), (1, 1)])
@pytest.mark.parametrize("clustered", [False, True])
@pytest.mark.parametrize("scan", SCANS)
def test_blocked_redundancy_equals_quadratic(
    threshold: float, blocks: tuple[int, int], clustered: bool, scan: str
) -> None:
    gen = torch.Generator().manual_seed(int(threshold * 10) + 3 * blocks[0] + clustered)
    h, t, d = 3, 37, 8
    k = clustered_keys(gen, h, t, d) if clustered else torch.randn(h, t, d, generator=gen)
    got = key_redundancy(
        unit_keys(k), threshold, row_block=blocks[0], col_block=blocks[1], **SCANS[scan]
    )
    ref = ref_redundancy(k, threshold)
    assert got.shape == (h, t)
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("tile_bytes", [1, 4 * 37 * 8, 1 << 30])
def test_all_rows_scan_in_head_groups_equals_quadratic(tile_bytes: int) -> None:
    """Head groups of 1, 2 and all heads (the tile bound) give the same exact result."""
    gen = torch.Generator().manual_seed(11)
    k = clustered_keys(gen, 5, 37, 16)
    got = key_redundancy(unit_keys(k), 0.5, col_block=8, all_rows=True, tile_bytes=tile_bytes)
    assert rel_err(got, ref_redundancy(k, 0.5)) < 1e-5


def test_fp16_filter_margin_bounds_the_float16_product() -> None:
    """The margin covers the float16 product's error on unit keys, also at head_dim 256."""
    gen = torch.Generator().manual_seed(2)
    for d in (8, 128, 256):
        kn = unit_keys(clustered_keys(gen, 2, 300, d))
        exact = kn.double() @ kn.double().transpose(1, 2)
        rough = (kn.half().float() @ kn.half().float().transpose(1, 2)).half().double()
        assert float((rough - exact).abs().max()) < fp16_filter_margin(d)
    assert 0.05 < fp16_filter_margin(128) < 0.08


@pytest.mark.parametrize("scan", SCANS)
def test_redundancy_is_exact_at_the_threshold(scan: str) -> None:
    """Pairs whose cosine is within 1e-5..1e-3 of the threshold, on either side: the bf16 and
    float16 pre-filters may not decide them, the float32 check must (same result as float64)."""
    threshold = 0.5
    base = math.acos(threshold)
    angles = []
    for m, delta in enumerate([1e-3, -1e-3, 1e-5, -1e-5, 3e-4, -3e-4]):
        start = 1.7 * m
        angles += [start, start + base + delta]  # cos(difference) = threshold -/+ ~delta
    a = torch.tensor(angles, dtype=torch.float64)
    k = torch.zeros(1, len(angles), 4, dtype=torch.float64)
    k[0, :, 0], k[0, :, 1] = a.cos(), a.sin()
    k = k.float()
    got = key_redundancy(unit_keys(k), threshold, row_block=3, col_block=2, **SCANS[scan])
    assert rel_err(got, ref_redundancy(k, threshold)) < 1e-5


def test_redundancy_penalises_duplicates_but_spares_the_latest_copy() -> None:
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(1, 30, 16, generator=gen)
    k[0, 10:20] = k[0, 10] + 0.01 * torch.randn(10, 16, generator=gen)  # ten near-copies
    red = key_redundancy(unit_keys(k), 0.5)[0]
    others = torch.cat([red[:10], red[20:]])
    assert red[10:18].min() > others.max()
    # Each copy's row zeroes its LAST similar key (R-KV keeps the most recent duplicate), so
    # copy 19 loses the similarity of the nine rows before it.
    assert red[19] < red[10:18].min()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("clustered", [False, True])
@pytest.mark.parametrize("threshold", [0.5, -0.2])
def test_redundancy_on_the_gpu_equals_quadratic(clustered: bool, threshold: float) -> None:
    """The GPU's default scan (all rows, float16 filter, cuBLAS) against the float64 form."""
    gen = torch.Generator().manual_seed(21 + clustered)
    h, t, d = 6, 700, 128
    k = clustered_keys(gen, h, t, d) if clustered else torch.randn(h, t, d, generator=gen)
    got = key_redundancy(unit_keys(k.cuda()), threshold, col_block=128, tile_bytes=4 * t * 128)
    assert got.device.type == "cuda"
    assert rel_err(got.cpu(), ref_redundancy(k, threshold)) < 1e-5
