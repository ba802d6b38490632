"""What one decode-time cut costs: the batched ranking beside the policy run per request.

A step cuts every request whose cache reached ``budget + every`` rows. This times the ranking
of ``B`` such requests (random keys of the model's layout, random query rows at the last slots)
two ways: :class:`kvdrop_engine.decode_batch.BatchedRank` over the batch at once (what the
engine runs) and the policy library's own call per request (what it ran before), and counts the
kept rows on which they differ (0 expected but for float ties at the budget's edge). ``cut
ms/request`` is the engine's whole cut of the same requests in a paged cache
(:meth:`DecodeCompressor.cut`: the gather, the ranking, the move of the kept rows, the read of
their indices), what ``long_generation.py``'s ``cut ms`` counts per request.

    python benchmarks/decode_cut_cost.py                      # CPU, SmolLM2-135M shape
    python benchmarks/decode_cut_cost.py --device cuda --dtype bfloat16 --model-preset qwen3-8b \\
        --batch 1 4 8 --policies rkv snapkv tova knorm
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from kvdrop_engine.capture import WindowCapture
from kvdrop_engine.decode_cut import DecodeCompressor, DecodeCut
from kvdrop_engine.loading import preset_config
from kvdrop_engine.paged import PagedKVCache, blocks_needed
from kvdrop_engine.plan import RequestPlan
from kvdrop_engine.request_options import submission
from kvdrop_engine.sequence import Request, new_request

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: torch.device, repeat: int) -> tuple[float, Any]:
    out = fn()  # warm-up (kernels, Triton compilation)
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    _sync(device)
    return (time.perf_counter() - started) / repeat, out


def measure(
    compressor: DecodeCompressor,
    spec: str,
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
    repeat: int,
    gen: torch.Generator,
) -> dict[str, Any]:
    """One row: ``batch`` due requests of ``spec`` ranked batched and per request."""
    cfg = compressor.config
    cut = compressor.choose({"policy": spec})
    assert cut is not None and cut.fast is not None, f"{spec} has no batched ranking"
    fast_rank = cut.fast
    num_tokens = cut.budget + cut.every
    count = cut.capture.window
    width = cfg.num_kv_heads * cfg.head_dim
    kv = torch.randn(2, cfg.num_layers, batch * num_tokens, width, generator=gen)
    kv[0] += 0.5 * torch.randn(1, 1, width, generator=gen)  # some similar keys
    kv = kv.to(device, dtype)
    qpos = torch.arange(num_tokens - count, num_tokens)
    q = torch.randn(batch, cfg.num_layers, count, cfg.num_heads, cfg.head_dim, generator=gen)
    q = q.to(device, dtype)
    parts = kv.split(num_tokens, dim=2)
    pos, toks = torch.arange(num_tokens), list(range(num_tokens))
    keys = kv[0].unflatten(1, (batch, num_tokens)).transpose(0, 1)
    queries = q.reshape(batch, cfg.num_layers, count, -1) if fast_rank.reads_queries else None

    def together() -> torch.Tensor:
        return fast_rank.select(keys, queries, qpos).cpu()

    def each() -> list[torch.Tensor]:
        return [
            compressor.select(cut, parts[i], pos, toks, (qpos, q[i]), batched=False)
            for i in range(batch)
        ]

    fast_s, fast = _timed(together, device, repeat)
    lib_s, lib = _timed(each, device, repeat)
    cut_s = _engine_cut(compressor, cut, kv, qpos, q, repeat)
    differ = sum(len(set(a.tolist()) ^ set(f.tolist())) for a, f in zip(lib, fast))
    return {
        "policy": spec,
        "requests": batch,
        "tokens": num_tokens,
        "batched_ms": 1e3 * fast_s,
        "batched_ms_per_request": 1e3 * fast_s / batch,
        "library_ms_per_request": 1e3 * lib_s / batch,
        "cut_ms_per_request": 1e3 * cut_s / batch,
        "rows_differing": differ,
    }


def _engine_cut(
    compressor: DecodeCompressor,
    cut: DecodeCut,
    kv: torch.Tensor,
    qpos: torch.Tensor,
    q: torch.Tensor,
    repeat: int,
) -> float:
    """Seconds of one :meth:`DecodeCompressor.cut` of the ``B`` requests of ``kv`` ``[2, L,
    B*T, D]`` (query rows ``q`` ``[B, L, r, Hq, d]`` at slots ``qpos``) in a paged cache; each
    run restores the requests (their blocks, rows and window) first, untimed."""
    cfg = compressor.config
    batch, num_tokens = q.shape[0], kv.shape[2] // q.shape[0]
    per = blocks_needed(num_tokens, 16)
    cache = PagedKVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_blocks=batch * per,
        dtype=kv.dtype,
        device=kv.device,
    )
    params, options = submission({"max_tokens": 1 << 20})
    reqs = [
        new_request(i, [1], params, options, vocab_size=cfg.vocab_size, detok=None)
        for i in range(batch)
    ]

    def restore(req: Request, i: int) -> None:
        cache.allocator.free(req.blocks)
        req.blocks = cache.allocator.allocate(per)
        req.plan = RequestPlan(decode=cut)
        req.num_computed, req.dropped, req.kept_positions = num_tokens, 0, None
        part = kv[:, :, i * num_tokens : (i + 1) * num_tokens]
        cache.write_slots(cache.slots(req.blocks, 0, num_tokens), part)
        req.window = WindowCapture(num_tokens, cut.capture.window, 0)
        req.window.add(qpos.tolist(), q[i])

    total = 0.0
    for run in range(repeat + 1):  # the first is the warm-up
        for i, req in enumerate(reqs):
            restore(req, i)
        _sync(kv.device)
        started = time.perf_counter()
        compressor.cut(cache, reqs)
        _sync(kv.device)
        total += (time.perf_counter() - started) if run else 0.0
    return total / repeat


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--model-preset", default="smollm2-135m")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--every", type=int, default=128)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--policies", nargs="+", default=["rkv", "knorm"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cfg = preset_config(args.model_preset)
    num_tokens = args.budget + args.every
    compressor = DecodeCompressor(cfg, budget=args.budget, every=args.every)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for spec in args.policies:
        for b in args.batch:
            rows.append(measure(compressor, spec, b, device, dtype, args.repeat, gen))
            print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        print(
            f"{args.model_preset} on {device} ({args.dtype}): {num_tokens} rows per request cut "
            f"to {args.budget}, {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads"
        )
        print(
            "policy  requests  batched ms  batched ms/request  library ms/request  "
            "cut ms/request  differing"
        )
        for r in rows:
            print(
                f"{r['policy']:<7} {r['requests']:>8}  {r['batched_ms']:>10.2f}  "
                f"{r['batched_ms_per_request']:>18.2f}  {r['library_ms_per_request']:>18.2f}  "
                f"{r['cut_ms_per_request']:>14.2f}  {r['rows_differing']:>9}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
