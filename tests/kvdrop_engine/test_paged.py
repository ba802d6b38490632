"""PagedKVCache / PagedAttention: mixed prefill+decode steps equal dense attention per sequence."""

from __future__ import annotations

import pytest
import torch

from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import DenseAttention, ModelConfig, Transformer
from kvdrop_engine.paged import (
    BlockAllocator,
    OutOfBlocksError,
    PagedAttention,
    PagedKVCache,
    SeqStep,
    blocks_needed,
    to_device,
    to_host,
)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def make_cache(cfg: ModelConfig, num_blocks: int = 64, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
    )


class Recorder:
    """Wraps a backend and keeps the queries it saw, per layer."""

    def __init__(self, inner: DenseAttention) -> None:
        self.inner = inner
        self.q: dict[int, list[torch.Tensor]] = {}

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.q.setdefault(layer, []).append(q.clone())
        return self.inner(layer, q, k, v)


def test_allocator_allocates_frees_and_reuses() -> None:
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 1
    with pytest.raises(OutOfBlocksError):
        alloc.allocate(2)
    assert alloc.num_free == 1  # a failed allocation takes nothing
    alloc.free(a[:2])
    b = alloc.allocate(2)
    assert set(b) == set(a[:2])  # freed blocks are reused first
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([a[2], a[2]])
    with pytest.raises(ValueError, match="positive"):
        BlockAllocator(0)


def test_blocks_needed() -> None:
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_load_then_read_round_trips_server_layout() -> None:
    cfg = preset_config("tiny")
    cache = make_cache(cfg, num_blocks=8, block_size=4)
    table = [5, 2, 7]
    kv = torch.randn(2, cfg.num_layers, 11, cfg.kv_dim)
    cache.load(table, kv)
    assert torch.equal(cache.read(table, 11), kv)
    # token 5 lives in block table[1] at offset 1, heads major inside the row
    k_tok5 = cache.k[1, table[1], 1].reshape(-1)
    assert torch.equal(k_tok5, kv[0, 1, 5])
    with pytest.raises(ValueError, match="expected"):
        cache.load(table, torch.zeros(2, cfg.num_layers, 3, cfg.kv_dim + 1))
    with pytest.raises(ValueError, match="do not fit"):
        cache.load(table, torch.zeros(2, cfg.num_layers, 13, cfg.kv_dim))


@pytest.mark.parametrize("max_decode_padding", [0.0, 0.25, 10.0])
def test_mixed_steps_match_dense_per_sequence(
    model: Transformer, max_decode_padding: float
) -> None:
    """Steps mixing prefill chunks and decodes give each sequence the logits of a lone dense run."""
    cfg = model.config
    cache = make_cache(cfg, num_blocks=64, block_size=4)
    gen = torch.Generator().manual_seed(0)
    lengths = {"a": 13, "b": 5, "c": 22, "d": 1}
    prompts = {s: torch.randint(3, cfg.vocab_size, (n,), generator=gen) for s, n in lengths.items()}
    extra = {s: torch.randint(3, cfg.vocab_size, (6,), generator=gen) for s in lengths}
    seqs = {s: torch.cat([prompts[s], extra[s]]) for s in lengths}
    tables = {s: cache.allocator.allocate(blocks_needed(len(seqs[s]), 4)) for s in lengths}
    done = dict.fromkeys(lengths, 0)
    # (seq, new tokens) per step: chunked prefill of "c", "d" joins late, decodes interleave.
    schedule = [
        [("a", 13), ("b", 5), ("c", 7)],
        [("a", 1), ("b", 1), ("c", 15), ("d", 1)],
        [("c", 1), ("a", 1), ("d", 1), ("b", 1)],
        [("b", 3), ("d", 1), ("c", 1)],
        [("a", 1), ("d", 1), ("c", 1), ("b", 1)],
    ]
    paged_logits: dict[str, list[torch.Tensor]] = {s: [] for s in lengths}
    captured: dict[str, list[list[torch.Tensor]]] = {"a": [], "c": []}
    with torch.inference_mode():
        for step in schedule:
            steps = [SeqStep(s, tables[s], done[s], n) for s, n in step]
            toks = torch.cat([seqs[s][done[s] : done[s] + n] for s, n in step])
            pos = torch.cat([torch.arange(done[s], done[s] + n) for s, n in step])
            attn = PagedAttention(
                cache, steps, capture={"a", "c"}, max_decode_padding=max_decode_padding
            )
            logits = model(toks, pos, attn)
            row = 0
            for s, n in step:
                paged_logits[s].append(logits[row : row + n])
                if s in attn.captured:
                    captured[s].append(attn.captured[s])
                row += n
                done[s] += n
        for s in lengths:
            dense = Recorder(DenseAttention(cfg))
            ref = model(seqs[s][: done[s]], torch.arange(done[s]), dense)
            got = torch.cat(paged_logits[s])
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            # the KV in the blocks is this sequence's own, post-RoPE
            kv = cache.read(tables[s], done[s])
            for layer in range(cfg.num_layers):
                ref_k = dense.inner.keys(layer).reshape(done[s], -1)
                torch.testing.assert_close(kv[0, layer], ref_k, atol=1e-6, rtol=1e-6)
            if s in captured:  # captured queries belong to this sequence, in token order
                for layer in range(cfg.num_layers):
                    got_q = torch.cat([c[layer] for c in captured[s]])
                    torch.testing.assert_close(got_q, dense.q[layer][0], atol=1e-6, rtol=1e-6)


def test_capture_is_by_sequence_not_batch_position(model: Transformer) -> None:
    """The same sequence at a different batch position captures the same queries."""
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(3, cfg.vocab_size, (9,), generator=gen)
    y = torch.randint(3, cfg.vocab_size, (9,), generator=gen)
    results = []
    for order in (("x", "y"), ("y", "x")):
        cache = make_cache(cfg)
        tables = {"x": cache.allocator.allocate(3), "y": cache.allocator.allocate(3)}
        toks = {"x": x, "y": y}
        steps = [SeqStep(s, tables[s], 0, 9) for s in order]
        attn = PagedAttention(cache, steps, capture={"x"})
        with torch.inference_mode():
            model(torch.cat([toks[s] for s in order]), torch.cat([torch.arange(9)] * 2), attn)
        results.append(torch.stack(attn.captured["x"]))
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=1e-6)


def test_step_validation(model: Transformer) -> None:
    cfg = model.config
    cache = make_cache(cfg)
    table = cache.allocator.allocate(2)
    with pytest.raises(ValueError, match="no new tokens"):
        PagedAttention(cache, [SeqStep(0, table, 0, 0)])
    attn = PagedAttention(cache, [SeqStep(0, table, 0, 3)])
    q = torch.zeros(4, cfg.num_heads, cfg.head_dim)
    kv = torch.zeros(4, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="built for 3 tokens"):
        attn(0, q, kv, kv)
    with pytest.raises(ValueError, match="do not fit"):
        PagedAttention(cache, [SeqStep(0, table, 7, 3)])


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_cache_keeps_model_dtype(model: Transformer, dtype: torch.dtype) -> None:
    cfg = model.config
    m = Transformer.random(cfg, seed=0, dtype=dtype)
    cache = PagedKVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_blocks=4,
        block_size=4,
        dtype=dtype,
    )
    table = cache.allocator.allocate(2)
    toks = torch.arange(3, 9)
    with torch.inference_mode():
        got = m(toks, torch.arange(6), PagedAttention(cache, [SeqStep(0, table, 0, 6)]))
        ref = m(toks, torch.arange(6), DenseAttention(cfg))
    assert cache.k.dtype == dtype
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


def test_scratch_block_is_stored_but_never_allocated() -> None:
    cfg = preset_config("tiny")
    cache = make_cache(cfg, num_blocks=4)
    assert cache.k.shape[1] == 5 and cache.scratch_block == 4
    assert sorted(cache.allocator.allocate(4)) == [0, 1, 2, 3]
    assert cache.capacity_tokens == 16
    assert cache.bytes_per_token == 2 * cfg.num_layers * cfg.kv_dim * 4


def test_read_cpu_and_host_transfers_keep_values() -> None:
    cfg = preset_config("tiny")
    cache = make_cache(cfg, num_blocks=8)
    kv = torch.randn(2, cfg.num_layers, 10, cfg.kv_dim)
    table = [5, 1, 7]
    cache.load(table, kv)
    assert torch.equal(cache.read_cpu(table, 10), kv)
    assert to_device(kv, "cpu") is kv and to_host(kv) is kv


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_staged_transfers_match_plain_copies_on_gpu() -> None:  # pragma: no cover - GPU only
    import threading

    from kvdrop_engine import paged

    base = torch.randn(2, 6, 3000, 512).to(torch.bfloat16)
    sources = [base[:, :, :2999], base[:, :, 7:2100], base.clone()]  # sliced, sliced, contiguous
    results: list[bool] = []

    def check(t: torch.Tensor) -> None:
        for _ in range(3):
            got = to_device(t, "cuda")
            results.append(torch.equal(got.cpu(), t) and got.shape == t.shape)

    old = paged.STAGING_BYTES
    paged.STAGING_BYTES = 4 << 20  # several pieces per tensor, both staging buffers in turn
    try:
        threads = [threading.Thread(target=check, args=(s,)) for s in sources]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        paged.STAGING_BYTES = old
    assert results == [True] * 9
    dev = base.cuda()
    assert torch.equal(to_host(dev), base) and to_host(dev).is_pinned()


def test_captured_rows_of_chunked_prefill_and_decode_steps_match_dense(model: Transformer) -> None:
    """Chosen rows of a chunked prefill and of decode steps (batched with another sequence)."""
    cfg = model.config
    cache = make_cache(cfg)
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(3, cfg.vocab_size, (20,), generator=gen)
    other = torch.randint(3, cfg.vocab_size, (24,), generator=gen)
    tables = {"s": cache.allocator.allocate(6), "o": cache.allocator.allocate(6)}
    done = {"s": 0, "o": 0}
    schedule = [[("s", 9), ("o", 12)], [("o", 8), ("s", 9)], [("o", 1), ("s", 1)], [("s", 1)]]
    wanted = {0: [0, 4, 8], 1: [2, 8], 2: [0], 3: [0]}  # offsets of "s" per step
    got, positions = [], []
    with torch.inference_mode():
        for i, step in enumerate(schedule):
            steps = [SeqStep(s, tables[s], done[s], n) for s, n in step]
            toks = torch.cat([{"s": seq, "o": other}[s][done[s] : done[s] + n] for s, n in step])
            pos = torch.cat([torch.arange(done[s], done[s] + n) for s, n in step])
            attn = PagedAttention(cache, steps, capture_rows={"s": wanted[i]})
            model(toks, pos, attn)
            got.append(attn.captured_rows("s"))
            positions += [done["s"] + off for off in wanted[i]]
            for s, n in step:
                done[s] += n
    dense = Recorder(DenseAttention(cfg))
    with torch.inference_mode():
        model(seq[: done["s"]], torch.arange(done["s"]), dense)
    q = torch.cat(got, dim=1)  # [L, rows, Hq, d]
    for layer in range(cfg.num_layers):
        torch.testing.assert_close(q[layer], dense.q[layer][0][positions], atol=1e-6, rtol=1e-6)
        keys = cache.keys(tables["s"], layer, done["s"])
        ref = dense.inner.keys(layer).reshape(done["s"], cfg.num_kv_heads, cfg.head_dim)
        torch.testing.assert_close(keys, ref, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="outside"):
        PagedAttention(cache, [SeqStep("s", tables["s"], 0, 2)], capture_rows={"s": [2]})


def test_staging_copy_is_exact_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host copy into a staging piece (memmove slices on the copy threads; a strided
    source through copy_) moves every byte, also when the size does not divide by 8."""
    from kvdrop_engine import paged
    from kvdrop_sdk.transport import buffers

    monkeypatch.setattr(buffers, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setenv("KVDROP_COPY_THREADS", "3")
    src = torch.randn(13, 7, 5, generator=torch.Generator().manual_seed(3)).bfloat16()
    for source in (src, src.transpose(0, 1).contiguous().transpose(0, 1)):
        dst = torch.empty(13, 7, 5, dtype=torch.bfloat16)
        paged._host_copy(dst, source)
        assert torch.equal(dst, src)
