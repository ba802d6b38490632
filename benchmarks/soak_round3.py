"""Soak phase ``round3``: the hostile clients of issue 28 beside good ones, against a quiet run.

Good clients (two over shared memory, two over the socket) store and read back their own chunks
and check every byte, first alone (the quiet run), then while hostile clients run beside them:
a lease hog (pins until ``too_many_leases``), a flood of 4-byte score records, writers that
reserve the pool and are SIGKILLed, a shm writer stalled past its lease and the quarantine that
then overwrites its old slots, HTTP tricklers (a byte every 0.5 s), idle HTTP connections past
the connection bound, 32 MB bodies, and NaN token scores. Reported: server RSS (start, peak),
wrong reads, good requests failed, the good clients' p99 latency in both runs, and how each
hostile client was answered. Used by ``benchmarks/soak.py --phases round3``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

import kvdrop_sdk as sdk
from kvdrop_sdk import CacheKind, CacheLayout
from kvdrop_sdk.errors import SDKError
from kvdrop_sdk.hashing import encode_tokens
from kvdrop_sdk.protocol import RpcClient, RpcError
from kvdrop_sdk.server.pool import shm_path
from kvdrop_sdk.testing.server import spawn_server

Row = dict[str, Any]
CHUNK = 32
KV = CacheLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.float32)
Q = CacheLayout(num_layers=2, num_heads=4, head_dim=8, dtype=torch.float32)
# Plain pyzmq (no torch import: spawning it must not load the machine the good clients run on).
_KILLED_WRITER = """
import json, sys, time, array, zmq
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.connect(sys.argv[1])
head = {"v": 1, "client": "crash-%d" % int(sys.argv[2]), "model": "crash", "kind": "kv", "salt": ""}
def call(op, rid, frames=(), **fields):
    sock.send_multipart([json.dumps({**head, "op": op, "rid": rid, **fields}).encode(), *frames])
    return json.loads(sock.recv_multipart()[0])
call("register", 1, layout=json.loads(sys.argv[3]))
first = int(sys.argv[2])
toks = array.array("q", range(first, first + 2048)).tobytes()
assert call("reserve", 2, [toks], lease_s=600)["ok"]
print("held", flush=True)
time.sleep(600)
"""


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return int(next(x for x in fh if x.startswith("VmRSS:")).split()[1]) * 1024


def _prompt(client: int, j: int) -> list[int]:
    return [(client * 1_000_003 + j * 7919 + t) % 50_000 for t in range(4 * CHUNK)]


def _kv(client: int, j: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(client * 1000 + j)
    return torch.randn(KV.shape(CacheKind.KV, 4 * CHUNK), generator=g)


class _Tally:
    def __init__(self) -> None:
        self.c: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.lock = threading.Lock()

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] += n


def _good(srv: Any, i: int, mode: str, stop: threading.Event, t: _Tally) -> None:
    """Store and read back this client's prompts; every byte read is checked, every call timed."""
    with sdk.kvcache.connect(srv.url, srv.http_url, f"good{i}", 10, layout=KV, transport=mode) as c:
        j = 0
        while not stop.is_set():
            j += 1  # fresh prompts: the pool churns, every freed slot is reused soon
            started = time.monotonic()
            try:
                c.store(_kv(i, j), _prompt(i, j))
                middle = time.monotonic()
                got = c.retrieve(_prompt(i, j))
                ended = time.monotonic()
            except SDKError as exc:
                t.add("good_failed")
                t.add(f"failed:{str(exc)[:100]}")
                continue
            with t.lock:
                t.latencies += [middle - started, ended - middle]
                t.c["good_requests"] += 2
            if got is not None:
                t.add("reads")
                t.add("wrong", int(not torch.equal(got, _kv(i, j)[:, :, : got.shape[2]])))


def _run_good(srv: Any, seconds: float, hostile: list[Callable[[threading.Event], None]]) -> _Tally:
    t, stop = _Tally(), threading.Event()
    threads = [
        threading.Thread(target=_good, args=(srv, i, mode, stop, t))
        for i, mode in enumerate(["shm", "shm", "socket", "socket"])
    ]
    for th in threads:
        th.start()
    time.sleep(1.0)  # the good clients have read /config and connected
    extra = [threading.Thread(target=h, args=(stop,), daemon=True) for h in hostile]
    for th in extra:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in threads + extra:
        th.join(60)
    return t


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def _hostiles(srv: Any, h: Counter[str], lock: threading.Lock) -> list[Callable[[Any], None]]:
    def count(key: str) -> None:
        with lock:
            h[key] += 1

    def lease_hog(stop: threading.Event) -> None:
        with RpcClient(srv.url, 10) as rpc:
            head = {"model": "hog", "kind": "kv", "salt": ""}
            rpc.call("register", {**head, "layout": KV.to_json()})
            rpc.call(
                "put",
                {**head, "dtype": "float32", "shape": list(KV.shape(CacheKind.KV, CHUNK))},
                [encode_tokens(list(range(CHUNK))), *_rows(CHUNK)],
            )
            while not stop.is_set():
                try:
                    rpc.call("pin", {**head, "lease_s": 600}, [encode_tokens(list(range(CHUNK)))])
                    count("hog pins granted")
                except RpcError as exc:
                    count(f"hog refused {exc.code}")
                    time.sleep(0.005)

    def score_flood(stop: threading.Event) -> None:
        with RpcClient(srv.url, 10) as rpc:
            head = {"model": "flood##query", "kind": "query", "salt": ""}
            rpc.call("register", {**head, "layout": Q.to_json()})
            k = 0
            while not stop.is_set():
                k += 1
                fields = {**head, "record": "scores", "rows": 1, "heads": 1}
                value = float("nan") if k % 50 == 0 else 1.0
                scores = torch.full((2, 1, 1), value).numpy().tobytes()
                try:
                    rpc.call("put_window", fields, [encode_tokens([k]), scores])
                    count("score records sent")
                except RpcError as exc:
                    count(f"scores refused {exc.code}")

    def killed_writers(stop: threading.Event) -> None:
        layout = json.dumps(KV.to_json())
        n = 0
        while not stop.is_set():
            n += 1
            proc = subprocess.Popen(
                [sys.executable, "-c", _KILLED_WRITER, srv.url, str(n * 10_000), layout],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout is not None
            if proc.stdout.readline().strip() == "held":
                proc.kill()
                count("writers SIGKILLed holding reservations")
            proc.wait(30)
            stop.wait(1.0)

    def stalled_writer(stop: threading.Event) -> None:
        with RpcClient(srv.url, 10) as rpc:
            head = {"model": "stall", "kind": "kv", "salt": ""}
            rpc.call("register", {**head, "layout": KV.to_json()})
            n = 0
            while not stop.is_set():
                n += 1
                res, _ = rpc.call(
                    "reserve",
                    {**head, "lease_s": 0.2},
                    [encode_tokens(list(range(n * 1000, n * 1000 + 4 * CHUNK)))],
                )
                stop.wait(3.0)  # past the lease and the 1 s quarantine: slots reused, verified
                with open(shm_path(srv.shm_name), "r+b") as fh:
                    mm = mmap.mmap(fh.fileno(), 0)
                    for off in res.get("offsets") or []:
                        mm[off : off + res["nbytes"]] = b"\xff" * res["nbytes"]
                    mm.close()
                count("late shm overwrites")
                try:
                    rpc.call("commit", {"lease": res["lease"]})
                except RpcError as exc:
                    count(f"stalled commit {exc.code}")

    def http_hostile(stop: threading.Event) -> None:
        port = srv.http_port
        burst = []
        for _ in range(48):  # over the bound of 32: the rest are answered 503
            try:
                burst.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                count("http connect refused")
        time.sleep(0.5)
        for s in burst:
            s.settimeout(0.5)
            try:
                if s.recv(12)[9:12] == b"503":
                    count("connections over the bound answered 503")
            except OSError:
                pass
            s.close()
        socks: list[socket.socket] = []
        while not stop.is_set():
            for _ in range(16 - len(socks)):  # trickling connections
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                    s.sendall(b"GET /health HTTP/1.1\r\nX: ")
                    socks.append(s)
                except OSError:
                    count("http connect refused")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(b"GET / HTTP/1.1\r\nContent-Length: 33554432\r\n\r\n")
                    count(f"32 MB body answered {s.recv(12)[9:12].decode() or 'closed'}")
            except OSError:
                count("32 MB body: connection reset")
            for s in list(socks):
                try:
                    s.sendall(b"a")
                except OSError:
                    socks.remove(s)
                    count("trickler closed by the server")
                    s.close()
            stop.wait(0.5)
        for s in socks:
            s.close()

    return [lease_hog, score_flood, killed_writers, stalled_writer, http_hostile]


def _rows(tokens: int) -> list[bytes]:
    t = torch.zeros(KV.shape(CacheKind.KV, tokens))
    return [t[a, b].numpy().tobytes() for a in range(t.shape[0]) for b in range(t.shape[1])]


def soak_round3(args: argparse.Namespace) -> list[Row]:
    """The row of the ``round3`` phase."""
    seconds = float(getattr(args, "round3_s", 20.0))
    flags = dict(
        chunk_size=CHUNK,
        l1_size_gb=0.003,
        enable=["transfer_query"],
        quarantine_s=1,
        max_client_leases=256,
        http_timeout_s=2,
        http_max_connections=32,
    )
    with spawn_server(**flags) as srv:
        pid = srv.proc.pid
        rss0 = _rss(pid)
        quiet = _run_good(srv, seconds, [])
        h: Counter[str] = Counter()
        lock = threading.Lock()
        peak = [rss0]

        def sample(stop: threading.Event) -> None:
            while not stop.wait(0.2):
                peak[0] = max(peak[0], _rss(pid))

        loud = _run_good(srv, seconds, [*_hostiles(srv, h, lock), sample])
        status = srv.status()
    p99q, p99h = _p99(quiet.latencies), _p99(loud.latencies)
    wrong = quiet.c["wrong"] + loud.c["wrong"]
    failed = quiet.c["good_failed"] + loud.c["good_failed"]
    rss_ok = peak[0] - rss0 < 256 << 20
    ok = wrong == 0 and failed == 0 and rss_ok and p99h <= 2 * max(p99q, 0.005)
    hostile = "; ".join(f"{k}: {v:,}" for k, v in sorted(h.items()))
    failures = [k for k in loud.c if k.startswith("failed:")][:3]
    measured = (
        f"{seconds:g} s quiet then {seconds:g} s with 5 hostile clients: good requests "
        f"{quiet.c['good_requests']:,} + {loud.c['good_requests']:,}, failed {failed}"
        f"{' ' + str(failures) if failures else ''}; wrong reads {wrong} in "
        f"{quiet.c['reads'] + loud.c['reads']:,}; good "
        f"p99 {p99q * 1000:.1f} ms quiet, {p99h * 1000:.1f} ms hostile "
        f"({p99h / max(p99q, 1e-9):.2f}x); server RSS {rss0 / 2**20:.0f} MiB at start, peak "
        f"{peak[0] / 2**20:.0f} MiB; hostile: {hostile}; server: {status['corrupted_chunks']} "
        f"overwritten chunks dropped, {status['verified_chunks']} verified, "
        f"{status['clients_gone']} gone clients cleaned up, {status['windows']} score records "
        f"kept ({status['window_bytes'] / 2**20:.1f} of "
        f"{status['window_capacity_bytes'] / 2**20:.0f} MiB)"
    )
    row = {
        "check": "round 3 hostile clients",
        "measured": measured,
        "result": "ok" if ok else "FAIL",
        "reads": quiet.c["reads"] + loud.c["reads"],
        "lost": wrong,
        "p99_quiet_s": p99q,
        "p99_hostile_s": p99h,
        "rss_start": rss0,
        "rss_peak": peak[0],
    }
    return [row]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--round3-s", type=float, default=20.0)
    for r in soak_round3(p.parse_args()):
        print(f"{r['result']}  {r['check']}: {r['measured']}")
    sys.exit(0)
