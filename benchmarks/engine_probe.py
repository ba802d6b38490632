"""Where the round-4 soak's good clients lose time: the engine part of ``soak.py --phases round4``
with probes inside the engine process (``engine_probe_hook.py``).

    python benchmarks/engine_probe.py --segments 2 --seconds 4 [--engine-args "..."]

The engine (the soak's flags) serves the four good clients alone and beside the hostile ones,
alternating. Printed per phase: good p50/p99 as the clients saw them; the same requests inside
the engine (submission to last event: time to the first event, steps, the longest step, how many
were preempted, and the p99 without the preempted ones); engine steps (p50/p99) with a least-squares
split of a step's time (batch size, prompt tokens, attention pairs in thousands, scoring requests,
and a hostile-phase term: what no step content explains, i.e. waits for the GIL or the CPU); the
probe thread's wake-up lateness. Lateness over 15 ms (with every busy thread's stack) and
collections over 5 ms are in ``OUT.slow``: what held the engine process up.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests

from soak_round3 import _p99, _Tally
from soak_round3_engine import MAX_CONNECTIONS, _free_port, _run_good, engine_cpus, pinned
from soak_round4 import _hostile, _hostile_counts, _merge

HOOK = Path(__file__).with_name("engine_probe_hook.py")


def _engine(
    out: str, extra: list[str], cpus: frozenset[int] = frozenset()
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, str(HOOK), out, "engine", "--random-preset", "tiny", "--port",
           str(port), "--max-connections", str(MAX_CONNECTIONS), "--request-timeout-s", "2",
           "--max-prefill-tokens", "128", "--return-tokens-as-token-ids", "--policy", "knorm",
           "--kv-budget-tokens", "3584", *extra]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pinned(cpus)
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the engine did not start")


def _phase_of(t: float, spans: dict[str, list[tuple[float, float]]]) -> str | None:
    return next((k for k, ss in spans.items() if any(a <= t <= b for a, b in ss)), None)


def _report(out: str, spans: dict[str, list[tuple[float, float]]]) -> None:
    data = json.loads(Path(out + ".json").read_text())
    off = data["wall_minus_perf"]
    steps = data["steps"]
    starts = [s[0] for s in steps]
    for phase in spans:
        reqs = []
        for r in data["requests"]:
            if len(r["events"]) < 8 or _phase_of(r["t0"] + off, spans) != phase:
                continue
            i, j = bisect.bisect_left(starts, r["t0"]), bisect.bisect_left(starts, r["events"][-1])
            longest = max((b - a for a, b, *_ in steps[i:j]), default=0.0)
            total = r["events"][-1] - r["t0"]
            reqs.append((total, r["events"][0] - r["t0"], j - i, longest, r["preempted"]))
        if not reqs:
            continue
        totals = sorted(x[0] for x in reqs)
        kept = sorted(x[0] for x in reqs if not x[4])
        tail = sorted(reqs)[int(0.98 * len(reqs)) :]
        print(f"{phase}: in the engine p50 {1000 * totals[len(totals) // 2]:.1f} ms, p99 "
              f"{1000 * _p99(totals):.1f} ms ({1000 * _p99(kept):.1f} ms without the "
              f"{len(totals) - len(kept)} preempted); slowest 2%: first event "
              f"{1000 * statistics.mean(x[1] for x in tail):.1f} ms, "
              f"{statistics.mean(x[2] for x in tail):.1f} steps, longest step "
              f"{1000 * statistics.mean(x[3] for x in tail):.1f} ms, "
              f"{sum(x[4] for x in tail)} of {len(tail)} preempted")  # fmt: skip
        times = sorted(1000 * (b - a) for a, b, *_ in steps if _phase_of(a + off, spans) == phase)
        print(f"{phase}: {len(times)} steps, p50 {times[len(times) // 2]:.2f} ms, p99 "
              f"{_p99(times):.2f} ms, longest {times[-1]:.1f} ms")  # fmt: skip
        probe = [line.split() for line in Path(out).read_text().splitlines()]
        probe = [p for p in probe if _phase_of(float(p[0]), spans) == phase]
        print(f"{phase}: probe lateness, median of 0.25 s p99s "
              f"{statistics.median(float(p[3]) for p in probe):.1f} ms, longest "
              f"{max(float(p[4]) for p in probe):.1f} ms")  # fmt: skip
    rows = [(1000 * (b - a), n, d, p, q / 1000, s, float(_phase_of(a + off, spans) == "hostile"))
            for a, b, n, d, p, q, s in steps if _phase_of(a + off, spans)]  # fmt: skip
    m = np.array(rows)
    x = np.c_[np.ones(len(m)), m[:, 1], m[:, 3], m[:, 4], m[:, 5], m[:, 6]]
    c = np.linalg.lstsq(x, m[:, 0], rcond=None)[0]
    print(f"step ms = {c[0]:.2f} + {c[1]:.3f} x batch + {c[2]:.4f} x prompt tokens + "
          f"{c[3]:.4f} x attention pairs/1000 + {c[4]:.2f} x scoring requests + {c[5]:.2f} x "
          "hostile phase")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--segments", type=int, default=2)
    p.add_argument("--seconds", type=float, default=4.0, help="of each quiet or hostile segment")
    p.add_argument("--engine-args", default="", help="extra `kvdrop engine` flags")
    p.add_argument("--salt", default="hostile", help="the hostile requests' cache_salt")
    p.add_argument(
        "--hostile",
        default="bombs,cut,scoring",
        help="which hostile clients run (soak_round4_hostile.py's kinds), to split their costs",
    )
    p.add_argument(
        "--engine-cpus", default="", help="the engine's CPUs, e.g. '0' (the clients: the others)"
    )
    args = p.parse_args()
    out = str(Path(tempfile.mkdtemp(prefix="engine-probe-")) / "probe.txt")
    cpus = engine_cpus(args.engine_cpus)
    proc, url = _engine(out, shlex.split(args.engine_args), cpus)
    seen: dict[Any, list[int]] = {}
    tallies = {"quiet": _Tally(), "hostile": _Tally()}
    spans: dict[str, list[tuple[float, float]]] = {"quiet": [], "hostile": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.segments):
                for phase in ("quiet", "hostile"):
                    bad = None
                    if phase == "hostile":
                        bad = _hostile(url, Path(tmp) / "seen.json", args.hostile, args.salt)
                    t0 = time.time()
                    _merge(tallies[phase], _run_good(url, args.seconds, [], seen))
                    spans[phase].append((t0, time.time()))
                    if bad is not None:
                        _hostile_counts(bad)
        time.sleep(2.5)  # the hook's last dump
    finally:
        proc.terminate()
        proc.wait(30)
    q, h = (tallies[k].latencies for k in ("quiet", "hostile"))
    print(f"load average {os.getloadavg()[0]:.1f}; good p50/p99 as the clients saw them: quiet "
          f"{1000 * statistics.median(q):.1f}/{1000 * _p99(q):.1f} ms, hostile "
          f"{1000 * statistics.median(h):.1f}/{1000 * _p99(h):.1f} ms "
          f"({_p99(h) / _p99(q):.2f}x); failed "
          f"{sum(t.c['good_failed'] for t in tallies.values())}")  # fmt: skip
    _report(out, spans)
    print(f"stalls (lateness over 15 ms, collections over 5 ms): {out}.slow")


if __name__ == "__main__":
    main()
