"""Contexts under server faults: restarts with the same shm name, kills mid-batch, GC of unclosed
contexts. Every test runs real server subprocesses on 127.0.0.1 with short timeouts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch

import kvdrop_sdk as sdk
from kvdrop_sdk import BatchedStream, CacheKind, CacheLayout, SDKError, create_request
from kvdrop_sdk.server.pool import shm_path, unique_shm_name
from kvdrop_sdk.testing.server import spawn_server
from kvdrop_sdk.testing.toy import ToyEngine

pytestmark = pytest.mark.timeout(180)

CHUNK = 256
LAYOUT = CacheLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.float32)


def toks(i: int, n: int = 2 * CHUNK) -> list[int]:
    return list(range(1000 * i, 1000 * i + n))


def kv_for(i: int, n: int = 2 * CHUNK) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(CacheKind.KV, n), generator=torch.Generator().manual_seed(i))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def same_place_flags() -> dict[str, Any]:
    """Flags that make a restarted server come back at the same ports and shm name."""
    return {
        "shm_name": unique_shm_name("kvdrop_test"),
        "port": free_port(),
        "http_port": free_port(),
        "l1_size_gb": 0.02,
        "chunk_size": CHUNK,
    }


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_shm_client_across_a_restart_writes_into_the_new_segment(sig: int) -> None:
    flags = same_place_flags()
    name = flags["shm_name"]
    try:
        with spawn_server(check_exit=False, **flags) as srv:
            ctx = sdk.kvcache.connect(srv.url, srv.http_url, "m", 5, layout=LAYOUT, transport="shm")
            assert ctx.store(kv_for(0), toks(0))
            old_instance = srv.config["instance"]
            srv.stop(sig)
        with spawn_server(**flags) as srv2:
            assert srv2.config["instance"] != old_instance
            reader = sdk.kvcache.connect(
                srv2.url, srv2.http_url, "m", 5, layout=LAYOUT, transport="shm"
            )
            # The old client stores into the NEW server's segment, never the unlinked old one.
            assert ctx.store(kv_for(1), toks(1)) is True
            assert torch.equal(reader.retrieve(toks(1)), kv_for(1))
            assert torch.equal(ctx.retrieve(toks(1)), kv_for(1))
            assert ctx.retrieve(toks(0)) is None  # the new server never held it
            assert reader.store(kv_for(2), toks(2))
            assert torch.equal(ctx.retrieve(toks(2)), kv_for(2))
            assert ctx.transfer_ctx.instance == srv2.config["instance"]
            ctx.close()
            reader.close()
    finally:
        if os.path.exists(shm_path(name)):
            os.unlink(shm_path(name))


def test_restart_with_another_layout_is_a_clear_error() -> None:
    flags = same_place_flags()
    other = CacheLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.float16)
    with spawn_server(**flags) as srv:
        owner = sdk.kvcache.connect(srv.url, srv.http_url, "m", 5, layout=LAYOUT)
        ctx = sdk.kvcache.connect(srv.url, srv.http_url, "m", 5)  # reads the layout, registers none
        assert ctx.store(kv_for(3), toks(3))
        owner.close()
        srv.stop()
    with spawn_server(**flags) as srv2:
        with sdk.kvcache.connect(srv2.url, srv2.http_url, "m", 5, layout=other):
            with pytest.raises(SDKError, match=r"layout.*changed"):
                ctx.store(kv_for(4), toks(4))
        ctx.close()


def test_server_killed_mid_batch_then_restarted(tmp_path: Any) -> None:
    """8 streams prefill/modify/decode while the server is SIGKILLed and restarted: every call
    either succeeds or fails with a clear error within its timeout, and nothing read afterwards
    is wrong (the toy engine checks every cached element against its formula)."""
    flags = same_place_flags()
    name = flags["shm_name"]
    layout = CacheLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.float32)
    timeout = 3.0
    try:
        with spawn_server(check_exit=False, **flags) as srv:
            engine = ToyEngine.connect(srv.url, srv.http_url, "toy", layout, timeout=timeout)
            ctx = engine.kv_ctx
            prompts = [[(97 * s + t) % 30000 for t in range(600)] for s in range(8)]
            batch = BatchedStream(max_concurrency=8, modify_concurrency=8)
            for p in prompts:
                batch.add(create_request(ctx, engine, p))
            batch.prefill()

            def slow_edit(t: dict[CacheKind, torch.Tensor], k: list[int]) -> Any:
                time.sleep(1.0)  # the server is killed while every stream is inside its edit
                return t[CacheKind.KV][:, :, :CHUNK], k[:CHUNK]

            killer = threading.Timer(0.3, lambda: srv.proc.send_signal(signal.SIGKILL))
            killer.start()
            started = time.monotonic()
            with pytest.raises(sdk.BatchedStreamError) as info:
                batch.modify(slow_edit, timeout=2)  # the edit (1 s) fits; the store does not
            killer.join()
            srv.proc.wait()
            assert time.monotonic() - started < 3 * timeout + 5  # each call gave up in time
            failures = info.value.failures  # type: ignore[attr-defined]
            assert len(failures) == len(prompts)
            for err in failures.values():
                assert f"no reply from kvdrop server at {srv.url} within 3 s" in str(err), err
        with spawn_server(**flags) as srv2:
            # Same ports and name: the same contexts carry on against the new server.
            batch.decode({"max_tokens": 4})  # raises if any stream fails
            again = BatchedStream(max_concurrency=8)
            for p in prompts:
                again.add(create_request(ctx, engine, p))
            again.prefill()
            again.prefill()  # second time: reuses, and the toy engine checks, every cached row
            assert srv2.status()["hits"] >= 8
            engine.close()
    finally:
        if os.path.exists(shm_path(name)):
            os.unlink(shm_path(name))


def test_unclosed_context_in_a_reference_cycle_is_collected_without_hanging() -> None:
    with spawn_server(l1_size_gb=0.01) as srv:
        script = textwrap.dedent(
            f"""
            import gc
            import torch
            import kvdrop_sdk as sdk
            from kvdrop_sdk import CacheLayout

            def run():
                layout = CacheLayout(2, 2, 16, torch.float32)
                ctx = sdk.kvcache.connect({srv.url!r}, {srv.http_url!r}, "gc", 10, layout=layout)
                ctx.lookup(list(range(256)))  # leaves a pooled socket open
                try:
                    raise RuntimeError("modify failed")
                except RuntimeError as exc:
                    ctx.last_error = exc  # ctx -> exc -> traceback -> frame -> ctx

            run()
            gc.collect()
            print("collected", flush=True)
            """
        )
        proc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0 and "collected" in proc.stdout, proc.stderr[-2000:]
