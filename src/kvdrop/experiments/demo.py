"""``kvdrop demo``: baseline vs token dropping, side by side, fully offline.

Starts a kvdrop server and the reference engine in this process (or, with ``--cache-server
lmcache``, runs the engine's LMCache backend against a real ``lmcache server``: the one at
``--url``/``--http-url``, else one it starts), builds a batch of long prompts
(pass-key retrieval with the real SmolLM2 model when installed, so answers can be checked; random
tokens with random weights), and runs baseline (prefill, decode) and dropped (prefill, modify with
a policy, decode) on the same engine, whose KV budget fits every dropped request at once but not
every baseline request. Prints the prefill / modify / decode tables and a summary, or ``--json``.
User errors (bad flags, a missing or unreadable model, a pool the machine cannot hold) are one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

__all__ = ["DemoSetupError", "add_arguments", "run"]


class DemoSetupError(ValueError):
    """The flags or the machine cannot run the demo; the message says what to change."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvdrop demo`` (heavy imports stay in ``run``)."""
    run_ = parser.add_argument_group("experiment")
    run_.add_argument("--policy", default="rkv", help="drop policy (see `kvdrop list`)")
    run_.add_argument("--keep-ratio", type=float, default=0.5, help="fraction kept (default 0.5)")
    run_.add_argument(
        "--policy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra policy parameter (JSON value), e.g. --policy-arg window=32",
    )
    run_.add_argument(
        "--no-rerotate",
        action="store_true",
        help="keep kept keys at their old RoPE positions (default: policies re-rotate them "
        "to 0..k-1, where the engine reads the kept prefix, with the RoPE parameters the "
        "engine registered)",
    )
    run_.add_argument(
        "--query-capture",
        choices=["window", "full"],
        default="window",
        help="queries the engine saves for query policies: the last tokens' and a strided "
        "sample (window, default) or every prompt token's (full, the upstream layout; always "
        "with --cache-server lmcache)",
    )
    run_.add_argument("--num-requests", type=int, default=16, help="prompts in the batch")
    run_.add_argument("--prompt-tokens", type=int, default=512, help="minimum prompt length")
    run_.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per request")
    run_.add_argument("--chunk-size", type=int, default=256, help="server chunk size")
    run_.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=None,
        help="engine KV budget (default: fits every dropped request, not baseline)",
    )
    run_.add_argument("--seed", type=int, default=0, help="seed of prompts and random weights")
    run_.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    run_.add_argument("--no-progress", action="store_true", help="no progress bars")
    cache = parser.add_argument_group("cache server")
    cache.add_argument(
        "--cache-server",
        choices=("kvdrop", "lmcache"),
        default="kvdrop",
        help="kvdrop (default; started in this process unless --url is given) or lmcache (a real "
        "`lmcache server`: pip install 'kvdrop[lmcache]', see docs/lmcache.md)",
    )
    cache.add_argument(
        "--url",
        default=None,
        help="ZMQ address of a running cache server, e.g. tcp://127.0.0.1:6555 (default: start "
        "one; an LMCache server needs --supported-transfer-mode auto, and --enable "
        "transfer_query for query policies)",
    )
    cache.add_argument(
        "--http-url", default=None, help="its HTTP address, e.g. http://127.0.0.1:8080"
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help=".gguf file or HF folder (default: the installed SmolLM2 GGUF)",
    )
    model.add_argument(
        "--random-preset",
        default=None,
        metavar="NAME",
        help="random weights of a preset shape (tiny, smollm2-135m, qwen3-8b)",
    )
    model.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    model.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    model.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _policy_params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"keep_ratio": args.keep_ratio, "chunk_size": args.chunk_size}
    for item in args.policy_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--policy-arg expects KEY=VALUE, got {item!r}")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def run(args: argparse.Namespace) -> int:
    """Run the experiment and print its report; 0 on success, 2 on bad flags."""
    # The in-process server, engine and client threads share two cores: spinning OpenMP workers
    # would steal them from each other (measured: decode steps up to 100x slower under load).
    # Must be set before torch starts its thread pool, so before the first torch import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import kvdrop

    for flag in ("num_requests", "prompt_tokens", "max_tokens", "chunk_size", "threads"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            print(f"kvdrop demo: error: --{flag.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    if (args.url is None) != (args.http_url is None):
        print("kvdrop demo: error: give --url and --http-url together", file=sys.stderr)
        return 2
    if args.cache_server == "lmcache":
        from kvdrop_engine.errors import EngineSetupError
        from kvdrop_engine.lmcache_connector import require_lmcache

        try:
            require_lmcache()
        except EngineSetupError as exc:
            print(f"kvdrop demo: error: {exc}", file=sys.stderr)
            return 2
    try:
        params = _policy_params(args)
        kvdrop.get(args.policy, **params)  # validate before loading anything heavy
        needs_query = kvdrop.describe(args.policy).needs_query
    except (ValueError, KeyError, kvdrop.PolicyConflictError) as exc:
        print(f"kvdrop demo: error: {exc}", file=sys.stderr)
        return 2
    try:
        report = _experiment(args, params, needs_query)
    except DemoSetupError as exc:
        print(f"kvdrop demo: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0


def _experiment(args: argparse.Namespace, params: dict[str, Any], needs_query: bool) -> dict:
    import torch

    import kvdrop
    from kvdrop.experiments.pipeline import (
        engine_budget,
        passkey_prompts,
        random_prompts,
        run_pipeline,
        summarize_runs,
    )
    from kvdrop_engine.connector import ServerConnector
    from kvdrop_engine.engine import Engine
    from kvdrop_engine.errors import EngineSetupError
    from kvdrop_engine.loading import load_model
    from kvdrop_sdk import kvcache, qcache
    from kvdrop_sdk.progress import ProgressBar

    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda msg: None) if args.no_progress else (lambda msg: print(msg, file=sys.stderr))
    t0 = time.perf_counter()
    model_args = argparse.Namespace(
        model=args.model,
        random_preset=args.random_preset,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
    )
    try:
        model, tokenizer, model_name = load_model(model_args)
    except (EngineSetupError, OSError, ValueError, ImportError, RuntimeError) as exc:
        # Missing files, bad checkpoints, missing extras, an unavailable --device.
        raise DemoSetupError(str(exc)) from None
    cfg = model.config
    log(
        f"model {model_name}: {cfg.num_layers} layers, {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads x {cfg.head_dim} (loaded in {time.perf_counter() - t0:.1f}s)"
    )
    lmcache = args.cache_server == "lmcache"
    if lmcache and "head_dim" in {p.name for p in kvdrop.describe(args.policy).params}:
        params.setdefault("head_dim", cfg.head_dim)  # lmcache.sdk has no layouts to read it from
    # kvdrop's SDK hands the policy an edit context with the layout's head_dim and RoPE, as a
    # user's kvdrop.get("snapkv", keep_ratio=0.5) gets it; lmcache.sdk contexts carry neither.
    rerotate: Any = (cfg.rope if lmcache else True) if not args.no_rerotate else False
    modify_fn = kvdrop.get(args.policy, rerotate=rerotate, **params)
    query_capture = args.query_capture
    if query_capture == "window" and modify_fn.needs_full_queries:
        # A scorer that reads every cached token's query (a plugin without sparse_queries)
        # cannot work from a window: capture them all rather than fail in modify.
        log(f"{args.policy} reads every prompt token's query: capturing them all (full mode)")
        query_capture = "full"

    if tokenizer is not None:
        prompts = passkey_prompts(tokenizer, args.num_requests, args.prompt_tokens, args.seed)
    else:
        prompts = random_prompts(cfg.vocab_size, args.num_requests, args.prompt_tokens, args.seed)
    lengths = [len(p.token_ids) for p in prompts]
    block_size = 16
    budget, baseline_fit, dropped_fit = engine_budget(
        lengths, args.max_tokens, args.keep_ratio, args.chunk_size, block_size
    )
    longest = f"{max(lengths)} prompt tokens + --max-tokens {args.max_tokens}"
    if max(lengths) + args.max_tokens > cfg.max_position_embeddings:
        raise DemoSetupError(
            f"the longest request ({longest}) exceeds the model's context length "
            f"{cfg.max_position_embeddings}; lower --prompt-tokens or --max-tokens"
        )
    if args.kv_budget_tokens is not None:
        budget = args.kv_budget_tokens
        need = -(-(max(lengths) + args.max_tokens - 1) // block_size) * block_size
        if budget < need:
            raise DemoSetupError(
                f"--kv-budget-tokens {budget} cannot hold the longest request ({longest}: "
                f"{need} tokens in blocks of {block_size}); give at least {need}"
            )
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    q_bytes = cfg.num_layers * cfg.num_heads * cfg.head_dim * model.dtype.itemsize
    full_q = needs_query and (query_capture == "full" or lmcache)
    # Room for both runs' prompts (KV and, in the full query mode, queries) plus the kept copies,
    # with slack: an eviction here would shorten a request's cached prefix and blur the
    # comparison. Query windows live beside the pool (the server gives them a quarter of its size).
    pool_gb = 4.0 * sum(lengths) * (kv_bytes + (q_bytes if full_q else 0)) / 1e9 + 0.05
    # Fresh salts per run: a server that outlives this run (--url) never serves its cache again.
    run_id = uuid.uuid4().hex[:8]
    with _cache_server(args, pool_gb, needs_query) as (url, http_url, status):
        if args.cache_server == "lmcache":
            from kvdrop_engine.lmcache_connector import LMCacheConnector, connect_sdk

            connector: Any = LMCacheConnector(url, http_url, model_name)
        else:
            connector = ServerConnector(url, http_url, model_name, query_capture=query_capture)
        engine = Engine(
            model,
            tokenizer=tokenizer,
            kv_budget_tokens=budget,
            block_size=block_size,
            connector=connector,
        ).start()
        try:
            if args.cache_server == "lmcache":
                # lmcache.sdk's contexts (they speak LMCache's protocol) under kvdrop's batch.
                contexts = connect_sdk(url, http_url, model_name, query=needs_query)
            else:
                contexts = [kvcache.connect(url, http_url, model_name)]
                if needs_query:
                    contexts.append(qcache.connect(url, http_url, model_name))
        except BaseException:
            engine.stop()
            connector.close()
            raise
        sampling = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}

        def progress(phase: str) -> ProgressBar | None:
            return None if args.no_progress else ProgressBar(label=phase)

        try:
            baseline = run_pipeline(
                "baseline",
                engine,
                contexts,
                prompts,
                sampling,
                cache_salt=f"baseline-{run_id}",
                progress=progress,
            )
            dropped = run_pipeline(
                "dropped",
                engine,
                contexts,
                prompts,
                sampling,
                modify_fn=modify_fn,
                cache_salt=f"dropped-{run_id}",
                progress=progress,
            )
            server_status = status()
        finally:
            engine.stop()
            for ctx in contexts:
                ctx.close()
            connector.close()
    summary = summarize_runs(baseline, dropped, len(prompts))
    return {
        "setup": {
            "model": model_name,
            "policy": args.policy,
            "policy_params": params,
            "rerotate": not args.no_rerotate,
            "query_capture": ("full" if lmcache else query_capture) if needs_query else None,
            "query_bytes_per_prompt_token": round(
                dropped.prefill_query_bytes / max(sum(lengths), 1), 1
            ),
            "num_requests": len(prompts),
            "prompt_lengths": lengths,
            "max_tokens": args.max_tokens,
            "engine_kv_budget_tokens": budget,
            "baseline_fits_at_once": baseline_fit,
            "dropped_fits_at_once": dropped_fit,
            "dtype": args.dtype,
            "device": args.device,
            "torch_threads": torch.get_num_threads(),
            "wall_seconds": time.perf_counter() - t0,
            "cache_server": args.cache_server,
            "server_evictions": server_status.get("evictions"),
        },
        "baseline": baseline.to_dict(),
        "dropped": dropped.to_dict(),
        "answers": [p.answer for p in prompts],
        "summary": summary,
    }


@contextlib.contextmanager
def _cache_server(
    args: argparse.Namespace, pool_gb: float, needs_query: bool
) -> Iterator[tuple[str, str, Any]]:
    """``(url, http_url, status())`` of the cache server to use: the given one, else one started
    here (a kvdrop server in this process, or an ``lmcache server`` subprocess)."""
    if args.url is not None:
        yield args.url, args.http_url, dict
        return
    if args.cache_server == "lmcache":
        from kvdrop_engine.testing import spawn_lmcache_server

        log = (lambda m: None) if args.no_progress else (lambda m: print(m, file=sys.stderr))
        log("starting an LMCache server (about 20 s)")
        with spawn_lmcache_server(
            l1_size_gb=round(max(pool_gb, 0.1), 3),
            chunk_size=args.chunk_size,
            transfer_query=needs_query,
        ) as lmc:
            yield lmc.url, lmc.http_url, dict
        return
    from kvdrop_sdk.server.app import Server
    from kvdrop_sdk.server.config import ServerConfig
    from kvdrop_sdk.server.pool import unique_shm_name

    try:
        server = Server(
            ServerConfig(
                port=0,
                http_port=0,
                chunk_size=args.chunk_size,
                l1_size_gb=pool_gb,
                shm_name=unique_shm_name("kvdrop_demo"),
                enable=("transfer_query",) if needs_query else (),
            )
        ).start()
    except OSError as exc:
        raise DemoSetupError(
            f"cannot start the cache server with a {pool_gb:.2f} GiB pool in /dev/shm: {exc}; "
            "use fewer or shorter prompts (--num-requests, --prompt-tokens)"
        ) from None
    try:
        yield server.url, server.http_url, server.status_json
    finally:
        server.stop()


def _print_report(report: dict[str, Any]) -> None:
    from kvdrop_sdk.metrics import Metrics
    from kvdrop_sdk.table import format_table

    setup = report["setup"]
    print("setup: " + ", ".join(f"{k}={v}" for k, v in setup.items() if k != "policy_params"))
    for run_name in ("baseline", "dropped"):
        for phase in ("prefill", "modify", "decode"):
            data = report[run_name][phase]
            if data is not None:
                metrics = Metrics(f"{run_name}: {data['title']}", _flat(data["metrics"]))
                print()
                print(metrics.format())
    s = report["summary"]
    rows = [
        {
            "run": "baseline",
            "decode_tok_per_s": s["baseline_decode_tput"],
            "peak_running": s["baseline_peak_running"],
            "kept_fraction": 1.0,
            "correct": _frac(s["baseline_correct"], s["num_requests"]),
        },
        {
            "run": "dropped",
            "decode_tok_per_s": s["dropped_decode_tput"],
            "peak_running": s["dropped_peak_running"],
            "kept_fraction": s["kept_fraction"],
            "correct": _frac(s["dropped_correct"], s["num_requests"]),
        },
    ]
    print()
    print(format_table(rows, title="summary"))
    print(
        f"decode throughput gain: {s['decode_gain']:.2f}x   identical answers (to EOS): "
        f"{s['identical_outputs']:.0%}   matching leading tokens: {s['matching_prefix']:.0%}"
    )
    if setup.get("query_capture"):
        print(
            f"queries saved ({setup['query_capture']} mode): "
            f"{setup['query_bytes_per_prompt_token']:,.0f} bytes per prompt token"
        )
    texts = report["dropped"]["texts"]
    if any(texts):
        print()
        answer_rows = [
            {"request": i, "answer": a, "baseline": _short(b), "dropped": _short(d)}
            for i, (a, b, d) in enumerate(
                zip(report["answers"], report["baseline"]["texts"], texts)
            )
        ]
        print(format_table(answer_rows, title="answers (first tokens of each output)"))


def _flat(metrics: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(_flat(value))
        else:
            out[key] = value
    return out


def _frac(correct: int | None, n: int) -> str:
    return "n/a" if correct is None else f"{correct}/{n}"


def _short(text: str, width: int = 30) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
