"""Decode graphs: batch buckets; capturing needs CUDA (the graphs themselves run on the GPU)."""

from __future__ import annotations

import pytest
import torch

from kvdrop_engine.graphs import BATCH_BUCKETS, DecodeGraphs
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_engine.paged import PagedKVCache


def test_bucket_is_the_smallest_that_fits() -> None:
    assert [DecodeGraphs.bucket(n) for n in (1, 3, 16, 17, 30, 256)] == [1, 4, 16, 24, 32, 256]
    assert DecodeGraphs.bucket(1000) == 1000  # past the table: its own size
    assert list(BATCH_BUCKETS) == sorted(BATCH_BUCKETS)


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
