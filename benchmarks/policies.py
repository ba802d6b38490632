"""Time and peak memory of every registered policy on a realistic KV shape.

Default: [2, 28, T, 1024] bfloat16 (a Qwen3-8B-like KV: 28 layers, 8 KV heads x 128) for
T in 2K and 8K; ``--tokens 2048 8192 16384 32768`` for the full sweep. Query policies get what the
SDK hands them from an engine in the lean query mode: the query window, ``[1, 28, W, 2048]`` rows
(16 query heads x 128, GQA group 2) of the last 64 positions and every 64th, with their positions
in the edit context (``--full-queries``: every position's, the upstream layout). Every call goes
through the edit context as the SDK makes it (RoPE parameters included, so kept keys are
re-rotated, as by default).

``--device cuda`` scores on the GPU (the policies' ``device=``) with the tensors on the CPU, as the
SDK retrieves them, so the time includes moving the keys and queries there;
``--tensors-on-device`` puts the inputs on the device first (scoring alone).

Each policy is timed (median of ``--repeats``) against the floor every policy pays: a plain
``index_select`` of the same number of rows, and against what moving the same KV costs on this
machine: one ``store`` + one ``retrieve`` through a real kvdrop server (shared memory), measured
in the same run (``x_store_retrieve``; ``--no-store-retrieve`` skips it). Peak memory is the peak
RSS increase while the policy runs (kvdrop.testing.profiling.PeakRSS), beside the input size;
on a GPU also the peak of device memory the call allocates beyond its inputs (``gpu_peak_mb``).
``--growth`` adds, per policy, how time and peak memory grow from each T to the next: the
exponent ``b`` of ``cost ~ T^b`` (1: linear, 2: quadratic).

    python benchmarks/policies.py [--tokens 2048 8192] [--policies knorm snapkv] [--json]
    python benchmarks/policies.py --device cuda --tokens 12288 --policies snapkv h2o knorm
    python benchmarks/policies.py --device cuda --tensors-on-device --layers 36 --q-heads 32 \
        --tokens 4096 16384 65536 --growth --no-store-retrieve     # cost against T on a GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import kvdrop
from kvdrop.errors import PolicyInputError
from kvdrop.testing.profiling import PeakRSS
from kvdrop_rope import RopeConfig
from kvdrop_sdk import CacheKind
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.table import format_table

#: The lean query window the reference engine saves by default: last W rows and every S-th.
WINDOW, STRIDE = 64, 64


def window_positions(num_tokens: int) -> torch.Tensor:
    """Positions of the rows an engine in the lean mode saves for a ``num_tokens`` prompt."""
    strided = set(range(0, num_tokens, STRIDE))
    return torch.tensor(sorted(strided | set(range(max(num_tokens - WINDOW, 0), num_tokens))))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeats: int, device: str = "cpu") -> tuple[float, Any]:
    """Median wall time of ``fn`` over ``repeats`` runs (after one warm-up) and its last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def store_retrieve_s(kv: torch.Tensor, args: argparse.Namespace) -> float:
    """Median seconds of store(kv) + retrieve through a real server on 127.0.0.1 (fresh tokens
    each time so every store really writes)."""
    from kvdrop_sdk import kvcache
    from kvdrop_sdk.layout import CacheLayout
    from kvdrop_sdk.testing.server import spawn_server

    _, layers, num_tokens, width = kv.shape
    layout = CacheLayout(layers, width // args.head_dim, args.head_dim, kv.dtype)
    nbytes = kv.numel() * kv.element_size()
    times = []
    with spawn_server(
        l1_size_gb=round(nbytes * 1.1 / 1024**3 + 0.01, 3),
        chunk_size=256,
        no_l1_use_lazy=True,
        startup_timeout=120,
    ) as server:
        with kvcache.connect(server.url, server.http_url, "bench", 120, layout=layout) as ctx:
            for i in range(args.repeats + 1):  # the first round warms up
                tokens = list(range(i * num_tokens, (i + 1) * num_tokens))
                t0 = time.perf_counter()
                ctx.store(kv, tokens)
                out = ctx.retrieve(tokens)
                elapsed = time.perf_counter() - t0
                if out is None or out.shape != kv.shape:
                    raise RuntimeError("store+retrieve baseline: retrieve missed")
                del out
                if i:
                    times.append(elapsed)
    return statistics.median(times)


def edit_inputs(
    needs_query: bool, kv: torch.Tensor, query: torch.Tensor, args: argparse.Namespace, full: bool
) -> tuple[dict[CacheKind, torch.Tensor], EditContext]:
    """The tensors and edit context an engine's edit would hand a policy: the KV, and for query
    policies every position's query (``full``) or the lean window with its positions."""
    num_tokens = kv.shape[2]
    tensors = {CacheKind.KV: kv}
    qpos = None
    if needs_query:
        qpos = torch.arange(num_tokens) if full else window_positions(num_tokens)
        tensors[CacheKind.QUERY] = query if full else query[:, :, qpos].contiguous()
    rope = RopeConfig(head_dim=args.head_dim, theta=1e6).to_json()  # Qwen3's
    context = EditContext.of(
        num_tokens, query_positions=qpos, rope=rope, head_dim=args.head_dim, chunk_size=256
    )
    return tensors, context


def bench_policy(
    name: str, kv: torch.Tensor, query: torch.Tensor, args: argparse.Namespace
) -> dict[str, Any]:
    info = kvdrop.describe(name)
    params: dict[str, Any] = {**info.example, "keep_ratio": args.keep_ratio, "chunk_size": 256}
    names = {p.name for p in info.params}
    if "head_dim" in names:
        params["head_dim"] = args.head_dim
    if "device" in names:
        params["device"] = args.device
    fn = kvdrop.get(name, **params)
    num_tokens = kv.shape[2]
    tokens = list(range(num_tokens))
    full = bool(args.full_queries)
    tensors, context = edit_inputs(info.needs.reads_queries, kv, query, args, full)
    try:
        seconds, (_, kept) = timed(
            lambda: fn(tensors, tokens, context=context), args.repeats, args.device
        )
    except PolicyInputError:
        if full or not info.needs.reads_queries:
            raise
        # A scorer that reads every cached token's query (e.g. the example plugin's
        # last-queries) refuses a window: it gets the full queries, and the row says so.
        full = True
        tensors, context = edit_inputs(True, kv, query, args, full)
        seconds, (_, kept) = timed(
            lambda: fn(tensors, tokens, context=context), args.repeats, args.device
        )
    index = torch.tensor(kept)
    floor, _ = timed(lambda: kv.index_select(2, index.to(kv.device)), args.repeats, args.device)
    on_gpu = args.device.startswith("cuda")
    if on_gpu:  # device memory the call allocates beyond its inputs, at its peak
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with PeakRSS() as mem:
        fn(tensors, tokens, context=context)
    gpu_peak_mb = None
    if on_gpu:
        torch.cuda.synchronize()
        gpu_peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    input_bytes = kv.numel() * kv.element_size()
    if info.needs.reads_queries:
        q_in = tensors[CacheKind.QUERY]
        input_bytes += q_in.numel() * q_in.element_size()
    return {
        "policy": name,
        "T": num_tokens,
        "queries": ("full" if full else "window") if info.needs.reads_queries else "-",
        "kept": len(kept),
        "seconds": seconds,
        "ms_per_1k_tokens": 1000 * seconds / (num_tokens / 1000),
        "index_select_s": floor,
        "x_floor": seconds / floor,
        "x_store_retrieve": None,
        "peak_mb": mem.peak / 2**20,
        "gpu_peak_mb": gpu_peak_mb,
        "input_mb": input_bytes / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--keep-ratio", type=float, default=0.5)
    parser.add_argument("--policies", nargs="+", default=None, help="default: every policy")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where policies score (their device=): cpu, cuda, auto (default cpu)",
    )
    parser.add_argument(
        "--tensors-on-device",
        action="store_true",
        help="put KV and queries on --device before timing (scoring alone, no transfer)",
    )
    parser.add_argument(
        "--full-queries",
        action="store_true",
        help="hand query policies every position's query (upstream layout) instead of the "
        "lean window",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--no-store-retrieve",
        action="store_true",
        help="skip the store+retrieve baseline (needs no server then)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--growth",
        action="store_true",
        help="also print, per policy, the exponent b of time and peak memory ~ T^b between "
        "consecutive --tokens",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    names = args.policies or kvdrop.available()
    rows = []
    for num_tokens in args.tokens:
        # Drawn in place in the target dtype (no float32 copy, 7.5 GB at T=32K, ever exists),
        # directly on the device with --tensors-on-device (no host copy of 30 GB at T=64K).
        where = args.device if args.tensors_on_device else "cpu"
        gen = torch.Generator(device=where).manual_seed(0)
        width = args.kv_heads * args.head_dim
        kv = torch.empty(2, args.layers, num_tokens, width, dtype=dtype, device=where)
        kv.normal_(generator=gen)
        query = torch.empty(
            1, args.layers, num_tokens, args.q_heads * args.head_dim, dtype=dtype, device=where
        )
        query.normal_(generator=gen)
        first = len(rows)
        for name in names:
            rows.append(bench_policy(name, kv, query, args))
            print(f"  {name} T={num_tokens}: {rows[-1]['seconds']:.3f}s", file=sys.stderr)
        del query  # keep the peak low: the server holds another copy of the KV
        if not args.no_store_retrieve:
            baseline = store_retrieve_s(kv.cpu(), args)
            print(f"  store+retrieve T={num_tokens}: {baseline:.3f}s", file=sys.stderr)
            for row in rows[first:]:
                row["store_retrieve_s"] = baseline
                row["x_store_retrieve"] = row["seconds"] / baseline
                print(f"    {row['policy']}: {row['x_store_retrieve']:.2f}x", file=sys.stderr)
        del kv
    setup = {
        "kv_shape": f"[2, {args.layers}, T, {args.kv_heads * args.head_dim}]",
        "query_shape": f"[1, {args.layers}, T, {args.q_heads * args.head_dim}]",
        "dtype": args.dtype,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "tensors_on": args.device if args.tensors_on_device else "cpu",
        "queries": "full" if args.full_queries else f"window (last {WINDOW} + every {STRIDE}th)",
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_avg_1min": round(os.getloadavg()[0], 1),
        "keep_ratio": args.keep_ratio,
        "repeats": args.repeats,
    }
    if args.json:
        print(json.dumps({"setup": setup, "results": rows}, indent=2))
    else:
        print(", ".join(f"{k}={v}" for k, v in setup.items()))
        print(format_table(rows))
        if args.growth and len(args.tokens) > 1:
            print()
            print(format_table(growth(rows), title="Growth with T: cost ~ T^b between sizes"))
    return 0


def growth(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per policy and pair of consecutive T: the exponents b of seconds and of peak memory
    (device memory on a GPU, else RSS) in ``cost ~ T^b``."""
    out = []
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_policy.setdefault(row["policy"], []).append(row)
    for policy, runs in by_policy.items():
        runs.sort(key=lambda r: r["T"])
        for a, b in itertools.pairwise(runs):
            ratio = math.log(b["T"] / a["T"])
            mem_a = a["gpu_peak_mb"] if a["gpu_peak_mb"] is not None else a["peak_mb"]
            mem_b = b["gpu_peak_mb"] if b["gpu_peak_mb"] is not None else b["peak_mb"]
            out.append(
                {
                    "policy": policy,
                    "T": f"{a['T']} -> {b['T']}",
                    "seconds": f"{a['seconds']:.4g} -> {b['seconds']:.4g}",
                    "time_exponent": math.log(b["seconds"] / a["seconds"]) / ratio,
                    "peak_mb": f"{mem_a:.0f} -> {mem_b:.0f}",
                    "memory_exponent": (
                        math.log(mem_b / mem_a) / ratio if mem_a > 0 and mem_b > 0 else None
                    ),
                }
            )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
