"""The batched decode-cut ranking (``kvdrop_engine.decode_batch``) keeps exactly the rows the
policy library keeps, request by request, for every policy it covers."""

from __future__ import annotations

import pytest
import torch

from kvdrop.attention import key_redundancy, unit_keys
from kvdrop_engine.decode_batch import BatchedRank
from kvdrop_engine.decode_cut import DecodeCompressor
from kvdrop_engine.loading import preset_config

SPECS = [
    "rkv",
    "rkv(threshold=0.1)",
    "snapkv",
    "snapkv(kernel=5,pooling=max)",
    "tova",
    "knorm",
    "streaming",
]


@pytest.mark.parametrize("spec", SPECS)
def test_the_batch_keeps_what_the_policy_keeps(spec: str) -> None:
    cfg = preset_config("tiny")
    compressor = DecodeCompressor(cfg, spec, budget=96, every=32)
    cut = compressor.default
    assert cut is not None and cut.fast is not None
    batch, num_tokens, rows = 3, 128, cut.capture.window
    gen = torch.Generator().manual_seed(0)
    width = cfg.num_kv_heads * cfg.head_dim
    kv = torch.randn(2, cfg.num_layers, batch * num_tokens, width, generator=gen)
    kv[0] += 0.8 * torch.randn(1, 1, width, generator=gen)  # similar keys: redundancy hits
    qpos = torch.arange(num_tokens - rows, num_tokens)
    q = torch.randn(batch, cfg.num_layers, rows, cfg.num_heads, cfg.head_dim, generator=gen)
    keys = kv[0].unflatten(1, (batch, num_tokens)).transpose(0, 1)
    queries = q.reshape(batch, cfg.num_layers, rows, -1) if cut.fast.reads_queries else None
    together = cut.fast.select(keys, queries, qpos)
    assert together.shape == (batch, 96)
    positions, tokens = torch.arange(num_tokens), list(range(num_tokens))
    for i, part in enumerate(kv.split(num_tokens, dim=2)):
        alone = compressor.select(cut, part, positions, tokens, (qpos, q[i]), batched=False)
        assert torch.equal(together[i], alone)


@pytest.mark.parametrize("offset", [0.0, 0.4, 1.2])
def test_the_dense_redundancy_equals_the_librarys_scan(offset: float) -> None:
    """The accelerator's way (a float16 filter, then float32 for the rows it keeps) gives
    R-KV's redundancy of the library's scan: keys in many directions (the filter rules out
    most rows, or all at 0.9), a shared direction (some similar keys, or many: every row)."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(2, 3, 90, 2, 16, generator=gen)
    k += offset * torch.randn(1, 1, 1, 2, 16, generator=gen)
    for threshold in (0.0, 0.5, 0.9):
        dense = BatchedRank._redundancy(k, threshold, dense=True)
        scan = BatchedRank._redundancy(k, threshold, dense=False)
        flat = k.permute(0, 1, 3, 2, 4).reshape(-1, 90, 16)
        library = key_redundancy(unit_keys(flat), threshold).view(2, 3, 2, 90)
        torch.testing.assert_close(dense, library, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(scan, library, rtol=0, atol=0)
