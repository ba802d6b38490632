"""Decode-throughput gain of token dropping, measured side by side in one run.

Starts a kvdrop server (subprocess, 127.0.0.1, free ports) and the reference engine with a KV
budget that holds every request once it is cut to ``--keep-ratio`` (so, at keep 0.5, about half
of the baseline requests at once; ``--fit-fraction`` or ``--kv-budget-tokens`` set it instead),
then runs:

* baseline: prefill every prompt (KV stored in the server), decode ``--max-tokens`` each;
* dropped:  prefill, modify with ``kvdrop.get(--policy, keep_ratio=--keep-ratio)``, decode.

Both runs use the same engine, prompts and greedy sampling; the dropped run's shorter caches let
more requests share each decode step. Prints every phase, both decode throughputs and their ratio,
the modify time per request and, for query policies, the query bytes the engine stored per prompt
token (``--query-capture window``, the lean default, or ``full``, every prompt token's).

    python benchmarks/decode_gain.py                         # CPU, SmolLM2-135M shape, random
    python benchmarks/decode_gain.py --model-preset tiny --num-requests 4 --policy snapkv
    python benchmarks/decode_gain.py --device cuda --dtype bfloat16 --model-preset qwen3-8b \\
        --num-requests 30 --prompt-tokens 8192 14336 --max-tokens 512 --share-prefill \\
        --policy snapkv
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch

import kvdrop
from kvdrop.experiments.pipeline import Prompt, engine_budget, run_pipeline
from kvdrop_engine.connector import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import load_checkpoint, preset_config
from kvdrop_engine.model import ModelConfig, Transformer
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import connect
from kvdrop_sdk.server.testing import spawn_server
from kvdrop_sdk.table import format_table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def log(msg: str) -> None:
    """Progress goes to stderr so ``--json`` output stays clean."""
    print(f"[decode_gain {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--model-preset", default="smollm2-135m", help="random-weight shape preset")
    p.add_argument("--model-path", default=None, help="HF folder or .gguf instead of a preset")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument(
        "--prompt-tokens",
        type=int,
        nargs="+",
        default=[1024],
        help="prompt length, or MIN MAX for lengths drawn uniformly",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per request")
    p.add_argument("--policy", default="chunk-halving")
    p.add_argument("--keep-ratio", type=float, default=0.5)
    p.add_argument("--no-rerotate", action="store_true", help="keep kept keys at old positions")
    p.add_argument(
        "--policy-device",
        default="auto",
        help="where policies score: auto (CUDA when available), cpu, cuda (default auto)",
    )
    p.add_argument(
        "--query-capture",
        choices=["window", "full"],
        default="window",
        help="queries the engine stores for query policies: the last tokens' and a strided "
        "sample (window, default) or every prompt token's (full)",
    )
    p.add_argument("--chunk-size", type=int, default=256, help="server chunk size")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--fit-fraction",
        type=float,
        default=None,
        help="size the budget for this fraction of baseline requests instead",
    )
    p.add_argument("--kv-budget-tokens", type=int, default=None, help="overrides --fit-fraction")
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--share-prefill",
        action="store_true",
        help="one cache salt for both runs: the dropped run's prefill loads the baseline's KV "
        "(halves server memory; its prefill numbers then show loading, not computing)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if len(args.prompt_tokens) not in (1, 2) or min(args.prompt_tokens) < 1:
        p.error("--prompt-tokens takes one length or MIN MAX (positive ints)")
    if not 0 < args.keep_ratio <= 1 or not 0 < (args.fit_fraction or 1) <= 1:
        p.error("--keep-ratio and --fit-fraction must be in (0, 1]")
    if args.num_requests < 1 or args.max_tokens < 1:
        p.error("--num-requests and --max-tokens must be >= 1")
    return args


def build_model(args: argparse.Namespace) -> Transformer:
    """Random weights initialised directly on the target device (fast for 8B shapes)."""
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    if args.model_path:
        return load_checkpoint(args.model_path, dtype=dtype, device=device)
    cfg = preset_config(args.model_preset)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    lo, hi = args.prompt_tokens[0], args.prompt_tokens[-1]
    lengths = torch.randint(lo, hi + 1, (args.num_requests,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def server_gb(cfg: ModelConfig, dtype: torch.dtype, prompts: list[list[int]], args: Any) -> float:
    """Pool size holding every run's prompt KV (+ queries when the policy needs them) twice over."""
    item = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * cfg.num_layers * cfg.kv_dim * item
    if kvdrop.describe(args.policy).needs_query and args.query_capture == "full":
        per_token += cfg.num_layers * cfg.q_dim * item  # windows live beside the pool
    runs = 1 if args.share_prefill else 2
    total = sum(len(p) + 1 + args.max_tokens for p in prompts) * per_token
    return max(0.25, (runs + args.keep_ratio) * total * 1.15 / 2**30)


def budget_blocks(prompts: list[list[int]], args: argparse.Namespace) -> int:
    """KV budget in blocks: every request after dropping fits at once (upper estimate of its
    kept chunks, its tail, the prefill token and ``max_tokens``), or ``--fit-fraction`` of the
    baseline requests of average size. A decode request is prompt + 1 token + max_tokens - 1."""
    bs, chunk = args.block_size, args.chunk_size
    base = [math.ceil((len(p) + args.max_tokens) / bs) for p in prompts]
    if args.fit_fraction is not None:
        fit = max(1, math.floor(len(prompts) * args.fit_fraction))
        return max(max(base), math.floor((fit + 0.5) * statistics.mean(base)))
    budget, _, _ = engine_budget(
        [len(p) for p in prompts], args.max_tokens, args.keep_ratio, chunk, bs
    )
    return budget // bs


def run(
    name: str,
    engine: Engine,
    server: Any,
    model_name: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    policy_fn: Any,
    needs_query: bool,
) -> dict[str, Any]:
    """One side of the comparison (`run_pipeline`, as the demo uses it): a table row."""
    kinds = [CacheKind.KV] + ([CacheKind.QUERY] if needs_query and policy_fn else [])
    ctxs = [connect(k, server.url, server.http_url, model_name) for k in kinds]
    salt = "shared" if args.share_prefill else name
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_tokens": args.max_tokens}
    log(f"{name}: prefill, {'modify, ' if policy_fn else ''}decode {len(prompts)} prompts")
    try:
        res = run_pipeline(
            name,
            engine,
            ctxs,
            [Prompt(p) for p in prompts],
            greedy,
            modify_fn=policy_fn,
            cache_salt=salt,
        )
    finally:
        for c in ctxs:
            c.close()
    modified = int(res.modify["num_requests"]) if res.modify is not None else 0
    return {
        "run": name,
        "prefill_tokens": res.prefill["input_tokens"],
        "prefill_s": res.prefill["duration"],
        "prefill_tok_s": res.prefill["input_tput"],
        "query_B_per_tok": res.prefill_query_bytes / max(int(res.prefill["input_tokens"]), 1),
        "modify_s": res.modify["duration"] if res.modify is not None else None,
        "modify_s_per_req": (
            float(res.modify["duration"]) / modified
            if res.modify is not None and modified
            else None
        ),
        "kept_fraction": res.modify["kept_fraction"] if res.modify is not None else 1.0,
        "decode_tokens": res.decode["output_tokens"],
        "decode_s": res.decode["duration"],
        "decode_tok_s": res.decode_tput,
        "peak_running": res.engine["peak_running"],
        "decode_steps": res.engine["steps"],
        "loaded_tokens": res.engine["tokens_loaded"],
        "recomputed_tokens": res.engine["prefill_tokens_computed"],
        "outputs": res.outputs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    log(f"building model ({args.model_path or args.model_preset}, {args.dtype}, {args.device})")
    model = build_model(args)
    cfg = model.config
    dtype = DTYPES[args.dtype]
    prompts = make_prompts(args, cfg.vocab_size)
    info = kvdrop.describe(args.policy)
    params: dict[str, Any] = {"keep_ratio": args.keep_ratio, "chunk_size": args.chunk_size}
    if "device" in {p.name for p in info.params}:
        params["device"] = args.policy_device
    # head_dim and the RoPE parameters come from the layout the engine registers.
    policy_fn = kvdrop.get(args.policy, rerotate=not args.no_rerotate, **params)

    # Budget: the decode request is prompt + 1 prefill token, then max_tokens more.
    if args.kv_budget_tokens:
        num_blocks = args.kv_budget_tokens // args.block_size
    else:
        num_blocks = budget_blocks(prompts, args)
    gb = server_gb(cfg, dtype, prompts, args)
    flags: dict[str, Any] = {"chunk_size": args.chunk_size, "l1_size_gb": round(gb, 3)}
    if info.needs_query:
        flags["enable"] = ["transfer_query"]
    log(f"starting kvdrop server (pool {gb:.2f} GiB)")
    with spawn_server(startup_timeout=300.0, **flags) as server:
        model_name = f"bench-{cfg.name}"
        connector = ServerConnector(
            server.url,
            server.http_url,
            model_name,
            transfer_query=info.needs_query,
            query_capture=args.query_capture,
        )
        engine = Engine(
            model,
            num_blocks=num_blocks,
            block_size=args.block_size,
            max_batch_size=max(256, args.num_requests),
            max_prefill_tokens=args.max_prefill_tokens,
            connector=connector,
        )
        with engine:
            base = run("baseline", engine, server, model_name, prompts, args, None, False)
            drop = run(
                "dropped", engine, server, model_name, prompts, args, policy_fn, info.needs_query
            )
        connector.close()
    same = sum(a == b for a, b in zip(base.pop("outputs"), drop.pop("outputs"), strict=True))
    ratio = drop["decode_tok_s"] / base["decode_tok_s"] if base["decode_tok_s"] else math.nan
    lengths = [len(p) for p in prompts]
    setup = {
        "device": str(torch.device(args.device)),
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "dtype": args.dtype,
        "model": args.model_path or args.model_preset,
        "layers": cfg.num_layers,
        "q_heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "num_requests": args.num_requests,
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_max": max(lengths),
        "prompt_tokens_total": sum(lengths),
        "max_tokens": args.max_tokens,
        "policy": args.policy,
        "policy_device": args.policy_device,
        "query_capture": args.query_capture if info.needs_query else None,
        "keep_ratio": args.keep_ratio,
        "chunk_size": args.chunk_size,
        "block_size": args.block_size,
        "kv_budget_tokens": num_blocks * args.block_size,
        "kv_budget_blocks": num_blocks,
        "share_prefill": args.share_prefill,
    }
    report = {
        "setup": setup,
        "runs": [base, drop],
        "decode_gain": ratio,
        "identical_outputs": f"{same}/{len(prompts)}",
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    keys = list(setup)
    print(format_table([setup], keys[:9], title="Setup"))
    print(format_table([setup], keys[9:18]))
    print(format_table([setup], keys[18:]))
    print()
    cols = [
        "run",
        "prefill_tok_s",
        "query_B_per_tok",
        "modify_s",
        "modify_s_per_req",
        "kept_fraction",
        "decode_tokens",
        "decode_s",
        "decode_tok_s",
        "peak_running",
        "decode_steps",
        "loaded_tokens",
        "recomputed_tokens",
    ]
    print(format_table([base, drop], cols, title="Baseline vs dropped (same engine, same run)"))
    print()
    print(
        f"decode throughput: baseline {base['decode_tok_s']:.1f} tok/s, dropped "
        f"{drop['decode_tok_s']:.1f} tok/s -> gain {ratio:.2f}x "
        f"(identical outputs {same}/{len(prompts)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
