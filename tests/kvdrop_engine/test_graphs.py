"""Decode graphs: batch buckets; capturing needs CUDA (the graphs themselves run on the GPU)."""

from __future__ import annotations

import pytest
import torch

from kvdrop_engine.graphs import BATCH_BUCKETS, DecodeGraphs, pick_graph, precapture_keys
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_engine.paged import PagedKVCache


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
