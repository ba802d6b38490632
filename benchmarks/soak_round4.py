"""Soak phase ``round4``: issue 33's hostile clients beside good ones.

Engine part: ``kvdrop engine --random-preset tiny --policy knorm`` with a small KV budget (so
cut requests are preempted) as a subprocess on 127.0.0.1. Four good clients post short greedy
completions and check each reply against their first (``soak_round3_engine``), alone (quiet)
and beside the hostile clients of ``soak_round4_hostile.py`` (a process of their own),
alternating, several times each, so that both see the same machine load: override bombs
(``leverage(sketch_dimension=4000)``, a 3,000-term spec,
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
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests
import torch

from soak_round3 import _p99, _rss, _Tally
from soak_round3_engine import _engine, _metrics, _run_good, engine_cpus

Row = dict[str, Any]
HOSTILE = Path(__file__).with_name("soak_round4_hostile.py")


def _hostile(url: str, seen: Path, which: str, salt: str) -> subprocess.Popen[str]:
    """The hostile clients ``which`` names (``soak_round4_hostile.py``; every request with
    ``cache_salt`` ``salt`` when given) in a process of their own, running."""
    proc = subprocess.Popen(
        [sys.executable, str(HOSTILE), url, str(seen), which, salt],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _hostile_counts(proc: subprocess.Popen[str]) -> Counter[str]:
    """Stop the hostile clients (they finish what is in flight) and read their counts."""
    out, _ = proc.communicate("", timeout=600)
    return Counter(json.loads(out.strip().splitlines()[-1]))


def _engine_row(
    seconds: float,
    segments: int = 4,
    which: str = "bombs,cut,scoring",
    extra: str = "",
    salt: str = "hostile",
    cpus: frozenset[int] = frozenset(),
) -> Row:
    """Good clients (unsalted) alone and beside the hostile ones, ``segments`` times each,
    alternating (quiet, hostile, quiet, ...), so both see the same machine load over the run;
    ``extra``: more engine flags (``soak.py --engine-args``); ``salt``: the hostile requests'
    ``cache_salt`` (one tenant, as the engine's per-client shares see it; "": none, so each
    hostile request is a client of its own for the prefill shares and, with the good ones, the
    one unsalted client for the KV shares); ``cpus``: the engine's CPUs (empty: all)."""
    seen: dict[Any, list[int]] = {}
    flags = ("--policy", "knorm", "--kv-budget-tokens", "3584", *shlex.split(extra))
    h: Counter[str] = Counter()
    quiet, loud = _Tally(), _Tally()
    with _engine(*flags, cpus=cpus) as (proc, url), tempfile.TemporaryDirectory() as tmp:
        rss0 = _rss(proc.pid)
        peak = [rss0]

        def sample(stop: threading.Event) -> None:
            while not stop.wait(0.1):
                peak[0] = max(peak[0], _rss(proc.pid))

        before = _metrics(url)
        for _ in range(segments):
            _merge(quiet, _run_good(url, seconds / segments, [], seen))
            hostile = _hostile(url, Path(tmp) / "cut-answers.json", which, salt)
            try:
                _merge(loud, _run_good(url, seconds / segments, [sample], seen))
            finally:
                h += _hostile_counts(hostile)
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
    load = os.getloadavg()[0]
    measured = (
        f"{'engine ' + extra + ': ' if extra else ''}"
        f"{f'engine on CPUs {sorted(cpus)}, clients on the others: ' if cpus else ''}"
        f"hostile cache_salt {salt!r}: "
        f"{segments} x {seconds / segments:g} s quiet alternating with {segments} x "
        f"{seconds / segments:g} s beside override bombs, preempted cut requests and prompt "
        f"scoring (load average {load:.1f}): good requests {quiet.c['good_requests']:,} + "
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
        "load_average": load,
    }


def _merge(into: _Tally, part: _Tally) -> None:
    into.c.update(part.c)
    into.latencies.extend(part.latencies)


def soak_round4(args: argparse.Namespace) -> list[Row]:
    """The rows of the ``round4`` phase."""
    seconds = float(getattr(args, "round4_s", 20.0))
    extra = str(getattr(args, "engine_args", ""))
    salt = str(getattr(args, "round4_salt", "hostile"))
    cpus = engine_cpus(str(getattr(args, "engine_cpus", "")))
    return [_engine_row(seconds, extra=extra, salt=salt, cpus=cpus), _server_row(seconds)]


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
    p.add_argument("--engine-args", default="", help="extra `kvdrop engine` flags")
    p.add_argument("--round4-salt", default="hostile", help="the hostile requests' cache_salt")
    for r in soak_round4(p.parse_args()):
        print(f"{r['result']}  {r['check']}: {r['measured']}")
    sys.exit(0)
