"""The experiment behind ``kvdrop demo``: baseline vs token dropping on one engine, offline.

Loads the model, builds a batch of long prompts (pass-key retrieval with the real SmolLM2 model
when installed, so answers can be checked; random tokens with random weights), checks the policy
against the model's layout, and runs baseline (prefill, decode) and dropped (prefill, modify with
the policy, decode) on the same engine through :mod:`~.harness`, whose KV budget fits every
dropped request at once but not every baseline request. The command, its flags and the printed
report are :mod:`kvdrop.commands.demo_cmd`.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdrop.experiments.harness import HarnessError
from kvdrop_sdk.batch import ProgressCallback

#: ``progress(phase)`` -> the batch's progress callback for that phase (None: quiet).
Progress = Callable[[str], "ProgressCallback | None"]

__all__ = ["DemoSetupError", "run_demo"]

BLOCK_SIZE = 16


class DemoSetupError(HarnessError):
    """The flags or the machine cannot run the demo; the message says what to change."""


@dataclass
class _Setup:
    """What the runs need: the model, the policy, the prompts and the sizes."""

    model: Any
    tokenizer: Any
    model_name: str
    modify_fn: Any
    capture: Any
    prompts: list[Any]
    budget: int
    fits: tuple[bool, bool]
    pool_gb: float


def load(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[Any, Any, str]:
    """The model of ``args`` (``--model``/``--random-preset``), with a line before and after."""
    from kvdrop_engine.errors import EngineSetupError
    from kvdrop_engine.loading import load_model

    t0 = time.perf_counter()
    log(f"loading {args.model or args.random_preset or 'the installed SmolLM2 model'} ...")
    spec = argparse.Namespace(
        model=args.model,
        random_preset=args.random_preset,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
    )
    try:
        model, tokenizer, model_name = load_model(spec)
    except (EngineSetupError, OSError, ValueError, ImportError, RuntimeError) as exc:
        # Missing files, bad checkpoints, missing extras, an unavailable --device.
        raise DemoSetupError(str(exc)) from None
    cfg = model.config
    log(
        f"model {model_name}: {cfg.num_layers} layers, {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads x {cfg.head_dim} (loaded in {time.perf_counter() - t0:.1f}s)"
    )
    return model, tokenizer, model_name


def _policy(args: argparse.Namespace, params: dict[str, Any], cfg: Any, log: Any) -> Any:
    """The policy as a user builds it, and the query capture it needs; checked on the layout."""
    import kvdrop
    from kvdrop.experiments.harness import check_policies
    from kvdrop_engine.connectors.factory import capture_mode
    from kvdrop_sdk.query_capture import QueryCapture

    lmcache = args.cache_server == "lmcache"
    if lmcache and "head_dim" in {p.name for p in kvdrop.describe(args.policy).params}:
        params.setdefault("head_dim", cfg.head_dim)  # lmcache.sdk has no layouts to read it from
    # kvdrop's SDK hands the policy an edit context with the layout's head_dim and RoPE, as a
    # user's kvdrop.get("snapkv", keep_ratio=0.5) gets it; lmcache.sdk contexts carry neither.
    rerotate: Any = (cfg.rope if lmcache else True) if not args.no_rerotate else False
    modify_fn = kvdrop.get(args.policy, rerotate=rerotate, **params)
    mode = capture_mode(args.cache_server, args.query_capture)
    capture = QueryCapture.for_policies([modify_fn], mode)
    if capture.full and args.query_capture == "window" and not lmcache:
        # A scorer that reads every cached token's query (a plugin without sparse_queries)
        # cannot work from a window: capture them all rather than fail in modify.
        log(f"{args.policy} reads every prompt token's query: capturing them all (full mode)")
    try:
        check_policies({args.policy: modify_fn}, cfg, capture, args.chunk_size)
    except HarnessError as exc:
        raise DemoSetupError(str(exc)) from None
    return modify_fn, capture


def _prompts(args: argparse.Namespace, tokenizer: Any, cfg: Any) -> list[Any]:
    from kvdrop.experiments.prompts import passkey_prompts, random_prompts

    if tokenizer is not None:
        return passkey_prompts(tokenizer, args.num_requests, args.prompt_tokens, args.seed)
    return random_prompts(cfg.vocab_size, args.num_requests, args.prompt_tokens, args.seed)


def _budget(args: argparse.Namespace, lengths: list[int], cfg: Any) -> tuple[int, bool, bool]:
    """The engine's KV budget (``--kv-budget-tokens`` or one that fits only the dropped run)."""
    from kvdrop.experiments.runner import engine_budget

    budget, baseline_fit, dropped_fit = engine_budget(
        lengths, args.max_tokens, args.keep_ratio, args.chunk_size, BLOCK_SIZE
    )
    longest = f"{max(lengths)} prompt tokens + --max-tokens {args.max_tokens}"
    if max(lengths) + args.max_tokens > cfg.max_position_embeddings:
        raise DemoSetupError(
            f"the longest request ({longest}) exceeds the model's context length "
            f"{cfg.max_position_embeddings}; lower --prompt-tokens or --max-tokens"
        )
    if args.kv_budget_tokens is not None:
        budget = args.kv_budget_tokens
        need = -(-(max(lengths) + args.max_tokens - 1) // BLOCK_SIZE) * BLOCK_SIZE
        if budget < need:
            raise DemoSetupError(
                f"--kv-budget-tokens {budget} cannot hold the longest request ({longest}: "
                f"{need} tokens in blocks of {BLOCK_SIZE}); give at least {need}"
            )
    return budget, baseline_fit, dropped_fit


def _setup(args: argparse.Namespace, params: dict[str, Any], log: Any) -> _Setup:
    from kvdrop.experiments.harness import kv_bytes_per_token, query_bytes_per_token

    model, tokenizer, model_name = load(args, log)
    cfg = model.config
    modify_fn, capture = _policy(args, params, cfg, log)
    prompts = _prompts(args, tokenizer, cfg)
    lengths = [len(p.token_ids) for p in prompts]
    budget, baseline_fit, dropped_fit = _budget(args, lengths, cfg)
    itemsize = model.dtype.itemsize
    per_token = kv_bytes_per_token(cfg, itemsize)
    if capture.full:
        per_token += query_bytes_per_token(cfg, itemsize)
    # Room for both runs' prompts (KV and, in the full query mode, queries) plus the kept copies,
    # with slack: an eviction here would shorten a request's cached prefix and blur the
    # comparison. Query windows live beside the pool (the server gives them a quarter of its size).
    pool_gb = 4.0 * sum(lengths) * per_token / 1e9 + 0.05
    return _Setup(
        model,
        tokenizer,
        model_name,
        modify_fn,
        capture,
        prompts,
        budget,
        (baseline_fit, dropped_fit),
        pool_gb,
    )


def _runs(
    args: argparse.Namespace, s: _Setup, log: Any, progress: Progress
) -> tuple[Any, Any, dict[str, Any]]:
    """Baseline then dropped on one harness; the server's status after both."""
    from kvdrop.experiments.harness import open_harness
    from kvdrop.experiments.runner import run_pipeline

    # Fresh salts per run: a server that outlives this run (--url) never serves its cache again.
    run_id = uuid.uuid4().hex[:8]
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    with open_harness(
        s.model,
        s.tokenizer,
        s.model_name,
        capture=s.capture,
        kv_budget_tokens=s.budget,
        pool_gb=s.pool_gb,
        chunk_size=args.chunk_size,
        kind=args.cache_server,
        url=args.url,
        http_url=args.http_url,
        block_size=BLOCK_SIZE,
        shm_prefix="kvdrop_demo",
        log=log,
    ) as h:
        results = [
            run_pipeline(
                name,
                h.engine,
                h.contexts,
                s.prompts,
                sampling,
                modify_fn=fn,
                cache_salt=f"{name}-{run_id}",
                progress=progress,
            )
            for name, fn in (("baseline", None), ("dropped", s.modify_fn))
        ]
    return results[0], results[1], h.final_status


def run_demo(
    args: argparse.Namespace,
    params: dict[str, Any],
    *,
    progress: Progress = lambda phase: None,
) -> dict[str, Any]:
    """Run the experiment of ``args`` (the ``kvdrop demo`` flags) and return its report;
    ``progress(phase)`` gives each phase's progress callback (the command's progress bars)."""
    import torch

    from kvdrop.experiments.runner import summarize_runs

    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda msg: None) if args.no_progress else (lambda msg: print(msg, file=sys.stderr))
    t0 = time.perf_counter()
    s = _setup(args, params, log)
    baseline, dropped, server_status = _runs(args, s, log, progress)
    lengths = [len(p.token_ids) for p in s.prompts]
    return {
        "setup": {
            "model": s.model_name,
            "policy": args.policy,
            "policy_params": params,
            "rerotate": not args.no_rerotate,
            "query_capture": s.capture.mode.value if s.capture.enabled else None,
            "query_bytes_per_prompt_token": round(
                dropped.prefill_query_bytes / max(sum(lengths), 1), 1
            ),
            "num_requests": len(s.prompts),
            "prompt_lengths": lengths,
            "max_tokens": args.max_tokens,
            "engine_kv_budget_tokens": s.budget,
            "baseline_fits_at_once": s.fits[0],
            "dropped_fits_at_once": s.fits[1],
            "dtype": args.dtype,
            "device": args.device,
            "torch_threads": torch.get_num_threads(),
            "wall_seconds": time.perf_counter() - t0,
            "cache_server": args.cache_server,
            "server_evictions": server_status.get("evictions"),
        },
        "baseline": baseline.to_dict(),
        "dropped": dropped.to_dict(),
        "answers": [p.answer for p in s.prompts],
        "summary": summarize_runs(baseline, dropped, len(s.prompts)),
    }
