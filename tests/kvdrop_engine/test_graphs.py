"""Decode graphs: batch buckets; capturing needs CUDA (the graphs themselves run on the GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from kvdrop_engine.graphs import (
    BATCH_BUCKETS,
    DecodeGraphs,
    TableRows,
    pick_graph,
    precapture_keys,
)
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_engine.paged import PagedKVCache, SeqStep


def test_bucket_is_the_smallest_that_fits() -> None:
    assert [DecodeGraphs.bucket(n) for n in (1, 3, 16, 17, 30, 256)] == [1, 4, 16, 24, 32, 256]
    assert DecodeGraphs.bucket(1000) == 1000  # past the table: its own size
    assert list(BATCH_BUCKETS) == sorted(BATCH_BUCKETS)


def test_precapture_covers_every_reachable_bucket_at_the_widest_table() -> None:
    # 30 requests at most: buckets up to 32; the widest table covers all 20000 blocks.
    keys = precapture_keys(range(1, 31), 256, 20000)
    assert keys == [(b, 32768) for b in (1, 2, 4, 8, 12, 16, 24, 32)]
    assert precapture_keys(BATCH_BUCKETS, 8, 100) == [(1, 128), (2, 128), (4, 128), (8, 128)]
    assert precapture_keys((), 256, 100) == []  # off: captured when first needed
    assert precapture_keys([3], 256, 1) == [(4, 16)]  # at least 16 columns


def test_a_step_replays_the_narrowest_captured_graph_that_fits() -> None:
    captured = [(32, 32768), (32, 64), (16, 32768)]
    assert pick_graph(captured, 32, 10) == (32, 64)
    assert pick_graph(captured, 32, 65) == (32, 32768)  # wider than needed: no new capture
    assert pick_graph(captured, 16, 1) == (16, 32768)
    # Nothing fits: a new graph of the smallest power-of-two width >= 16 (captured mid-run).
    assert pick_graph(captured, 8, 40) == (8, 64)
    assert pick_graph([], 1, 3) == (1, 16)


def test_graphs_need_a_cuda_cache() -> None:
    cfg = preset_config("tiny")
    cache = PagedKVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_blocks=4,
    )
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(Transformer.random(cfg), cache, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graph_replay_matches_eager_decode() -> None:  # pragma: no cover - GPU only
    from kvdrop_engine.paged import PagedAttention, SeqStep

    cfg = preset_config("tiny")
    model = Transformer.random(cfg, device="cuda")
    cache = PagedKVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_blocks=16,
        block_size=16,
        device="cuda",
    )
    cache.k.normal_()
    cache.v.normal_()
    seqs = [SeqStep(0, [0, 1], 20, 1), SeqStep(1, [2, 3, 4], 40, 1)]
    tokens = [5, 6]
    with torch.inference_mode():
        want = model(
            torch.tensor(tokens, device="cuda"),
            torch.tensor([20, 40], device="cuda"),
            PagedAttention(cache, seqs),
        )
    logits, greedy = DecodeGraphs(model, cache, 8).run(seqs, tokens)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert greedy.tolist() == want.argmax(-1).tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_an_engine_captures_its_graphs_at_start() -> None:  # pragma: no cover - GPU only
    from kvdrop_engine.engine import Engine

    model = Transformer.random(preset_config("tiny"), device="cuda")
    engine = Engine(model, num_blocks=64, max_batch_size=8, graph_batch_sizes=range(1, 5))
    graphs = engine.graphs
    assert graphs is not None and graphs.captured == [(1, 64), (2, 64), (4, 64)]
    with engine:
        prompts = [[5 + i, 6, 7] for i in range(3)]
        params = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 20}
        for p in prompts:
            engine.generate(p, params, "t")
    assert graphs.capture_seconds == 0.0 and engine.stats().graph_capture_seconds == 0.0
    assert graphs.captured == [(1, 64), (2, 64), (4, 64)]


SCRATCH = 99


def _full_table(seqs: list[SeqStep], batch: int, width: int) -> torch.Tensor:
    """The block table written from scratch: what every step wrote before TableRows."""
    table = torch.full((batch, width), SCRATCH, dtype=torch.int32)
    for i, s in enumerate(seqs):
        blocks = list(s.block_table[:width])
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return table


def test_table_rows_rewrites_only_the_rows_whose_sequence_or_blocks_changed() -> None:
    rows = TableRows(4, 8, SCRATCH)
    a, b = SeqStep("a", (1, 2), 20, 1), SeqStep("b", (3,), 5, 1)
    assert rows.update([a, b])
    assert torch.equal(rows.host, _full_table([a, b], 4, 8))
    rows.host[0, 7] = rows.host[1, 7] = -1  # marks: a row rewritten loses its mark
    assert not rows.update([a, b])  # the same block tuples: nothing to write, nothing to copy
    assert rows.host[0, 7] == rows.host[1, 7] == -1
    grown = SeqStep("b", (*b.block_table, 4), 17, 1)  # b grew by a block: a new tuple
    assert rows.update([a, grown])
    assert rows.host[0, 7] == -1  # a's row untouched
    assert rows.host[1].tolist() == [3, 4] + [SCRATCH] * 6
    assert rows.update([grown])  # a left the batch: its row goes back to the scratch block
    assert rows.host[1].tolist() == [SCRATCH] * 8 and rows.host[0].tolist()[:2] == [3, 4]
    assert not rows.update([grown])


def test_table_rows_compares_lists_by_value_and_cuts_blocks_past_its_width() -> None:
    rows = TableRows(2, 4, SCRATCH)
    table = [5, 6]
    assert rows.update([SeqStep("x", table, 30, 1)])
    table.append(7)  # changed in place: a list is compared by value
    assert rows.update([SeqStep("x", table, 40, 1)])
    assert rows.host[0].tolist() == [5, 6, 7, SCRATCH]
    assert rows.update([SeqStep("x", (1, 2, 3, 4, 5, 6), 90, 1)])
    assert rows.host[0].tolist() == [1, 2, 3, 4]
    assert rows.update([SeqStep("y", (1, 2, 3, 4, 5, 6), 90, 1)])  # another sequence, same blocks


def test_table_rows_equal_the_whole_table_written_every_step() -> None:
    rng = random.Random(0)
    batch, width = 8, 16
    rows = TableRows(batch, width, SCRATCH)
    live: dict[str, tuple[int, ...]] = {}
    for step in range(400):
        action = rng.random()
        if action < 0.15 and len(live) < batch:  # admitted
            live[f"r{step}"] = tuple(rng.sample(range(64), rng.randint(1, 20)))
        elif action < 0.25 and live:  # finished or preempted
            del live[rng.choice(sorted(live))]
        elif action < 0.6 and live:  # grew by a block
            rid = rng.choice(sorted(live))
            live[rid] = (*live[rid], rng.randrange(64))
        elif action < 0.7 and live:  # cut: its tail freed
            rid = rng.choice(sorted(live))
            live[rid] = live[rid][: max(1, len(live[rid]) // 2)]
        elif action < 0.75 and live:  # swapped back in other blocks
            rid = rng.choice(sorted(live))
            live[rid] = tuple(rng.sample(range(64), len(live[rid])))
        order = sorted(live)
        rng.shuffle(order)  # the batch's order may change between steps
        seqs = [SeqStep(rid, live[rid], 0, 1) for rid in order]
        rows.update(seqs)
        assert torch.equal(rows.host, _full_table(seqs, batch, width)), step
