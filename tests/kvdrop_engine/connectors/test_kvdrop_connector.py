"""ServerConnector against a REAL kvdrop server subprocess: prefixes load, prompts store, and
every request's stored KV and queries are its own under concurrency."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import DenseAttention, ModelConfig, Transformer, generate
from kvdrop_engine.paged import PagedAttention, PagedKVCache, SeqStep, blocks_needed
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import Context, connect
from kvdrop_sdk.errors import SDKError
from kvdrop_sdk.query_capture import QueryCapture, QueryNeed
from kvdrop_sdk.testing.server import ServerHandle, spawn_server
from kvdrop_sdk.window import retrieve_window

CHUNK = 16
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    with spawn_server(chunk_size=CHUNK, enable=["transfer_query"]) as handle:
        yield handle


def contexts(server: ServerHandle, name: str) -> tuple[Context, Context]:
    kv = connect(CacheKind.KV, server.url, server.http_url, name)
    q = connect(CacheKind.QUERY, server.url, server.http_url, name)
    return kv, q


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Recorder:
    """DenseAttention that also keeps each layer's queries (the reference for one lone request)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.dense = DenseAttention(cfg)
        self.q: dict[int, torch.Tensor] = {}

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.q[layer] = q.clone()
        return self.dense(layer, q, k, v)


def reference(model: Transformer, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """KV ``[2, L, T, W]`` and queries ``[1, L, T, Wq]`` of ``prompt`` run alone, densely."""
    cfg = model.config
    rec = Recorder(cfg)
    with torch.inference_mode():
        model(torch.tensor(prompt), torch.arange(len(prompt)), rec)
    layers = range(cfg.num_layers)
    k = torch.stack([rec.dense.keys(i).reshape(len(prompt), -1) for i in layers])
    v = torch.stack([rec.dense.values(i).reshape(len(prompt), -1) for i in layers])
    q = torch.stack([rec.q[i].reshape(len(prompt), -1) for i in layers])
    return torch.stack([k, v]), q.unsqueeze(0)


def test_registers_layouts_and_follows_server_config(
    model: Transformer, server: ServerHandle
) -> None:
    conn = ServerConnector(server.url, server.http_url, "reg-model")
    Engine(model, num_blocks=8, connector=conn)
    try:
        assert conn.transfer_query and conn.chunk_size == CHUNK
        kv_ctx, q_ctx = contexts(server, "reg-model")
        cfg = model.config
        assert kv_ctx.layout.shape(CacheKind.KV, 5) == (2, cfg.num_layers, 5, cfg.kv_dim)
        assert q_ctx.layout.shape(CacheKind.QUERY, 5) == (1, cfg.num_layers, 5, cfg.q_dim)
        assert kv_ctx.layout.dtype == torch.float32
        # The RoPE parameters travel with the KV layout: edits can re-rotate without being told.
        assert kv_ctx.layout.rope == model.config.rope.to_json()
        kv_ctx.close()
        q_ctx.close()
        with pytest.raises(SDKError, match="already bound"):
            conn.bind(model.config, torch.float32)
    finally:
        conn.close()


def test_prefill_stores_whole_chunks_of_kv_and_queries(
    model: Transformer, server: ServerHandle
) -> None:
    prompt = tokens(3 * CHUNK + 5, seed=1)
    conn = ServerConnector(
        server.url, server.http_url, "store-model", queries=QueryCapture(QueryNeed.FULL)
    )
    with Engine(model, num_blocks=16, connector=conn) as eng:
        first = eng.generate(prompt, {**GREEDY, "max_tokens": 4})
        st = eng.stats()
    conn.close()
    assert st.kv_tokens_stored == 3 * CHUNK and st.query_tokens_stored == 3 * CHUNK
    assert first == generate(model, prompt, 4, stop_at_eos=False)
    kv_ref, q_ref = reference(model, prompt)
    kv_ctx, q_ctx = contexts(server, "store-model")
    kv, q = kv_ctx.retrieve(prompt), q_ctx.retrieve(prompt)
    assert kv is not None and q is not None
    torch.testing.assert_close(kv, kv_ref[:, :, : 3 * CHUNK], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, q_ref[:, :, : 3 * CHUNK], atol=1e-5, rtol=1e-5)
    assert kv_ctx.retrieve(prompt, cache_salt="other") is None  # salt separates caches
    kv_ctx.close()
    q_ctx.close()


def test_decoding_from_loaded_prefix_equals_recompute(
    model: Transformer, server: ServerHandle
) -> None:
    """Logits of the suffix after loading the prefix from the server equal a full recompute."""
    cfg = model.config
    prompt = tokens(4 * CHUNK + 7, seed=2)
    conn = ServerConnector(server.url, server.http_url, "load-model")
    with Engine(model, num_blocks=16, connector=conn) as eng:
        eng.generate(prompt[: 4 * CHUNK + 1], {**GREEDY, "max_tokens": 1})  # stores 4 chunks
        kv = conn.load(prompt)
        assert kv is not None and kv.shape[2] == 4 * CHUNK
        # the engine itself: loads 64 tokens, computes only the other 7, same greedy output
        out = eng.generate(prompt, {**GREEDY, "max_tokens": 6})
        st = eng.stats()
    assert st.tokens_loaded == 4 * CHUNK
    assert st.prefill_tokens_computed == 4 * CHUNK + 1 + 7
    # One load: its copy into the blocks is part of it, and it ran alone (busy = its time).
    assert 0 < st.prefix_copy_seconds <= st.prefix_load_seconds
    assert st.prefix_load_busy_seconds == pytest.approx(st.prefix_load_seconds)
    assert out == generate(model, prompt, 6, stop_at_eos=False)
    # logits: paged cache filled from the server, then the suffix, vs dense over everything
    cache = PagedKVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_blocks=8,
        block_size=CHUNK,
    )
    table = cache.allocator.allocate(blocks_needed(len(prompt), CHUNK))
    cache.load(table, kv)
    n = kv.shape[2]
    with torch.inference_mode():
        got = model(
            torch.tensor(prompt[n:]),
            torch.arange(n, len(prompt)),
            PagedAttention(cache, [SeqStep(0, table, n, len(prompt) - n)]),
        )
        ref = model(torch.tensor(prompt), torch.arange(len(prompt)), DenseAttention(cfg))
    torch.testing.assert_close(got, ref[n:], atol=1e-5, rtol=1e-5)
    conn.close()


def test_fully_cached_prompt_recomputes_only_the_last_token(
    model: Transformer, server: ServerHandle
) -> None:
    prompt = tokens(2 * CHUNK, seed=3)
    conn = ServerConnector(server.url, server.http_url, "full-model")
    with Engine(model, num_blocks=8, connector=conn) as eng:
        a = eng.generate(prompt, {**GREEDY, "max_tokens": 5})
        eng.reset_stats()
        b = eng.generate(prompt, {**GREEDY, "max_tokens": 5})
        st = eng.stats()
    conn.close()
    assert a == b
    assert st.tokens_loaded == 2 * CHUNK - 1 and st.prefill_tokens_computed == 1
    assert st.kv_tokens_stored == 0  # nothing new to store


def test_edited_kv_under_kept_tokens_is_what_decode_uses(
    model: Transformer, server: ServerHandle
) -> None:
    """After a modify stored edited KV under kept tokens, the engine decodes from that KV."""
    prompt = tokens(3 * CHUNK + 4, seed=4)
    kept = prompt[:CHUNK] + prompt[2 * CHUNK : 3 * CHUNK]  # middle chunk dropped
    kv_full, _ = reference(model, prompt)
    edited = torch.cat([kv_full[:, :, :CHUNK], kv_full[:, :, 2 * CHUNK : 3 * CHUNK]], dim=2)
    conn = ServerConnector(server.url, server.http_url, "edit-model", transfer_query=False)
    with Engine(model, num_blocks=8, block_size=CHUNK, connector=conn) as eng:
        # the engine registered the layout; an SDK context (as modify uses) stores the edit
        kv_ctx = connect(CacheKind.KV, server.url, server.http_url, "edit-model")
        assert kv_ctx.store(edited, kept)
        suffix = prompt[3 * CHUNK :]
        out = eng.generate(kept + suffix, {**GREEDY, "max_tokens": 5})
        st = eng.stats()
    assert st.tokens_loaded == 2 * CHUNK and st.prefill_tokens_computed == len(suffix)
    # reference: the same edited KV in a paged cache, then greedy decode by hand
    cfg = model.config
    cache = PagedKVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_blocks=8,
        block_size=CHUNK,
    )
    table = cache.allocator.allocate(4)
    cache.load(table, edited)
    pos, new, ref = 2 * CHUNK, suffix, []
    with torch.inference_mode():
        for _ in range(5):
            step = PagedAttention(cache, [SeqStep(0, table, pos, len(new))])
            logits = model(torch.tensor(new), torch.arange(pos, pos + len(new)), step)
            pos += len(new)
            new = [int(logits[-1].argmax())]
            ref.append(new[0])
    assert out == ref
    assert out != generate(model, prompt, 5, stop_at_eos=False)  # the edit mattered
    kv_ctx.close()
    conn.close()


def test_shared_prefix_completes_queries_from_the_server(
    model: Transformer, server: ServerHandle
) -> None:
    """A prompt whose first chunks were stored by another prompt loads their KV, computes the
    rest, and still leaves complete KV and queries for all its chunks (no hole in the query
    cache, e.g. for prompts sharing a system prompt)."""
    shared = tokens(2 * CHUNK, seed=20)
    a = shared + tokens(CHUNK + 3, seed=21)
    b = shared + tokens(2 * CHUNK + 5, seed=22)
    conn = ServerConnector(
        server.url, server.http_url, "shared-model", queries=QueryCapture(QueryNeed.FULL)
    )
    with Engine(model, num_blocks=16, connector=conn) as eng:
        eng.generate(a, {**GREEDY, "max_tokens": 2})
        eng.reset_stats()
        out = eng.generate(b, {**GREEDY, "max_tokens": 4})
        st = eng.stats()
    conn.close()
    assert st.tokens_loaded == 2 * CHUNK and st.prefill_tokens_computed == len(b) - 2 * CHUNK
    assert st.query_tokens_stored == 4 * CHUNK
    assert out == generate(model, b, 4, stop_at_eos=False)
    kv_ref, q_ref = reference(model, b)
    kv_ctx, q_ctx = contexts(server, "shared-model")
    kv, q = kv_ctx.retrieve(b), q_ctx.retrieve(b)
    assert kv is not None and q is not None and q.shape[2] == 4 * CHUNK
    torch.testing.assert_close(kv, kv_ref[:, :, : 4 * CHUNK], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, q_ref[:, :, : 4 * CHUNK], atol=1e-5, rtol=1e-5)
    kv_ctx.close()
    q_ctx.close()


def test_kv_prefix_without_queries_stores_kv_only(model: Transformer, server: ServerHandle) -> None:
    """After a modify the kept tokens have KV but no queries: the next prompt stores KV only
    rather than queries with a hole."""
    prefix = tokens(2 * CHUNK, seed=23)
    longer = prefix + tokens(CHUNK + 2, seed=24)
    kv_only = ServerConnector(server.url, server.http_url, "hole-model", transfer_query=False)
    with Engine(model, num_blocks=16, connector=kv_only) as eng:
        eng.generate([*prefix, 7], {**GREEDY, "max_tokens": 1})
    kv_only.close()
    conn = ServerConnector(
        server.url, server.http_url, "hole-model", queries=QueryCapture(QueryNeed.FULL)
    )
    with Engine(model, num_blocks=16, connector=conn) as eng:
        eng.generate(longer, {**GREEDY, "max_tokens": 2})
        st = eng.stats()
    assert conn.transfer_query
    assert st.tokens_loaded == 2 * CHUNK and st.kv_tokens_stored == 3 * CHUNK
    assert st.query_tokens_stored == 0
    assert conn.lookup(longer) == 3 * CHUNK and conn.lookup_queries(longer) == 0
    conn.close()


def test_eight_concurrent_requests_store_their_own_kv_and_queries(
    model: Transformer, server: ServerHandle
) -> None:
    """The upstream bug: queries attributed by batch position. Here every request's stored
    queries and KV equal those of the same request run alone."""
    common = tokens(CHUNK, seed=99)  # half of the prompts share their first chunk
    prompts = [
        (common if i % 2 else []) + tokens(CHUNK * (2 + i % 3) + i, seed=100 + i) for i in range(8)
    ]
    conn = ServerConnector(
        server.url, server.http_url, "conc-model", queries=QueryCapture(QueryNeed.FULL)
    )
    # small prefill chunks and a budget for ~5 requests: prefill chunks of different requests
    # share steps with each other and with decodes, and some requests wait for admission.
    eng = Engine(model, num_blocks=24, block_size=CHUNK, max_prefill_tokens=40, connector=conn)
    outs: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        try:
            barrier.wait()
            outs[i] = eng.generate(prompts[i], {**GREEDY, "max_tokens": 8})
        except BaseException as exc:
            errors.append(exc)

    with eng:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        st = eng.stats()
    assert not errors, errors
    assert 1 < st.peak_running < 8
    kv_ctx, q_ctx = contexts(server, "conc-model")
    for i, p in enumerate(prompts):
        aligned = len(p) // CHUNK * CHUNK
        kv_ref, q_ref = reference(model, p)
        kv, q = kv_ctx.retrieve(p), q_ctx.retrieve(p)
        assert kv is not None and q is not None, f"request {i} not stored"
        assert kv.shape[2] == q.shape[2] == aligned
        torch.testing.assert_close(kv, kv_ref[:, :, :aligned], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q, q_ref[:, :, :aligned], atol=1e-5, rtol=1e-5)
        assert outs[i] == generate(model, p, 8, stop_at_eos=False)
        # Each request's query window (prompt and decode rows) is its own, too.
        window = retrieve_window(q_ctx, p + outs[i])
        assert window is not None, f"request {i} has no window"
        _, q_all = reference(model, p + outs[i][:-1])
        rows = q_all[:, :, window.positions]
        torch.testing.assert_close(window.queries, rows, atol=1e-5, rtol=1e-5)
    kv_ctx.close()
    q_ctx.close()
    conn.close()


def test_window_mode_stores_the_last_rows_and_a_strided_sample_only(
    model: Transformer, server: ServerHandle
) -> None:
    """The lean mode: no query chunks, one window per call keyed by prompt + generated tokens,
    holding the rows of the last W computed positions (decode steps included) and of every
    S-th position, with their attention log-normalisers over every key they saw."""
    cfg = model.config
    prompt = tokens(5 * CHUNK + 5, seed=30)  # 85 tokens
    conn = ServerConnector(
        server.url, server.http_url, "window-model", queries=QueryCapture(QueryNeed.WINDOW, 8, 32)
    )
    with Engine(model, num_blocks=16, connector=conn, max_prefill_tokens=40) as eng:
        out = eng.generate(prompt, {**GREEDY, "max_tokens": 4})
        st = eng.stats()
    _, q_ctx = contexts(server, "window-model")
    assert conn.query_capture == "window" and conn.lookup_queries(prompt) == 0
    assert st.query_tokens_stored == 0 and st.kv_tokens_stored == 5 * CHUNK
    assert retrieve_window(q_ctx, prompt) is None  # keyed by every token of the call
    window = retrieve_window(q_ctx, prompt + out)
    assert window is not None and window.lse is not None
    computed = len(prompt) + len(out) - 1  # the last generated token was never fed back
    assert window.positions.tolist() == [0, 32, 64, *range(computed - 8, computed)]
    assert st.query_rows_stored == 11
    row = cfg.num_layers * (cfg.q_dim * 4 + cfg.num_heads * 4)  # float32 queries + lse
    assert st.query_bytes_stored == 11 * row
    seq = prompt + out[:-1]
    _, q_ref = reference(model, seq)
    torch.testing.assert_close(window.queries, q_ref[:, :, window.positions], atol=1e-5, rtol=1e-5)
    assert_lse(model, seq, window.positions, window.lse)
    q_ctx.close()
    conn.close()


def assert_lse(
    model: Transformer, seq: list[int], positions: torch.Tensor, lse: torch.Tensor
) -> None:
    """``lse [1, L, R, Hq]`` is the log-sum-exp of each row's causal logits over ``seq``."""
    cfg = model.config
    group = cfg.num_heads // cfg.num_kv_heads
    kv_ref, q_ref = reference(model, seq)
    n = len(seq)
    causal = torch.arange(n)[None, :] > torch.arange(n)[:, None]
    for layer in range(cfg.num_layers):
        qh = q_ref[0, layer].view(n, cfg.num_heads, cfg.head_dim)
        kh = kv_ref[0, layer].view(n, cfg.num_kv_heads, cfg.head_dim)
        logits = torch.einsum("qhd,khd->hqk", qh, kh.repeat_interleave(group, dim=1))
        logits = (logits * cfg.head_dim**-0.5).masked_fill(causal, -torch.inf)
        ref = torch.logsumexp(logits, dim=-1)[:, positions].T
        torch.testing.assert_close(lse[0, layer], ref, atol=1e-4, rtol=1e-5)


def test_requests_ending_together_each_store_their_own_window(
    model: Transformer, server: ServerHandle
) -> None:
    """Prompts of one length with one token budget, submitted together, end in the same steps;
    their windows are finalised in one batched call, and each holds its own rows and
    log-normalisers (as for a request alone)."""
    prompts = [tokens(3 * CHUNK + 3, seed=40 + i) for i in range(4)]
    conn = ServerConnector(
        server.url,
        server.http_url,
        "window-batch",
        queries=QueryCapture(QueryNeed.WINDOW, window=6, stride=16),
    )
    outs: list[list[int]] = [[] for _ in prompts]
    barrier = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        barrier.wait()
        outs[i] = eng.generate(prompts[i], {**GREEDY, "max_tokens": 5})

    with Engine(model, num_blocks=32, connector=conn, max_prefill_tokens=512) as eng:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        st = eng.stats()
    assert st.requests_finished == len(prompts)
    _, q_ctx = contexts(server, "window-batch")
    for p, out in zip(prompts, outs, strict=True):
        assert len(out) == 5
        window = retrieve_window(q_ctx, p + out)
        assert window is not None and window.lse is not None
        seq = p + out[:-1]
        _, q_ref = reference(model, seq)
        torch.testing.assert_close(
            window.queries, q_ref[:, :, window.positions], atol=1e-5, rtol=1e-5
        )
        assert_lse(model, seq, window.positions, window.lse)
    q_ctx.close()
    conn.close()


def test_server_without_transfer_query(model: Transformer) -> None:
    with spawn_server(chunk_size=CHUNK) as srv:
        with pytest.raises(SDKError, match="does not enable"):
            ServerConnector(srv.url, srv.http_url, "m", transfer_query=True).bind(
                model.config, torch.float32
            )
        conn = ServerConnector(srv.url, srv.http_url, "m")
        with Engine(model, num_blocks=8, connector=conn) as eng:
            eng.generate(tokens(2 * CHUNK + 1, seed=5), {**GREEDY, "max_tokens": 2})
            st = eng.stats()
        assert not conn.transfer_query
        assert st.kv_tokens_stored == 2 * CHUNK and st.query_tokens_stored == 0
        conn.close()


def test_bf16_model_stores_bf16(server: ServerHandle) -> None:
    cfg = preset_config("tiny")
    m16 = Transformer.random(cfg, seed=0, dtype=torch.bfloat16)
    prompt = tokens(2 * CHUNK + 3, seed=6)
    conn = ServerConnector(server.url, server.http_url, "bf16-model")
    with Engine(m16, num_blocks=8, connector=conn) as eng:
        a = eng.generate(prompt, {**GREEDY, "max_tokens": 4})
        b = eng.generate(prompt, {**GREEDY, "max_tokens": 4})  # from the loaded prefix
        assert eng.stats().tokens_loaded == 2 * CHUNK
    kv = conn.load(prompt)
    assert kv is not None and kv.dtype == torch.bfloat16
    assert a == b
    conn.close()


def test_unreachable_server_is_a_clear_error(model: Transformer) -> None:
    conn = ServerConnector("tcp://127.0.0.1:9", "http://127.0.0.1:9", "m", timeout=2)
    with pytest.raises(SDKError, match="config"):
        Engine(model, num_blocks=8, connector=conn)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefix_staged_on_a_load_thread_under_cuda_graphs(server: ServerHandle) -> None:
    """With CUDA graphs the load thread moves the prefix to the GPU on its own stream and the
    loop scatters it into the blocks: the same greedy tokens as computing the whole prompt."""
    gpu_model = Transformer.random(preset_config("tiny"), seed=0).cuda()
    prompt = tokens(6 * CHUNK + 5, seed=12)
    conn = ServerConnector(server.url, server.http_url, "gpu-load-model")
    with Engine(gpu_model, num_blocks=32, connector=conn) as eng:
        assert eng.graphs is not None
        eng.generate(prompt[: 6 * CHUNK + 1], {**GREEDY, "max_tokens": 1})  # stores 6 chunks
        out = eng.generate(prompt, {**GREEDY, "max_tokens": 8})
        assert eng.stats().tokens_loaded == 6 * CHUNK
    with Engine(gpu_model, num_blocks=32) as plain:
        assert out == plain.generate(prompt, {**GREEDY, "max_tokens": 8})
    conn.close()


def test_a_window_capture_copies_the_window_rows_only_once(
    model: Transformer, server: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The capture's work in a chunked prefill (issue 31: a query engine's prefill must cost
    the window's bytes, not the prompt's): the chunks before the window capture no row, each
    layer keeps only the window's rows of the chunks holding it, the window copies each row once,
    and the request's finalised window reaches the host in one synchronisation."""
    import kvdrop_engine.capture as capture_mod
    import kvdrop_engine.paged as paged_mod
    import kvdrop_engine.runner as runner_mod

    window, chunk = 8, 12
    prompt = tokens(5 * CHUNK + 5, seed=50)  # 85 tokens: 8 chunks of 12 (the last 1)
    seen: dict[str, list[int]] = {"added": [], "layer_rows": [], "syncs": []}
    add, call, to_host_all = (
        capture_mod.WindowCapture.add,
        paged_mod.PagedAttention.__call__,
        runner_mod.to_host_all,
    )

    def counted_add(self: object, positions: list[int], rows: torch.Tensor) -> None:
        seen["added"].append(int(rows.shape[1]))
        add(self, positions, rows)  # type: ignore[arg-type]

    def counted_call(self: PagedAttention, *args: torch.Tensor) -> torch.Tensor:
        index = self._capture_index
        seen["layer_rows"].append(0 if index is None else int(index.numel()))
        return call(self, *args)

    def counted_sync(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seen["syncs"].append(len(tensors))
        return to_host_all(*tensors)

    monkeypatch.setattr(capture_mod.WindowCapture, "add", counted_add)
    monkeypatch.setattr(paged_mod.PagedAttention, "__call__", counted_call)
    monkeypatch.setattr(runner_mod, "to_host_all", counted_sync)
    conn = ServerConnector(
        server.url,
        server.http_url,
        "window-work",
        queries=QueryCapture(QueryNeed.WINDOW, window, 0),
    )
    with Engine(model, num_blocks=16, connector=conn, max_prefill_tokens=chunk) as eng:
        out = eng.generate(prompt, {**GREEDY, "max_tokens": 1})
        st = eng.stats()
    layers = model.config.num_layers
    # The window (positions 77..84) spans the last two chunks (72..83 and 84): 7 rows, then 1.
    assert seen["layer_rows"] == [0] * 6 * layers + [7] * layers + [1] * layers
    assert seen["added"] == [7, 1] and sum(seen["added"]) == window
    assert seen["syncs"] == [3]  # positions, queries, lse: one call, one synchronisation
    assert st.query_rows_stored == window and st.query_tokens_stored == 0
    # The stores ran on the store threads, each kind on its own counter.
    assert st.kv_store_seconds > 0 and st.window_store_seconds > 0
    assert st.scores_store_seconds == 0
    _, q_ctx = contexts(server, "window-work")
    stored = retrieve_window(q_ctx, prompt + out)
    assert stored is not None and stored.positions.tolist() == list(range(77, 85))
    q_ctx.close()
    conn.close()
