"""Store/retrieve throughput through shared memory and the socket path vs an in-process copy_.

Starts its own kvdrop server subprocess (with --shm-name and --no-l1-use-lazy), stores and
retrieves one ``[2, L, T, W]`` tensor through each transport, and reports GB/s (median of
``--repeats``) and the ratio to ``dst.copy_(src)`` of the same tensor measured in the same run.

With ``--against lmcache`` it also starts a real ``lmcache server`` (shared memory, the flags of
docs/lmcache.md), registers the layout the way an engine does (kvdrop's LMCache backend), moves
the same tensor through ``lmcache.sdk`` and prints kvdrop_sdk (shared memory) and lmcache.sdk
side by side, with the ratio kvdrop / LMCache.

    python benchmarks/transfer.py                       # [2, 8, 8192, 1024] bfloat16
    python benchmarks/transfer.py --tokens 2048 --json
    python benchmarks/transfer.py --against lmcache     # needs pip install 'kvdrop[lmcache]'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch

import kvdrop_sdk as sdk
from kvdrop_sdk.layout import DTYPES
from kvdrop_sdk.table import format_table
from kvdrop_sdk.testing.server import spawn_server


def _median_s(
    fn: Callable[[], Any], repeats: int, setup: Callable[[int], None] | None = None
) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (after one warm-up run)."""
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup(i)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i:
            times.append(dt)
    return statistics.median(times)


def _measure(
    ctx: Any, src: torch.Tensor, args: argparse.Namespace, base: int, label: str
) -> tuple[float, float, float]:
    """Median seconds of store, retrieve, and retrieve keeping every result (bytes checked once).

    ``ctx`` is a kvdrop_sdk or an lmcache.sdk context (same ``store``/``retrieve`` signatures).
    """
    tokens: list[int] = []

    def fresh(i: int) -> None:
        # New token ids per run so every store writes every chunk.
        start = (base + i) * args.tokens
        tokens[:] = range(start, start + args.tokens)

    def store() -> None:
        if not ctx.store(src, tokens):
            raise RuntimeError("store wrote nothing")

    store_s = _median_s(store, args.repeats, fresh)
    deadline = time.monotonic() + 30  # an LMCache server commits a store just after acking it
    while (out := ctx.retrieve(tokens)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    whole = args.tokens // args.chunk_size * args.chunk_size
    if out is None or not torch.equal(out, src[:, :, :whole]):
        raise RuntimeError(f"{label}: retrieved tensor differs from the stored one")
    del out
    retrieve_s = _median_s(lambda: ctx.retrieve(tokens), args.repeats)
    # Keeping every result defeats buffer recycling: each retrieve faults in fresh pages.
    kept: list[Any] = []
    kept_s = _median_s(lambda: kept.append(ctx.retrieve(tokens)), args.repeats)
    kept.clear()
    return store_s, retrieve_s, kept_s


def _gpu_rows(ctx: Any, src: torch.Tensor, args: argparse.Namespace, gb: float) -> list[dict]:
    """The GPU side (``--device cuda``), same tensor: retrieve onto the GPU by DMA from the
    page-locked shared memory and store from the GPU the same way, against the host path
    (retrieve, then ``.to(device)``) and the floor (a pinned host buffer's DMA)."""
    device = torch.device(args.device)
    tokens = list(range(777_000, 777_000 + args.tokens))
    if not ctx.store(src, tokens):
        raise RuntimeError("store wrote nothing")
    whole = args.tokens // args.chunk_size * args.chunk_size
    out = ctx.retrieve(tokens, device=device)
    if out is None or not torch.equal(out.cpu(), src[:, :, :whole]):
        raise RuntimeError("retrieve(device=cuda) differs from the stored tensor")
    pinned = src.pin_memory()
    on_gpu = src.to(device)

    def floor() -> None:
        on_gpu.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(device)

    def host_path() -> None:
        t = ctx.retrieve(tokens)
        t.to(device)
        torch.cuda.synchronize(device)

    fresh: list[int] = []

    def new_tokens(i: int) -> None:
        start = (2000 + i) * args.tokens
        fresh[:] = range(start, start + args.tokens)

    floor_s = _median_s(floor, args.repeats)
    timed = [
        ("pinned buffer -> GPU (floor)", floor_s),
        (
            "retrieve -> GPU (DMA)",
            _median_s(lambda: ctx.retrieve(tokens, device=device), args.repeats),
        ),
        ("retrieve, then .to(GPU)", _median_s(host_path, args.repeats)),
        (
            "store from GPU (DMA)",
            _median_s(lambda: ctx.store(on_gpu, fresh), args.repeats, new_tokens),
        ),
    ]
    return [
        {
            "transport": "shm+gpu",
            "op": op,
            "median_ms": sec * 1e3,
            "GB/s": gb / sec,
            "x copy_": floor_s / sec,
        }
        for op, sec in timed
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure everything; returns the report dict (rows + setup)."""
    dtype = DTYPES[args.dtype]
    heads = 8 if args.width % 8 == 0 else 1
    layout = sdk.CacheLayout(args.layers, heads, args.width // heads, dtype)
    shape = layout.shape(sdk.CacheKind.KV, args.tokens)
    src = torch.randn(shape, dtype=torch.float32).to(dtype)
    nbytes = src.numel() * src.element_size()
    gb = nbytes / 1e9

    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), args.repeats)
    clone_s = _median_s(src.clone, args.repeats)
    rows: list[dict[str, Any]] = [
        {
            "transport": "in-process",
            "op": "copy_",
            "median_ms": copy_s * 1e3,
            "GB/s": gb / copy_s,
            "x copy_": 1.0,
        },
        {
            "transport": "in-process",
            "op": "clone (fresh memory)",
            "median_ms": clone_s * 1e3,
            "GB/s": gb / clone_s,
            "x copy_": copy_s / clone_s,
        },
    ]
    pool_gb = nbytes * 3 / 1024**3 + 0.01
    with spawn_server(
        l1_size_gb=round(pool_gb, 3),
        chunk_size=args.chunk_size,
        no_l1_use_lazy=True,
        startup_timeout=120,
    ) as server:
        for n, transport in enumerate(args.transports):
            with sdk.kvcache.connect(
                server.url,
                server.http_url,
                f"bench-{transport}",
                120,
                layout=layout,
                transport=transport,
            ) as ctx:
                store_s, retrieve_s, kept_s = _measure(
                    ctx, src, args, base=1000 * n, label=ctx.transfer_ctx.mode
                )
                if args.device != "cpu" and ctx.transfer_ctx.mode == "shm":
                    rows += _gpu_rows(ctx, src, args, gb)
                for op, sec in (
                    ("store", store_s),
                    ("retrieve", retrieve_s),
                    ("retrieve, kept", kept_s),
                ):
                    rows.append(
                        {
                            "transport": ctx.transfer_ctx.mode,
                            "op": op,
                            "median_ms": sec * 1e3,
                            "GB/s": gb / sec,
                            "x copy_": copy_s / sec,
                        }
                    )
    against = _against_lmcache(src, layout, args, gb, rows) if args.against == "lmcache" else None
    return {
        "against": against,
        "shape": list(shape),
        "dtype": args.dtype,
        "bytes": nbytes,
        "chunk_size": args.chunk_size,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_avg_1min": os.getloadavg()[0],
        "repeats": args.repeats,
        "rows": rows,
    }


def _against_lmcache(
    src: torch.Tensor,
    layout: sdk.CacheLayout,
    args: argparse.Namespace,
    gb: float,
    rows: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The same tensor through lmcache.sdk on a real LMCache server; rows kvdrop vs LMCache."""
    import lmcache.sdk as lmc_sdk

    from kvdrop_engine.connectors.lmcache import LMCacheConnector
    from kvdrop_engine.testing import spawn_lmcache_server

    nbytes = src.numel() * src.element_size()
    model = types.SimpleNamespace(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_heads,
        num_heads=layout.num_heads,
        head_dim=layout.head_dim,
    )
    # Room for every store of the run: LMCache evicts in the background (at 80% full), so a store
    # into a full pool is refused rather than making room.
    with spawn_lmcache_server(
        l1_size_gb=round(nbytes * (args.repeats + 2) / 1024**3 / 0.8 + 0.05, 3),
        chunk_size=args.chunk_size,
        transfer_query=False,
    ) as server:
        # The SDK reads the model's layout from an engine's registration: kvdrop's LMCache
        # backend registers it exactly as vLLM's connector would (a one-chunk staging area).
        with LMCacheConnector(
            server.url, server.http_url, "bench-lmcache", staging_tokens=args.chunk_size
        ) as engine_side:
            engine_side.bind(model, layout.dtype)
            ctx = lmc_sdk.kvcache.connect(server.url, server.http_url, "bench-lmcache", 120)
            try:
                store_s, retrieve_s, kept_s = _measure(ctx, src, args, 5000, "lmcache.sdk")
            finally:
                ctx.close()
    ours = {r["op"]: r for r in rows if r["transport"] == "shm"}
    out = []
    for op, sec in (("store", store_s), ("retrieve", retrieve_s), ("retrieve, kept", kept_s)):
        mine = ours.get(op)
        out.append(
            {
                "op": op,
                "kvdrop GB/s": mine["GB/s"] if mine else float("nan"),
                "LMCache GB/s": gb / sec,
                "kvdrop / LMCache": mine["GB/s"] / (gb / sec) if mine else float("nan"),
                "LMCache median_ms": sec * 1e3,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run, print a table (or JSON with --json)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--width", type=int, default=1024, help="num_kv_heads * head_dim")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--transports", default="shm,socket", help="comma-separated: shm, socket")
    p.add_argument(
        "--against",
        choices=["lmcache"],
        default=None,
        help="also move the same tensor through lmcache.sdk on a real LMCache server",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cuda: also retrieve onto and store from the GPU by DMA (rows 'shm+gpu'; x copy_ "
        "there is the ratio to a pinned buffer's DMA)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if args.against == "lmcache" and "shm" not in args.transports:
        p.error("--against lmcache compares with the shm transport; keep shm in --transports")
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"shape {report['shape']} {report['dtype']} ({report['bytes'] / 1e6:.1f} MB), "
        f"chunk {report['chunk_size']}, torch threads {report['torch_threads']}, "
        f"cpus {report['cpu_count']}, load avg {report['load_avg_1min']:.1f}, "
        f"median of {report['repeats']}"
    )
    print(format_table(report["rows"], ["transport", "op", "median_ms", "GB/s", "x copy_"]))
    if report["against"] is not None:
        print()
        print(
            format_table(
                report["against"],
                ["op", "kvdrop GB/s", "LMCache GB/s", "kvdrop / LMCache", "LMCache median_ms"],
                title="kvdrop_sdk on the kvdrop server vs lmcache.sdk on the LMCache server "
                "(shared memory, same tensor)",
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
