"""The server under fuzzed messages and sustained load: clear errors, exact bytes, bounded memory.

The longer versions of these runs are ``benchmarks/soak.py``.
"""

from __future__ import annotations

import hashlib
import random
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import requests
import torch

import kvdrop_sdk as sdk
from kvdrop_sdk import BatchedStream, CacheKind, CacheLayout, create_request
from kvdrop_sdk.testing.fuzz import FuzzTarget, fuzz_messages, send_fuzz
from kvdrop_sdk.testing.server import ServerHandle, spawn_server
from kvdrop_sdk.testing.toy import ToyCall, ToyEngine, encode_rows, positions_of

pytestmark = pytest.mark.timeout(240)

CHUNK = 16
LAYOUT = CacheLayout(num_layers=2, num_heads=1, head_dim=8, dtype=torch.float32)
MESSAGES = 3000


def calls_for(engine: ToyEngine, prompt_prefix: Sequence[int]) -> list[ToyCall]:
    """The engine's recorded calls whose prompt starts with ``prompt_prefix`` (in call order)."""
    n = len(prompt_prefix)
    return [c for c in list(engine.calls) if c.prompt[:n] == list(prompt_prefix)]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerHandle]:
    with spawn_server(
        chunk_size=CHUNK, l1_size_gb=0.05, max_lease_s=2, enable=["transfer_query"]
    ) as srv:
        yield srv


def test_fuzzed_messages_get_clear_errors_and_change_no_stored_byte(
    fuzz_server: ServerHandle,
) -> None:
    srv = fuzz_server
    rng = torch.Generator().manual_seed(0)
    checked = []
    with sdk.kvcache.connect(srv.url, srv.http_url, "checked/m", 10, layout=LAYOUT) as ctx:
        for i in range(8):
            toks = list(range(1000 * i, 1000 * i + 4 * CHUNK))
            kv = torch.randn(LAYOUT.shape(CacheKind.KV, 4 * CHUNK), generator=rng)
            assert ctx.store(kv, toks)
            checked.append((toks, digest(kv)))
    with sdk.kvcache.connect(srv.url, srv.http_url, "fuzz/m", 10, layout=LAYOUT):
        pass
    before = srv.status()
    target = FuzzTarget("fuzz/m", LAYOUT, CHUNK)
    report = send_fuzz(srv.url, fuzz_messages(seed=1, count=MESSAGES, target=target))
    assert report.sent == MESSAGES
    assert report.no_reply == 0 and report.malformed_replies == 0, report
    assert report.ok + report.errors == MESSAGES
    assert report.errors > 0.8 * MESSAGES  # nearly all were refused...
    assert len(report.codes) >= 10  # ...for many different, named reasons
    assert "internal" not in report.codes, report.codes
    after = srv.status()
    assert after["errors"] - before["errors"] == report.errors
    assert srv.proc.poll() is None
    assert requests.get(f"{srv.http_url}/health", timeout=10).json()["status"] == "ok"
    for transport in ("shm", "socket"):
        with sdk.kvcache.connect(srv.url, srv.http_url, "checked/m", 10, transport=transport) as c:
            for toks, want in checked:
                got = c.retrieve(toks)
                assert got is not None and digest(got) == want


def _http_garbage(rng: random.Random) -> bytes:
    method = rng.choice([b"GET", b"POST", b"PUT", b"DELETE", b"\x00\xff", b"G" * 300])
    path = rng.choice([b"/", b"/status", b"/config", b"/health", b"/" + b"a" * 70_000, b"%%%"])
    head = method + b" " + path + b" HTTP/1.1\r\n"
    for _ in range(rng.randrange(4)):
        head += rng.choice([b"Content-Length: -1\r\n", b"X: " + b"y" * 9000 + b"\r\n", b"\r\n"])
    return head + b"\r\n" + bytes(rng.randrange(256) for _ in range(rng.randrange(64)))


def test_http_garbage_leaves_the_server_up(fuzz_server: ServerHandle) -> None:
    rng = random.Random(2)
    for _ in range(200):
        with socket.create_connection(("127.0.0.1", fuzz_server.http_port), timeout=10) as s:
            try:  # the server may answer and hang up before reading everything
                s.sendall(_http_garbage(rng))
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
            except OSError:
                pass
    assert requests.get(f"{fuzz_server.http_url}/health", timeout=10).json()["status"] == "ok"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return int(next(x for x in fh if x.startswith("VmRSS:")).split()[1]) * 1024


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_writes_of_three_times_the_pool_evict_and_read_back_exact_or_miss(transport: str) -> None:
    layout = CacheLayout(num_layers=4, num_heads=2, head_dim=32, dtype=torch.bfloat16)
    chunk_bytes = layout.nbytes(CacheKind.KV, CHUNK)  # 16 KiB
    slots = 256
    with spawn_server(chunk_size=CHUNK, l1_size_gb=slots * chunk_bytes / 1024**3) as srv:
        pool = srv.config["l1_bytes"]
        rss_before = _rss(srv.proc.pid)
        with sdk.kvcache.connect(
            srv.url, srv.http_url, "evict", 10, layout=layout, transport=transport
        ) as ctx:
            written: dict[int, tuple[list[int], torch.Tensor]] = {}
            for i in range(3 * slots // 4):  # 3x the pool, 4 chunks per request
                toks = list(range(10_000 * i, 10_000 * i + 4 * CHUNK))
                gen = torch.Generator().manual_seed(i)
                kv = torch.randn(layout.shape(CacheKind.KV, 4 * CHUNK), generator=gen)
                kv = kv.to(layout.dtype)
                assert ctx.store(kv, toks)
                written[i] = (toks, kv)
                if i % 16 == 15:  # read some back while writing: exact bytes or a miss
                    for j in random.Random(i).sample(sorted(written), 8):
                        toks_j, want = written[j]
                        got = ctx.retrieve(toks_j)
                        if got is not None:  # a prefix of whole chunks may have survived
                            assert torch.equal(bits(got), bits(want[:, :, : got.shape[2]]))
            hits = 0
            for toks, want in written.values():
                got = ctx.retrieve(toks)
                if got is not None:
                    assert torch.equal(bits(got), bits(want[:, :, : got.shape[2]]))
                    hits += got.shape[2] // CHUNK
            status = srv.status()
        assert status["evictions"] >= 2 * slots
        assert 0 < hits <= slots
        assert status["pool_bytes_used"] <= pool
        # What the server holds grows by the pool at most (plus socket and allocator slack).
        assert _rss(srv.proc.pid) - rss_before < pool + (64 << 20)


def test_64_concurrent_streams_each_read_their_own_kv_and_queries(kv_server: ServerHandle) -> None:
    """64 streams with distinct prompts prefill, edit and decode at once; the toy engine checks
    every cached element it reuses against its formula, and each edit sees only its own rows."""
    layout = CacheLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.float32)
    qlayout = CacheLayout(num_layers=2, num_heads=4, head_dim=8, dtype=torch.float32)
    engine = ToyEngine.connect(
        kv_server.url, kv_server.http_url, "streams64", layout, query_layout=qlayout, timeout=60
    )
    q_ctx = engine.q_ctx
    assert q_ctx is not None
    try:
        chunk = int(engine.kv_ctx.chunk_size)
        prompts = [[(131 * s + 7 * t) % 30_000 for t in range(3 * chunk + s)] for s in range(64)]
        batch = BatchedStream(max_concurrency=64, modify_concurrency=16)
        streams = [create_request([engine.kv_ctx, q_ctx], engine, p) for p in prompts]
        for s in streams:
            batch.add(s)
        batch.prefill()
        seen: dict[int, list[int]] = {}
        lock = threading.Lock()

        def edit(t: dict[CacheKind, torch.Tensor], toks: list[int]) -> Any:
            kv, q = t[CacheKind.KV], t[CacheKind.QUERY]
            assert torch.equal(kv, encode_rows(CacheKind.KV, toks, positions_of(kv), layout))
            assert torch.equal(q, encode_rows(CacheKind.QUERY, toks, positions_of(q), qlayout))
            keep = list(range(chunk)) + list(range(len(toks) - chunk, len(toks)))
            with lock:
                seen[toks[0]] = toks
            return kv[:, :, keep], [toks[i] for i in keep]

        batch.modify(edit)
        assert sorted(seen) == sorted(p[0] for p in prompts)
        for p in prompts:
            assert seen[p[0]] == p[: len(seen[p[0]])] and len(seen[p[0]]) % chunk == 0
        batch.decode({"max_tokens": 3})
        for s, p in zip(streams, prompts, strict=True):
            cached = len(seen[p[0]])
            kept = list(range(chunk)) + list(range(cached - chunk, cached))
            calls = calls_for(engine, s.tokens[: 2 * chunk])
            # Its decode reused exactly its own kept rows (first and last chunk of its prompt).
            assert calls and calls[-1].reused_positions == kept
    finally:
        engine.close()
