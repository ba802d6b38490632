"""Modify time and KV bytes per edit: the full path against the path that moves only what the
policy reads (``kv_path="full"`` vs ``"least"``), at a real model's KV shape, no engine.

Starts a kvdrop server (subprocess, 127.0.0.1, free ports), stores ``--requests`` random
``[2, L, T, D]`` caches (the layout registered with RoPE, as an engine registers it), then edits
every one with each ``--policy`` through ``batch.modify`` once per ``--paths`` value: ``full``
(the whole KV fetched, the edited bytes stored), ``server`` (nothing fetched for chunk-halving
and streaming, the keys for knorm; the server keeps the rows, re-rotating on its CPU) and
``client`` (the kept keys re-rotated on the edit's device and stored back, the values gathered
by index in shared memory). Prints modify_s, the KV MB each edit moved, where an edit's time
went (fetch / edit / store) and whether the stored bytes equal the first path's.

    python benchmarks/edit_path.py                                   # qwen3-8b's KV shape, 2k
    python benchmarks/edit_path.py --tokens 8192 --requests 8 --edit-device cuda
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import kvdrop
from kvdrop_rope import RopeConfig
from kvdrop_sdk.batch import BatchedStream
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import connect
from kvdrop_sdk.keep import KV_PATH_CHOICES
from kvdrop_sdk.layout import DTYPES, CacheLayout
from kvdrop_sdk.request import create_request
from kvdrop_sdk.table import format_table
from kvdrop_sdk.testing.server import spawn_server


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--tokens", type=int, default=2048, help="cached tokens per request")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--keep-ratio", type=float, default=0.5)
    p.add_argument("--policy", nargs="+", default=["chunk-halving", "streaming", "knorm"])
    p.add_argument("--edit-device", default=None, help="batch.modify(device=)")
    p.add_argument(
        "--paths",
        nargs="+",
        choices=KV_PATH_CHOICES,
        default=["full", "server", "client"],
        help="kv_path values measured, in order (speedup and same_bytes against the first)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    return p.parse_args(argv)


def _no_engine(*args: Any) -> Any:
    raise AssertionError("edit_path.py never generates")


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rope = RopeConfig(head_dim=args.head_dim, theta=1_000_000.0)
    layout = CacheLayout(
        args.layers, args.kv_heads, args.head_dim, DTYPES[args.dtype], rope=rope.to_json()
    )
    per_request = layout.nbytes(CacheKind.KV, args.tokens)
    # The sources and about two paths' edits (older edits are evicted first: least recently used).
    pool_gb = max(0.25, 2.5 * args.requests * per_request / 2**30)
    rows = []
    with (
        spawn_server(chunk_size=args.chunk_size, l1_size_gb=pool_gb) as server,
        connect(CacheKind.KV, server.url, server.http_url, "edit-path", layout=layout) as ctx,
    ):
        # On a GPU edit: the caches are made there (fast) and the shared memory page-locked
        # before anything is timed, as an engine does before it serves (prepare_dma).
        where = torch.device(args.edit_device or "cpu")
        if where.type == "cuda":
            started = time.perf_counter()
            locked = ctx.prepare_dma()
            print(f"prepare_dma: {locked} in {time.perf_counter() - started:.1f} s", flush=True)
        gen = torch.Generator(device=where).manual_seed(0)
        prompts = []
        for i in range(args.requests):
            tokens = torch.randint(1, 30000, (args.tokens,)).tolist()
            shape = layout.shape(CacheKind.KV, args.tokens)
            kv = torch.randn(shape, generator=gen, device=where)
            ctx.store(kv.to(layout.dtype), tokens, f"src{i}")
            prompts.append(tokens)
        for name in args.policy:
            fn = kvdrop.get(name, keep_ratio=args.keep_ratio, chunk_size=args.chunk_size)
            stored: dict[str, torch.Tensor] = {}
            for kv_path in args.paths:
                batch = BatchedStream(max_concurrency=args.requests)
                for i, tokens in enumerate(prompts):
                    batch.add(create_request([ctx], _no_engine, tokens, f"src{i}"))
                start = time.perf_counter()
                report = batch.modify(fn, device=args.edit_device, kv_path=kv_path)
                wall = time.perf_counter() - start
                first = next(iter(batch))
                got = ctx.retrieve(first.tokens, first.active_cache_salt)
                assert got is not None
                stored[kv_path] = got
                rows.append(
                    {
                        "policy": name,
                        "kv_path": kv_path,
                        "path": report["edit_path"],
                        "modify_s": round(wall, 4),
                        "kv_MB_per_edit": round(float(report["kv_bytes_per_edit"]) / 1e6, 2),
                        "fetch_s_per_edit": round(float(report["fetch_s_per_edit"]), 4),
                        "edit_s_per_edit": round(float(report["edit_s_per_edit"]), 4),
                        "store_s_per_edit": round(float(report["store_s_per_edit"]), 4),
                        # The first request's stored cache against the first path's.
                        "same_bytes": torch.equal(got, stored[args.paths[0]]),
                    }
                )
            base = next(r for r in rows if r["policy"] == name)["modify_s"]
            for r in rows:
                if r["policy"] == name:
                    r["speedup"] = round(base / max(r["modify_s"], 1e-9), 2)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = measure(args)
    shape = f"[2, {args.layers}, {args.tokens}, {args.kv_heads * args.head_dim}] {args.dtype}"
    title = f"{args.requests} edits of {shape} on {args.edit_device or 'the host'} per kv_path"
    print(format_table(rows, list(rows[0]), title=title))
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
