"""ModelRunner's side passes: the query windows of the requests finishing in one step."""

from __future__ import annotations

import torch

from kvdrop_engine.capture import WindowCapture
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_engine.runner import ModelRunner


def window(num_prompt: int, seed: int, config_layers: int, heads: int, dim: int) -> WindowCapture:
    """A window holding rows of every position below ``num_prompt`` (sampled and recent)."""
    cap = WindowCapture(num_prompt=num_prompt, window=4, stride=3)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(config_layers, num_prompt, heads, dim, generator=gen)
    cap.add(list(range(num_prompt)), rows)
    return cap


def test_window_records_of_one_step_equal_one_call_per_request() -> None:
    cfg = preset_config("tiny")
    runner = ModelRunner(
        Transformer.random(cfg, seed=0),
        cfg,
        num_blocks=8,
        block_size=16,
        max_batch_size=4,
        fused_ops=None,
        cuda_graphs=None,
    )
    runner.cache.k.normal_(generator=torch.Generator().manual_seed(1))
    shape = (cfg.num_layers, cfg.num_heads, cfg.head_dim)
    jobs = [([0, 1], 21, window(21, 2, *shape)), ([5], 10, window(10, 3, *shape))]
    empty = WindowCapture(num_prompt=5, window=2, stride=0)  # kept no rows
    batched = runner.window_records([*jobs, ([2], 4, empty)])
    assert batched[2] is None
    for (blocks, computed, cap), got in zip(jobs, batched, strict=False):
        want = runner.window_record(blocks, computed, cap)
        assert want is not None and got is not None
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    positions, queries, lse = batched[1]  # type: ignore[misc]
    assert lse.shape == (cfg.num_layers, positions.numel(), cfg.num_heads)
    assert torch.isfinite(lse).all() and queries.shape[1] == positions.numel()
    assert runner.window_records([]) == []
