"""Soak phase ``round3-engine``: issue 28's hostile HTTP clients against ``kvdrop engine``.

The engine runs as a subprocess (``kvdrop engine --random-preset tiny``) on 127.0.0.1. Four good
clients (keep-alive sessions) post short greedy ``/v1/completions`` of token-id prompts and check
each reply (one choice, ``max_tokens`` token ids, finish ``length``, the same ids as the first
reply to that prompt), first alone (the quiet run), then beside hostile clients: 32 MB
``[{},{},...]`` bodies (413), a ``Content-Length`` over the limit (413 before the body),
tricklers sending a byte every 0.5 s (closed at the request deadline), bursts of connections
over ``--max-connections`` (503), and clients that post a long prompt and disconnect before its
first token (the engine must cancel it: ``/metrics`` shows how much of them was computed).
Reported: engine RSS (start, peak), good requests and failures, good p99 quiet vs hostile, and
how each hostile client was answered. Used by ``benchmarks/soak.py --phases round3-engine``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import requests

from soak_round3 import _p99, _rss, _Tally

Row = dict[str, Any]
MAX_TOKENS = 8
MAX_CONNECTIONS = 32
LONG_PROMPT = 3000
LONG_MAX_TOKENS = 1000
ABANDONED = "long prompts abandoned before their first token"
#: 32 MB of ``[{},{},...]``, within ``--max-request-bytes`` (33,554,432): read, then refused by
#: the JSON pre-scan (413) before ``json.loads`` would build ~800 MB of dicts.
_BIG = b"[" + b"{}," * ((32_000_000 - 3) // 3) + b"{}]"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_cpus(spec: str) -> frozenset[int]:
    """The engine's CPUs of ``spec`` (``'0-3,8'`` -> {0, 1, 2, 3, 8}; ``''``: none, all shared);
    this process (the soak's clients and their children) moves to the others. ValueError if
    it leaves no CPU for the clients."""
    cpus: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if cpus:
        rest = os.sched_getaffinity(0) - cpus
        if not rest:
            raise ValueError(f"engine CPUs {spec!r} leave no CPU for the clients")
        os.sched_setaffinity(0, rest)
    return frozenset(cpus)


def pinned(cpus: frozenset[int]) -> Callable[[], None] | None:
    """A ``preexec_fn`` that runs the child on ``cpus`` (None: inherited)."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


@contextmanager
def _engine(
    *extra: str, cpus: frozenset[int] = frozenset()
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``kvdrop engine`` (with ``extra`` flags) on a free port, ready on ``/health``; stopped
    (and reaped) after. ``cpus``: the engine's CPU affinity (empty: inherited)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kvdrop", "engine", "--random-preset", "tiny", "--port", str(port)]
    cmd += ["--max-connections", str(MAX_CONNECTIONS), "--request-timeout-s", "2"]
    cmd += ["--max-prefill-tokens", "128", "--return-tokens-as-token-ids", *extra]
    log = tempfile.TemporaryFile()  # not a pipe: a full pipe would block the engine's logging
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pinned(cpus))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"kvdrop engine exited: {log.read().decode()[-2000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvdrop engine not healthy after 120 s")
            time.sleep(0.1)
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def _prompt(client: int, j: int) -> list[int]:
    return [3 + (client * 97 + j * 31 + t) % 500 for t in range(16)]


def _check(reply: requests.Response) -> list[int]:
    """The reply's token ids; AssertionError if it is not one choice of MAX_TOKENS ids."""
    assert reply.status_code == 200, f"status {reply.status_code}: {reply.text[:100]}"
    body = reply.json()
    (choice,) = body["choices"]
    tokens = choice["logprobs"]["tokens"]
    assert choice["finish_reason"] == "length", choice["finish_reason"]
    assert len(tokens) == MAX_TOKENS == body["usage"]["completion_tokens"], tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _good(url: str, i: int, stop: threading.Event, t: _Tally, seen: dict[Any, list[int]]) -> None:
    """Post this client's eight prompts round and round; every reply checked, every call timed."""
    with requests.Session() as session:
        for j in itertools.cycle(range(8)):
            if stop.is_set():
                return
            body = {"prompt": _prompt(i, j), "max_tokens": MAX_TOKENS, "temperature": 0}
            body |= {"ignore_eos": True, "logprobs": 0}
            started = time.monotonic()
            try:
                ids = _check(session.post(f"{url}/v1/completions", json=body, timeout=30))
            except (requests.RequestException, AssertionError, KeyError, ValueError) as exc:
                t.add("good_failed")
                t.add(f"failed:{type(exc).__name__}: {str(exc)[:100]}")
                continue
            with t.lock:
                t.latencies.append(time.monotonic() - started)
                t.c["good_requests"] += 1
                t.c["reads"] += 1
                t.c["wrong"] += int(seen.setdefault((i, j), ids) != ids)


def _run_good(url: str, seconds: float, hostile: list[Callable[[threading.Event], None]],
              seen: dict[Any, list[int]]) -> _Tally:  # fmt: skip
    t, stop = _Tally(), threading.Event()
    threads = [threading.Thread(target=_good, args=(url, i, stop, t, seen)) for i in range(4)]
    threads += [threading.Thread(target=h, args=(stop,), daemon=True) for h in hostile]
    for th in threads:
        th.start()
    stop.wait(seconds)
    stop.set()
    for th in threads:
        th.join(60)
    return t


def _status(s: socket.socket) -> str:
    """The status code the server answered on ``s``, or 'closed'."""
    try:
        return s.recv(12)[9:12].decode() or "closed"
    except OSError:
        return "reset"


def _connect(port: int) -> socket.socket:
    """A client socket to the engine (10 s timeout on each read and write)."""
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _big_bodies(port: int, count: Callable[[str], None], stop: threading.Event) -> None:
    """Every 0.5 s: a 32 MB ``[{},...]`` body (read, then 413) and a 1 GiB ``Content-Length``
    (413 before the body)."""
    head = b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
    while not stop.wait(0.5):
        try:
            with _connect(port) as s:
                s.sendall(head + f"Content-Length: {len(_BIG)}\r\n\r\n".encode() + _BIG)
                count(f"32 MB [{{}},...] body answered {_status(s)}")
            with _connect(port) as s:
                s.sendall(head + b"Content-Length: 1073741824\r\n\r\n")
                count(f"1 GiB Content-Length answered {_status(s)}")
        except OSError:  # the server refused it (503 while a burst held the bound)
            count("big body: reset while sending")


def _tricklers(port: int, count: Callable[[str], None], stop: threading.Event) -> None:
    """Eight requests that trickle a byte every 0.5 s, each replaced once the server ends it."""
    socks: list[tuple[socket.socket, float]] = []
    while not stop.is_set():
        for _ in range(8 - len(socks)):
            try:
                s = _connect(port)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nX: ")
                socks.append((s, time.monotonic()))
            except OSError:
                count("trickler refused")
        for s, opened in list(socks):
            try:
                if not select.select([s], [], [], 0)[0]:
                    s.sendall(b"a")  # the server has not answered: one more byte
                    continue
                answer = _status(s)
            except OSError:
                answer = "reset"
            socks.remove((s, opened))
            count(f"trickler answered {answer} after {time.monotonic() - opened:.0f} s")
            s.close()
        stop.wait(0.5)
    for s, _ in socks:
        s.close()


def _bursts(port: int, count: Callable[[str], None], stop: threading.Event) -> None:
    """Every 2.5 s, 16 connections more than ``--max-connections`` held 0.5 s (503s counted)."""
    while not stop.wait(2.0):
        burst = []
        for _ in range(MAX_CONNECTIONS + 16):
            try:
                burst.append(_connect(port))
            except OSError:
                count("burst connect refused")
        stop.wait(0.5)
        for s in burst:
            s.settimeout(0.2)
            if _status(s) == "503":
                count("connections over the bound answered 503")
            s.close()


def _disconnectors(port: int, count: Callable[[str], None], stop: threading.Event) -> None:
    """Every 0.25 s, a 3,000-token prompt closed right after it is sent (the engine must cancel)."""
    n = 0
    while not stop.wait(0.25):
        n += 1
        prompt = ",".join(str(3 + (n * 13 + t) % 500) for t in range(LONG_PROMPT))
        body = (
            f'{{"prompt":[{prompt}],"max_tokens":{LONG_MAX_TOKENS},'
            '"temperature":0,"ignore_eos":true}'
        ).encode()
        try:
            with _connect(port) as s:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                # a 503 (a burst holds the bound) comes at once; a completion takes seconds
                if select.select([s], [], [], 0.02)[0] and _status(s) == "503":
                    count("long prompts answered 503")
                else:
                    count(ABANDONED)
        except OSError:
            count("long prompt: connection reset")


def _hostiles(port: int, count: Callable[[str], None]) -> list[Callable[[threading.Event], None]]:
    """The hostile clients, each a function of the stop event (``count`` tallies outcomes)."""
    kinds = [_big_bodies, _tricklers, _bursts, _disconnectors]
    return [functools.partial(f, port, count) for f in kinds]


def _metrics(url: str) -> dict[str, float]:
    """The ``kvdrop:`` counters of ``/metrics`` (finish reasons as ``requests_<reason>``)."""
    out: dict[str, float] = {}
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(r"kvdrop:(\w+)\{([^}]*)\} (\S+)$", line)
        if m:
            reason = re.search(r'finished_reason="(\w+)"', m[2])
            key = f"requests_{reason[1]}" if reason else m[1]
            out[key] = out.get(key, 0.0) + float(m[3])
    return out


def soak_round3_engine(args: argparse.Namespace) -> list[Row]:
    """The row of the ``round3-engine`` phase."""
    seconds = float(getattr(args, "round3_s", 20.0))
    seen: dict[Any, list[int]] = {}
    with _engine() as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        rss0 = _rss(proc.pid)
        quiet = _run_good(url, seconds, [], seen)
        before = _metrics(url)
        h: Counter[str] = Counter()
        lock = threading.Lock()
        peak = [rss0]

        def count(key: str) -> None:
            with lock:
                h[key] += 1

        def sample(stop: threading.Event) -> None:
            while not stop.wait(0.1):
                peak[0] = max(peak[0], _rss(proc.pid))

        loud = _run_good(url, seconds, [*_hostiles(port, count), sample], seen)
        time.sleep(1.0)  # the last abandoned request's watcher (0.1 s checks) has cancelled it
        after = _metrics(url)
        rss = (rss0, peak[0], _rss(proc.pid))
    return [_row(seconds, quiet, loud, h, rss, before, after)]


def _row(seconds: float, quiet: _Tally, loud: _Tally, h: Counter[str], rss: tuple[int, int, int],
         before: dict[str, float], after: dict[str, float]) -> Row:  # fmt: skip
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    p99q, p99h = _p99(quiet.latencies), _p99(loud.latencies)
    failed = quiet.c["good_failed"] + loud.c["good_failed"]
    wrong = quiet.c["wrong"] + loud.c["wrong"]
    good = loud.c["good_requests"]
    aborted = int(d.get("requests_abort", 0))
    sent = h[ABANDONED]
    prompt_done = d.get("prefix_cache_queries_total", 0) - good * 16
    generated = d.get("generation_tokens_total", 0) - good * MAX_TOKENS
    cancelled_ok = aborted >= sent * 0.9 and generated < 0.1 * max(sent, 1) * LONG_MAX_TOKENS
    rss_ok = rss[1] - rss[0] < 256 << 20
    ok = wrong == 0 and failed == 0 and rss_ok and p99h <= 2 * max(p99q, 0.005) and cancelled_ok
    hostile = "; ".join(f"{k}: {v:,}" for k, v in sorted(h.items()))
    failures = [k for k in quiet.c + loud.c if k.startswith("failed:")][:3]
    measured = (
        f"{seconds:g} s quiet then {seconds:g} s with 4 hostile clients: good requests "
        f"{quiet.c['good_requests']:,} + {good:,}, failed {failed}"
        f"{' ' + str(failures) if failures else ''}; wrong replies {wrong}; good p99 "
        f"{p99q * 1000:.1f} ms quiet, {p99h * 1000:.1f} ms hostile "
        f"({p99h / max(p99q, 1e-9):.2f}x); engine RSS {rss[0] / 2**20:.0f} MiB at start, peak "
        f"{rss[1] / 2**20:.0f} MiB, {rss[2] / 2**20:.0f} MiB at the end; "
        f"hostile: {hostile}; engine: {aborted} requests aborted, "
        f"{prompt_done:,.0f} of {sent * LONG_PROMPT:,} abandoned prompt tokens computed, "
        f"{generated:,.0f} of {sent * LONG_MAX_TOKENS:,} asked tokens generated"
    )
    return {
        "check": "round 3 hostile clients, engine",
        "measured": measured,
        "result": "ok" if ok else "FAIL",
        "reads": quiet.c["reads"] + loud.c["reads"],
        "lost": wrong,
        "p99_quiet_s": p99q,
        "p99_hostile_s": p99h,
        "rss_start": rss[0],
        "rss_peak": rss[1],
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--round3-s", type=float, default=20.0)
    for r in soak_round3_engine(p.parse_args()):
        print(f"{r['result']}  {r['check']}: {r['measured']}")
    sys.exit(0)
