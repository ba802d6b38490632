"""The server process: HTTP, LRU eviction and pins, leases, malformed requests, signals, CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import requests
import torch
import zmq

import kvdrop_sdk as sdk
from kvdrop_sdk import CacheKind, CacheLayout, SDKError
from kvdrop_sdk.hashing import encode_tokens
from kvdrop_sdk.protocol import RpcClient, RpcError, encode_header
from kvdrop_sdk.server.pool import shm_path, unique_shm_name
from kvdrop_sdk.testing.server import ServerHandle, spawn_server

CHUNK = 256
# float32, width 32: one chunk is 2 * 2 * 256 * 32 * 4 = 128 KiB; the tiny pool holds 8 chunks.
LAYOUT = CacheLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.float32)
CHUNK_BYTES = LAYOUT.nbytes(CacheKind.KV, CHUNK)
TINY_POOL_GB = 8 * CHUNK_BYTES / 1024**3


def toks(i: int, n: int = 2 * CHUNK) -> list[int]:
    """Distinct token ids for request ``i``."""
    return list(range(100_000 * (i + 1), 100_000 * (i + 1) + n))


def kv_for(i: int, n: int = 2 * CHUNK) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(CacheKind.KV, n), generator=torch.Generator().manual_seed(i))


def fields(model: str) -> dict[str, Any]:
    return {"model": model, "kind": "kv", "salt": ""}


# -- HTTP ----------------------------------------------------------------------------------------
def test_http_endpoints(kv_server: ServerHandle, model_name: str) -> None:
    config = requests.get(f"{kv_server.http_url}/config", timeout=10).json()
    assert config["chunk_size"] == 256
    assert config["shm_name"] == kv_server.shm_name
    assert config["port"] == kv_server.port and config["http_port"] == kv_server.http_port
    assert config["features"] == ["transfer_query"]
    assert config["l1_bytes"] == int(0.25 * 1024**3)
    assert config["eviction_policy"] == "LRU"
    assert requests.get(f"{kv_server.http_url}/health", timeout=10).json() == {"status": "ok"}
    with sdk.kvcache.connect(kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT) as c:
        before = kv_server.status()
        assert c.store(kv_for(0), toks(0))
        assert c.retrieve(toks(0)) is not None
        assert c.retrieve(toks(1)) is None
        after = kv_server.status()
    assert {"model": model_name, "kind": "kv", "layout": LAYOUT.to_json()} in after["layouts"]
    assert after["stores"] - before["stores"] == 2
    assert after["objects"] - before["objects"] == 2
    assert after["hits"] - before["hits"] == 1
    assert after["misses"] - before["misses"] == 1
    assert after["pool_bytes_used"] - before["pool_bytes_used"] == 2 * CHUNK_BYTES
    assert after["pool_bytes_total"] == int(0.25 * 1024**3)
    assert after["pinned_objects"] == 0
    missing = requests.get(f"{kv_server.http_url}/nope", timeout=10)
    assert missing.status_code == 404 and "/status" in missing.json()["paths"]


# -- eviction, pins, leases ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_server() -> Any:
    with spawn_server(l1_size_gb=TINY_POOL_GB, chunk_size=CHUNK) as srv:
        yield srv


def test_lru_eviction_keeps_recently_used_and_pinned(tiny_server: ServerHandle) -> None:
    model = "lru"
    ctx = sdk.kvcache.connect(tiny_server.url, tiny_server.http_url, model, 10, layout=LAYOUT)
    rpc = RpcClient(tiny_server.url, 10)
    try:
        base = tiny_server.status()["evictions"]
        for i in range(4):  # A, B, C, D: fills the 8 slots
            assert ctx.store(kv_for(i), toks(i))
        assert tiny_server.status()["objects"] == 8
        assert torch.equal(ctx.retrieve(toks(0)), kv_for(0))  # touch A
        assert ctx.store(kv_for(4), toks(4))  # E evicts B, the least recently used
        assert ctx.retrieve(toks(1)) is None
        for i in (0, 2, 3, 4):
            assert torch.equal(ctx.retrieve(toks(i)), kv_for(i)), i
        assert tiny_server.status()["evictions"] - base == 2

        # Pin C (as a shared-memory reader does), then write 4 new requests: C must survive.
        pinned, _ = rpc.call("pin", {**fields(model), "lease_s": 30}, [encode_tokens(toks(2))])
        assert pinned["num_tokens"] == 2 * CHUNK
        for i in range(5, 9):
            assert ctx.store(kv_for(i), toks(i))
        assert torch.equal(ctx.retrieve(toks(2)), kv_for(2))
        assert ctx.retrieve(toks(0)) is None
        status = tiny_server.status()
        assert status["pinned_objects"] == 2 and status["objects"] == 8
        released, _ = rpc.call("release", {"lease": pinned["lease"]})
        assert released["valid_chunks"] == 2
        assert tiny_server.status()["pinned_objects"] == 0
    finally:
        rpc.close()
        ctx.close()


def test_full_pool_of_pinned_chunks_refuses_store(tiny_server: ServerHandle) -> None:
    model = "full"
    ctx = sdk.kvcache.connect(tiny_server.url, tiny_server.http_url, model, 10, layout=LAYOUT)
    rpc = RpcClient(tiny_server.url, 10)
    leases = []
    try:
        for i in range(4):
            ctx.store(kv_for(i), toks(i))
            reply, _ = rpc.call("pin", {**fields(model), "lease_s": 30}, [encode_tokens(toks(i))])
            assert reply["num_tokens"] == 2 * CHUNK
            leases.append(reply["lease"])
        with pytest.raises(SDKError, match="pool is full"):
            ctx.store(kv_for(9), toks(9))
        for i in range(4):
            assert torch.equal(ctx.retrieve(toks(i)), kv_for(i))
    finally:
        for lease in leases:
            rpc.call("release", {"lease": lease})
        rpc.close()
        ctx.close()
    with sdk.kvcache.connect(tiny_server.url, tiny_server.http_url, model, 10) as again:
        assert again.store(kv_for(9), toks(9))


def test_chunk_larger_than_pool_is_refused(tiny_server: ServerHandle) -> None:
    huge = CacheLayout(2, 16, 128, torch.float32)  # 2 * 2 * 256 * 2048 * 4 = 8 MiB per chunk
    with sdk.kvcache.connect(tiny_server.url, tiny_server.http_url, "huge", 10, layout=huge) as c:
        with pytest.raises(SDKError, match="larger --l1-size-gb"):
            c.store(torch.zeros(huge.shape(CacheKind.KV, CHUNK)), list(range(CHUNK)))


def test_leases_expire_so_crashed_clients_cannot_leak(tiny_server: ServerHandle) -> None:
    model = "lease"
    ctx = sdk.kvcache.connect(tiny_server.url, tiny_server.http_url, model, 10, layout=LAYOUT)
    rpc = RpcClient(tiny_server.url, 10)
    try:
        assert ctx.store(kv_for(20), toks(20))
        expired_before = tiny_server.status()["expired_leases"]
        pin, _ = rpc.call("pin", {**fields(model), "lease_s": 0.3}, [encode_tokens(toks(20))])
        reserve, _ = rpc.call(
            "reserve", {**fields(model), "lease_s": 0.3}, [encode_tokens(toks(21))]
        )
        assert reserve["chunks"] == [0, 1] and reserve["nbytes"] == CHUNK_BYTES
        status = tiny_server.status()
        assert status["pinned_objects"] >= 2 and status["reserved_objects"] == 2
        time.sleep(0.6)
        status = tiny_server.status()
        assert status["pinned_objects"] == 0 and status["reserved_objects"] == 0
        assert status["expired_leases"] - expired_before == 2
        released, _ = rpc.call("release", {"lease": pin["lease"]})
        assert released["valid_chunks"] == 0  # the reader learns its pin lapsed
        with pytest.raises(RpcError, match="expired before commit") as info:
            rpc.call("commit", {"lease": reserve["lease"]})
        assert info.value.code == "lease_expired"
        assert ctx.lookup(toks(21)) == 0
    finally:
        rpc.close()
        ctx.close()


def test_reserved_chunks_are_invisible_until_committed(tiny_server: ServerHandle) -> None:
    model = "reserve"
    ctx = sdk.kvcache.connect(tiny_server.url, tiny_server.http_url, model, 10, layout=LAYOUT)
    rpc = RpcClient(tiny_server.url, 10)
    try:
        raw = encode_tokens(toks(30))
        first, _ = rpc.call("reserve", {**fields(model), "lease_s": 30}, [raw])
        assert ctx.lookup(toks(30)) == 0
        assert ctx.retrieve(toks(30)) is None
        # A second writer of the same chunks while the first is writing: first copy wins.
        second, _ = rpc.call("reserve", {**fields(model), "lease_s": 30}, [raw])
        assert second["lease"] is None and second["duplicates"] == 2
        committed, _ = rpc.call("commit", {"lease": first["lease"]})
        assert committed["stored"] == 2
        assert ctx.lookup(toks(30)) == 2 * CHUNK
        aborted, _ = rpc.call(
            "reserve", {**fields(model), "lease_s": 30}, [encode_tokens(toks(31))]
        )
        rpc.call("abort", {"lease": aborted["lease"]})
        assert ctx.lookup(toks(31)) == 0
        assert tiny_server.status()["reserved_objects"] == 0
    finally:
        rpc.close()
        ctx.close()


# -- malformed requests ----------------------------------------------------------------------------
def _raw(sock: zmq.Socket, frames: list[bytes]) -> dict[str, Any]:
    sock.send_multipart(frames)
    assert sock.poll(10_000), f"no reply to {frames[0][:60]!r}"
    reply = sock.recv_multipart()
    return json.loads(reply[0])


def _hdr(**fields: Any) -> bytes:
    return encode_header({"v": 1, "rid": 7, **fields})


def test_malformed_requests_get_error_replies_and_change_nothing(
    kv_server: ServerHandle, model_name: str
) -> None:
    with sdk.kvcache.connect(kv_server.url, kv_server.http_url, model_name, 30, layout=LAYOUT) as c:
        assert c.store(kv_for(40), toks(40))
        objects_before = kv_server.status()["objects"]
        m = {"model": model_name, "kind": "kv"}
        t512 = encode_tokens(toks(41))
        row = CHUNK * LAYOUT.width * 4
        put_ok = {"op": "put", **m, "dtype": "float32", "shape": [2, 2, 512, 32]}
        cases: list[tuple[list[bytes], str]] = [
            ([b"\xff\xfe\x00garbage"], "bad_header"),
            ([b"{not json"], "bad_header"),
            ([b"[1, 2]"], "bad_header"),
            ([b""], "bad_header"),
            ([b'{"v": 1, "pad": "' + b" " * 70_000 + b'"}'], "oversized"),
            ([encode_header({"op": "ping", "rid": 7})], "bad_version"),
            ([_hdr(op="explode")], "unknown_op"),
            ([_hdr(op=7)], "unknown_op"),
            ([_hdr(op="lookup", **m)], "bad_frames"),
            ([_hdr(op="lookup", **m), b"1234567"], "bad_tokens"),
            ([_hdr(op="lookup", kind="kv"), t512], "bad_field"),
            ([_hdr(op="lookup", model=model_name, kind="value"), t512], "unknown_kind"),
            ([_hdr(op="lookup", **m, salt=5), t512], "bad_field"),
            ([_hdr(op="lookup", model="nobody", kind="kv"), t512], "unregistered"),
            ([_hdr(op="layout", model=model_name, kind="query"), t512], "bad_model"),
            ([_hdr(op="register", **m, layout={"num_layers": 2}), b""], "bad_layout"),
            (
                [_hdr(op="register", **m, layout={**LAYOUT.to_json(), "dtype": "complex64"})],
                "bad_layout",
            ),
            ([_hdr(op="commit", lease=7)], "bad_field"),
            ([_hdr(op="commit", lease="0" * 32)], "unknown_lease"),
            ([_hdr(op="pin", **m, lease_s=-1), t512], "bad_field"),
            ([_hdr(op="get", **m, first_chunk=-1), t512], "bad_field"),
            ([_hdr(op="get", **m, max_chunks=0), t512], "bad_field"),
            ([_hdr(**{**put_ok, "dtype": "float16"}), t512, *[b"\0" * row] * 8], "dtype_mismatch"),
            (
                [_hdr(**{**put_ok, "shape": [2, 2, 512, 16]}), t512, *[b"\0" * row] * 8],
                "shape_mismatch",
            ),
            ([_hdr(**put_ok), t512, *[b"\0" * row] * 7], "bad_data"),
            ([_hdr(**put_ok), t512, *[b"\0" * (row - 4)] * 8], "bad_data"),
            ([_hdr(**put_ok), t512[:-8], *[b"\0" * row] * 8], "bad_tokens"),
            ([_hdr(**put_ok, first_chunk=2), t512, *[b"\0" * row] * 8], "bad_field"),
            ([_hdr(**put_ok, first_chunk=1), t512, *[b"\0" * row] * 8], "shape_mismatch"),
            ([_hdr(**put_ok), b"", *[b"\0" * row] * 8], "bad_tokens"),
        ]
        zctx = zmq.Context()
        sock = zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(kv_server.url)
        try:
            for frames, code in cases:
                reply = _raw(sock, frames)
                assert reply["ok"] is False, (frames[0][:80], reply)
                assert reply["code"] == code, (frames[0][:80], reply)
                assert reply["error"]
                if code not in ("bad_header", "oversized"):
                    assert reply["rid"] == 7
            assert _raw(sock, [_hdr(op="ping")])["ok"] is True
        finally:
            sock.close(0)
            zctx.term()
        assert requests.get(f"{kv_server.http_url}/health", timeout=10).json()["status"] == "ok"
        assert kv_server.status()["objects"] == objects_before
        assert c.lookup(toks(41)) == 0
        assert torch.equal(c.retrieve(toks(40)), kv_for(40))


def test_frame_larger_than_the_limit_drops_only_that_peer(tiny_server: ServerHandle) -> None:
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tiny_server.url)
    try:
        frame = b"\0" * (tiny_server.config["max_message_bytes"] + 1)
        sock.send_multipart([_hdr(op="ping"), frame])
        assert not sock.poll(1500)  # the server dropped the connection instead of buffering
    finally:
        sock.close(0)
        zctx.term()
    with RpcClient(tiny_server.url, 10) as rpc:
        assert rpc.call("ping")[0]["ok"] is True


# -- lifecycle -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sig", "flags"),
    [(signal.SIGTERM, {}), (signal.SIGINT, {"no_l1_use_lazy": True})],
)
def test_signal_stops_cleanly_and_unlinks_shm(sig: int, flags: dict[str, Any]) -> None:
    with spawn_server(l1_size_gb=0.01, **flags) as srv:
        assert srv.shm_name and os.path.exists(shm_path(srv.shm_name))
        assert os.path.getsize(shm_path(srv.shm_name)) == srv.config["shm_bytes"]
        with sdk.kvcache.connect(srv.url, srv.http_url, "m", 10, layout=LAYOUT) as ctx:
            assert ctx.transfer_ctx.mode == "shm"
            assert ctx.store(kv_for(1), toks(1))
            assert srv.stop(sig) == 0
        assert not os.path.exists(shm_path(srv.shm_name))


def test_in_process_server_start_stop() -> None:
    from kvdrop_sdk.server import Server, ServerConfig

    name = unique_shm_name()
    server = Server(ServerConfig(port=0, http_port=0, l1_size_gb=0.01, shm_name=name)).start()
    try:
        assert os.path.exists(shm_path(name))
        with sdk.kvcache.connect(server.url, server.http_url, "m", 10, layout=LAYOUT) as ctx:
            assert ctx.transfer_ctx.mode == "shm"
            assert ctx.store(kv_for(2), toks(2))
            assert torch.equal(ctx.retrieve(toks(2)), kv_for(2))
    finally:
        server.stop()
        server.stop()
    assert not os.path.exists(shm_path(name))


def test_existing_shm_name_is_refused(tmp_path: Any) -> None:
    name = unique_shm_name()
    with open(shm_path(name), "wb"):
        pass
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvdrop_sdk.server",
                "--port",
                "0",
                "--http-port",
                "0",
                "--shm-name",
                name,
                "--l1-size-gb",
                "0.01",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1
        assert "already exists" in proc.stderr and name in proc.stderr
        assert os.path.getsize(shm_path(name)) == 0  # the other owner's file is untouched
    finally:
        os.unlink(shm_path(name))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--enable", "bogus"], "--enable 'bogus': unknown feature"),
        (["--l1-size-gb", "0"], "--l1-size-gb must be > 0"),
        (["--shm-name", "a/b"], "--shm-name 'a/b'"),
        (["--chunk-size", "-4"], "--chunk-size must be a positive int"),
        (["--port", "65536"], "--port must be 0..65535"),
        (["--workers", "0"], "--workers must be an int in 1..256, got 0"),
        (["--max-client-leases", "0"], "--max-client-leases must be an int in 1..1048576, got 0"),
    ],
)
def test_bad_flags_are_rejected_with_message(args: list[str], message: str) -> None:
    import argparse

    from kvdrop_sdk.server.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError) as info:
        config_from_args(parser.parse_args(args))
    assert message in str(info.value)


def test_bad_flag_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvdrop_sdk.server", "--port", "0", "--enable", "bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown feature" in proc.stderr


def test_cli_help_lists_the_documented_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvdrop", "server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in (
        "--l1-size-gb",
        "--eviction-policy",
        "--chunk-size",
        "--port",
        "--http-port",
        "--shm-name",
        "--no-l1-use-lazy",
        "--enable",
        "--host",
    ):
        assert flag in out, flag
    assert "transfer_query" in out


def test_kvdrop_server_command_serves(tmp_path: Any) -> None:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvdrop",
            "server",
            "--port",
            "0",
            "--http-port",
            "0",
            "--l1-size-gb",
            "0.01",
            "--enable",
            "transfer_query",
            "--ready-file",
            str(ready),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["host"] == "127.0.0.1" and info["features"] == ["transfer_query"]
        config = requests.get(f"http://127.0.0.1:{info['http_port']}/config", timeout=10).json()
        assert config["port"] == info["port"] and config["shm_name"] is None
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "kvdrop server: zmq tcp://127.0.0.1:" in out


def test_reader_whose_pin_lapsed_gets_a_miss_not_other_data(
    tiny_server: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared-memory reader stalls past its lease while a writer reuses the slots."""
    import kvdrop_sdk.transport.contiguous as contiguous

    model = "lapse"
    reader = sdk.kvcache.connect(
        tiny_server.url, tiny_server.http_url, model, 10, layout=LAYOUT, transport="shm"
    )
    writer = sdk.kvcache.connect(
        tiny_server.url, tiny_server.http_url, model, 10, layout=LAYOUT, transport="socket"
    )
    real_copy = contiguous.copy_rows
    stalled = []

    def stalling_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if not stalled:
            stalled.append(True)
            time.sleep(0.4)  # the 0.2 s pin lapses; the writer then evicts and reuses the slots
            for i in range(50, 54):
                assert writer.store(kv_for(i), toks(i))
        real_copy(dst, src)

    try:
        assert reader.store(kv_for(49), toks(49))
        monkeypatch.setattr(contiguous, "copy_rows", stalling_copy)
        out = reader.transfer_ctx.retrieve(
            {"model": model, "kind": "kv", "salt": ""},
            encode_tokens(toks(49)),
            LAYOUT,
            CacheKind.KV,
            lease_s=0.2,
        )
        assert stalled and out is None
        monkeypatch.setattr(contiguous, "copy_rows", real_copy)
        assert reader.retrieve(toks(49)) is None  # evicted
        assert torch.equal(reader.retrieve(toks(53)), kv_for(53))
    finally:
        reader.close()
        writer.close()
