"""What the query capture costs a prefill phase (issue 31): two engines on one kvdrop server,
one whose connector captures no query (decode_gain.py's baseline engine) and one that stores
the lean window (its query engine, ``--query-capture window``), run alternately (A B A B ...)
on the same prompts, each repetition under a fresh cache salt so every prefill is computed.

Per run it prints the phase's wall time and the engine's loop-thread split (prefill steps,
window finalising, shipping, idle), and counts the capture's work (not only its time, the CPU
is shared): query rows kept per request (``WindowCapture.add``), bytes copied into the windows,
host synchronisations (``to_host``/``to_host_all`` calls) and window stores per request.
``--profile`` adds a cProfile of each engine's loop thread (top functions by cumulative time).

    python benchmarks/capture_cost.py --model-preset tiny --num-requests 8 \\
        --prompt-tokens 1500 2500 --max-prefill-tokens 1024 --repeats 2 --profile
    # the GPU shape (one H200/H100, about 4 minutes): PART=capture benchmarks/gpu_jobs/i31.sh
    python benchmarks/capture_cost.py --device cuda --dtype bfloat16 --model-preset qwen3-8b \\
        --num-requests 30 --prompt-tokens 8192 14336 --max-prefill-tokens 8192 \\
        --kv-budget-tokens 131072 --repeats 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import Counter
from typing import Any

import torch

import kvdrop
from kvdrop_engine import capture as capture_mod
from kvdrop_engine import paged, runner
from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_sdk.batch import BatchedStream
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import connect
from kvdrop_sdk.query_capture import QueryCapture
from kvdrop_sdk.request import create_request
from kvdrop_sdk.table import format_table
from kvdrop_sdk.testing.server import spawn_server

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from decode_gain import DTYPES, build_model, make_prompts

#: Work counters of the current run (reset per run).
WORK: Counter[str] = Counter()


def _count_work() -> None:
    """Wrap the capture's and the runner's host copies so each run counts its work."""
    add = capture_mod.WindowCapture.add

    def counted_add(self: Any, positions: list[int], rows: torch.Tensor) -> None:
        WORK["window_add_calls"] += 1
        WORK["rows_kept"] += len(positions)
        WORK["rows_offered"] += int(rows.shape[1])
        WORK["bytes_into_window"] += rows.numel() * rows.element_size()
        add(self, positions, rows)

    capture_mod.WindowCapture.add = counted_add  # type: ignore[method-assign]
    for mod in (paged, runner):
        for name in ("to_host", "to_host_all"):
            if hasattr(mod, name):
                fn = getattr(mod, name)

                def counted(*a: Any, _fn: Any = fn, _name: str = name) -> Any:
                    WORK[f"{_name}_calls"] += 1
                    return _fn(*a)

                setattr(mod, name, counted)
    records = runner.ModelRunner.window_records

    def counted_records(self: Any, finished: Any) -> Any:
        WORK["window_record_batches"] += 1
        WORK["window_records"] += len(finished)
        return records(self, finished)

    runner.ModelRunner.window_records = counted_records  # type: ignore[method-assign]


def _profiled(engine: Engine, profiles: dict[str, cProfile.Profile], key: str) -> None:
    """Run ``engine``'s loop thread under a cProfile kept in ``profiles[key]``."""
    loop = engine._loop

    def run() -> None:
        prof = profiles.setdefault(key, cProfile.Profile())
        prof.enable()
        try:
            loop()
        finally:
            prof.disable()

    engine._loop = run  # type: ignore[method-assign]


def prefill(engine: Engine, ctxs: list[Any], prompts: list[list[int]], salt: str) -> float:
    """One prefill phase (every prompt with ``max_tokens`` 1, stores awaited): its seconds."""
    batch = BatchedStream(max_concurrency=len(prompts))
    for p in prompts:
        batch.add(create_request(ctxs, engine.post_completion, p, salt))
    started = time.perf_counter()
    batch.prefill({"temperature": 0.0, "ignore_eos": True, "max_tokens": 1})
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--model-preset", default="tiny")
    p.add_argument("--model-path", default=None)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[1500, 2500])
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--max-prefill-tokens", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--kv-budget-tokens", type=int, default=None, help="per engine (default: every prompt)"
    )
    p.add_argument("--pool-runs", type=float, default=1.5, help="pool size in runs' KV")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="cProfile each engine's loop thread")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)

    model = build_model(args)
    cfg = model.config
    prompts = make_prompts(args, cfg.vocab_size)
    capture = QueryCapture.for_policies([kvdrop.get("snapkv")], "window")
    item = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    total = sum(len(x) for x in prompts) * 2 * cfg.num_layers * cfg.kv_dim * item
    # decode_gain.py's pool with --share-prefill (1.5 runs' KV, +15%): from the second run on
    # every store evicts, as in its query engine's runs.
    gb = max(0.25, args.pool_runs * total * 1.15 / 2**30)
    blocks = sum(-(-(len(x) + 1) // args.block_size) for x in prompts) + 8
    if args.kv_budget_tokens:  # each engine's budget (two engines live at once)
        blocks = args.kv_budget_tokens // args.block_size
    _count_work()
    profiles: dict[str, cProfile.Profile] = {}
    rows = []
    flags = {"chunk_size": args.chunk_size, "l1_size_gb": round(gb, 3), "no_l1_use_lazy": True}
    with spawn_server(startup_timeout=300.0, enable=["transfer_query"], **flags) as server:
        engines = {}
        for name, tq in (("no capture", False), ("window capture", True)):
            conn = ServerConnector(
                server.url, server.http_url, "bench", transfer_query=tq, queries=capture
            )
            engine = Engine(
                model,
                num_blocks=blocks,
                block_size=args.block_size,
                max_batch_size=max(256, args.num_requests),
                graph_batch_sizes=(),
                max_prefill_tokens=args.max_prefill_tokens,
                connector=conn,
            )
            if args.profile:
                _profiled(engine, profiles, name)
            engine.start()
            engines[name] = (engine, tq)
        kv = connect(CacheKind.KV, server.url, server.http_url, "bench")
        if args.device == "cuda":  # page-locked once, as decode_gain.py's holder does
            kv.prepare_dma()
        q = connect(CacheKind.QUERY, server.url, server.http_url, "bench", capture=capture)
        try:
            # Warm-up outside the table: a full prefill chunk and a window, on each engine.
            warm = prompts[0][: args.max_prefill_tokens + 7]
            for name, (engine, _) in engines.items():
                engine.generate(warm, {"max_tokens": 1}, f"warm-{name}")
            for rep in range(args.repeats):
                for name, (engine, tq) in engines.items():
                    WORK.clear()
                    engine.reset_stats()
                    seconds = prefill(engine, [kv, q] if tq else [kv], prompts, f"r{rep}-{name}")
                    st = engine.stats().to_dict()
                    n = len(prompts)
                    rows.append(
                        {
                            "run": name,
                            "rep": rep,
                            "prefill_s": seconds,
                            "steps": st["steps"],
                            "prefill_steps_s": st["prefill_step_seconds"],
                            "window_s": st["window_seconds"],
                            "ship_s": st["ship_seconds"],
                            "idle_s": st["idle_seconds"],
                            "rows_kept_per_req": WORK["rows_kept"] / n,
                            "rows_offered_per_req": WORK["rows_offered"] / n,
                            "window_MB_copied_per_req": WORK["bytes_into_window"] / n / 1e6,
                            "adds_per_req": WORK["window_add_calls"] / n,
                            "host_syncs": WORK["to_host_calls"] + WORK["to_host_all_calls"],
                            "record_batches": WORK["window_record_batches"],
                            "windows_stored": st["query_rows_stored"] and WORK["window_records"],
                            "query_B_stored_per_req": st["query_bytes_stored"] / n,
                            "kv_store_s_per_req": st["kv_store_seconds"] / n,
                            "window_store_s_per_req": st["window_store_seconds"] / n,
                        }
                    )
        finally:
            kv.close()
            q.close()
            for engine, _ in engines.values():
                engine.stop()
    print(format_table(rows))
    for name, prof in profiles.items():
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
        print(f"\n== loop thread of the {name} engine (cProfile, cumulative)\n{out.getvalue()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
