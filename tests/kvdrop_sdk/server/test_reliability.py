"""Reliability of the server under faults and hostile clients (issue 10's numbered failures).

Every test talks to a real server subprocess on 127.0.0.1 (or an in-process ``Server``), with
short timeouts so the whole file runs in well under a minute.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
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
from kvdrop_sdk.testing.server import (
    ServerHandle,
    spawn_server,
    spawn_server_in_child,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

CHUNK = 256
LAYOUT = CacheLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.float32)
CHUNK_BYTES = LAYOUT.nbytes(CacheKind.KV, CHUNK)  # 128 KiB
TINY_POOL_GB = 8 * CHUNK_BYTES / 1024**3  # 8 chunks


def toks(i: int, n: int = 2 * CHUNK) -> list[int]:
    """Distinct token ids for request ``i``."""
    return list(range(100_000 * (i + 1), 100_000 * (i + 1) + n))


def kv_for(i: int, n: int = 2 * CHUNK) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(CacheKind.KV, n), generator=torch.Generator().manual_seed(i))


def fields(model: str) -> dict[str, Any]:
    return {"model": model, "kind": "kv", "salt": ""}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvdrop_sdk.server", "--port", "0", "--http-port", "0", *args]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def tiny_pool() -> Any:
    with spawn_server(l1_size_gb=TINY_POOL_GB, chunk_size=CHUNK) as srv:
        yield srv


# -- 1. socket retrieves release their pins -------------------------------------------------------
def test_socket_retrieve_releases_its_pins_once_sent(tiny_pool: ServerHandle) -> None:
    with sdk.kvcache.connect(
        tiny_pool.url, tiny_pool.http_url, "pins", 10, layout=LAYOUT, transport="socket"
    ) as ctx:
        for i in range(4):
            assert ctx.store(kv_for(i), toks(i))
        for i in range(4):
            assert torch.equal(ctx.retrieve(toks(i)), kv_for(i))
    # No other request arrives: the pins must go once ZMQ has sent the bytes, not on a later get.
    assert wait_until(lambda: tiny_pool.status()["pinned_objects"] == 0, 5.0)
    with sdk.kvcache.connect(tiny_pool.url, tiny_pool.http_url, "pins2", 10, layout=LAYOUT) as c:
        for i in range(10, 14):  # the whole pool is writable again (8 new chunks)
            assert c.store(kv_for(i), toks(i))


# -- 3. leases are owned and unguessable ----------------------------------------------------------
def test_foreign_and_unknown_leases_are_refused(tiny_pool: ServerHandle) -> None:
    model = "owned"
    with sdk.kvcache.connect(tiny_pool.url, tiny_pool.http_url, model, 10, layout=LAYOUT) as ctx:
        assert ctx.store(kv_for(1), toks(1))
    owner, other = RpcClient(tiny_pool.url, 10), RpcClient(tiny_pool.url, 10)
    try:
        pin, _ = owner.call("pin", {**fields(model), "lease_s": 30}, [encode_tokens(toks(1))])
        res, _ = owner.call("reserve", {**fields(model), "lease_s": 30}, [encode_tokens(toks(2))])
        for lease in (pin["lease"], res["lease"]):
            assert isinstance(lease, str) and len(lease) >= 32  # 128 random bits, not a counter
        for op, lease in (("release", pin["lease"]), ("commit", res["lease"])):
            with pytest.raises(RpcError) as info:
                other.call(op, {"lease": lease})
            assert info.value.code == "unknown_lease"
        with pytest.raises(RpcError) as info:
            other.call("abort", {"lease": res["lease"]})
        assert info.value.code == "unknown_lease"
        status = tiny_pool.status()
        assert status["pinned_objects"] == 2 and status["reserved_objects"] == 2
        assert owner.call("release", {"lease": pin["lease"]})[0]["valid_chunks"] == 2
        owner.call("abort", {"lease": res["lease"]})
        status = tiny_pool.status()
        assert status["pinned_objects"] == 0 and status["reserved_objects"] == 0
        with pytest.raises(RpcError) as info:  # released leases are gone, also for the owner
            owner.call("release", {"lease": pin["lease"]})
        assert info.value.code == "unknown_lease"
    finally:
        owner.close()
        other.close()


def test_leases_of_a_killed_client_are_reclaimed(tiny_pool: ServerHandle) -> None:
    model = "killed"
    with sdk.kvcache.connect(tiny_pool.url, tiny_pool.http_url, model, 10, layout=LAYOUT) as ctx:
        assert ctx.store(kv_for(3), toks(3))
    script = textwrap.dedent(
        f"""
        import sys
        from kvdrop_sdk.hashing import encode_tokens
        from kvdrop_sdk.protocol import RpcClient
        rpc = RpcClient({tiny_pool.url!r}, 10)
        f = {{"model": {model!r}, "kind": "kv", "salt": "", "lease_s": 1.0}}
        rpc.call("pin", f, [encode_tokens({toks(3)!r})])
        rpc.call("reserve", f, [encode_tokens({toks(4)!r})])
        print("held", flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        status = tiny_pool.status()
        assert status["pinned_objects"] == 2 and status["reserved_objects"] == 2
        proc.kill()
        proc.wait()
        assert wait_until(
            lambda: (
                tiny_pool.status()["pinned_objects"] == 0
                and tiny_pool.status()["reserved_objects"] == 0
            ),
            5.0,
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- 5. whole messages are capped; workers drop their last request --------------------------------
def test_huge_multi_frame_message_is_refused_whole(tiny_pool: ServerHandle) -> None:
    zctx = zmq.Context.instance()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tiny_pool.url)
    try:
        frame = b"\0" * (40 << 20)  # each frame is under the single-frame limit (65 MiB)
        sock.send_multipart([encode_header({"v": 1, "op": "ping", "rid": 1}), *[frame] * 3])
        assert sock.poll(20_000), "no reply to a 120 MiB message"
        reply = json.loads(sock.recv_multipart()[0])
        assert reply["ok"] is False and reply["code"] == "oversized", reply
        assert "limit" in reply["error"]
    finally:
        sock.close(0)
    with RpcClient(tiny_pool.url, 10) as rpc:
        assert rpc.call("ping")[0]["ok"] is True


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        line = next(x for x in fh if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_worker_does_not_keep_its_last_request(tiny_pool: ServerHandle) -> None:
    pid = tiny_pool.proc.pid
    before = _rss(pid)
    zctx = zmq.Context.instance()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tiny_pool.url)
    try:
        # One 60 MiB frame (under both limits) comes from its own mapping: freed means unmapped.
        sock.send_multipart([encode_header({"v": 1, "op": "ping", "rid": 2}), b"\1" * (60 << 20)])
        assert sock.poll(20_000)
        assert json.loads(sock.recv_multipart()[0])["ok"] is True
    finally:
        sock.close(0)
    assert wait_until(lambda: _rss(pid) < before + (20 << 20), 5.0), (before, _rss(pid))


# -- 6. zmq.REQ clients get replies ---------------------------------------------------------------
def test_req_socket_gets_a_reply(kv_server: ServerHandle) -> None:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kv_server.url)
    try:
        sock.send(encode_header({"v": 1, "op": "ping", "rid": 5}))
        assert sock.poll(10_000), "a REQ client got no reply"
        reply = json.loads(sock.recv())
        assert reply["ok"] is True and reply["rid"] == 5
        sock.send(b"{broken")
        assert sock.poll(10_000)
        assert json.loads(sock.recv())["code"] == "bad_header"
    finally:
        sock.close(0)


# -- 8. crash leftovers, parent death, pool sizing, busy ports ------------------------------------
def test_restart_after_sigkill_reclaims_the_stale_segment() -> None:
    name = unique_shm_name("kvdrop_test")
    with spawn_server(shm_name=name, l1_size_gb=0.01, check_exit=False) as srv:
        srv.stop(signal.SIGKILL)
        assert os.path.exists(shm_path(name))  # SIGKILL leaves it; the next start reclaims it
        with spawn_server(shm_name=name, l1_size_gb=0.01) as again:
            with sdk.kvcache.connect(again.url, again.http_url, "m", 10, layout=LAYOUT) as ctx:
                assert ctx.transfer_ctx.mode == "shm"
                assert ctx.store(kv_for(5), toks(5))
                assert torch.equal(ctx.retrieve(toks(5)), kv_for(5))
        assert not os.path.exists(shm_path(name))


def test_segment_of_a_live_server_is_refused_in_one_line() -> None:
    with spawn_server(l1_size_gb=0.01) as srv:
        assert srv.shm_name is not None
        size = os.path.getsize(shm_path(srv.shm_name))
        proc = subprocess.run(
            server_cmd("--shm-name", srv.shm_name, "--l1-size-gb", "0.01"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "in use by a running server" in lines[0], proc.stderr
        assert srv.shm_name in lines[0]
        assert os.path.getsize(shm_path(srv.shm_name)) == size
        assert requests.get(f"{srv.http_url}/health", timeout=10).json()["status"] == "ok"


def test_busy_port_is_one_line_error() -> None:
    from kvdrop_sdk.server import Server, ServerConfig
    from kvdrop_sdk.server.app import ServerStartError

    with spawn_server(shm_name=None, l1_size_gb=0.01) as srv:
        args = server_cmd("--l1-size-gb", "0.01")
        args[args.index("--port") + 1] = str(srv.port)
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert f"--port {srv.port} is in use" in lines[0], lines[0]
        # The HTTP port, in-process (the same message reaches the CLI's one line).
        server = Server(ServerConfig(port=0, http_port=srv.http_port, l1_size_gb=0.01))
        with pytest.raises(ServerStartError, match=f"--http-port {srv.http_port} is in use"):
            server.start()


def test_pool_larger_than_memory_is_refused_in_one_line() -> None:
    from kvdrop_sdk.server import Server, ServerConfig
    from kvdrop_sdk.server.app import ServerStartError

    too_big = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3 * 2 + 1)
    proc = subprocess.run(
        server_cmd("--l1-size-gb", str(too_big)), capture_output=True, text=True, timeout=60
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "--l1-size-gb" in lines[0] and "GiB" in lines[0], lines[0]
    name = unique_shm_name("kvdrop_test")
    server = Server(ServerConfig(port=0, http_port=0, l1_size_gb=too_big, shm_name=name))
    with pytest.raises(ServerStartError, match="--l1-size-gb"):
        server.start()
    assert not os.path.exists(shm_path(name))


def test_pool_larger_than_dev_shm_is_refused() -> None:
    from kvdrop_sdk.server.pool import PoolSizeError, check_pool_size

    with pytest.raises(PoolSizeError, match=r"/dev/shm has .* free.*--l1-size-gb"):
        check_pool_size(10 << 30, shm=True, lazy=True, memory=100 << 30, shm_free=4 << 30)
    with pytest.raises(PoolSizeError, match=r"more than this machine's .* memory"):
        check_pool_size(10 << 30, shm=False, lazy=True, memory=8 << 30, shm_free=None)
    with pytest.raises(PoolSizeError, match=r"--no-l1-use-lazy.*available"):
        check_pool_size(10 << 30, shm=False, lazy=False, memory=16 << 30, shm_free=None,
                        available=6 << 30)  # fmt: skip
    check_pool_size(10 << 30, shm=True, lazy=True, memory=16 << 30, shm_free=12 << 30)


def test_spawned_server_dies_with_its_parent() -> None:
    parent, pid, name = spawn_server_in_child()
    try:
        assert pid_alive(pid) and os.path.exists(shm_path(name))
        parent.kill()  # as the OOM killer would: no cleanup code runs in the parent
        parent.wait()
        assert wait_until(lambda: not pid_alive(pid), 10.0), "the server outlived its parent"
        assert wait_until(lambda: not os.path.exists(shm_path(name)), 5.0), "segment leaked"
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        if os.path.exists(shm_path(name)):
            os.unlink(shm_path(name))


# -- 10. nested JSON, idle HTTP connections, layout squatting, partial stores ---------------------
def test_deeply_nested_header_is_a_bad_header(kv_server: ServerHandle) -> None:
    with RpcClient(kv_server.url, 10) as rpc:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(kv_server.url)
        try:
            sock.send(b"[" * 20_000 + b"]" * 20_000)
            assert sock.poll(10_000)
            reply = json.loads(sock.recv_multipart()[0])
            assert reply["code"] == "bad_header", reply
        finally:
            sock.close(0)
        assert rpc.call("ping")[0]["ok"] is True


def test_idle_http_connections_are_closed() -> None:
    with spawn_server(shm_name=None, l1_size_gb=0.01, http_timeout_s=0.5) as srv:
        conns = []
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", srv.http_port), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            conns.append(s)
        try:
            time.sleep(1.5)
            for s in conns:
                assert s.recv(1024) == b""  # the server hung up on the idle half-sent request
            assert requests.get(f"{srv.http_url}/health", timeout=10).json()["status"] == "ok"
        finally:
            for s in conns:
                s.close()


def test_layout_squatting_does_not_lock_out_the_engine(kv_server: ServerHandle) -> None:
    model = "squat/model"
    wrong = CacheLayout(num_layers=1, num_heads=1, head_dim=8, dtype=torch.float16)
    squatter = sdk.kvcache.connect(kv_server.url, kv_server.http_url, model, 10, layout=wrong)
    squatter.close()
    # The real engine comes later: no chunk was stored under the squatter's layout, so it wins.
    with sdk.kvcache.connect(kv_server.url, kv_server.http_url, model, 10, layout=LAYOUT) as eng:
        assert eng.layout == LAYOUT
        assert eng.store(kv_for(7), toks(7))
        # Once chunks are stored under it, a different layout is refused with a clear error.
        with pytest.raises(SDKError, match=r"layout_conflict.*holds 2 chunk"):
            sdk.kvcache.connect(kv_server.url, kv_server.http_url, model, 10, layout=wrong)
        assert torch.equal(eng.retrieve(toks(7)), kv_for(7))


def test_store_that_keeps_only_some_chunks_says_so(tiny_pool: ServerHandle) -> None:
    from kvdrop_sdk.errors import PartialStoreError

    model = "partial"
    ctx = sdk.kvcache.connect(tiny_pool.url, tiny_pool.http_url, model, 10, layout=LAYOUT)
    rpc = RpcClient(tiny_pool.url, 10)
    try:
        for i in range(3):  # 6 of 8 slots, all pinned
            assert ctx.store(kv_for(i), toks(i))
            rpc.call("pin", {**fields(model), "lease_s": 30}, [encode_tokens(toks(i))])
        with pytest.raises(PartialStoreError, match=r"stored 2 of 4 chunk") as info:
            ctx.store(kv_for(9, 4 * CHUNK), toks(9, 4 * CHUNK))
        assert (info.value.stored, info.value.dropped) == (2, 2)
        assert ctx.lookup(toks(9, 4 * CHUNK)) == 2 * CHUNK
        rpc.call("pin", {**fields(model), "lease_s": 30}, [encode_tokens(toks(9, 4 * CHUNK))])
        with pytest.raises(PartialStoreError, match=r"stored 0 of 2 chunk.*pool is full"):
            ctx.store(kv_for(10), toks(10))
        assert ctx.store(kv_for(9, 2 * CHUNK), toks(9, 2 * CHUNK)) is False  # all cached: False
    finally:
        rpc.close()
        ctx.close()
