"""Reliability soak: fuzzed messages, sustained load, 64 streams, faults and hostile clients.

The long form of the reliability tests (``tests/**/test_reliability.py``, ``test_fuzz.py``,
``test_context_faults.py``, ``test_engine_faults.py``). Every server runs as a subprocess on
127.0.0.1; nothing leaves the machine. Prints one table row per check (what was done, what was
measured, ok/FAIL) and exits 1 if any check failed.

    python benchmarks/soak.py                 # a few minutes
    python benchmarks/soak.py --quick         # about a minute
    python benchmarks/soak.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import requests
import torch
import zmq

import kvdrop_sdk as sdk
from kvdrop_sdk import BatchedStream, CacheKind, CacheLayout, create_request
from kvdrop_sdk.errors import SDKError
from kvdrop_sdk.hashing import encode_tokens
from kvdrop_sdk.protocol import RpcClient, RpcError, encode_header
from kvdrop_sdk.server.pool import shm_path, unique_shm_name
from kvdrop_sdk.table import format_table
from kvdrop_sdk.testing.fuzz import FuzzTarget, fuzz_messages, send_fuzz
from kvdrop_sdk.testing.server import spawn_server, spawn_server_in_child
from kvdrop_sdk.testing.toy import ToyEngine
from soak_mixed import soak_mixed
from soak_round3 import soak_round3
from soak_round3_engine import soak_round3_engine
from soak_round4 import soak_round4

Row = dict[str, Any]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return int(next(x for x in fh if x.startswith("VmRSS:")).split()[1]) * 1024


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``cond()`` held, or None if it did not within ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def _row(check: str, measured: str, ok: bool, **numbers: Any) -> Row:
    return {"check": check, "measured": measured, "result": "ok" if ok else "FAIL", **numbers}


# -- fuzz ------------------------------------------------------------------------------------------
def soak_fuzz(args: argparse.Namespace) -> list[Row]:
    layout = CacheLayout(num_layers=2, num_heads=1, head_dim=8, dtype=torch.float32)
    chunk = 16
    with spawn_server(chunk_size=chunk, l1_size_gb=0.05, max_lease_s=2) as srv:
        checked = []
        with sdk.kvcache.connect(srv.url, srv.http_url, "checked/m", 10, layout=layout) as ctx:
            for i in range(16):
                toks = list(range(1000 * i, 1000 * i + 4 * chunk))
                kv = torch.randn(
                    layout.shape(CacheKind.KV, 4 * chunk),
                    generator=torch.Generator().manual_seed(i),
                )
                ctx.store(kv, toks)
                checked.append((toks, kv))
        with sdk.kvcache.connect(srv.url, srv.http_url, "fuzz/m", 10, layout=layout):
            pass
        target = FuzzTarget("fuzz/m", layout, chunk)
        per = args.messages // args.fuzz_clients
        reports: list[Any] = [None] * args.fuzz_clients

        def client(k: int) -> None:
            reports[k] = send_fuzz(srv.url, fuzz_messages(100 + k, per, target))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.fuzz_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        sent = sum(r.sent for r in reports)
        unclear = sum(r.no_reply + r.malformed_replies for r in reports)
        internal = sum(r.codes.get("internal", 0) for r in reports)
        codes = set().union(*(r.codes for r in reports))
        intact = 0
        for transport in ("shm", "socket"):
            with sdk.kvcache.connect(
                srv.url, srv.http_url, "checked/m", 10, transport=transport
            ) as c:
                for toks, want in checked:
                    got = c.retrieve(toks)
                    intact += got is not None and torch.equal(got, want)
        healthy = requests.get(f"{srv.http_url}/health", timeout=10).json()["status"] == "ok"
    ok = unclear == 0 and internal == 0 and intact == 2 * len(checked) and healthy
    return [
        _row(
            "messages fuzzed",
            f"{sent:,} generated messages from {args.fuzz_clients} clients in {seconds:.0f} s: "
            f"{unclear} without a well-formed reply, {internal} 'internal', {len(codes)} distinct "
            f"error codes; {intact}/{2 * len(checked)} checked retrieves byte-identical",
            ok,
            messages=sent,
            reads=2 * len(checked),
            lost=2 * len(checked) - intact,
        )
    ]


# -- load ------------------------------------------------------------------------------------------
def soak_load(args: argparse.Namespace) -> list[Row]:
    layout = CacheLayout(num_layers=4, num_heads=2, head_dim=64, dtype=torch.bfloat16)
    chunk = 64
    chunk_bytes = layout.nbytes(CacheKind.KV, chunk)  # 128 KiB
    slots = 128  # a 16 MiB pool
    per_req = 4

    def expected(w: int, i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(w * 1_000_003 + i)
        return torch.randn(layout.shape(CacheKind.KV, per_req * chunk), generator=gen).to(
            layout.dtype
        )

    def tokens(w: int, i: int) -> list[int]:
        base = (w * 1_000_003 + i) * 1000
        return list(range(base, base + per_req * chunk))

    stats = {"written": 0, "read": 0, "hits": 0, "misses": 0, "wrong": 0, "errors": 0}
    lock = threading.Lock()
    with spawn_server(chunk_size=chunk, l1_size_gb=slots * chunk_bytes / 1024**3) as srv:
        pool = int(srv.config["l1_bytes"])
        rss0 = _rss(srv.proc.pid)
        peak = [rss0]
        done = threading.Event()
        progress = [0] * args.writers

        def writer(w: int, transport: str) -> None:
            with sdk.kvcache.connect(
                srv.url, srv.http_url, "load", 30, layout=layout, transport=transport
            ) as ctx:
                i = 0
                while not done.is_set():
                    try:
                        ctx.store(expected(w, i), tokens(w, i))
                        with lock:
                            stats["written"] += per_req * chunk_bytes
                    except SDKError:
                        with lock:
                            stats["errors"] += 1
                    i += 1
                    progress[w] = i

        def reader(r: int, transport: str) -> None:
            rng = random.Random(r)
            with sdk.kvcache.connect(
                srv.url, srv.http_url, "load", 30, layout=layout, transport=transport
            ) as ctx:
                while not done.is_set():
                    w = rng.randrange(args.writers)
                    if progress[w] == 0:
                        time.sleep(0.01)
                        continue
                    i = rng.randrange(max(0, progress[w] - 3 * slots // per_req), progress[w])
                    got = ctx.retrieve(tokens(w, i))
                    with lock:
                        if got is None:
                            stats["misses"] += 1
                            continue
                        stats["hits"] += 1
                        stats["read"] += got.numel() * got.element_size()
                    want = expected(w, i)[:, :, : got.shape[2]]
                    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                        with lock:
                            stats["wrong"] += 1

        transports = ["shm", "socket"]
        threads = [
            threading.Thread(target=writer, args=(w, transports[w % 2]))
            for w in range(args.writers)
        ] + [
            threading.Thread(target=reader, args=(r, transports[r % 2]))
            for r in range(args.readers)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        while time.perf_counter() - t0 < args.load_s:
            peak[0] = max(peak[0], _rss(srv.proc.pid))
            time.sleep(0.5)
        done.set()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        status = srv.status()
    growth = peak[0] - rss0
    ok = stats["wrong"] == 0 and stats["errors"] == 0 and growth < pool + (64 << 20)
    return [
        _row(
            "load held",
            f"{args.writers} writers + {args.readers} readers (shm and socket) for {seconds:.0f} s "
            f"on a {pool >> 20} MiB pool: {stats['written'] / 2**30:.2f} GiB written "
            f"({stats['written'] / pool:.0f}x the pool), {stats['read'] / 2**30:.2f} GiB read, "
            f"{status['evictions']:,} evictions, {stats['hits']:,} hits exact, "
            f"{stats['wrong']} wrong, {stats['misses']:,} misses; server RSS +{growth >> 20} MiB",
            ok,
            bytes_written=stats["written"],
            load_s=seconds,
            pool_bytes=pool,
            reads=stats["hits"],
            lost=stats["wrong"],
        )
    ]


# -- 64 streams ------------------------------------------------------------------------------------
def _toy_batch(engine: ToyEngine, prompts: list[list[int]], **kw: Any) -> BatchedStream:
    batch = BatchedStream(max_concurrency=len(prompts), **kw)
    contexts = [engine.kv_ctx] + ([engine.q_ctx] if engine.q_ctx is not None else [])
    for p in prompts:
        batch.add(create_request(contexts, engine, p))
    return batch


def soak_streams(args: argparse.Namespace) -> list[Row]:
    layout = CacheLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.float32)
    qlayout = CacheLayout(num_layers=2, num_heads=4, head_dim=8, dtype=torch.float32)
    chunk = 32
    failures = 0
    calls = 0
    with spawn_server(chunk_size=chunk, l1_size_gb=0.1, enable=["transfer_query"]) as srv:
        engine = ToyEngine.connect(
            srv.url, srv.http_url, "streams", layout, query_layout=qlayout, timeout=60
        )
        try:
            for rnd in range(args.stream_rounds):
                prompts = [
                    [(131 * s + 7 * t + rnd * 977) % 30_000 for t in range(3 * chunk + s)]
                    for s in range(64)
                ]
                batch = _toy_batch(engine, prompts, modify_concurrency=16)
                try:
                    batch.prefill()
                    batch.modify(
                        lambda t, k: (
                            t[CacheKind.KV][:, :, list(range(chunk)) + list(range(-chunk, 0))],
                            k[:chunk] + k[-chunk:],
                        )
                    )
                    batch.decode({"max_tokens": 4})
                    batch.prefill()  # the toy engine checks every reused element again
                except sdk.BatchedStreamError as exc:
                    failures += len(getattr(exc, "failures", {})) or 1
            calls = len(engine.calls)
        finally:
            engine.close()
    return [
        _row(
            "64 concurrent streams",
            f"{args.stream_rounds} rounds x 64 streams (prefill, modify, decode, re-prefill; "
            f"{calls:,} engine calls, every reused KV/query element checked): "
            f"{failures} streams read anything but their own rows",
            failures == 0,
            reads=calls,
            lost=failures,
        )
    ]


# -- faults ----------------------------------------------------------------------------------------
def soak_faults(args: argparse.Namespace) -> list[Row]:
    rows = []
    layout = CacheLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.float32)
    flags = {
        "shm_name": unique_shm_name("kvdrop_soak"),
        "port": _free_port(),
        "http_port": _free_port(),
        "chunk_size": 32,
        "l1_size_gb": 0.02,
    }
    timeout = 2.0
    survived = 0
    worst = 0.0
    unclear = 0
    wrong_after = 0
    prompts = [[(97 * s + t) % 30_000 for t in range(200)] for s in range(8)]
    engine: ToyEngine | None = None
    try:
        for cycle in range(args.fault_cycles):
            sig = signal.SIGKILL if cycle % 2 == 0 else signal.SIGTERM
            with spawn_server(check_exit=False, **flags) as srv:
                if engine is None:
                    engine = ToyEngine.connect(
                        srv.url, srv.http_url, "faults", layout, timeout=timeout
                    )
                batch = _toy_batch(engine, prompts, modify_concurrency=8)
                try:
                    batch.prefill()  # against the new server: recomputes, checks, stores
                    batch.decode({"max_tokens": 2})
                except sdk.BatchedStreamError:
                    wrong_after += 1

                def slow(t: dict[CacheKind, torch.Tensor], k: list[int]) -> Any:
                    time.sleep(0.5)
                    return t[CacheKind.KV][:, :, :32], k[:32]

                killed_at = [0.0]

                def kill(
                    proc: Any = srv.proc, sig: int = sig, stamp: list[float] = killed_at
                ) -> None:
                    stamp[0] = time.monotonic()
                    proc.send_signal(sig)

                timer = threading.Timer(0.2, kill)
                timer.start()
                try:
                    batch.modify(slow, timeout=1)
                except sdk.BatchedStreamError as exc:
                    for err in getattr(exc, "failures", {}).values():
                        if "no reply" not in str(err) and "kvdrop server" not in str(err):
                            unclear += 1
                timer.join()
                worst = max(worst, time.monotonic() - killed_at[0])
                srv.proc.wait()
            survived += 1
        with spawn_server(**flags) as srv:  # the same name and ports once more: no wrong data
            assert engine is not None
            batch = _toy_batch(engine, prompts)
            try:
                batch.prefill()
                batch.prefill()
            except sdk.BatchedStreamError:
                wrong_after += 1
    finally:
        if engine is not None:
            engine.close()
        if os.path.exists(shm_path(flags["shm_name"])):
            os.unlink(shm_path(flags["shm_name"]))
    rows.append(
        _row(
            "server faults mid-batch",
            f"{survived}/{args.fault_cycles} SIGKILL/SIGTERM of the server while 8 streams were "
            f"editing, each followed by a restart with the same --shm-name and ports: every "
            f"pending call failed within {worst:.1f} s (timeout {timeout:g} s), {unclear} "
            f"unclear errors, {wrong_after} batches with wrong data after the restarts",
            survived == args.fault_cycles and unclear == 0 and wrong_after == 0,
            faults=survived,
            lost=wrong_after,
        )
    )
    rows.append(_client_kill())
    rows.append(_parent_kill())
    return rows


def _client_kill() -> Row:
    layout = CacheLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.float32)
    with spawn_server(chunk_size=32, l1_size_gb=0.01) as srv:
        with sdk.kvcache.connect(srv.url, srv.http_url, "m", 10, layout=layout) as ctx:
            ctx.store(torch.zeros(layout.shape(CacheKind.KV, 64)), list(range(64)))
        script = textwrap.dedent(
            f"""
            import sys
            from kvdrop_sdk.hashing import encode_tokens
            from kvdrop_sdk.protocol import RpcClient
            rpc = RpcClient({srv.url!r}, 10)
            f = {{"model": "m", "kind": "kv", "salt": "", "lease_s": 1.0}}
            rpc.call("pin", f, [encode_tokens(list(range(64)))])
            rpc.call("reserve", f, [encode_tokens(list(range(100, 164)))])
            print("held", flush=True)
            sys.stdin.read()
            """
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        proc.stdout.readline()
        held = srv.status()
        proc.kill()
        proc.wait()

        def free() -> bool:
            s = srv.status()
            return s["pinned_objects"] == 0 and s["reserved_objects"] == 0

        took = _wait(free, 10)
    ok = took is not None and held["pinned_objects"] == 2 and held["reserved_objects"] == 2
    return _row(
        "client SIGKILL",
        f"a client holding 2 pinned + 2 reserved chunks (1 s leases) was SIGKILLed: reclaimed "
        f"after {took if took is None else round(took, 2)} s",
        ok,
        faults=1,
    )


def _parent_kill() -> Row:
    parent, pid, name = spawn_server_in_child()
    parent.kill()
    parent.wait()
    gone = _wait(lambda: not _alive(pid), 10)
    unlinked = _wait(lambda: not os.path.exists(shm_path(name)), 5)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    return _row(
        "parent SIGKILL",
        f"the process that ran spawn_server was SIGKILLed: server exited after "
        f"{gone if gone is None else round(gone, 2)} s, segment unlinked: "
        f"{'yes' if unlinked is not None else 'NO'}",
        gone is not None and unlinked is not None,
        faults=1,
    )


# -- hostile clients -------------------------------------------------------------------------------
def soak_hostile(args: argparse.Namespace) -> list[Row]:
    layout = CacheLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.float32)
    refused = attempts = 0
    with spawn_server(chunk_size=32, l1_size_gb=0.05, http_timeout_s=0.5) as srv:
        with sdk.kvcache.connect(srv.url, srv.http_url, "m", 10, layout=layout) as ctx:
            for i in range(20):
                ctx.store(torch.zeros(layout.shape(CacheKind.KV, 64)), list(range(i, i + 64)))
        owner, thief = RpcClient(srv.url, 10), RpcClient(srv.url, 10)
        f = {"model": "m", "kind": "kv", "salt": "", "lease_s": 30}
        for i in range(20):
            pin, _ = owner.call("pin", f, [encode_tokens(list(range(i, i + 64)))])
            for op in ("release", "commit", "abort"):
                attempts += 1
                try:
                    thief.call(op, {"lease": pin["lease"]})
                except RpcError as exc:
                    refused += exc.code == "unknown_lease"
            owner.call("release", {"lease": pin["lease"]})
        owner.close()
        thief.close()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.url)
        big = b"\0" * (40 << 20)
        sock.send_multipart([encode_header({"v": 1, "op": "ping", "rid": 1}), big, big])
        huge = sock.poll(20_000) and json.loads(sock.recv_multipart()[0])["code"] == "oversized"
        sock.send(b"[" * 30_000 + b"]" * 30_000)
        nested = sock.poll(10_000) and json.loads(sock.recv_multipart()[0])["code"] == "bad_header"
        sock.close(0)
        wrong = CacheLayout(num_layers=1, num_heads=1, head_dim=4, dtype=torch.float16)
        sdk.kvcache.connect(srv.url, srv.http_url, "squat", 10, layout=wrong).close()
        with sdk.kvcache.connect(srv.url, srv.http_url, "squat", 10, layout=layout) as real:
            squat_ok = real.layout == layout
        conns = [socket.create_connection(("127.0.0.1", srv.http_port)) for _ in range(100)]
        for c in conns:
            c.sendall(b"GET /status HTTP/1.1\r\n")
        time.sleep(1.5)
        closed = 0
        for c in conns:
            c.settimeout(5)
            closed += c.recv(100) == b""
            c.close()
    return [
        _row(
            "hostile clients",
            f"foreign lease release/commit/abort refused {refused}/{attempts}; 80 MiB "
            f"2-frame message refused whole: {'yes' if huge else 'NO'}; 30k-deep JSON header: "
            f"bad_header {'yes' if nested else 'NO'}; layout squatter displaced: "
            f"{'yes' if squat_ok else 'NO'}; idle half-sent HTTP requests closed {closed}/100",
            refused == attempts and huge and nested and squat_ok and closed == 100,
        )
    ]


# -- engine ----------------------------------------------------------------------------------------
def soak_engine(args: argparse.Namespace) -> list[Row]:
    from kvdrop_engine.connectors.kvdrop import ServerConnector
    from kvdrop_engine.engine import Engine
    from kvdrop_engine.http import CompletionHTTPServer
    from kvdrop_engine.loading import preset_config
    from kvdrop_engine.model import Transformer

    model = Transformer.random(preset_config("tiny"), seed=0)
    greedy = {"temperature": 0, "ignore_eos": True}
    gaps: list[float] = []
    with spawn_server(chunk_size=16, l1_size_gb=0.01, check_exit=False) as srv:
        conn = ServerConnector(srv.url, srv.http_url, "engine-soak", timeout=30)
        eng = Engine(model, num_blocks=2048, connector=conn, load_timeout_s=1.0)
        try:
            running = eng.post_completion(list(range(3, 8)), {**greedy, "max_tokens": 20_000})
            next(running)
            srv.proc.send_signal(signal.SIGSTOP)
            newcomers = [list(range(100 + 7 * k, 100 + 7 * k + 330)) for k in range(4)]
            finished = []

            def newcomer(p: list[int]) -> None:
                finished.append(len(eng.generate(p, {**greedy, "max_tokens": 3})))

            workers = [threading.Thread(target=newcomer, args=(p,)) for p in newcomers]
            last = time.monotonic()
            for w in workers:
                w.start()
            for _ in running:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                if len(finished) == len(newcomers) and len(gaps) > 50:
                    break
            running.close()
            for w in workers:
                w.join(30)
            fallbacks = eng.stats().connector_fallbacks
        finally:
            srv.proc.send_signal(signal.SIGCONT)
            eng.stop()
            conn.close()
    rows = [
        _row(
            "engine, cache server hung",
            f"server SIGSTOPped while a stream decoded and 4 new 330-token prompts arrived "
            f"(load_timeout_s 1): "
            f"{len(finished)}/4 finished by recompute ({fallbacks} fallbacks), longest decode "
            f"gap of the running stream {max(gaps):.2f} s",
            len(finished) == 4 and max(gaps) < 5.0,
            faults=1,
        )
    ]
    with Engine(model, num_blocks=2048) as eng2:
        with CompletionHTTPServer(eng2, model_name="m", port=0) as http:
            body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4000, **greedy}).encode()
            for _ in range(8):
                s = socket.create_connection((http.host, http.port))
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                time.sleep(0.1)
                s.close()
            _wait(lambda: eng2.num_free_blocks == eng2.num_blocks, 20)
            computed = eng2.stats().decode_tokens_computed
    rows.append(
        _row(
            "engine, abandoned requests",
            f"8 non-streaming requests of max_tokens 4000 abandoned after 0.1 s: "
            f"{computed:,} tokens computed of 32,000",
            computed < 8 * 400,
        )
    )
    return rows


PHASES: dict[str, Callable[[argparse.Namespace], list[Row]]] = {
    "fuzz": soak_fuzz,
    "load": soak_load,
    "streams": soak_streams,
    "faults": soak_faults,
    "hostile": soak_hostile,
    "engine": soak_engine,
    "mixed": soak_mixed,
    "round3": soak_round3,
    "round3-engine": soak_round3_engine,
    "round4": soak_round4,
}


TRUST = (
    "every shared-memory client maps the whole pool read-write (all models and salts): only "
    "processes trusted like the server itself may use the shm transport; others use the socket"
)


def summary(rows: list[Row]) -> list[dict[str, str]]:
    """The five figures of docs/reliability.md, from the detailed rows."""
    by = {r["check"]: r for r in rows}
    out = []
    if "messages fuzzed" in by:
        r = by["messages fuzzed"]
        out.append({"figure": "messages fuzzed", "value": f"{r['messages']:,} ({r['result']})"})
    if "load held" in by:
        r = by["load held"]
        out.append(
            {
                "figure": "load held",
                "value": f"{r['bytes_written'] / 2**30:.2f} GiB written = "
                f"{r['bytes_written'] / r['pool_bytes']:.0f}x the pool in {r['load_s']:.0f} s "
                f"({r['result']})",
            }
        )
    faulty = [r for r in rows if r.get("faults")]
    if faulty:
        total = sum(r["faults"] for r in faulty)
        ok = sum(r["faults"] for r in faulty if r["result"] == "ok")
        out.append({"figure": "faults survived", "value": f"{ok}/{total}"})
    reads = sum(r.get("reads", 0) for r in rows)
    lost = sum(r.get("lost", 0) for r in rows)
    out.append({"figure": "bytes lost", "value": f"{lost} wrong reads in {reads:,} checked"})
    out.append({"figure": "trust boundary (shm)", "value": TRUST})
    return out


def run(args: argparse.Namespace) -> Iterator[Row]:
    for name in args.phases:
        yield from PHASES[name](args)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run the phases, print the table (or JSON); exit 1 if a check failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short run (about a minute)")
    p.add_argument("--messages", type=int, default=100_000, help="fuzzed messages in total")
    p.add_argument("--fuzz-clients", type=int, default=4)
    p.add_argument("--load-s", type=float, default=60.0, help="seconds of sustained load")
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--stream-rounds", type=int, default=5)
    p.add_argument("--fault-cycles", type=int, default=10)
    p.add_argument("--mixed-s", type=float, default=30.0, help="seconds of hostile + good load")
    p.add_argument(
        "--round3-s", type=float, default=20.0, help="seconds of each run of the round3 phases"
    )
    p.add_argument(
        "--round4-s", type=float, default=20.0, help="seconds of each run of the round4 phase"
    )
    p.add_argument(
        "--engine-args",
        default="",
        help="extra `kvdrop engine` flags for the round4 phase's engine, e.g. "
        "'--max-client-prefill-tokens 16'",
    )
    p.add_argument(
        "--engine-cpus",
        default="",
        help="CPUs for the round4 phase's engine, e.g. '0-3' (the soak and its clients take the "
        "others, as clients on other machines would); '' shares every CPU",
    )
    p.add_argument(
        "--round4-salt",
        default="hostile",
        help="the cache_salt of the round4 phase's hostile requests (one tenant, as the engine's "
        "per-client prefill and KV shares see it); '' for none",
    )
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated of {list(PHASES)}")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    args = p.parse_args(argv)
    if args.quick:
        args.messages, args.load_s, args.stream_rounds, args.fault_cycles = 10_000, 10.0, 1, 2
        args.mixed_s = args.round3_s = args.round4_s = 8.0
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = [x for x in args.phases if x not in PHASES]
    if unknown:
        p.error(f"unknown phase(s) {unknown}; expected some of {list(PHASES)}")
    t0 = time.perf_counter()
    rows = []
    for row in run(args):
        rows.append(row)
        if not args.json:
            print(
                f"[{time.perf_counter() - t0:6.0f} s] {row['result']:4}  {row['check']}", flush=True
            )
    failed = [r for r in rows if r["result"] != "ok"]
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary(rows), "seconds": seconds}, indent=2))
    elif args.markdown:
        print(f"\ncpus {os.cpu_count()}, load avg {os.getloadavg()[0]:.1f}, {seconds:.0f} s\n")
        print("| figure | value |\n|---|---|")
        print("\n".join(f"| {r['figure']} | {r['value']} |" for r in summary(rows)))
        print("\n| check | result | measured |\n|---|---|---|")
        print("\n".join(f"| {r['check']} | {r['result']} | {r['measured']} |" for r in rows))
    else:
        print(f"\ncpus {os.cpu_count()}, load avg {os.getloadavg()[0]:.1f}, {seconds:.0f} s\n")
        print(format_table(rows, ["check", "result", "measured"]))
        print()
        print(format_table(summary(rows), ["figure", "value"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
