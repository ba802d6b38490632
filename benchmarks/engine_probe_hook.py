"""Run ``kvdrop engine`` with probes inside its process (``benchmarks/engine_probe.py`` starts it).

``python engine_probe_hook.py OUT engine FLAGS...``: a thread sleeps 1 ms in a loop and records how
late it wakes (the GIL or the CPU held it up); a wake later than 15 ms writes every busy thread's
stack to ``OUT.slow``, as does a garbage collection over 5 ms; each engine step's time and
content, and the events of every 16-token request, go to ``OUT.json`` every 2 s.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import threading
import time
import traceback
from typing import Any

OUT = sys.argv.pop(1)
STEPS: list[tuple[Any, ...]] = []
REQUESTS: list[dict[str, Any]] = []
_slow = open(OUT + ".slow", "a")  # open for the process's life
_gc_started = [0.0]
IDLE = ("wait", "select", "_wait_for_tstate_lock", "readinto", "accept", "get", "poll")


def _gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _gc_started[0]) * 1000
    if ms > 5:
        _slow.write(f"GC gen{info['generation']} {ms:.1f} ms at {time.time():.3f}\n")
        _slow.flush()


def _stacks(ms: float) -> None:
    """Where every busy thread is (the holder has just let go): one line each."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [f"== late {ms:.1f} ms at {time.time():.3f}"]
    for tid, frame in sys._current_frames().items():
        stack = traceback.extract_stack(frame)[-5:]
        if tid == me or stack[-1].name in IDLE:
            continue
        where = " <- ".join(f"{f.name}({os.path.basename(f.filename)}:{f.lineno})" for f in stack)
        lines.append(f"  [{names.get(tid, tid)}] {where}")
    _slow.write("\n".join(lines) + "\n")
    _slow.flush()


def _dump() -> None:
    now = (time.time(), time.perf_counter())
    with open(OUT + ".json.part", "w") as fh:
        json.dump({"steps": STEPS, "requests": REQUESTS, "wall_minus_perf": now[0] - now[1]}, fh)
    os.replace(OUT + ".json.part", OUT + ".json")  # never half-written when the engine stops


def _probe() -> None:
    late: list[float] = []
    last = dumped = time.monotonic()
    with open(OUT, "a") as fh:
        while True:
            t = time.perf_counter()
            time.sleep(0.001)
            ms = (time.perf_counter() - t - 0.001) * 1000
            late.append(ms)
            if ms > 15:
                _stacks(ms)
            now = time.monotonic()
            if now - last >= 0.25:
                late.sort()
                n = len(late)
                fh.write(f"{time.time():.3f} {n} {late[n // 2]:.2f} {late[int(n * 0.99)]:.2f} "
                         f"{late[-1]:.2f}\n")  # fmt: skip
                fh.flush()
                late, last = [], now
            if now - dumped > 2:
                _dump()
                dumped = now


def _patch() -> None:
    import kvdrop_engine.engine as E

    step, post = E.Engine._step, E.Engine.post_completion

    def timed_step(self: Any, batch: list[Any]) -> None:
        before = [r.num_computed for r in batch]
        t = time.perf_counter()
        step(self, batch)
        done = time.perf_counter()
        decodes = prompt = pairs = scoring = 0
        for r, b in zip(batch, before, strict=True):
            n = r.num_computed - b
            if n == 1 and r.output and b >= len(r.prompt) - 1:
                decodes += 1
            elif n > 0:
                prompt, pairs = prompt + n, pairs + n * (b + n)
                scoring += r.score_top is not None
        STEPS.append((t, done, len(batch), decodes, prompt, pairs, scoring))

    def timed_post(self: Any, prompt: list[int], *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        events = post(self, prompt, *args, **kwargs)
        if len(prompt) != 16:  # the soak's good clients
            return events
        record: dict[str, Any] = {"t0": started, "events": []}
        REQUESTS.append(record)

        def read() -> Any:
            try:
                for event in events:
                    record["events"].append(time.perf_counter())
                    yield event
            finally:
                record["preempted"] = bool(events.req.preempted)
                events.close()

        return read()

    E.Engine._step, E.Engine.post_completion = timed_step, timed_post


gc.callbacks.append(_gc)
_patch()
threading.Thread(target=_probe, daemon=True, name="probe").start()
sys.argv = ["kvdrop", *sys.argv[1:]]
runpy.run_module("kvdrop", run_name="__main__", alter_sys=True)
