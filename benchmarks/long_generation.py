"""Long generations with and without compression while decoding, side by side in one run.

Many prompts (``--prompt-tokens MIN MAX``, drawn uniformly) each generate ``--max-tokens``
tokens (greedy, EOS ignored) on one reference engine with a fixed KV budget
(``--kv-budget-tokens``, the engine's default 65536). The same job runs once per row:

* ``full``: every request keeps its whole cache (``"kvdrop": {"decode": null}``), so the budget
  holds few long requests at once and the rest wait or are preempted;
* one row per ``--decode-policy``: each request's cache is cut back to ``--decode-budget``
  tokens every ``--decode-every`` generated tokens (:mod:`kvdrop_engine.decode_cut`), so a request
  never holds more than budget + every tokens while it decodes and more of them run together.

Per row: output tokens/s over the job's wall time, the peak number of running requests, the KV
tokens held per decode step (all running requests together, mean) and by one request at most, the
longest and 99th-percentile gap between two tokens of one request (as its reader saw them: a cut,
a prefill chunk or a preemption of the step shows here), preemptions and the cuts' time.
``--time-limit`` stops a row after that many seconds (its requests cancelled): the row is then
marked partial and its rates are over the time it ran.

    python benchmarks/long_generation.py                    # CPU smoke, SmolLM2-135M shape
    python benchmarks/long_generation.py --device cuda --dtype bfloat16 --model-preset qwen3-8b \\
        --num-requests 64 --prompt-tokens 1024 2048 --max-tokens 4096 --kv-budget-tokens 65536 \\
        --decode-budget 1024 --decode-every 128
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import torch

from kvdrop_engine.decode_cut import DEFAULT_DECODE_EVERY, DecodeCompressor
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_sdk.table import format_table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def log(msg: str) -> None:
    """Progress goes to stderr so ``--json`` output stays clean."""
    print(f"[long_generation {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--model-preset", default="smollm2-135m", help="random-weight shape preset")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 256], help="MIN [MAX]")
    p.add_argument("--max-tokens", type=int, default=384, help="generated tokens per request")
    p.add_argument(
        "--kv-budget-tokens", type=int, default=2048, help="the engine's KV budget (2048)"
    )
    p.add_argument("--decode-policy", nargs="+", default=["rkv"], help="one row per policy")
    p.add_argument("--decode-budget", type=int, default=64, help="tokens kept by each cut")
    p.add_argument(
        "--decode-every",
        type=int,
        default=32,
        help=f"generated tokens between cuts (32; the engine's default is {DEFAULT_DECODE_EVERY})",
    )
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--time-limit", type=float, default=None, help="seconds per row at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    p.add_argument(
        "--skip-full",
        action="store_true",
        help="no full-KV row (its figures from an earlier run; gains are then not printed)",
    )
    args = p.parse_args(argv)
    if len(args.prompt_tokens) not in (1, 2) or min(args.prompt_tokens) < 1:
        p.error("--prompt-tokens takes MIN [MAX], each >= 1")
    for name in ("num_requests", "max_tokens", "decode_budget", "decode_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """``--num-requests`` random prompts, lengths uniform in ``--prompt-tokens``."""
    lo, hi = args.prompt_tokens[0], args.prompt_tokens[-1]
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(lo, hi + 1, (args.num_requests,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


class _Reader:
    """One request's tokens as its client sees them: count and the gaps between them."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tokens = 0
        self.gaps: list[float] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        last = None
        try:
            for _ in self.stream:
                now = time.perf_counter()
                if last is not None:
                    self.gaps.append(now - last)
                last = now
                self.tokens += 1
        except Exception:  # cancelled by the time limit
            pass


def run_job(
    engine: Engine,
    prompts: list[list[int]],
    max_tokens: int,
    decode: dict[str, Any] | None,
    time_limit: float | None,
) -> dict[str, Any]:
    """The job once (``decode``: the requests' ``"kvdrop.decode"`` override, None: uncut)."""
    engine.reset_stats()
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    params["kvdrop"] = {"decode": decode}
    started = time.perf_counter()
    readers = [_Reader(engine.post_completion(p, params)) for p in prompts]
    deadline = None if time_limit is None else started + time_limit
    partial = False
    for r in readers:
        left = None if deadline is None else max(0.0, deadline - time.perf_counter())
        r.thread.join(left)
        if r.thread.is_alive():
            partial = True
            break
    if partial:
        for r in readers:
            r.stream.close()
        for r in readers:
            r.thread.join(60)
    wall = time.perf_counter() - started
    st = engine.stats()
    gaps = sorted(g for r in readers for g in r.gaps)
    tokens = sum(r.tokens for r in readers)
    steps = max(st.decode_only_steps, 1)
    return {
        "run": "full" if decode is None else str(decode["policy"]),
        "requests": len(prompts),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "peak_running": st.peak_running,
        "kv_tokens_per_step": st.decode_kv_tokens / steps,
        "peak_kv_per_request": st.peak_decode_kv_tokens,
        "peak_kv_tokens": st.peak_blocks_used * engine.block_size,
        "gap_max_ms": 1e3 * gaps[-1] if gaps else 0.0,
        "gap_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
        "decode_step_ms": 1e3 * st.decode_step_seconds / steps,
        "preemptions": st.preemptions,
        "decode_cuts": st.decode_cuts,
        "cut_ms_per_cut": 1e3 * st.decode_cut_seconds / max(st.decode_cuts, 1),
        "cut_seconds": st.decode_cut_seconds,
        "partial": partial,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cfg = preset_config(args.model_preset)
    log(f"building {args.model_preset} (random weights) on {device} in {args.dtype}")
    model = Transformer.random(cfg, seed=args.seed, dtype=dtype, device=device).eval()
    compressor = DecodeCompressor(cfg, budget=args.decode_budget, every=args.decode_every)
    engine = Engine(
        model,
        kv_budget_tokens=args.kv_budget_tokens,
        max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        compressor=compressor,
    )
    prompts = make_prompts(args, cfg.vocab_size)
    runs: list[dict[str, Any] | None] = [] if args.skip_full else [None]
    runs += [{"policy": p, "budget": args.decode_budget} for p in args.decode_policy]
    rows = []
    with engine:
        log("warm-up: a short job with cuts (kernels, graphs, each policy's first call)")
        warm = [prompts[0][: args.decode_budget], prompts[-1][: args.decode_budget]]
        for decode in runs:
            run_job(engine, warm, 2 * args.decode_every + 2, decode, None)
        for decode in runs:
            name = "full" if decode is None else decode["policy"]
            log(f"{name}: {len(prompts)} requests x {args.max_tokens} tokens")
            rows.append(run_job(engine, prompts, args.max_tokens, decode, args.time_limit))
            log(f"{name}: {rows[-1]['tokens_per_s']:.1f} tokens/s")
    base = None if args.skip_full else rows[0]["tokens_per_s"]
    for row in rows:
        row["gain"] = row["tokens_per_s"] / base if base else float("nan")
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        return 0
    print(
        f"{args.model_preset} on {device} ({args.dtype}), KV budget {args.kv_budget_tokens} "
        f"tokens, {args.num_requests} prompts of {args.prompt_tokens[0]}-{args.prompt_tokens[-1]}"
        f" tokens x {args.max_tokens} generated; cut to {args.decode_budget} every "
        f"{args.decode_every}"
    )
    cols = [
        ("run", "run", "{}"),
        ("tokens/s", "tokens_per_s", "{:.1f}"),
        ("gain", "gain", "{:.2f}x"),
        ("peak running", "peak_running", "{}"),
        ("KV tokens/step", "kv_tokens_per_step", "{:.0f}"),
        ("peak KV/request", "peak_kv_per_request", "{}"),
        ("max gap ms", "gap_max_ms", "{:.1f}"),
        ("p99 gap ms", "gap_p99_ms", "{:.1f}"),
        ("step ms", "decode_step_ms", "{:.2f}"),
        ("preempted", "preemptions", "{}"),
        ("cuts", "decode_cuts", "{}"),
        ("cut ms", "cut_ms_per_cut", "{:.2f}"),
        ("cut s", "cut_seconds", "{:.1f}"),
        ("partial", "partial", "{}"),
    ]
    table = [{name: fmt.format(row[key]) for name, key, fmt in cols} for row in rows]
    print(format_table(table, [c[0] for c in cols]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
