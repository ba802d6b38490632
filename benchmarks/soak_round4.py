"""Soak phase ``round4``: issue 33's hostile clients beside good ones.

Engine part: ``kvdrop engine --random-preset tiny --policy knorm`` with a small KV budget (so
cut requests are preempted) as a subprocess on 127.0.0.1. Four good clients post short greedy
completions and check each reply against their first (``soak_round3_engine``), first alone
(quiet), then beside: override bombs (``leverage(sketch_dimension=4000)``, a 3,000-term spec,
``expected-attention(n_future_positions=4000000)``, a plugin the operator did not allow: each must
be a 400), preemption under cut (200-token prompts cut to half, 120 tokens each, several at once:
each reply must equal that prompt's first reply), ``prompt_logprobs`` (a 3,000-token prompt
scored, an answer over the bound refused with a 400, and clients that leave after 0.3 s).

Cache-server part: a ``kvdrop server --quarantine-s 1`` where one client keeps a reservation
open past its lease and quarantine (its slot is then verified by checksum) while a writer stores
into the pool and a third client's lookups are timed, against the same lookups with no held
reservation. Used by ``benchmarks/soak.py --phases round4``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import requests
import torch

from soak_round3 import _p99, _rss
from soak_round3_engine import _engine, _metrics, _run_good

Row = dict[str, Any]
CUT_PROMPT, CUT_TOKENS = 200, 120
BOMBS = (
    "leverage(sketch_dimension=4000)",
    "+".join(["knorm"] * 3000),
    "expected-attention(n_future_positions=4000000)",
    "cap(n_future_positions=400000)",
    "value-norm",  # a plugin's policy: not allowed by --client-policies builtin
)


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=body, timeout=timeout)


def _bombs(url: str, count: Callable[[str], None], stop: threading.Event) -> None:
    """Override bombs, round and round: each must be refused with a 400 at once."""
    prompt = [3 + t % 400 for t in range(300)]
    for spec in itertools.cycle(BOMBS):
        if stop.wait(0.2):
            return
        body = {"prompt": prompt, "max_tokens": 4, "kvdrop": {"policy": spec}}
        started = time.monotonic()
        try:
            r = _post(url, body, 30)
            count(f"override bomb answered {r.status_code}")
            count(f"override bomb answered within {1 if time.monotonic() - started < 1 else 30} s")
        except requests.RequestException as exc:
            count(f"override bomb: {type(exc).__name__}")


def _cut_prompt(n: int) -> list[int]:
    gen = torch.Generator().manual_seed(n)
    return torch.randint(3, 500, (CUT_PROMPT,), generator=gen).tolist()


def _preempted(url: str, count: Callable[[str], None], stop: threading.Event,
               seen: dict[int, list[int]], lock: threading.Lock) -> None:  # fmt: skip
    """Batches of six cut requests of 120 greedy tokens, one a second (beside the scoring they
    outgrow the budget and are preempted): each reply must equal the first reply to its
    prompt."""
    n = 0
    while not stop.is_set():
        n += 1
        prompts = [(n + k) % 6 for k in range(6)]
        replies: list[Any] = [None] * 6
        threads = [
            threading.Thread(target=_one_cut, args=(url, p, replies, k))
            for k, p in enumerate(prompts)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        stop.wait(1.0)
        for p, r in zip(prompts, replies, strict=True):
            if not isinstance(r, requests.Response) or r.status_code != 200:
                count(f"cut request failed: {getattr(r, 'status_code', r)!s:.80}")
                continue
            toks = r.json()["choices"][0]["logprobs"]["tokens"]
            with lock:
                same = seen.setdefault(p, toks) == toks
            count("cut request: same answer" if same else "cut request: OTHER answer")


def _one_cut(url: str, p: int, replies: list[Any], k: int) -> None:
    body = {"prompt": _cut_prompt(p), "max_tokens": CUT_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "logprobs": 0}
    try:
        replies[k] = _post(url, body)
    except requests.RequestException as exc:
        replies[k] = exc


def _scoring(url: str, count: Callable[[str], None], stop: threading.Event) -> None:
    """prompt_logprobs: a 3,000-token prompt scored, an answer over the bound (400), and a
    client that posts 16 x 1,000-token prompts and leaves after 0.3 s."""
    long = [3 + (t * 7) % 500 for t in range(3000)]
    many = [[3 + (t * 11 + k) % 500 for t in range(1000)] for k in range(16)]
    huge = [[3 + (t + k) % 500 for t in range(1000)] for k in range(64)]
    while not stop.is_set():
        try:
            r = _post(url, {"prompt": long, "max_tokens": 1, "prompt_logprobs": 1})
            count(f"3,000-token prompt_logprobs answered {r.status_code}")
            body = {"prompt": huge, "max_tokens": 4, "prompt_logprobs": 20, "logprobs": 20}
            count(f"97 MB-answer request answered {_post(url, body).status_code}")
            raw = json.dumps({"prompt": many, "max_tokens": 1, "prompt_logprobs": 0}).encode()
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(raw)}\r\n\r\n".encode()
                    + raw
                )
                time.sleep(0.3)
            count("16 x 1,000-token scorings left after 0.3 s")
        except requests.RequestException as exc:
            count(f"scoring: {type(exc).__name__}")
        stop.wait(1.0)


def _engine_row(seconds: float) -> Row:
    seen: dict[Any, list[int]] = {}
    flags = ("--policy", "knorm", "--kv-budget-tokens", "3584")
    with _engine(*flags) as (proc, url):
        rss0 = _rss(proc.pid)
        quiet = _run_good(url, seconds, [], seen)
        before = _metrics(url)
        h: Counter[str] = Counter()
        lock, peak = threading.Lock(), [rss0]
        cut_seen: dict[int, list[int]] = {}

        def count(key: str) -> None:
            with lock:
                h[key] += 1

        def sample(stop: threading.Event) -> None:
            while not stop.wait(0.1):
                peak[0] = max(peak[0], _rss(proc.pid))

        hostile = [
            lambda stop: _bombs(url, count, stop),
            lambda stop: _preempted(url, count, stop, cut_seen, lock),
            lambda stop: _scoring(url, count, stop),
            sample,
        ]
        loud = _run_good(url, seconds, hostile, seen)
        time.sleep(2.0)  # the last abandoned scoring's watcher has cancelled it
        after = _metrics(url)
        stats = requests.get(f"{url}/stats", timeout=10).json()
        rss = (rss0, peak[0], _rss(proc.pid))
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    p99q, p99h = _p99(quiet.latencies), _p99(loud.latencies)
    failed = quiet.c["good_failed"] + loud.c["good_failed"]
    wrong = quiet.c["wrong"] + loud.c["wrong"] + h["cut request: OTHER answer"]
    bombs_ok = all(k.endswith("400") for k in h if k.startswith("override bomb answered 4"))
    rss_ok = rss[2] - rss[0] < 100 << 20
    ok = failed == 0 and wrong == 0 and rss_ok and p99h <= 1.5 * max(p99q, 0.005) and bombs_ok
    hostile_s = "; ".join(f"{k}: {v:,}" for k, v in sorted(h.items()))
    measured = (
        f"{seconds:g} s quiet then {seconds:g} s with override bombs, preempted cut requests "
        f"and prompt scoring: good requests {quiet.c['good_requests']:,} + "
        f"{loud.c['good_requests']:,}, failed {failed}; wrong replies {wrong}; good p99 "
        f"{p99q * 1000:.1f} ms quiet, {p99h * 1000:.1f} ms hostile "
        f"({p99h / max(p99q, 1e-9):.2f}x); engine RSS {rss[0] / 2**20:.0f} MiB at start, peak "
        f"{rss[1] / 2**20:.0f} MiB, {rss[2] / 2**20:.0f} MiB at the end "
        f"({(rss[2] - rss[0]) / 2**20:+.0f} MiB); preemptions {stats.get('preemptions', 0)}, "
        f"prompt cuts {stats.get('prompt_cuts', 0)}; requests aborted "
        f"{int(d.get('requests_abort', 0))}; hostile: {hostile_s}"
    )
    return {
        "check": "round 4 hostile clients, engine",
        "measured": measured,
        "result": "ok" if ok else "FAIL",
        "reads": quiet.c["reads"] + loud.c["reads"],
        "lost": wrong,
        "p99_quiet_s": p99q,
        "p99_hostile_s": p99h,
        "rss_start": rss[0],
        "rss_end": rss[2],
    }


def soak_round4(args: argparse.Namespace) -> list[Row]:
    """The rows of the ``round4`` phase."""
    seconds = float(getattr(args, "round4_s", 20.0))
    return [_engine_row(seconds), _server_row(seconds)]


def _server_row(seconds: float) -> Row:
    """Lookups of a third client with and without a reservation held past lease and quarantine
    (its slot verified by checksum, now outside the store's lock)."""
    from kvdrop_sdk import CacheKind, CacheLayout, kvcache
    from kvdrop_sdk.hashing import encode_tokens
    from kvdrop_sdk.protocol import RpcClient
    from kvdrop_sdk.testing.server import spawn_server, wait_until

    layout = CacheLayout(num_layers=2, num_heads=2, head_dim=16, dtype=torch.float32)
    chunk = 256
    chunk_bytes = layout.nbytes(CacheKind.KV, chunk)
    pool_gb = 64 * chunk_bytes / 1024**3

    def timed(srv: Any, stop: threading.Event) -> list[float]:
        times: list[float] = []

        def writer() -> None:
            with kvcache.connect(srv.url, srv.http_url, "s", 10, layout=layout) as ctx:
                for j in itertools.count():
                    if stop.is_set():
                        return
                    toks = [1_000_000 + (j % 200) * 4 * chunk + t for t in range(4 * chunk)]
                    kv = torch.randn(layout.shape(CacheKind.KV, 4 * chunk))
                    ctx.store(kv, toks)
                    ctx.retrieve(toks)

        th = threading.Thread(target=writer, daemon=True)
        th.start()
        with kvcache.connect(srv.url, srv.http_url, "s", 10, layout=layout) as reader:
            end = time.monotonic() + seconds / 2
            while time.monotonic() < end:
                started = time.monotonic()
                reader.lookup(list(range(4 * chunk)))
                times.append(time.monotonic() - started)
        stop.set()
        th.join(30)
        return times

    with spawn_server(l1_size_gb=pool_gb, chunk_size=chunk, quarantine_s=1) as srv:
        quiet = timed(srv, threading.Event())
        with RpcClient(srv.url, 10) as held:  # stays connected: its slot stays suspect
            head = {"model": "s", "kind": "kv", "salt": ""}
            held.call("register", {**head, "layout": layout.to_json()})
            held.call("reserve", {**head, "lease_s": 0.2}, [encode_tokens(list(range(chunk)))])
            wait_until(lambda: srv.status()["suspect_reservations"] == 1, 15)
            loud = timed(srv, threading.Event())
            verified = srv.status()["verified_chunks"]
    mq, ml = statistics.median(quiet), statistics.median(loud)
    ok = ml <= 1.5 * max(mq, 1e-4) and verified > 0
    measured = (
        f"a third client's lookups beside a writer, {seconds / 2:g} s each: median "
        f"{mq * 1000:.2f} ms, longest {max(quiet) * 1000:.1f} ms with no held reservation; "
        f"median {ml * 1000:.2f} ms, longest {max(loud) * 1000:.1f} ms with one held past lease "
        f"and --quarantine-s 1 ({verified:,} chunks verified by checksum meanwhile)"
    )
    return {
        "check": "round 4 held reservation, cache server",
        "measured": measured,
        "result": "ok" if ok else "FAIL",
        "lookup_median_quiet_s": mq,
        "lookup_median_held_s": ml,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--round4-s", type=float, default=20.0)
    for r in soak_round4(p.parse_args()):
        print(f"{r['result']}  {r['check']}: {r['measured']}")
    sys.exit(0)
