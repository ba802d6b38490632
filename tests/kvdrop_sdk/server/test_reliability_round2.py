"""Reliability round 2 (issue 20): wrong data from RoPE, windows and stalled writers; requests that
took the cache down for everyone; unclear errors. Real server subprocesses on 127.0.0.1."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kvdrop_sdk as sdk
from kvdrop_rope import RopeConfig
from kvdrop_sdk import CacheKind, CacheLayout, SDKError
from kvdrop_sdk.errors import ServerUnavailableError
from kvdrop_sdk.hashing import encode_tokens
from kvdrop_sdk.protocol import RpcClient, RpcError
from kvdrop_sdk.server.pool import shm_path, unique_shm_name
from kvdrop_sdk.testing.server import ServerHandle, spawn_server, wait_until
from kvdrop_sdk.window import QueryWindow, retrieve_window, store_window

pytestmark = pytest.mark.timeout(180)

CHUNK = 256
ROPE = RopeConfig(head_dim=16, theta=10000.0).to_json()
LAYOUT = CacheLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.float32, rope=ROPE)
Q_LAYOUT = CacheLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float32, rope=ROPE)
CHUNK_BYTES = LAYOUT.nbytes(CacheKind.KV, CHUNK)  # 128 KiB


def toks(i: int, n: int = 2 * CHUNK) -> list[int]:
    return list(range(100_000 * (i + 1), 100_000 * (i + 1) + n))


def kv_for(i: int, n: int = 2 * CHUNK) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(CacheKind.KV, n), generator=torch.Generator().manual_seed(i))


def window_for(i: int, rows: int = 4, scale: float = 1.0) -> QueryWindow:
    q = torch.randn(1, 2, rows, Q_LAYOUT.width, generator=torch.Generator().manual_seed(i))
    return QueryWindow(q * scale, torch.arange(rows, dtype=torch.int64) * 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fields(model: str, kind: str = "kv") -> dict[str, Any]:
    return {"model": model, "kind": kind, "salt": ""}


@pytest.fixture
def qserver() -> Iterator[ServerHandle]:
    with spawn_server(l1_size_gb=0.02, chunk_size=CHUNK, enable=["transfer_query"]) as srv:
        yield srv


# -- 1. RoPE validated, and part of a layout's identity -------------------------------------------
@pytest.mark.parametrize(
    "rope",
    [
        {**ROPE, "theta": 1e-300},
        {**ROPE, "theta": float("inf")},
        {**ROPE, "scaling": {"rope_type": "yarn", "factor": 0}},
        {**ROPE, "scaling": {"rope_type": "linear", "factor": -1.0}},
        {**ROPE, "scaling": {"rope_type": "llama3", "factor": 8.0}},
    ],
)
def test_bad_rope_is_refused_at_registration(qserver: ServerHandle, rope: dict[str, Any]) -> None:
    layout = {**LAYOUT.to_json(), "rope": rope}
    with RpcClient(qserver.url, 10) as rpc:
        with pytest.raises(RpcError) as info:
            rpc.call("register", {**fields("bad-rope"), "layout": layout})
        assert info.value.code == "bad_layout" and "rope" in str(info.value)
        assert rpc.call("ping")[0]["ok"]
    assert qserver.status()["layouts"] == []


def test_foreign_rope_does_not_pass_the_engines_stores(qserver: ServerHandle) -> None:
    foreign = {**LAYOUT.to_json(), "rope": {**ROPE, "theta": 500000.0}}
    engine = sdk.kvcache.connect(qserver.url, qserver.http_url, "m", 10, layout=LAYOUT)
    try:
        with RpcClient(qserver.url, 10) as squatter:  # before the engine's first store
            squatter.call("register", {**fields("m"), "layout": foreign})
        assert engine.store(kv_for(1), toks(1))
        (row,) = qserver.status()["layouts"]
        assert row["layout"]["rope"] == ROPE  # the engine's store re-took its own registration
        reader = sdk.kvcache.connect(qserver.url, qserver.http_url, "m", 10)
        assert reader.layout.rope == ROPE and torch.equal(reader.retrieve(toks(1)), kv_for(1))
        reader.close()
        with RpcClient(qserver.url, 10) as squatter:  # now it holds chunks: refused
            with pytest.raises(RpcError) as info:
                squatter.call("register", {**fields("m"), "layout": foreign})
            assert info.value.code == "layout_conflict"
    finally:
        engine.close()
    # A foreign RoPE that holds chunks first: the engine is refused, never served under it.
    with RpcClient(qserver.url, 10) as squatter:
        squatter.call("register", {**fields("m2"), "layout": foreign})
    squat = sdk.kvcache.connect(qserver.url, qserver.http_url, "m2", 10)
    assert squat.store(kv_for(2), toks(2))
    squat.close()
    with pytest.raises(SDKError, match="layout_conflict"):
        sdk.kvcache.connect(qserver.url, qserver.http_url, "m2", 10, layout=LAYOUT)


# -- 2. windows: first copy wins, the kind is in the key ------------------------------------------
def test_a_stored_window_cannot_be_replaced(qserver: ServerHandle) -> None:
    q = sdk.qcache.connect(qserver.url, qserver.http_url, "w", 10, layout=Q_LAYOUT)
    try:
        tokens = toks(3, 40)
        assert store_window(q, tokens, window_for(1, rows=4)) is True
        assert store_window(q, tokens, window_for(2, rows=5, scale=1e30)) is False
        got = retrieve_window(q, tokens)
        assert got is not None and torch.equal(got.queries, window_for(1, rows=4).queries)
        # A put under the KV kind with the query model's name is another key.
        kv_layout = {**Q_LAYOUT.to_json()}
        with RpcClient(qserver.url, 10) as rpc:
            rpc.call("register", {**fields("w##query"), "layout": kv_layout})
            hostile = window_for(9, rows=5, scale=1e30)
            rpc.call(
                "put_window",
                {**fields("w##query"), "rows": 5, "dtype": "float32"},
                [
                    encode_tokens(tokens),
                    encode_tokens(hostile.positions.tolist()),
                    hostile.queries.numpy().tobytes(),
                ],
            )
        got = retrieve_window(q, tokens)
        assert got is not None and float(got.queries.abs().max()) < 100
    finally:
        q.close()


# -- 3. a stalled shared-memory writer ------------------------------------------------------------
def test_stalled_shm_writer_does_not_overwrite_a_reused_slot() -> None:
    with spawn_server(l1_size_gb=4 * CHUNK_BYTES / 1024**3, chunk_size=CHUNK) as srv:
        with RpcClient(srv.url, 10) as writer1:
            writer1.call("register", {**fields("s"), "layout": LAYOUT.to_json()})
            res, _ = writer1.call(
                "reserve", {**fields("s"), "lease_s": 0.3}, [encode_tokens(toks(0, CHUNK))]
            )
            (offset,) = res["offsets"]
            # Writer 1 passed its lease check and stalls; its lease expires meanwhile.
            assert wait_until(lambda: srv.status()["expired_leases"] >= 1, 10)
            assert srv.status()["quarantined_chunks"] == 1
            writer2 = sdk.kvcache.connect(srv.url, srv.http_url, "s", 10, transport="shm")
            kv = kv_for(5, 3 * CHUNK)
            assert writer2.store(kv, toks(5, 3 * CHUNK))  # 3 chunks: the pool minus 1 quarantined
            # Writer 1 wakes up and copies into the slot it was given.
            assert srv.shm_name is not None
            with open(shm_path(srv.shm_name), "r+b") as fh:
                mm = mmap.mmap(fh.fileno(), 0)
                mm[offset : offset + CHUNK_BYTES] = b"\xff" * CHUNK_BYTES
                mm.close()
            with pytest.raises(RpcError) as info:
                writer1.call("commit", {"lease": res["lease"]})
            assert info.value.code == "lease_expired"
            assert torch.equal(writer2.retrieve(toks(5, 3 * CHUNK)), kv)  # 0 bytes overwritten
            status = srv.status()
            assert status["quarantined_bytes"] == 0 and status["objects"] == 3
            assert writer2.store(kv_for(6, CHUNK), toks(6, CHUNK))  # the slot is free again
            writer2.close()


# -- 5. /dev/shm filling up after the start -------------------------------------------------------
_SHM_FULL_SCRIPT = """
import json, os, sys, torch
import kvdrop_sdk as sdk
from kvdrop_sdk import CacheLayout
from kvdrop_sdk.testing.server import spawn_server
layout = CacheLayout(2, 2, 16, torch.float32)
n = 24 * 256  # 3 MiB of chunks in a 4 MiB pool
kv = torch.randn(2, 2, n, 32)
out = {}
with spawn_server(l1_size_gb=4 / 1024, chunk_size=256) as srv:
    filler = "/dev/shm/filler"
    st = os.statvfs("/dev/shm")
    with open(filler, "wb") as fh:  # others fill /dev/shm after the start: 1 MiB stays free
        os.posix_fallocate(fh.fileno(), 0, st.f_bavail * st.f_frsize - (1 << 20))
    for mode in ("shm", "socket"):
        ctx = sdk.kvcache.connect(srv.url, srv.http_url, mode, 10, layout=layout, transport=mode)
        try:
            ctx.store(kv, list(range(n)))
            out[mode] = "stored"
        except sdk.SDKError as exc:
            out[mode] = str(exc)
        ctx.close()
    out["alive"] = srv.proc.poll() is None and srv.status()["objects"] >= 0
    os.unlink(filler)
    ctx = sdk.kvcache.connect(srv.url, srv.http_url, "after", 10, layout=layout)
    out["after"] = ctx.store(kv[:, :, :512], list(range(512)))
    out["read"] = bool(torch.equal(ctx.retrieve(list(range(512))), kv[:, :, :512]))
    ctx.close()
print(json.dumps(out))
"""


def test_dev_shm_full_after_start_is_a_clear_error_and_the_server_stays_up(
    tmp_path: Any,
) -> None:
    """An 8 MiB tmpfs on /dev/shm in a private mount namespace; a 4 MiB lazy pool; then /dev/shm
    fills up. Client and server must survive (no SIGBUS) and the store must say why."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-rm", "true"], capture_output=True, check=False)
    if unshare is None or probe.returncode != 0:
        pytest.skip("needs `unshare -rm` (user and mount namespaces) for a private small tmpfs")
    path = tmp_path / "shm_full.py"
    path.write_text(_SHM_FULL_SCRIPT)
    script = f"mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} {path}"
    proc = subprocess.run(
        [unshare, "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in ("shm", "socket"):
        assert "no_space" in out[mode] and "/dev/shm is full" in out[mode], out
    assert out["alive"] and out["after"] and out["read"], out


# -- 6/7. lean mode: windows after a restart, query-layout squatting -------------------------------
def test_windows_are_stored_again_after_a_restart_in_lean_mode() -> None:
    flags = {
        "shm_name": unique_shm_name("kvdrop_test"),
        "port": free_port(),
        "http_port": free_port(),
        "l1_size_gb": 0.02,
        "chunk_size": CHUNK,
        "enable": ["transfer_query"],
    }
    try:
        with spawn_server(**flags) as srv:
            q = sdk.qcache.connect(srv.url, srv.http_url, "lean", 5, layout=Q_LAYOUT)
            assert store_window(q, toks(1, 30), window_for(1))
        with spawn_server(**flags) as srv2:
            assert srv2.status()["layouts"] == []
            assert store_window(q, toks(2, 30), window_for(2))  # re-registers, then stores
            got = retrieve_window(q, toks(2, 30))
            assert got is not None and torch.equal(got.queries, window_for(2).queries)
            assert retrieve_window(q, toks(1, 30)) is None  # the restarted server never held it
            q.close()
    finally:
        if os.path.exists(shm_path(flags["shm_name"])):
            os.unlink(shm_path(flags["shm_name"]))


def test_query_layout_squatting_does_not_lock_the_engine_out(qserver: ServerHandle) -> None:
    q = sdk.qcache.connect(qserver.url, qserver.http_url, "sq", 10, layout=Q_LAYOUT)
    other = {**Q_LAYOUT.to_json(), "dtype": "float16"}
    try:
        with RpcClient(qserver.url, 10) as squatter:
            squatter.call("register", {**fields("sq##query", "query"), "layout": other})
            assert store_window(q, toks(1, 30), window_for(1))  # re-registered, then stored
            with pytest.raises(RpcError) as info:  # windows hold the registration now
                squatter.call("register", {**fields("sq##query", "query"), "layout": other})
            assert info.value.code == "layout_conflict" and "window" in str(info.value)
        assert store_window(q, toks(2, 30), window_for(2))
        got = retrieve_window(q, toks(1, 30))
        assert got is not None and torch.equal(got.queries, window_for(1).queries)
    finally:
        q.close()


# -- 8. a bad request gets its real reason at once ------------------------------------------------
def test_oversized_request_gets_its_reason_at_once(qserver: ServerHandle) -> None:
    ctx = sdk.kvcache.connect(qserver.url, qserver.http_url, "big", 30, layout=LAYOUT)
    try:
        started = time.monotonic()
        with pytest.raises(SDKError, match="cache_salt is 100000 characters") as info:
            ctx.store(kv_for(1), toks(1), cache_salt="x" * 100_000)
        assert not isinstance(info.value, ServerUnavailableError)
        # The server answers a header it cannot decode with the request's rid too.
        with RpcClient(qserver.url, 30) as rpc:
            with pytest.raises(RpcError) as rinfo:
                rpc.call("lookup", {**fields("big"), "salt": "y" * 100_000}, [b"\0" * 8])
            assert rinfo.value.code == "oversized"
        assert time.monotonic() - started < 5  # not the 30 s timeout
        assert "is the kvdrop server running" not in str(rinfo.value)
        assert ctx.store(kv_for(1), toks(1))
    finally:
        ctx.close()


# -- 11. unclear errors ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flag",
    [
        ["--l1-size-gb", "inf"],
        ["--l1-size-gb", "nan"],
        ["--l1-size-gb", "1e309"],
        ["--http-timeout-s", "inf"],
        ["--max-lease-s", "inf"],
        ["--quarantine-s", "-1"],
    ],
)
def test_non_finite_float_flags_are_one_line_errors(flag: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvdrop_sdk.server", "--port", "0", "--http-port", "0", *flag],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert flag[0] in lines[0] and "finite" in lines[0]


def test_meta_sparse_and_bool_inputs_are_sdk_errors(qserver: ServerHandle) -> None:
    ctx = sdk.kvcache.connect(qserver.url, qserver.http_url, "inputs", 10, layout=LAYOUT)
    try:
        tokens = toks(1)
        bad_kv = {
            "meta": torch.empty(LAYOUT.shape(CacheKind.KV, len(tokens)), device="meta"),
            "sparse": kv_for(1).to_sparse(),
        }
        for what, kv in bad_kv.items():
            with pytest.raises(SDKError, match=what):
                ctx.store(kv, tokens)
        for bad in (
            [True] * 512,
            torch.ones(512, dtype=torch.bool),
            torch.zeros(512, device="meta"),
        ):
            with pytest.raises(SDKError, match=r"bool|meta"):
                ctx.store(kv_for(1), bad)  # type: ignore[arg-type]
            with pytest.raises(SDKError, match=r"bool|meta"):
                ctx.retrieve(bad)  # type: ignore[arg-type]
        with pytest.raises(SDKError, match="meta"):
            QueryWindow(torch.empty(1, 2, 3, 64, device="meta"), torch.arange(3))
        assert ctx.lookup(tokens) == 0  # nothing was stored as token 1
    finally:
        ctx.close()
