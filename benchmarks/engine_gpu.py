"""The engine's GPU path on one device: ceilings, kernel checks, and where a step's time goes.

One run measures, in order:

1. ceilings: device copy bandwidth (bytes read + written) and a bf16 matrix product's rate;
   host<->device copies of one prompt's KV, pageable and page-locked; host memcpy on 1 and N
   threads (the shm transport's copies);
2. correctness on the GPU against float64 references on fresh random inputs: the paged decode
   kernel (several shapes, lengths 1..N), the fused RMSNorm and SwiGLU;
3. the paged decode kernel at the benchmark's two batch shapes over launch parameters (the
   achieved bandwidth of each);
4. a model-level decode step (``--model-preset``, random weights, a KV cache filled with random
   data) at those shapes: eager vs CUDA graph, fused ops on and off, each against its floor, plus
   a profile of one eager step by kernel;
5. prefill chunks (``--chunk`` tokens at position 0 and later), fused ops on/off, query capture on,
   plus a profile by kernel; reading one prompt's KV out for a store and loading it back.

    python benchmarks/engine_gpu.py --model-preset qwen3-8b --out /tmp/profile
"""

# Closures below are timed where they are defined, inside their loop iteration.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvdrop_engine import kernels
from kvdrop_engine.graphs import DecodeGraphs
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import RMSNorm, Transformer
from kvdrop_engine.paged import PagedAttention, PagedDecode, PagedKVCache, SeqStep, blocks_needed
from kvdrop_sdk.table import format_table
from kvdrop_sdk.transport.buffers import copy_threads, empty_tensor, run_copies

RESULTS: dict[str, Any] = {}
PROFILES: list[str] = []


def log(msg: str) -> None:
    print(f"[engine_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cuda_time(fn: Callable[[], Any], repeats: int = 10, warmup: int = 2) -> float:
    """Median seconds of ``fn`` timed with CUDA events (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def wall_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn`` (synchronising the device after each call)."""
    for _ in range(warmup):
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---------------------------------------------------------------------------------- 1. ceilings
def ceilings(kv_bytes: int) -> dict[str, float]:
    out: dict[str, float] = {}
    n = 2 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    out["d2d_copy_GBs"] = 2 * n / cuda_time(lambda: dst.copy_(src), 20) / 1e9
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    out["bf16_matmul_TFLOPs"] = 2 * 8192**3 / cuda_time(lambda: a @ b, 10) / 1e12
    host = torch.randint(0, 255, (kv_bytes,), dtype=torch.uint8)
    pinned = torch.empty(kv_bytes, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(host)
    dev = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
    out["h2d_pageable_GBs"] = kv_bytes / wall_time(lambda: dev.copy_(host)) / 1e9
    out["h2d_pinned_GBs"] = kv_bytes / wall_time(lambda: dev.copy_(pinned, non_blocking=True)) / 1e9
    out["d2h_pageable_GBs"] = kv_bytes / wall_time(lambda: host.copy_(dev)) / 1e9
    out["d2h_pinned_GBs"] = kv_bytes / wall_time(lambda: pinned.copy_(dev, non_blocking=True)) / 1e9

    def staged() -> None:  # what PagedKVCache.load does for a large host tensor
        p = torch.empty(kv_bytes, dtype=torch.uint8, pin_memory=True)
        p.copy_(host)
        dev.copy_(p, non_blocking=True)

    out["h2d_staged_GBs"] = kv_bytes / wall_time(staged) / 1e9
    out["host_torch_copy_GBs"] = kv_bytes / wall_time(lambda: pinned.copy_(host)) / 1e9
    other = torch.empty_like(host)
    other.fill_(1)  # fault its pages in: both timings below copy into touched memory
    pieces = 64
    step = kv_bytes // pieces
    import ctypes

    def memmove_tasks() -> list[Callable[[], None]]:
        return [
            lambda i=i: ctypes.memmove(
                other.data_ptr() + i * step, host.data_ptr() + i * step, step
            )
            for i in range(pieces)
        ]

    t = time.perf_counter()
    for task in memmove_tasks():
        task()
    out["host_memmove_1thread_GBs"] = kv_bytes / (time.perf_counter() - t) / 1e9
    run_copies(memmove_tasks(), kv_bytes)  # warm the pool
    t = time.perf_counter()
    run_copies(memmove_tasks(), kv_bytes)
    out[f"host_memmove_{copy_threads()}threads_GBs"] = kv_bytes / (time.perf_counter() - t) / 1e9
    # Into fresh, unfaulted memory (what a retrieve does when no recycled buffer fits).
    t = time.perf_counter()
    other = empty_tensor((kv_bytes,), torch.uint8, populate=False)
    run_copies(memmove_tasks(), kv_bytes)
    out["host_memmove_fresh_parallel_GBs"] = kv_bytes / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    other = empty_tensor((kv_bytes,), torch.uint8, populate=True)
    out["host_populate_GBs"] = kv_bytes / (time.perf_counter() - t) / 1e9
    return out


# ------------------------------------------------------------------------------ 2. correctness
def decode_reference(q, kc, vc, table, lens) -> torch.Tensor:
    bsz, hq, d = q.shape
    _, bs, hkv, _ = kc.shape
    out = torch.empty(bsz, hq, d, dtype=torch.float64, device=q.device)
    for b in range(bsz):
        n = int(lens[b])
        nb = blocks_needed(n, bs)
        k = kc[table[b, :nb].long()].reshape(-1, hkv, d)[:n].double()
        v = vc[table[b, :nb].long()].reshape(-1, hkv, d)[:n].double()
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        p = (torch.einsum("hd,thd->ht", q[b].double(), k) * d**-0.5).softmax(-1)
        out[b] = torch.einsum("ht,thd->hd", p, v)
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.double()
    if not torch.isfinite(x).all():
        return math.inf
    return float((x - ref).norm() / ref.norm())


def correctness() -> list[dict[str, Any]]:
    rows = []
    cases = [
        (5, 32, 8, 128, 16, [1, 17, 300, 4096, 9000]),
        (3, 9, 3, 64, 16, [2, 64, 1000]),
        (4, 16, 16, 128, 16, [15, 16, 33, 2500]),
    ]
    for bsz, hq, hkv, d, bs, lens in cases:
        nblk = sum(blocks_needed(n, bs) for n in lens) + 8
        kc = torch.randn(nblk, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
        width = max(blocks_needed(n, bs) for n in lens)
        perm = torch.randperm(nblk, device="cuda").int()
        table = torch.full((bsz, width), -1, dtype=torch.int32, device="cuda")
        at = 0
        for b, n in enumerate(lens):
            k = blocks_needed(n, bs)
            table[b, :k] = perm[at : at + k]
            at += k
        table[table < 0] = 0
        lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
        ref = decode_reference(q, kc, vc, table, lens_t)
        for splits in (1, 4, 16):
            out = torch.full_like(q, float("nan"))
            kernels.paged_decode(q, kc, vc, table, lens_t, splits=splits, out=out)
            rows.append(
                {
                    "check": f"paged_decode B{bsz} H{hq}/{hkv} d{d} s{splits}",
                    "rel_err": rel_err(out, ref),
                }
            )
    for n, dim in ((4096, 4096), (17, 128), (3, 1000)):
        x = torch.randn(n, dim, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
        norm = RMSNorm(dim, 1e-6).to("cuda", torch.bfloat16)
        norm.weight.data.copy_(w)
        ref = norm(x)
        got = kernels.rms_norm(x, w, 1e-6)
        rows.append(
            {
                "check": f"rms_norm {n}x{dim}",
                "rel_err": rel_err(got, ref.double()),
                "mismatch": float((got != ref).float().mean()),
            }
        )
        g, u = torch.randn_like(x), torch.randn_like(x)
        ref = torch.nn.functional.silu(g) * u
        got = kernels.silu_mul(g, u)
        rows.append(
            {
                "check": f"silu_mul {n}x{dim}",
                "rel_err": rel_err(got, ref.double()),
                "mismatch": float((got != ref).float().mean()),
            }
        )
    return rows


# ------------------------------------------------------------------------------ 3. kernel sweep
def fill_random(cache: PagedKVCache) -> None:
    for layer in range(cache.num_layers):
        cache.k[layer].normal_()
        cache.v[layer].normal_()


def batch_seqs(cache: PagedKVCache, lengths: list[int]) -> list[SeqStep]:
    """SeqSteps decoding at ``lengths`` (token ``n`` written at position n) over fresh blocks."""
    seqs = []
    blocks = cache.allocator.allocate(sum(blocks_needed(n + 1, cache.block_size) for n in lengths))
    at = 0
    for i, n in enumerate(lengths):
        k = blocks_needed(n + 1, cache.block_size)
        seqs.append(SeqStep(i, blocks[at : at + k], n, 1))
        at += k
    return seqs


def sweep(cache: PagedKVCache, shapes: dict[str, list[int]], hq: int) -> list[dict[str, Any]]:
    rows = []
    d = cache.head_dim
    for name, lengths in shapes.items():
        seqs = batch_seqs(cache, lengths)
        dec = PagedDecode.build(cache, seqs)
        q = torch.randn(len(seqs), hq, d, device="cuda", dtype=cache.dtype)
        kv_bytes = sum(n + 1 for n in lengths) * 2 * cache.num_kv_heads * d * cache.k.element_size()
        best = None
        configs = [(64, 4, 2), (32, 4, 2), (64, 4, 3), (128, 8, 2), (64, 8, 3), (128, 4, 3)]
        for splits in (4, 8, 16, 32):
            for block_n, warps, stages in configs:

                def call(s=splits, bn=block_n, w=warps, st=stages) -> None:
                    kernels.paged_decode(
                        q,
                        cache.k[0],
                        cache.v[0],
                        dec.table,
                        dec.lens,
                        splits=s,
                        block_n=bn,
                        num_warps=w,
                        num_stages=st,
                    )

                try:
                    t = cuda_time(call, 20, 3)
                except Exception as exc:  # a config Triton cannot build
                    log(f"sweep {name} {splits}/{block_n}/{warps}/{stages}: {exc!r}")
                    continue
                row = {
                    "shape": name,
                    "splits": splits,
                    "block_n": block_n,
                    "warps": warps,
                    "stages": stages,
                    "us": t * 1e6,
                    "GBs": kv_bytes / t / 1e9,
                }
                rows.append(row)
                if best is None or t < best["us"] / 1e6:
                    best = row
        default = kernels.decode_splits(len(seqs), cache.num_kv_heads, "cuda")
        t = cuda_time(lambda: dec.attend(0, q), 20, 3)
        rows.append(
            {
                "shape": name,
                "splits": default,
                "block_n": 64,
                "warps": 4,
                "stages": 2,
                "us": t * 1e6,
                "GBs": kv_bytes / t / 1e9,
                "note": "default",
            }
        )
        if best is not None:
            best = dict(best, note="best")
            rows.append(best)
        cache.allocator.free([b for s in seqs for b in s.block_table])
    return rows


# ------------------------------------------------------------------------ 4. model decode step
def profile_table(fn: Callable[[], Any], top: int = 14) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=top, max_name_column_width=60
    )


def weight_bytes(model: Transformer) -> int:
    total = 0
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


def decode_steps(
    model: Transformer,
    cache: PagedKVCache,
    shapes: dict[str, list[int]],
    bandwidth: float,
    out_dir: Path,
) -> list[dict[str, Any]]:
    rows = []
    wbytes = weight_bytes(model)
    for name, lengths in shapes.items():
        seqs = batch_seqs(cache, lengths)
        tokens = torch.randint(0, model.config.vocab_size, (len(seqs),)).tolist()
        kv_tokens = sum(n + 1 for n in lengths)
        floor = (wbytes + kv_tokens * cache.bytes_per_token) / bandwidth

        def eager() -> torch.Tensor:
            attn = PagedAttention(cache, seqs)
            with torch.inference_mode():
                return model(
                    torch.tensor(tokens, device="cuda"),
                    torch.tensor([s.start for s in seqs], device="cuda"),
                    attn,
                )

        graphs = DecodeGraphs(model, cache, 256)

        def graphed() -> list[int]:
            _, greedy = graphs.run(seqs, tokens)
            return greedy.tolist()

        for fused in (False, True):
            model.use_ops(kernels if fused else None)
            graphs = DecodeGraphs(model, cache, 256)
            t_eager = wall_time(eager, 5, 2)
            t_graph = wall_time(graphed, 20, 3)
            rows.append(
                {
                    "shape": name,
                    "fused": fused,
                    "batch": len(seqs),
                    "kv_tokens": kv_tokens,
                    "floor_ms": floor * 1e3,
                    "eager_ms": t_eager * 1e3,
                    "graph_ms": t_graph * 1e3,
                    "graph_over_floor": t_graph / floor,
                }
            )
        # Graph vs eager agreement (same inputs; KV of the new token is rewritten identically).
        e = eager().float()
        g_logits, g_greedy = graphs.run(seqs, tokens)
        rows[-1]["graph_vs_eager_rel"] = rel_err(g_logits, e.double())
        rows[-1]["argmax_agree"] = float((g_greedy == e.argmax(-1)).float().mean())
        model.use_ops(None)
        PROFILES.append(f"--- eager decode step {name}, plain ops\n{profile_table(eager)}")
        model.use_ops(kernels)
        PROFILES.append(f"--- eager decode step {name}, fused ops\n{profile_table(eager)}")
        cache.allocator.free([b for s in seqs for b in s.block_table])
    return rows


# ------------------------------------------------------------------------------- 5. prefill
def prefill(
    model: Transformer, cache: PagedKVCache, chunk: int, out_dir: Path
) -> list[dict[str, Any]]:
    rows = []
    total = 14336
    blocks = cache.allocator.allocate(blocks_needed(total, cache.block_size))
    vocab = model.config.vocab_size
    for start in (0, total - chunk):
        tokens = torch.randint(0, vocab, (chunk,), device="cuda")
        pos = torch.arange(start, start + chunk, device="cuda")
        last = torch.tensor([chunk - 1], device="cuda")
        for fused, capture in ((False, False), (True, False), (True, True)):
            model.use_ops(kernels if fused else None)

            def step(capture=capture) -> None:
                attn = PagedAttention(
                    cache, [SeqStep(0, blocks, start, chunk)], capture={0} if capture else ()
                )
                with torch.inference_mode():
                    model(tokens, pos, attn, logits_rows=last)
                if capture:  # what the engine does with the captured queries today
                    q = torch.stack([t for t in attn.captured[0]])
                    q.reshape(q.shape[0], chunk, -1).cpu()

            t = wall_time(step, 3, 1)
            rows.append(
                {
                    "start": start,
                    "tokens": chunk,
                    "fused": fused,
                    "capture": capture,
                    "ms": t * 1e3,
                    "tok_s": chunk / t,
                }
            )
        model.use_ops(kernels)

        def plain_step() -> None:
            attn = PagedAttention(cache, [SeqStep(0, blocks, start, chunk)])
            with torch.inference_mode():
                model(tokens, pos, attn, logits_rows=last)

        PROFILES.append(f"--- prefill chunk at {start}, fused ops\n{profile_table(plain_step, 16)}")
    # Store read-out and load-back of one whole prompt.
    t_read = wall_time(lambda: cache.read_cpu(blocks, total), 3, 1)
    host = cache.read_cpu(blocks, total)
    t_read_pageable = wall_time(lambda: cache.read(blocks, total).cpu(), 3, 1)
    t_load = wall_time(lambda: cache.load(blocks, host), 3, 1)
    t_load_pageable = wall_time(lambda: cache.load(blocks, host.clone()), 2, 0)
    gb = host.numel() * host.element_size() / 1e9
    rows.append(
        {
            "start": "store read",
            "tokens": total,
            "ms": t_read * 1e3,
            "GBs": gb / t_read,
            "pageable_GBs": gb / t_read_pageable,
        }
    )
    rows.append(
        {
            "start": "prefix load",
            "tokens": total,
            "ms": t_load * 1e3,
            "GBs": gb / t_load,
            "clone_then_load_GBs": gb / t_load_pageable,
        }
    )
    cache.allocator.free(blocks)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-preset", default="qwen3-8b")
    p.add_argument("--budget-tokens", type=int, default=186752)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--out", default="engine_gpu_out")
    p.add_argument(
        "--skip", nargs="*", default=[], help="sections to skip: ceil check sweep decode prefill"
    )
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    RESULTS["device"] = {
        "name": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": getattr(kernels.triton, "__version__", None),
    }
    log(f"{RESULTS['device']}")
    cfg = preset_config(args.model_preset)
    kv_token = 2 * cfg.num_layers * cfg.kv_dim * 2
    if "ceil" not in args.skip:
        RESULTS["ceilings"] = ceilings(11000 * kv_token)
        log(f"ceilings {RESULTS['ceilings']}")
    bandwidth = RESULTS.get("ceilings", {}).get("d2d_copy_GBs", 4300) * 1e9
    if "check" not in args.skip:
        RESULTS["checks"] = correctness()
        print(format_table(RESULTS["checks"], ["check", "rel_err", "mismatch"], title="Checks"))
    log("building model")
    model = Transformer.random(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    cache = PagedKVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_blocks=args.budget_tokens // 16,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
    )
    fill_random(cache)
    gen = torch.Generator().manual_seed(1)
    shapes = {
        "base16x11k": torch.randint(8597, 14289 + 256, (16,), generator=gen).tolist(),
        "drop30x5.6k": torch.randint(4300, 7150 + 256, (30,), generator=gen).tolist(),
    }
    if "sweep" not in args.skip:
        RESULTS["sweep"] = sweep(cache, shapes, cfg.num_heads)
        best = [r for r in RESULTS["sweep"] if r.get("note")]
        print(
            format_table(
                best,
                ["shape", "note", "splits", "block_n", "warps", "stages", "us", "GBs"],
                title="paged_decode, one layer",
            )
        )
    if "decode" not in args.skip:
        RESULTS["decode"] = decode_steps(model, cache, shapes, bandwidth, out_dir)
        print(format_table(RESULTS["decode"], list(RESULTS["decode"][-1]), title="Decode step"))
    if "prefill" not in args.skip:
        RESULTS["prefill"] = prefill(model, cache, args.chunk, out_dir)
        cols = [
            "start",
            "tokens",
            "fused",
            "capture",
            "ms",
            "tok_s",
            "GBs",
            "pageable_GBs",
            "clone_then_load_GBs",
        ]
        print(format_table(RESULTS["prefill"], cols, title="Prefill chunk / store read / load"))
    (out_dir / "engine_gpu.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    (out_dir / "profiles.txt").write_text("\n\n".join(PROFILES))
    if "ceilings" in RESULTS:
        print(format_table([RESULTS["ceilings"]], list(RESULTS["ceilings"]), title="Ceilings"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
