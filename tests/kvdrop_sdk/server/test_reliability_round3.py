"""Round 3 (issue 28): what one client can cost the others -- HTTP limits, leases, windows,
quarantine and what a policy's output or a client's scores may contain.

Every test talks to a real server (subprocess or in-process ``Server``) on 127.0.0.1 or to the
real ``ChunkStore``/``WindowStore``; each failed on the code before the fix.
"""

from __future__ import annotations

import json
import logging
import mmap
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch

import kvdrop_sdk as sdk
from kvdrop_sdk import CacheKind, CacheLayout
from kvdrop_sdk.context import connect
from kvdrop_sdk.errors import PartialStoreError, SDKError
from kvdrop_sdk.hashing import encode_tokens
from kvdrop_sdk.protocol import RpcClient, RpcError
from kvdrop_sdk.server.app import Server
from kvdrop_sdk.server.config import ServerConfig
from kvdrop_sdk.server.pool import shm_path
from kvdrop_sdk.testing.server import ServerHandle, spawn_server, wait_until
from kvdrop_sdk.window import TokenScores, retrieve_scores, store_scores

pytestmark = pytest.mark.timeout(120)


def http_exchange(port: int, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` raw; the status and body of the answer (read until the server closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


@pytest.fixture
def in_process() -> Iterator[Server]:
    server = Server(
        ServerConfig(
            port=0,
            http_port=0,
            l1_size_gb=0.01,
            http_timeout_s=1.0,
            http_max_connections=3,
            max_request_bytes=1000,
        )
    ).start()
    try:
        yield server
    finally:
        server.stop()


# -- A/E/G: the cache server's HTTP endpoint -------------------------------------------------------
def test_cache_server_refuses_a_large_body_with_413_before_reading_it() -> None:
    with spawn_server(shm_name=None, l1_size_gb=0.01, max_request_bytes=1000) as srv:
        status, body = http_exchange(
            srv.http_port, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
        )
        assert status == 413
        assert "over the limit of 1000" in json.loads(body)["error"]
        assert srv.status()["requests"] >= 0  # still up
        config = json.loads(http_exchange(srv.http_port, b"GET /config HTTP/1.0\r\n\r\n")[1])
        assert config["max_request_bytes"] == 1000


def test_cache_server_closes_a_trickled_request_at_its_deadline(in_process: Server) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", in_process.http_port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        closed = None
        while closed is None and time.monotonic() - started < 30:
            if select.select([sock], [], [], 0.25)[0]:
                try:
                    if sock.recv(65536) == b"":
                        closed = time.monotonic() - started
                except ConnectionResetError:
                    closed = time.monotonic() - started
            else:
                try:
                    sock.sendall(b"a")  # a byte every 0.25 s: each read finishes in time
                except (BrokenPipeError, ConnectionResetError):
                    closed = time.monotonic() - started
    assert closed is not None and closed < 15, closed  # deadline 1 s (http_timeout_s)


def test_cache_server_bounds_open_connections(in_process: Server) -> None:
    port = in_process.http_port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
    try:
        httpd = in_process._http
        assert httpd is not None
        assert wait_until(lambda: httpd.open_connections == 3, 10)
        status, body = http_exchange(port, b"GET /health HTTP/1.0\r\n\r\n")
        assert status == 503
        assert "too many open connections (limit 3)" in json.loads(body)["error"]
    finally:
        for sock in idle:
            sock.close()
    assert wait_until(lambda: http_exchange(port, b"GET /health HTTP/1.0\r\n\r\n")[0] == 200, 10)


def test_cache_server_log_fields_are_escaped_and_capped(
    in_process: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvdrop_sdk.server")
    path = "/\x1b[2J\x1b[31mforged\x07\x08" + "p" * 60_000
    status, body = http_exchange(
        in_process.http_port, f"GET {path} HTTP/1.0\r\n\r\n".encode("latin-1")
    )
    assert status == 404
    assert len(body) < 2000  # the 404 names the path, capped
    assert wait_until(lambda: any("forged" in r.getMessage() for r in caplog.records), 10)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvdrop_sdk.server"]
    for line in lines:
        assert not any(c in line for c in "\x1b\x07\x08"), repr(line[:200])
        assert len(line) < 1000, len(line)


# -- B: crashed and stalled writers ---------------------------------------------------------------
CHUNK = 256
LAYOUT = CacheLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.float32)
CHUNK_BYTES = LAYOUT.nbytes(CacheKind.KV, CHUNK)  # 128 KiB
POOL_GB = 4 * CHUNK_BYTES / 1024**3  # 4 chunks


def toks(i: int, n: int) -> list[int]:
    return list(range(100_000 * (i + 1), 100_000 * (i + 1) + n))


def kv_for(i: int, n: int) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(CacheKind.KV, n), generator=torch.Generator().manual_seed(i))


def fields(model: str) -> dict[str, Any]:
    return {"model": model, "kind": "kv", "salt": ""}


_HOLDER = """
import sys, time
from kvdrop_sdk.hashing import encode_tokens
from kvdrop_sdk.protocol import RpcClient
rpc = RpcClient(sys.argv[1], 10)
head = {"model": "w", "kind": "kv", "salt": ""}
rpc.call("register", {**head, "layout": %r})
res, _ = rpc.call("reserve", {**head, "lease_s": 600}, [encode_tokens(list(range(4 * 256)))])
print(len(res["offsets"]), flush=True)
time.sleep(600)
"""


def test_a_sigkilled_writers_reservations_come_back_when_its_connection_closes() -> None:
    with spawn_server(l1_size_gb=POOL_GB, chunk_size=CHUNK, max_lease_s=600) as srv:
        script = _HOLDER % (LAYOUT.to_json(),)
        holder = subprocess.Popen(
            [sys.executable, "-c", script, srv.url], stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "4"
            assert srv.status()["reserved_objects"] == 4  # the whole pool, for 600 s
            holder.kill()
            holder.wait(10)
            assert wait_until(lambda: srv.status()["reserved_objects"] == 0, 10)
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait(10)
        with sdk.kvcache.connect(srv.url, srv.http_url, "w", 10, transport="socket") as good:
            kv = kv_for(1, 4 * CHUNK)
            assert good.store(kv, toks(1, 4 * CHUNK))  # the pool-sized store fits at once
            assert torch.equal(good.retrieve(toks(1, 4 * CHUNK)), kv)
        assert srv.status()["quarantined_bytes"] == 0


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_a_writer_stalled_past_lease_and_quarantine_never_gives_foreign_bytes(
    transport: str,
) -> None:
    with spawn_server(l1_size_gb=POOL_GB, chunk_size=CHUNK, quarantine_s=1) as srv:
        with RpcClient(srv.url, 10) as stalled:  # stays connected: not known gone
            stalled.call("register", {**fields("s"), "layout": LAYOUT.to_json()})
            res, _ = stalled.call(
                "reserve", {**fields("s"), "lease_s": 0.2}, [encode_tokens(toks(0, CHUNK))]
            )
            (offset,) = res["offsets"]
            assert wait_until(lambda: srv.status()["suspect_reservations"] == 1, 15)
            good = sdk.kvcache.connect(srv.url, srv.http_url, "s", 10, transport=transport)
            try:
                kv = kv_for(5, 4 * CHUNK)
                assert good.store(kv, toks(5, 4 * CHUNK))  # the whole pool: the slot is reused
                assert srv.status()["verified_chunks"] == 1
                assert torch.equal(good.retrieve(toks(5, 4 * CHUNK)), kv)
                assert srv.shm_name is not None
                with open(shm_path(srv.shm_name), "r+b") as fh:  # the stalled writer wakes up
                    mm = mmap.mmap(fh.fileno(), 0)
                    mm[offset : offset + CHUNK_BYTES] = b"\xff" * CHUNK_BYTES
                    mm.close()
                got = good.retrieve(toks(5, 4 * CHUNK))
                n = 0 if got is None else got.shape[2]
                assert n < 4 * CHUNK  # the overwritten chunk is a miss...
                if got is not None:  # ...and everything returned is the good client's own
                    assert torch.equal(got, kv[:, :, :n])
                assert srv.status()["corrupted_chunks"] == 1
            finally:
                good.close()


def test_lease_and_quarantine_flags_are_checked_and_reported() -> None:
    with pytest.raises(ValueError, match=r"--quarantine-s .*0 would hand them on"):
        ServerConfig(quarantine_s=0)
    with spawn_server(l1_size_gb=POOL_GB, chunk_size=CHUNK, max_lease_s=2) as srv:
        config = requests.get(f"{srv.http_url}/config", timeout=10).json()
        assert (config["max_lease_s"], config["quarantine_s"]) == (2.0, 600.0)
        assert config["max_client_leases"] == 1024
        with RpcClient(srv.url, 10) as rpc:
            rpc.call("register", {**fields("g"), "layout": LAYOUT.to_json()})
            res, _ = rpc.call(
                "reserve", {**fields("g"), "lease_s": 100}, [encode_tokens(toks(0, CHUNK))]
            )
            assert res["lease_s"] == 2.0  # what was granted, not what was asked
            rpc.call("commit", {"lease": res["lease"]})
            head = {**fields("g"), "lease_s": 1}
            pin, _ = rpc.call("pin", head, [encode_tokens(toks(0, CHUNK))])
            assert pin["lease_s"] == 1.0


def test_a_store_refused_for_quarantined_slots_says_so() -> None:
    with spawn_server(l1_size_gb=POOL_GB, chunk_size=CHUNK) as srv:
        with RpcClient(srv.url, 10) as stalled:
            stalled.call("register", {**fields("q"), "layout": LAYOUT.to_json()})
            stalled.call(
                "reserve", {**fields("q"), "lease_s": 0.2}, [encode_tokens(toks(0, CHUNK))]
            )
            assert wait_until(lambda: srv.status()["quarantined_bytes"] == CHUNK_BYTES, 15)
            with sdk.kvcache.connect(srv.url, srv.http_url, "q", 10, transport="socket") as good:
                with pytest.raises(PartialStoreError, match=f"{CHUNK_BYTES} quarantined"):
                    good.store(kv_for(2, 4 * CHUNK), toks(2, 4 * CHUNK))


# -- H: token scores must be finite --------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_token_scores_are_refused_by_client_and_server(
    kv_server: ServerHandle, model_name: str, bad: float
) -> None:
    q_layout = CacheLayout(num_layers=2, num_heads=4, head_dim=8, dtype=torch.bfloat16)
    tokens = list(range(300, 340))
    scores = torch.rand(2, 2, 32, generator=torch.Generator().manual_seed(2))
    scores[1, 0, 7] = bad
    with connect(
        CacheKind.QUERY, kv_server.url, kv_server.http_url, model_name, layout=q_layout
    ) as ctx:
        with pytest.raises(SDKError, match="token scores must be finite; 1 of 128"):
            store_scores(ctx, tokens, TokenScores(scores), "h")
        # A client that skips the SDK's check meets the server's.
        with RpcClient(kv_server.url, 10) as rpc:
            head = {
                "model": ctx.server_model_name,
                "kind": "query",
                "salt": "h",
                "record": "scores",
                "rows": 32,
                "heads": 2,
            }
            with pytest.raises(RpcError, match="scores must be finite; 1 of 128") as info:
                rpc.call("put_window", head, [encode_tokens(tokens), scores.numpy().tobytes()])
            assert info.value.code == "bad_data"
        assert retrieve_scores(ctx, tokens, "h") is None  # nothing was stored
