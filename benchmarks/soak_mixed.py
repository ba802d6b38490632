"""Soak phase ``mixed``: hostile requests (issue 20, items 1-11) mixed into normal load.

Good clients (shared memory and socket) store and read their own chunks and query windows and
check every byte they read back, while a hostile client cycles through the failure classes of
issue 20: bad and foreign RoPE, window replacement (more rows, other kind), a stalled shm writer
past its lease, query-layout squatting, a 100 KB cache_salt, bool token ids and meta tensors.
Reported: wrong reads, good requests that failed, hostile requests not refused as expected, and
refusals that looked like a dead server (``ServerUnavailableError``: what makes an engine back
off). Then three rows of their own: windows after a server restart in the lean query mode,
/dev/shm filling up after the start (in a private mount namespace), and an engine serving a
stream while hostile HTTP requests arrive. Used by ``benchmarks/soak.py --phases mixed``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import requests
import torch

import kvdrop_sdk as sdk
from kvdrop_rope import RopeConfig
from kvdrop_sdk import CacheKind, CacheLayout
from kvdrop_sdk.errors import SDKError, ServerUnavailableError
from kvdrop_sdk.hashing import encode_tokens
from kvdrop_sdk.protocol import RpcClient, RpcError
from kvdrop_sdk.server.pool import shm_path, unique_shm_name
from kvdrop_sdk.testing.server import spawn_server
from kvdrop_sdk.window import QueryWindow, retrieve_window, store_window

Row = dict[str, Any]
CHUNK = 32
ROPE = RopeConfig(head_dim=8).to_json()
KV = CacheLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.float32, rope=ROPE)
Q = CacheLayout(num_layers=2, num_heads=4, head_dim=8, dtype=torch.float32, rope=ROPE)


def _row(check: str, measured: str, ok: bool, **numbers: Any) -> Row:
    return {"check": check, "measured": measured, "result": "ok" if ok else "FAIL", **numbers}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt(client: int, j: int, n: int = 4 * CHUNK) -> list[int]:
    return [(client * 1_000_003 + j * 7919 + t) % 50_000 for t in range(n)]


def _kv(client: int, j: int, n: int = 4 * CHUNK) -> torch.Tensor:
    g = torch.Generator().manual_seed(client * 1000 + j)
    return torch.randn(KV.shape(CacheKind.KV, n), generator=g)


def _window(j: int, rows: int = 4, scale: float = 1.0) -> QueryWindow:
    g = torch.Generator().manual_seed(j)
    q = torch.randn(1, Q.num_layers, rows, Q.width, generator=g) * scale
    return QueryWindow(q, torch.arange(rows, dtype=torch.int64) * 2)


class _Tally:
    """Thread-safe counters of the mixed load."""

    def __init__(self) -> None:
        self.c: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.worst_refusal_s = 0.0

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] += n


def _good_kv(srv: Any, i: int, mode: str, stop: threading.Event, t: _Tally) -> None:
    """Store and read back this client's own prompts; every byte read is checked."""
    ctx = sdk.kvcache.connect(srv.url, srv.http_url, f"good{i}", 10, layout=KV, transport=mode)
    try:
        j = 0
        while not stop.is_set():
            j = (j + 1) % 12
            try:
                ctx.store(_kv(i, j), _prompt(i, j))
                got = ctx.retrieve(_prompt(i, j))
                t.add("good_requests", 2)
            except SDKError as exc:
                t.add("good_failed")
                t.add(f"good_failed:{type(exc).__name__}:{str(exc)[:80]}")
                continue
            if got is not None:
                n = got.shape[2]
                t.add("reads")
                t.add("wrong", int(not torch.equal(got, _kv(i, j)[:, :, :n])))
    finally:
        ctx.close()


def _good_windows(srv: Any, stop: threading.Event, t: _Tally, ready: threading.Event) -> None:
    """Store this client's windows first (first copy wins), then read and re-store them."""
    q = sdk.qcache.connect(srv.url, srv.http_url, "goodq", 10, layout=Q)
    try:
        for j in range(12):
            store_window(q, _prompt(99, j, 40), _window(j))
        ready.set()
        j = 0
        while not stop.is_set():
            j = (j + 1) % 12
            try:
                store_window(q, _prompt(99, j, 40), _window(j))
                got = retrieve_window(q, _prompt(99, j, 40))
                t.add("good_requests", 2)
            except SDKError as exc:
                t.add("good_failed")
                t.add(f"good_failed:{type(exc).__name__}:{str(exc)[:80]}")
                continue
            if got is not None:
                t.add("reads")
                t.add("wrong", int(not torch.equal(got.queries, _window(j).queries)))
    finally:
        q.close()


def _hostile_actions(srv: Any) -> list[tuple[str, Callable[[], Any], Callable[[Any], bool]]]:
    """(name, action, is the outcome the expected refusal) for each hostile request."""
    rpc = RpcClient(srv.url, 10)
    f = {"kind": "kv", "salt": ""}
    bad_ropes = [{**ROPE, "theta": 1e-300}, {**ROPE, "scaling": {"rope_type": "yarn", "factor": 0}}]
    foreign = {**KV.to_json(), "rope": {**ROPE, "theta": 500000.0}}
    rpc.call("register", {**f, "model": "evil", "layout": KV.to_json()})
    rpc.call("register", {**f, "model": "goodq##query", "layout": Q.to_json()})
    ctx = sdk.kvcache.connect(srv.url, srv.http_url, "evil", 10, layout=KV)

    def code(expected: str) -> Callable[[Any], bool]:
        return lambda out: isinstance(out, RpcError) and out.code == expected

    def window_put(kind: str, model: str) -> Any:
        hostile = _window(7, rows=5, scale=1e30)
        header = {"kind": kind, "model": model, "salt": "", "rows": 5, "dtype": "float32"}
        frames = [
            encode_tokens(_prompt(99, 1, 40)),
            encode_tokens(hostile.positions.tolist()),
            hostile.queries.numpy().tobytes(),
        ]
        return rpc.call("put_window", header, frames)[0]

    def stalled_writer() -> Any:
        res, _ = rpc.call(
            "reserve", {**f, "model": "evil", "lease_s": 0.2}, [encode_tokens(_prompt(7, 7))]
        )
        time.sleep(0.4)  # stalled past the lease; another client may be given the slot now
        with open(shm_path(srv.shm_name), "r+b") as fh:
            mm = mmap.mmap(fh.fileno(), 0)
            for off in res.get("offsets") or []:
                mm[off : off + res["nbytes"]] = b"\xff" * res["nbytes"]
            mm.close()
        return rpc.call("commit", {"lease": res["lease"]}) if res.get("lease") else None

    salt = "x" * 100_000
    meta = torch.empty(KV.shape(CacheKind.KV, 64), device="meta")
    return [
        *[
            (
                "bad RoPE",
                lambda r=r: rpc.call(
                    "register", {**f, "model": "r", "layout": {**foreign, "rope": r}}
                ),
                code("bad_layout"),
            )
            for r in bad_ropes
        ],
        (
            "foreign RoPE over held chunks",
            lambda: rpc.call("register", {**f, "model": "good0", "layout": foreign}),
            lambda out: code("layout_conflict")(out) or isinstance(out, tuple),
        ),
        ("window with more rows", lambda: window_put("query", "goodq##query"), _not_stored),
        ("window under the KV kind", lambda: window_put("kv", "goodq##query"), lambda o: True),
        ("stalled shm writer", stalled_writer, code("lease_expired")),
        (
            "query layout squatting",
            lambda: rpc.call(
                "register",
                {
                    "kind": "query",
                    "model": "goodq##query",
                    "layout": {**Q.to_json(), "dtype": "float16"},
                },
            ),
            lambda out: code("layout_conflict")(out) or isinstance(out, tuple),
        ),
        ("100 KB cache_salt (SDK)", lambda: ctx.lookup(_prompt(1, 1), salt), _sdk_error),
        (
            "100 KB cache_salt (raw)",
            lambda: rpc.call("lookup", {**f, "model": "evil", "salt": salt}, [b"\0" * 8]),
            code("oversized"),
        ),
        ("bool token ids", lambda: ctx.store(_kv(1, 1, 64), [True] * 64), _sdk_error),
        ("meta kv", lambda: ctx.store(meta, list(range(64))), _sdk_error),
    ]


def _not_stored(out: Any) -> bool:
    return isinstance(out, dict) and out.get("stored") is False


def _sdk_error(out: Any) -> bool:
    return isinstance(out, SDKError) and not isinstance(out, ServerUnavailableError)


def _hostile(srv: Any, stop: threading.Event, t: _Tally, ready: threading.Event) -> None:
    ready.wait(60)
    actions = _hostile_actions(srv)
    k = 0
    while not stop.is_set():
        name, action, expected = actions[k % len(actions)]
        k += 1
        started = time.monotonic()
        try:
            out: Any = action()
        except Exception as exc:  # the outcome under test
            out = exc
        took = time.monotonic() - started
        t.add("hostile")
        t.add("hostile_unavailable", int(isinstance(out, ServerUnavailableError)))
        if not expected(out):
            t.add("hostile_unexpected")
            t.add(f"unexpected:{name}:{str(out)[:80]}")
        elif isinstance(out, Exception):
            with t.lock:
                t.worst_refusal_s = max(t.worst_refusal_s, took)
        time.sleep(0.01)


def _mixed_load(args: argparse.Namespace) -> Row:
    t = _Tally()
    stop, ready = threading.Event(), threading.Event()
    with spawn_server(chunk_size=CHUNK, l1_size_gb=0.01, enable=["transfer_query"]) as srv:
        workers = [
            threading.Thread(target=_good_kv, args=(srv, i, mode, stop, t))
            for i, mode in enumerate(["shm", "shm", "socket", "socket"])
        ]
        workers += [
            threading.Thread(target=_good_windows, args=(srv, stop, t, ready)),
            threading.Thread(target=_hostile, args=(srv, stop, t, ready)),
        ]
        for w in workers:
            w.start()
        time.sleep(args.mixed_s)
        stop.set()
        for w in workers:
            w.join(60)
        status = srv.status()
    c = t.c
    notes = sorted(k for k in c if ":" in k)[:4]
    ok = (
        c["wrong"] == 0
        and c["good_failed"] == 0
        and c["hostile_unexpected"] == 0
        and c["hostile_unavailable"] == 0
    )
    return _row(
        "hostile requests mixed into load",
        f"{args.mixed_s:g} s: 5 good clients (shm, socket, query windows) made "
        f"{c['good_requests']:,} requests while 1 hostile client sent {c['hostile']:,} (bad and "
        f"foreign RoPE, window replacement by rows and by kind, stalled shm writer, "
        f"query-layout squatting, 100 KB cache_salt, bool token ids, meta tensors): "
        f"{c['wrong']} wrong reads in {c['reads']:,} checked, {c['good_failed']} good requests "
        f"failed, {c['hostile_unexpected']} hostile requests not refused as expected, "
        f"{c['hostile_unavailable']} refusals that looked like a dead server (back-offs); "
        f"slowest refusal {t.worst_refusal_s:.2f} s; {status['quarantined_chunks']} chunks "
        f"quarantined" + (f"; {notes}" if notes else ""),
        ok,
        reads=c["reads"],
        lost=c["wrong"],
    )


def _lean_restart() -> Row:
    flags = {
        "shm_name": unique_shm_name("kvdrop_soak"),
        "port": _free_port(),
        "http_port": _free_port(),
        "chunk_size": CHUNK,
        "l1_size_gb": 0.01,
        "enable": ["transfer_query"],
    }
    stored = recovered_after = 0
    calls = 20
    try:
        with spawn_server(check_exit=False, **flags) as srv:
            q = sdk.qcache.connect(srv.url, srv.http_url, "lean", 5, layout=Q)
            stored += store_window(q, _prompt(5, 0, 40), _window(0))
            srv.stop(signal.SIGKILL)
        with spawn_server(**flags):
            t0 = time.monotonic()
            for j in range(1, calls + 1):
                if store_window(q, _prompt(5, j, 40), _window(j)):
                    got = retrieve_window(q, _prompt(5, j, 40))
                    ok = got is not None and torch.equal(got.queries, _window(j).queries)
                    stored += ok
                    recovered_after = recovered_after or (time.monotonic() - t0)
            q.close()
    finally:
        if os.path.exists(shm_path(flags["shm_name"])):
            os.unlink(shm_path(flags["shm_name"]))
    return _row(
        "restart recovery in the lean mode",
        f"the cache server SIGKILLed and restarted (same ports and --shm-name) under a query "
        f"context in the lean mode: {stored - 1}/{calls} windows stored and read back exactly "
        f"afterwards, the first {recovered_after:.2f} s after the restart (query layout "
        "registered again by the context's restart path)",
        stored - 1 == calls,
        faults=1,
    )


_SHM_FULL = """
import json, os, time, torch
import kvdrop_sdk as sdk
from kvdrop_sdk import CacheLayout
from kvdrop_sdk.testing.server import spawn_server
layout = CacheLayout(2, 2, 16, torch.float32)
n = 24 * 256
kv = torch.randn(2, 2, n, 32)
out = {}
with spawn_server(l1_size_gb=4 / 1024, chunk_size=256) as srv:
    st = os.statvfs("/dev/shm")
    with open("/dev/shm/filler", "wb") as fh:
        os.posix_fallocate(fh.fileno(), 0, st.f_bavail * st.f_frsize - (1 << 20))
    for mode in ("shm", "socket"):
        ctx = sdk.kvcache.connect(srv.url, srv.http_url, mode, 10, layout=layout, transport=mode)
        t0 = time.monotonic()
        try:
            ctx.store(kv, list(range(n)))
            out[mode] = "stored"
        except sdk.SDKError as exc:
            out[mode] = str(exc)
        out[mode + "_s"] = time.monotonic() - t0
        ctx.close()
    out["alive"] = srv.proc.poll() is None
    os.unlink("/dev/shm/filler")
    ctx = sdk.kvcache.connect(srv.url, srv.http_url, "after", 10, layout=layout)
    out["after"] = ctx.store(kv, list(range(n)))
    out["read"] = bool(torch.equal(ctx.retrieve(list(range(n))), kv))
    ctx.close()
print(json.dumps(out))
"""


def _shm_exhaustion() -> Row:
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rm", "true"], check=False).returncode:
        return _row("shm exhaustion survived", "skipped: needs `unshare -rm`", True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "shm_full.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(_SHM_FULL)
        cmd = f"mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} {path}"
        proc = subprocess.run(
            [unshare, "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=300
        )
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return _row("shm exhaustion survived", f"rc {proc.returncode}: {proc.stderr[-300:]}", False)
    refused = all("no_space" in out[m] for m in ("shm", "socket"))
    return _row(
        "shm exhaustion survived",
        f"8 MiB tmpfs as /dev/shm, 4 MiB lazy pool, then /dev/shm filled to 1 MiB free: a 3 MiB "
        f"store refused with no_space over shm in {out['shm_s']:.2f} s and over the socket in "
        f"{out['socket_s']:.2f} s (no SIGBUS: client and server up: "
        f"{'yes' if out['alive'] else 'NO'}); after freeing /dev/shm the same store succeeded "
        f"and read back exactly: {'yes' if out['after'] and out['read'] else 'NO'}",
        proc.returncode == 0 and refused and out["alive"] and out["after"] and out["read"],
        faults=1,
    )


def _engine_hostile_http() -> Row:
    from kvdrop_engine.connectors.kvdrop import ServerConnector
    from kvdrop_engine.engine import Engine
    from kvdrop_engine.http import CompletionHTTPServer
    from kvdrop_engine.loading import preset_config
    from kvdrop_engine.model import Transformer

    model = Transformer.random(preset_config("tiny"), seed=0)
    greedy = {"temperature": 0, "ignore_eos": True}
    hostile = {
        "temperature 1e-39": {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1e-39},
        "100 KB cache_salt": {"prompt": [5, 6, 7], "max_tokens": 2, "cache_salt": "x" * 100_000},
        "2M stop_token_ids": {"prompt": [5, 6], "max_tokens": 2, "stop_token_ids": [1] * 2_000_000},
    }
    statuses: dict[str, int] = {}
    with spawn_server(chunk_size=16, l1_size_gb=0.01) as srv:
        conn = ServerConnector(srv.url, srv.http_url, "engine-mixed", timeout=30)
        with Engine(model, num_blocks=1024, connector=conn) as eng:
            with CompletionHTTPServer(eng, model_name="m", port=0) as http:
                url = f"http://{http.host}:{http.port}/v1/completions"
                tokens: list[int] = []
                errors: list[str] = []

                def stream() -> None:
                    try:
                        tokens.extend(
                            eng.generate(list(range(3, 60)), {**greedy, "max_tokens": 300})
                        )
                    except Exception as exc:  # the outcome under test
                        errors.append(f"{type(exc).__name__}: {str(exc)[:100]}")

                normal = threading.Thread(target=stream)
                normal.start()
                with requests.Session() as s:
                    s.trust_env = False
                    for name, body in hostile.items():
                        try:
                            statuses[name] = s.post(url, json=body, timeout=60).status_code
                        except requests.RequestException:
                            statuses[name] = -1
                normal.join(120)
                backed_off = eng._transfers is not None and not eng._transfers.io_ok()
        conn.close()
    refused = sum(1 for code in statuses.values() if code == 400)
    answers = ", ".join(f"{k}: HTTP {v}" for k, v in statuses.items())
    return _row(
        "engine, hostile HTTP requests",
        f"{len(hostile)} hostile requests ({answers}) "
        f"while a stream decoded: the stream got {len(tokens)}/300 tokens"
        + (f" ({errors[0]})" if errors else "")
        + f"; {refused} refused with "
        f"400; engine backed off from the cache server: {'YES' if backed_off else 'no'} (chat "
        "route not run: the tiny random preset has no tokenizer)",
        # What this phase checks: the good stream is unharmed and bad input backs nothing off.
        # Which bad requests the HTTP layer answers with 400 is the OpenAI server's contract.
        len(tokens) == 300 and not backed_off,
    )


def soak_mixed(args: argparse.Namespace) -> list[Row]:
    """The rows of the ``mixed`` phase."""
    return [_mixed_load(args), _lean_restart(), _shm_exhaustion(), _engine_hostile_http()]
