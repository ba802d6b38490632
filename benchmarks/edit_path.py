"""Modify time and KV bytes per edit: the full path against the path that moves only what the
policy reads (``kv_path="full"`` vs ``"least"``), at a real model's KV shape, no engine.

Starts a kvdrop server (subprocess, 127.0.0.1, free ports), stores ``--requests`` random
``[2, L, T, D]`` caches (the layout registered with RoPE, as an engine registers it), then edits
every one with each ``--policy`` through ``batch.modify`` twice, under fresh salts: once with the
whole KV fetched and the edited bytes stored (``full``), once the automatic way (nothing fetched
for chunk-halving and streaming, the keys for knorm; the server keeps the kept rows). Prints
modify_s, per edit, and the KV MB each edit moved, side by side.

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
    pool_gb = max(0.25, 4 * args.requests * per_request / 2**30)
    rows = []
    with (
        spawn_server(chunk_size=args.chunk_size, l1_size_gb=pool_gb) as server,
        connect(CacheKind.KV, server.url, server.http_url, "edit-path", layout=layout) as ctx,
    ):
        gen = torch.Generator().manual_seed(0)
        prompts = []
        for i in range(args.requests):
            tokens = torch.randint(1, 30000, (args.tokens,), generator=gen).tolist()
            kv = torch.randn(layout.shape(CacheKind.KV, args.tokens), generator=gen)
            ctx.store(kv.to(layout.dtype), tokens, f"src{i}")
            prompts.append(tokens)
        for name in args.policy:
            fn = kvdrop.get(name, keep_ratio=args.keep_ratio, chunk_size=args.chunk_size)
            row: dict[str, Any] = {"policy": name}
            for kv_path in ("full", "least"):
                batch = BatchedStream(max_concurrency=args.requests)
                for i, tokens in enumerate(prompts):
                    batch.add(create_request([ctx], _no_engine, tokens, f"src{i}"))
                start = time.perf_counter()
                report = batch.modify(fn, device=args.edit_device, kv_path=kv_path)
                wall = time.perf_counter() - start
                tag = "before" if kv_path == "full" else "after"
                row[f"modify_s_{tag}"] = round(wall, 4)
                row[f"path_{tag}"] = report["edit_path"]
                row[f"kv_MB_per_edit_{tag}"] = round(float(report["kv_bytes_per_edit"]) / 1e6, 2)
            row["speedup"] = round(row["modify_s_before"] / max(row["modify_s_after"], 1e-9), 2)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = measure(args)
    shape = f"[2, {args.layers}, {args.tokens}, {args.kv_heads * args.head_dim}] {args.dtype}"
    title = f"{args.requests} edits of {shape} (before: kv_path=full; after: least)"
    print(format_table(rows, list(rows[0]), title=title))
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
