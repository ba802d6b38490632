"""Context/connect against a real server subprocess: round trips, prefix rules, errors, threads."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import kvdrop_sdk as sdk
from kvdrop_sdk import CacheKind, CacheLayout, SDKError
from kvdrop_sdk.testing.server import ServerHandle, spawn_server

CHUNK = 256
LAYOUT = CacheLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.bfloat16)
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def make(kind: CacheKind, layout: CacheLayout, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Random tensor of ``kind``'s shape, with NaN/inf/-0.0 sprinkled in to check bits."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(layout.shape(kind, num_tokens), generator=g).to(layout.dtype)
    flat = t.view(-1)
    flat[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(layout.dtype)
    return t


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included)."""
    return a.shape == b.shape and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def tokens_for(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def kv_ctx(kv_server: ServerHandle, model_name: str) -> Iterator[sdk.Context]:
    with sdk.kvcache.connect(kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT) as c:
        yield c


@pytest.mark.parametrize("transport", ["shm", "socket"])
@pytest.mark.parametrize("kind", [CacheKind.KV, CacheKind.QUERY])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bitwise(
    kv_server: ServerHandle, model_name: str, transport: str, kind: CacheKind, dtype: torch.dtype
) -> None:
    layout = CacheLayout(3, 4 if kind is CacheKind.QUERY else 2, 8, dtype)
    with sdk.connect(
        kind, kv_server.url, kv_server.http_url, model_name, 30, layout=layout, transport=transport
    ) as ctx:
        assert ctx.transfer_ctx.mode == transport
        assert ctx.kind is kind
        assert ctx.layout == layout
        data = make(kind, layout, 700, seed=1)
        tokens = tokens_for(700, 5)
        assert ctx.store(data, tokens) is True
        out = ctx.retrieve(tokens)
        assert out is not None
        assert (
            out.shape
            == layout.shape(kind, 512)
            == (
                (2 if kind is CacheKind.KV else 1),
                3,
                512,
                8 * (4 if kind is CacheKind.QUERY else 2),
            )
        )
        assert out.is_contiguous() and out.device.type == "cpu"
        assert bits_equal(out, data[:, :, :512])
        out.add_(1)  # caller owns the tensor: editing it must not change the cache
        again = ctx.retrieve(tokens)
        assert again is not None and bits_equal(again, data[:, :, :512])


def test_query_kind_uses_its_own_model_name_and_layout(
    kv_server: ServerHandle, model_name: str
) -> None:
    qlay = CacheLayout(2, 8, 16, torch.float16)
    with sdk.qcache.connect(kv_server.url, kv_server.http_url, model_name, 30, layout=qlay) as q:
        assert q.server_model_name == model_name + "##query"
        assert q.model_name == model_name
        with sdk.kvcache.connect(
            kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT
        ) as kv:
            tokens = tokens_for(256)
            assert q.store(make(CacheKind.QUERY, qlay, 256), tokens)
            assert kv.retrieve(tokens) is None  # same tokens, other kind: separate cache
            assert q.retrieve(tokens).shape == (1, 2, 256, 128)
    layouts = {(r["model"], r["kind"]): r["layout"] for r in kv_server.status()["layouts"]}
    assert layouts[(model_name + "##query", "query")] == qlay.to_json()
    assert layouts[(model_name, "kv")] == LAYOUT.to_json()


def test_prefix_rules(kv_ctx: sdk.Context) -> None:
    prompt = tokens_for(4 * CHUNK, 1000)
    kv = make(CacheKind.KV, LAYOUT, 4 * CHUNK, seed=2)
    assert kv_ctx.store(kv, prompt)
    assert kv_ctx.lookup(prompt) == 4 * CHUNK
    # shares the first 2 of 4 chunks
    other = prompt[: 2 * CHUNK] + tokens_for(2 * CHUNK, 90_000)
    out = kv_ctx.retrieve(other)
    assert out is not None and out.shape[2] == 512
    assert bits_equal(out, kv[:, :, :512])
    assert kv_ctx.lookup(other) == 512
    # 300 tokens of the prompt retrieve one chunk
    out = kv_ctx.retrieve(prompt[:300])
    assert out is not None and out.shape[2] == 256 and bits_equal(out, kv[:, :, :256])
    # a prefix shorter than a chunk, a different first token, an empty prompt: misses
    assert kv_ctx.retrieve(prompt[:255]) is None
    assert kv_ctx.retrieve([7, *prompt[1:]]) is None
    assert kv_ctx.retrieve([]) is None
    assert kv_ctx.lookup([7, *prompt[1:]]) == 0
    # a changed token in chunk 3 changes the keys of chunk 3 and after only
    changed = list(prompt)
    changed[2 * CHUNK + 10] += 1
    assert kv_ctx.lookup(changed) == 512


def test_store_keeps_whole_chunks_only(kv_ctx: sdk.Context) -> None:
    tokens = tokens_for(600, 7)
    kv = make(CacheKind.KV, LAYOUT, 600, seed=3)
    assert kv_ctx.store(kv, tokens)
    assert kv_ctx.lookup(tokens) == 512
    assert kv_ctx.store(kv[:, :, :100], tokens[:100]) is False  # no whole chunk
    assert kv_ctx.lookup(tokens[:100]) == 0


def test_store_again_returns_false_and_first_copy_wins(kv_ctx: sdk.Context) -> None:
    tokens = tokens_for(512, 3)
    first = make(CacheKind.KV, LAYOUT, 512, seed=4)
    second = make(CacheKind.KV, LAYOUT, 512, seed=5)
    assert kv_ctx.store(first, tokens) is True
    assert kv_ctx.store(second, tokens) is False
    assert bits_equal(kv_ctx.retrieve(tokens), first)
    # one new chunk after two cached ones: stored (True), old chunks unchanged
    longer = tokens + tokens_for(256, 50_000)
    third = make(CacheKind.KV, LAYOUT, 768, seed=6)
    assert kv_ctx.store(third, longer) is True
    out = kv_ctx.retrieve(longer)
    assert bits_equal(out[:, :, :512], first)
    assert bits_equal(out[:, :, 512:], third[:, :, 512:])


def test_cache_salt_isolates(kv_ctx: sdk.Context) -> None:
    tokens = tokens_for(256, 11)
    kv = make(CacheKind.KV, LAYOUT, 256, seed=7)
    assert kv_ctx.store(kv, tokens, cache_salt="alice")
    assert kv_ctx.retrieve(tokens) is None
    assert kv_ctx.retrieve(tokens, cache_salt="bob") is None
    assert kv_ctx.lookup(tokens, cache_salt="bob") == 0
    assert bits_equal(kv_ctx.retrieve(tokens, cache_salt="alice"), kv)
    other = make(CacheKind.KV, LAYOUT, 256, seed=8)
    assert kv_ctx.store(other, tokens, cache_salt="bob") is True
    assert bits_equal(kv_ctx.retrieve(tokens, cache_salt="bob"), other)


def test_models_are_isolated(kv_server: ServerHandle, model_name: str) -> None:
    with (
        sdk.kvcache.connect(
            kv_server.url, kv_server.http_url, model_name + "-a", 30, layout=LAYOUT
        ) as a,
        sdk.kvcache.connect(
            kv_server.url, kv_server.http_url, model_name + "-b", 30, layout=LAYOUT
        ) as b,
    ):
        tokens = tokens_for(256)
        assert a.store(make(CacheKind.KV, LAYOUT, 256), tokens)
        assert b.retrieve(tokens) is None


def test_token_tensor_and_range_accepted(kv_ctx: sdk.Context) -> None:
    kv = make(CacheKind.KV, LAYOUT, 256, seed=9)
    assert kv_ctx.store(kv, torch.arange(256) + 77)
    assert bits_equal(kv_ctx.retrieve(range(77, 77 + 256)), kv)


def test_shape_and_token_errors(kv_ctx: sdk.Context) -> None:
    kv = make(CacheKind.KV, LAYOUT, 256)
    with pytest.raises(SDKError, match=r"len\(tokens\) == kv.shape\[2\]"):
        kv_ctx.store(kv, tokens_for(255))
    with pytest.raises(SDKError, match=r"expected \(2, 2, 256, 32\)"):
        kv_ctx.store(torch.zeros(2, 3, 256, 32, dtype=torch.bfloat16), tokens_for(256))
    with pytest.raises(SDKError, match=r"expected \(2, 2, 256, 32\)"):
        kv_ctx.store(torch.zeros(1, 2, 256, 32, dtype=torch.bfloat16), tokens_for(256))
    with pytest.raises(SDKError, match=r"dtype torch.float32.*bfloat16"):
        kv_ctx.store(kv.float(), tokens_for(256))
    with pytest.raises(SDKError, match=r"must be a torch\.Tensor"):
        kv_ctx.store([[1.0]], tokens_for(256))  # type: ignore[arg-type]
    with pytest.raises(SDKError, match="non-negative"):
        kv_ctx.retrieve([-1] * 256)
    with pytest.raises(SDKError, match="token ids"):
        kv_ctx.retrieve(["a"] * 256)  # type: ignore[list-item]
    with pytest.raises(SDKError, match="cache_salt must be a string"):
        kv_ctx.retrieve(tokens_for(256), cache_salt=3)  # type: ignore[arg-type]
    assert kv_ctx.lookup(tokens_for(256)) == 0  # nothing was stored by the failed calls


def test_non_contiguous_input_is_stored_correctly(kv_ctx: sdk.Context) -> None:
    base = make(CacheKind.KV, LAYOUT, 300, seed=12)
    kv = base[:, :, 20:276]  # a strided view
    tokens = tokens_for(256, 400)
    assert kv_ctx.store(kv, tokens)
    assert bits_equal(kv_ctx.retrieve(tokens), kv.contiguous())


def test_unregistered_model_says_how_to_register(kv_server: ServerHandle, model_name: str) -> None:
    with pytest.raises(SDKError, match=r"no layout registered.*layout=CacheLayout"):
        sdk.kvcache.connect(kv_server.url, kv_server.http_url, model_name, 30)
    with pytest.raises(SDKError, match=r"Context takes \(url, http_url, model_name, kind="):
        sdk.Context(CacheKind.KV, kv_server.url, kv_server.http_url, model_name, 30)  # type: ignore[arg-type]
    ctx = sdk.Context(kv_server.url, kv_server.http_url, model_name, CacheKind.KV, 30)
    with ctx:
        with pytest.raises(SDKError, match="register_caches"):
            ctx.retrieve(tokens_for(256))
        with pytest.raises(SDKError, match="no layout registered"):
            ctx.register_caches()


def test_layout_registered_once_then_read_by_other_contexts(
    kv_server: ServerHandle, model_name: str
) -> None:
    with sdk.kvcache.connect(kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT) as c:
        assert c.store(make(CacheKind.KV, LAYOUT, CHUNK), tokens_for(CHUNK))
    with sdk.connect("kv", kv_server.url, kv_server.http_url, model_name, 30) as ctx:
        assert ctx.layout == LAYOUT
    other = CacheLayout(2, 2, 16, torch.float16)
    # Chunks are stored under the layout: another one is refused (see docs/sdk/server.md).
    with pytest.raises(SDKError, match=r"registered with .* holds 1 chunk"):
        sdk.kvcache.connect(kv_server.url, kv_server.http_url, model_name, 30, layout=other)


def test_unknown_kind_and_bad_arguments(kv_server: ServerHandle) -> None:
    with pytest.raises(SDKError, match="unknown cache kind 'value'"):
        sdk.connect("value", kv_server.url, kv_server.http_url, "m", 30)
    with pytest.raises(ValueError, match="unknown cache kind 'value'"):  # as upstream's connect
        sdk.connect("value", kv_server.url, kv_server.http_url, "m", 30)
    with pytest.raises(SDKError, match="tcp://HOST:PORT"):
        sdk.connect("kv", "localhost:6555", kv_server.http_url, "m", 30)
    with pytest.raises(SDKError, match="http://HOST:PORT"):
        sdk.connect("kv", kv_server.url, "localhost:8080", "m", 30)
    with pytest.raises(SDKError, match="transport 'udp'"):
        sdk.connect("kv", kv_server.url, kv_server.http_url, "m", 30, transport="udp")
    with pytest.raises(SDKError, match="timeout"):
        sdk.connect("kv", kv_server.url, kv_server.http_url, "m", 0)


def test_query_kind_needs_transfer_query(socket_server: ServerHandle) -> None:
    with pytest.raises(SDKError, match="--enable transfer_query"):
        sdk.qcache.connect(socket_server.url, socket_server.http_url, "m", 30, layout=LAYOUT)


def test_socket_only_server(socket_server: ServerHandle, model_name: str) -> None:
    with pytest.raises(SDKError, match="without --shm-name"):
        sdk.kvcache.connect(
            socket_server.url,
            socket_server.http_url,
            model_name,
            30,
            layout=LAYOUT,
            transport="shm",
        )
    with sdk.kvcache.connect(
        socket_server.url, socket_server.http_url, model_name, 30, layout=LAYOUT
    ) as ctx:
        assert ctx.transfer_ctx.mode == "socket"
        kv = make(CacheKind.KV, LAYOUT, 512, seed=13)
        assert ctx.store(kv, tokens_for(512))
        assert bits_equal(ctx.retrieve(tokens_for(512)), kv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_down_fails_fast_with_hint() -> None:
    port, http_port = _free_port(), _free_port()
    t0 = time.monotonic()
    with pytest.raises(SDKError, match=rf"kvdrop server --port {port} --http-port {http_port}"):
        sdk.kvcache.connect(f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", "m", 2)
    assert time.monotonic() - t0 < 3


def test_server_dying_mid_session_fails_within_timeout(model_name: str) -> None:
    with spawn_server(shm_name=None, l1_size_gb=0.01, check_exit=False) as srv:
        ctx = sdk.kvcache.connect(srv.url, srv.http_url, model_name, 1.5, layout=LAYOUT)
        kv = make(CacheKind.KV, LAYOUT, 256)
        assert ctx.store(kv, tokens_for(256))
        srv.proc.kill()
        srv.proc.wait()
        for call in (
            lambda: ctx.retrieve(tokens_for(256)),
            lambda: ctx.store(kv, tokens_for(256, 9)),
        ):
            t0 = time.monotonic()
            with pytest.raises(SDKError, match=r"no reply .* within 1.5 s.*kvdrop server --port"):
                call()
            assert time.monotonic() - t0 < 3
        ctx.close()


def test_close_is_idempotent_and_final(kv_server: ServerHandle, model_name: str) -> None:
    ctx = sdk.kvcache.connect(kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT)
    ctx.close()
    ctx.close()
    with pytest.raises(SDKError, match="closed"):
        ctx.retrieve(tokens_for(256))
    with pytest.raises(SDKError, match="closed"):
        ctx.store(make(CacheKind.KV, LAYOUT, 256), tokens_for(256))


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_many_threads_share_one_context(
    kv_server: ServerHandle, model_name: str, transport: str
) -> None:
    n_threads, rounds = 8, 3
    errors: list[BaseException] = []
    with sdk.kvcache.connect(
        kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT, transport=transport
    ) as ctx:

        def worker(i: int) -> None:
            try:
                for r in range(rounds):
                    n = CHUNK * (1 + (i + r) % 3)
                    tokens = tokens_for(n, 1_000_000 * (i + 1) + 10_000 * r)
                    kv = make(CacheKind.KV, LAYOUT, n, seed=100 * i + r)
                    assert ctx.store(kv, tokens)
                    for _ in range(2):
                        out = ctx.retrieve(tokens)
                        assert out is not None and bits_equal(out, kv), f"thread {i} round {r}"
                        assert ctx.lookup(tokens) == n
            except BaseException as exc:  # collected and re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_many_contexts_in_threads(kv_server: ServerHandle, model_name: str) -> None:
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            transport = "shm" if i % 2 else "socket"
            with sdk.kvcache.connect(
                kv_server.url,
                kv_server.http_url,
                model_name,
                30,
                layout=LAYOUT,
                transport=transport,
            ) as ctx:
                tokens = tokens_for(512, 5_000_000 + 1000 * i)
                kv = make(CacheKind.KV, LAYOUT, 512, seed=i)
                assert ctx.store(kv, tokens)
                assert bits_equal(ctx.retrieve(tokens), kv)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_socket_store_split_into_pipelined_requests(
    kv_server: ServerHandle, model_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvdrop_sdk.transport.contiguous as contiguous

    monkeypatch.setattr(contiguous, "PUT_BATCH_BYTES", 1)  # one chunk per request
    with sdk.kvcache.connect(
        kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT, transport="socket"
    ) as ctx:
        tokens = tokens_for(5 * CHUNK + 17, 300)
        kv = make(CacheKind.KV, LAYOUT, len(tokens), seed=21)
        assert ctx.store(kv[:, :, : 2 * CHUNK], tokens[: 2 * CHUNK])
        before = kv_server.status()
        assert ctx.store(kv, tokens) is True
        after = kv_server.status()
        assert after["stores"] - before["stores"] == 3
        assert after["duplicate_chunks"] - before["duplicate_chunks"] == 2
        assert after["requests"] - before["requests"] >= 5  # one put per chunk
        assert bits_equal(ctx.retrieve(tokens), kv[:, :, : 5 * CHUNK])
        assert ctx.store(kv, tokens) is False


@pytest.mark.parametrize("transport", ["socket", "shm"])
def test_retrieve_copies_out_on_several_threads(
    kv_server: ServerHandle, model_name: str, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks copied out of frames / slots by the copy threads land where they belong."""
    from kvdrop_sdk.transport import buffers

    monkeypatch.setattr(buffers, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setenv("KVDROP_COPY_THREADS", "3")
    with sdk.kvcache.connect(
        kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT, transport=transport
    ) as ctx:
        tokens = tokens_for(7 * CHUNK, 900 + len(transport))
        kv = make(CacheKind.KV, LAYOUT, len(tokens), seed=23)
        assert ctx.store(kv, tokens)
        for _ in range(2):  # a fresh buffer, then a recycled one
            assert bits_equal(ctx.retrieve(tokens), kv)


def test_shm_retrieve_by_one_torch_gather(
    kv_server: ServerHandle, model_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVDROP_SHM_COPY=torch: the slots gathered by one index_select land where they belong."""
    monkeypatch.setenv("KVDROP_SHM_COPY", "torch")
    with sdk.kvcache.connect(
        kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT, transport="shm"
    ) as ctx:
        tokens = tokens_for(6 * CHUNK + 5, 1300)
        kv = make(CacheKind.KV, LAYOUT, len(tokens), seed=29)
        assert ctx.store(kv, tokens)
        assert bits_equal(ctx.retrieve(tokens), kv[:, :, : 6 * CHUNK])
        assert bits_equal(ctx.retrieve(tokens[: 3 * CHUNK]), kv[:, :, : 3 * CHUNK])


@pytest.mark.parametrize("streams", ["2", "3", "16"])
def test_socket_retrieve_split_into_ranges(
    kv_server: ServerHandle, model_name: str, streams: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large socket retrieve fetched as chunk ranges on several connections: the same
    tensor; a prefix shorter than the tokens asked for ends in the range where it ends."""
    import kvdrop_sdk.transport.contiguous as contiguous

    monkeypatch.setattr(contiguous, "SPLIT_GET_BYTES", 0)
    monkeypatch.setenv("KVDROP_SOCKET_STREAMS", streams)
    with sdk.kvcache.connect(
        kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT, transport="socket"
    ) as ctx:
        tokens = tokens_for(7 * CHUNK + 3, 1700 + int(streams))
        kv = make(CacheKind.KV, LAYOUT, len(tokens), seed=31)
        assert ctx.store(kv[:, :, : 5 * CHUNK], tokens[: 5 * CHUNK])
        assert bits_equal(ctx.retrieve(tokens[: 5 * CHUNK]), kv[:, :, : 5 * CHUNK])
        assert bits_equal(ctx.retrieve(tokens), kv[:, :, : 5 * CHUNK])  # 5 of 7 chunks cached
        assert ctx.retrieve(tokens_for(4 * CHUNK, 99_000)) is None
