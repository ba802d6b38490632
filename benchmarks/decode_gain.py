"""Decode-throughput gain of token dropping, measured side by side in one run.

Starts a kvdrop server (subprocess, 127.0.0.1, free ports) and the reference engine with a KV
budget that holds every request once it is cut to ``--keep-ratio`` (so, at keep 0.5, about half
of the baseline requests at once; ``--fit-fraction`` or ``--kv-budget-tokens`` set it instead),
then runs:

* baseline: prefill every prompt (KV stored in the server), decode ``--max-tokens`` each;
* one run per ``--policy`` (several may be given, side by side): prefill, modify with
  ``kvdrop.get(policy, keep_ratio=--keep-ratio)``, decode.

All runs use the same prompts, KV budget and greedy sampling; the dropped runs' shorter caches let
more requests share each decode step. Policies that read queries run on a second engine (same
model and budget) whose connector captures them, and compute their own prefill (so their prefill
rate is the rate *with* query capture; the baseline's is without).

Each dropped run also reports its modify time per request and, for query policies, the query bytes
the engine stored per prompt token (``--query-capture window``, the lean default: the last tokens'
queries and a strided sample; ``full``: every prompt token's).

Besides throughputs it prints, per run, the decode step time two ways -- the engine's own mean
over decode-only steps and the decode phase's wall time per step (which includes loading cached
prefixes) -- next to the step's floor: the bytes a decode step must read (the weights once, plus
every running request's cached K and V) over the device's copy bandwidth measured in the same run.

    python benchmarks/decode_gain.py                         # CPU, SmolLM2-135M shape, random
    python benchmarks/decode_gain.py --device cuda --dtype bfloat16 --model-preset qwen3-8b \\
        --num-requests 30 --prompt-tokens 8192 14336 --max-tokens 512 --max-prefill-tokens 8192 \\
        --share-prefill --policy chunk-halving snapkv
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

import kvdrop
from kvdrop.experiments.prompts import Prompt
from kvdrop.experiments.runner import engine_budget, run_pipeline
from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import load_checkpoint, preset_config
from kvdrop_engine.model import ModelConfig, Transformer
from kvdrop_engine.reconstruct import ReconstructionPrompt
from kvdrop_sdk.batch import BatchedStream, BatchedStreamFailures
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import connect
from kvdrop_sdk.keep import KV_PATH_CHOICES
from kvdrop_sdk.query_capture import QueryCapture, QueryNeed, needs_of
from kvdrop_sdk.request import create_request
from kvdrop_sdk.table import format_table
from kvdrop_sdk.testing.server import spawn_server

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
    p.add_argument(
        "--policy",
        nargs="+",
        default=["chunk-halving"],
        help="one or more policies, each measured in its own dropped run",
    )
    p.add_argument(
        "--policy-device",
        default=None,
        help="device= for policies that take it (scoring there; default: the policy's own)",
    )
    p.add_argument(
        "--modify-concurrency", type=int, default=None, help="edits at once (SDK default)"
    )
    p.add_argument(
        "--edit-device",
        default=None,
        help="run each edit on this device (batch.modify(device=); cuda: the KV is DMA'd "
        "from the server's shared memory and the kept rows stored back from the GPU)",
    )
    p.add_argument(
        "--kv-path",
        choices=KV_PATH_CHOICES,
        default="auto",
        help="how each edit's KV travels (kvdrop_sdk.keep.edit_path): least moves only what "
        "the policy reads (nothing for chunk-halving, streaming, random, kvzip; the keys for "
        "knorm, snapkv, ...; with --edit-device cuda the kept keys are re-rotated on the GPU and "
        "stored back, the values gathered by index in shared memory: client); server re-rotates "
        "on the server's CPU; full fetches the whole KV and stores the edited bytes (upstream's "
        "path); auto (default) is least, but full for a keys-reading edit on a GPU",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up request (kernel compilation and first-use costs then land in "
        "the baseline's numbers)",
    )
    p.add_argument("--keep-ratio", type=float, default=0.5)
    p.add_argument("--no-rerotate", action="store_true", help="keep kept keys at old positions")
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
    p.add_argument(
        "--no-job",
        action="store_true",
        help="skip the pipelined job of each run (BatchedStream.job: every request's prefill, "
        "edit and decode chained, all at once, under a fresh cache salt); its wall time is "
        "what e2e_gain compares",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="print each job's timeline: per request, when its prefill, edit and decode began "
        "and ended (seconds since the job started; in --json always, as job_timeline)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="measure every --sweep-requests x --sweep-keep point (each against its own "
        "baseline) and print gain against keep ratio",
    )
    p.add_argument("--sweep-keep", type=float, nargs="+", default=[0.75, 0.5, 0.25])
    p.add_argument("--sweep-requests", type=int, nargs="+", default=[8, 30, 64])
    p.add_argument("--plot", default=None, help="with --sweep: draw gain vs keep ratio to this PNG")
    args = p.parse_args(argv)
    if len(args.prompt_tokens) not in (1, 2) or min(args.prompt_tokens) < 1:
        p.error("--prompt-tokens takes one length or MIN MAX (positive ints)")
    if not 0 < args.keep_ratio <= 1 or not 0 < (args.fit_fraction or 1) <= 1:
        p.error("--keep-ratio and --fit-fraction must be in (0, 1]")
    if args.sweep and not all(0 < k <= 1 for k in args.sweep_keep):
        p.error("--sweep-keep ratios must be in (0, 1]")
    if args.plot and not args.sweep:
        p.error("--plot draws the sweep: add --sweep")
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
    """Pool size holding one run's prompt KV (+ queries when a policy needs them) and its edit,
    twice over without ``--share-prefill``; at most 70% of this machine's memory (the pool
    evicts least recently used chunks, and each run needs only its own)."""
    item = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * cfg.num_layers * cfg.kv_dim * item
    if (
        any(kvdrop.describe(p).needs.reads_queries for p in args.policy)
        and args.query_capture == "full"
    ):
        per_token += cfg.num_layers * cfg.q_dim * item  # windows live beside the pool
    runs = 1 if args.share_prefill else 2
    total = sum(len(p) + 1 + args.max_tokens for p in prompts) * per_token
    want = (runs + args.keep_ratio) * total * 1.15 / 2**30
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        ram = float("inf")
    return max(0.25, min(want, 0.7 * ram))


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


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device memory bandwidth in bytes/s: a large device-to-device copy, counting the bytes read
    and the bytes written (the ceiling a memory-bound decode step can reach)."""
    if device.type != "cuda":
        return math.nan
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * repeats / seconds


def weight_bytes(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the input embedding
    table (only the batch's rows), unless it is tied to the output head."""
    total = 0
    for name, param in model.named_parameters():  # tied weights appear once
        if name == "embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue
        total += param.numel() * param.element_size()
    return total


def step_floor(row: dict[str, Any], wbytes: int, token_bytes: int, bandwidth: float) -> None:
    """Add the decode-step times and their floor to a run's row (in place)."""
    steps = row.pop("decode_only_steps")
    kv_tokens = row.pop("decode_kv_tokens")
    seconds = row.pop("decode_step_seconds")
    row["graph_capture_s"] = row.pop("graph_capture_seconds")
    row["prefix_load_s"] = row.pop("prefix_load_seconds")
    # One load's rate: the bytes loaded over the time loads took, summed over requests (loads
    # run several at once, so the phase saw up to load_concurrency times this).
    loaded_gb = row["loaded_tokens"] * token_bytes / 1e9
    row["load_gb_s"] = loaded_gb / row["prefix_load_s"] if row["prefix_load_s"] else math.nan
    # The link's rate while loading: the bytes over the wall time with a load in flight.
    busy = row["prefix_load_busy_s"]
    row["load_gb_s_busy"] = loaded_gb / busy if busy else math.nan
    # Aggregate: the bytes loaded over the decode phase's wall time (loads overlap each other).
    row["load_gb_s_phase"] = loaded_gb / row["decode_s"] if row["decode_s"] else math.nan
    row["phase_ms_per_step"] = 1e3 * row["decode_s"] / max(1, row["decode_steps"])
    row["step_ms"] = 1e3 * seconds / steps if steps else math.nan
    row["kv_tokens_per_step"] = kv_tokens / steps if steps else math.nan
    step_bytes = wbytes + row["kv_tokens_per_step"] * token_bytes
    row["gb_per_step"] = step_bytes / 1e9
    row["floor_ms"] = 1e3 * step_bytes / bandwidth
    row["step_over_floor"] = row["step_ms"] / row["floor_ms"]
    row["phase_over_floor"] = row["phase_ms_per_step"] / row["floor_ms"]


def run(
    name: str,
    engine: Engine,
    server: Any,
    model_name: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    policy_fn: Any,
    needs_query: bool,
    salt: str,
    reconstruct: bool = False,
    queries: QueryCapture | None = None,
) -> dict[str, Any]:
    """One side of the comparison (`run_pipeline`, as the demo uses it): a table row.
    ``reconstruct``: the prefill runs KVzip's reconstruction pass (policies declaring
    ``token_scores``); its loop-thread time is reported next to the prefill's. ``queries``: the
    query engine's capture (:func:`query_capture`)."""
    uses_q = (needs_query or reconstruct) and policy_fn is not None
    kinds = [CacheKind.KV] + ([CacheKind.QUERY] if uses_q else [])
    capture = replace(queries or QueryCapture(QueryNeed(args.query_capture)), scores=reconstruct)
    ctxs = [connect(k, server.url, server.http_url, model_name, capture=capture) for k in kinds]
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
            modify_concurrency=args.modify_concurrency,
            modify_device=args.edit_device,
            modify_kv_path=args.kv_path,
            reconstruct=reconstruct,
        )
    finally:
        for c in ctxs:
            c.close()
    log(f"{name}: done (decode graphs captured: {engine.graphs and engine.graphs.captured})")
    memory = host_memory()
    mod = None if res.modify is None else float(res.modify["duration"])
    log(
        f"{name}: prefill {float(res.prefill['duration']):.2f} s, modify {mod} s, decode "
        f"{float(res.decode['duration']):.2f} s ({res.decode_tput:.1f} tok/s), loads "
        f"{res.engine['tokens_loaded']} tokens in {res.engine['prefix_load_seconds']:.2f} s"
    )
    recon_s = float(res.prefill_engine.get("reconstruction_seconds", 0.0))
    prefill_s = float(res.prefill["duration"])
    return {
        "run": name,
        "prefill_tokens": res.prefill["input_tokens"],
        "prefill_s": res.prefill["duration"],
        "prefill_tok_s": res.prefill["input_tput"],
        # The pass runs on the loop thread inside the prefill phase: its share of the phase, and
        # its time over the rest of the phase (the prefill proper).
        "reconstruct_s": recon_s if reconstruct else None,
        "reconstruct_x_prefill": (
            recon_s / (prefill_s - recon_s) if reconstruct and prefill_s > recon_s else None
        ),
        "query_B_per_tok": res.prefill_query_bytes / max(int(res.prefill["input_tokens"]), 1),
        "modify_s": res.modify["duration"] if res.modify is not None else None,
        "modify_s_per_req": (
            float(res.modify["duration"]) / int(res.modify["num_requests"])
            if res.modify is not None and res.modify["num_requests"]
            else None
        ),
        "kept_fraction": res.modify["kept_fraction"] if res.modify is not None else 1.0,
        # How the edits' KV travelled, and how much of it per edit (fetched + stored).
        "edit_path": res.modify["edit_path"] if res.modify is not None else None,
        "kv_MB_per_edit": (
            float(res.modify["kv_bytes_per_edit"]) / 1e6 if res.modify is not None else None
        ),
        # Where one edit's time went (means over the edits; they overlap in the phase).
        **{
            f"{part}_per_edit": (
                float(res.modify[f"{part}_s_per_edit"]) if res.modify is not None else None
            )
            for part in ("fetch", "edit", "store")
        },
        "decode_tokens": res.decode["output_tokens"],
        "decode_s": res.decode["duration"],
        "decode_tok_s": res.decode_tput,
        "peak_running": res.engine["peak_running"],
        "decode_steps": res.engine["steps"],
        "loaded_tokens": res.engine["tokens_loaded"],
        "recomputed_tokens": res.engine["prefill_tokens_computed"],
        "decode_only_steps": res.engine["decode_only_steps"],
        "decode_step_seconds": res.engine["decode_step_seconds"],
        "decode_kv_tokens": res.engine["decode_kv_tokens"],
        "graph_capture_seconds": res.engine["graph_capture_seconds"],
        "prefix_load_seconds": res.engine["prefix_load_seconds"],
        "prefix_copy_s": res.engine.get("prefix_copy_seconds", 0.0),
        "prefix_load_busy_s": res.engine.get("prefix_load_busy_seconds", 0.0),
        "phases": decode_phases(res.engine, float(res.decode["duration"])),
        "prefill_phases": {
            **prefill_phases(res.prefill_engine, prefill_s, len(prompts)),
            **memory,
        },
        "outputs": res.outputs,
        # Its prefill only loaded the baseline's KV (--share-prefill): end_to_end charges the
        # baseline's computed prefill instead.
        "shared_prefill": salt == "shared" and policy_fn is not None,
    }


def job(
    name: str,
    engine: Engine,
    server: Any,
    model_name: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    policy_fn: Any,
    needs_query: bool,
    reconstruct: bool = False,
    queries: QueryCapture | None = None,
) -> dict[str, Any]:
    """The same requests as one pipelined job (``BatchedStream.job``): each request's edit
    starts once its prefill is stored and its decode once its edit is back, while the others
    run; a fresh cache salt, so every prefill is computed. The baseline's job is one call per
    request of ``max_tokens + 1`` tokens (the dropped runs' prefill token plus their decode).
    Returns the job's wall time (first prompt sent to last token received) and its failures."""
    uses_q = (needs_query or reconstruct) and policy_fn is not None
    kinds = [CacheKind.KV] + ([CacheKind.QUERY] if uses_q else [])
    capture = replace(queries or QueryCapture(QueryNeed(args.query_capture)), scores=reconstruct)
    ctxs = [connect(k, server.url, server.http_url, model_name, capture=capture) for k in kinds]
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_tokens": args.max_tokens}
    if policy_fn is None:
        greedy["max_tokens"] += 1
    batch = BatchedStream(max_concurrency=len(prompts), modify_concurrency=args.modify_concurrency)
    for p in prompts:
        batch.add(create_request(ctxs, engine.post_completion, p, f"job-{name}"))
    log(f"{name}: the pipelined job of {len(prompts)} prompts")
    engine.reset_stats()
    failed = 0
    try:
        report = batch.job(
            greedy,
            policy_fn,
            prefill_params={**greedy, "reconstruct": True} if reconstruct else None,
            timeout=600.0,
            device=args.edit_device,
            kv_path=args.kv_path,
        )
    except BatchedStreamFailures as exc:
        report, failed = exc.metrics, len(exc.failures)
        log(f"{name}: {failed} request(s) of the job failed: {exc}")
    finally:
        for c in ctxs:
            c.close()
    stats = engine.stats()
    log(f"{name}: job {float(report['duration']):.2f} s, {failed} failed")
    return {
        "job_s": float(report["duration"]),
        "job_tok_s": float(report["output_tput"]),
        "job_failed": failed,
        "job_fallbacks": stats.connector_fallbacks + stats.store_failures,
        "job_timeline": {sid: dict(marks) for sid, marks in batch.timeline.items()},
        # The engine's loop thread over the job: what it computed and where its time went.
        "job_engine": {
            "steps": stats.steps,
            "decode_only_steps": stats.decode_only_steps,
            "prefill_steps_s": stats.prefill_step_seconds,
            "decode_steps_s": stats.decode_step_seconds,
            "pass_s": stats.reconstruction_seconds,
            "idle_s": stats.idle_seconds,
            "peak_running": stats.peak_running,
            "preemptions": stats.preemptions,
            "recomputed_tokens": stats.recomputed_tokens,
            "loaded_tokens": stats.tokens_loaded,
        },
    }


def job_spans(timeline: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """When the job's stages began and ended (seconds since it started, over its streams):
    ``decode_before_prefill_end`` > 0 says decodes ran while prompts were still prefilled,
    ``decode_before_modify_end`` > 0 that they ran while edits were in flight."""

    def at(event: str, pick: Any) -> float | None:
        times = [marks[event] for marks in timeline.values() if event in marks]
        return pick(times) if times else None

    spans = {
        "last_prefill_end": at("prefill_end", max),
        "first_modify_start": at("modify_start", min),
        "last_modify_end": at("modify_end", max),
        "first_decode_start": at("decode_start", min),
        "last_decode_end": at("decode_end", max),
    }
    first = spans["first_decode_start"]
    for stage, end in (("prefill", "last_prefill_end"), ("modify", "last_modify_end")):
        last = spans[end]
        spans[f"decode_before_{stage}_end"] = (
            None if first is None or last is None else max(0.0, last - first)
        )
    return spans


def log_precapture(engine: Engine) -> None:
    """How long the engine took to capture its decode graphs at start (outside every phase)."""
    graphs = engine.graphs
    if graphs is not None:
        n, seconds = len(graphs.captured), graphs.precapture_seconds
        log(f"{n} decode graphs captured at start in {seconds:.1f} s")


def warm_up(engine: Engine, args: argparse.Namespace, vocab: int) -> None:
    """One request through the engine before anything is measured: compiles the GPU kernels,
    picks the matrix-product algorithms (the decode graphs were captured at start)."""
    gen = torch.Generator().manual_seed(args.seed + 2)
    n = min(args.max_prefill_tokens + args.chunk_size + 7, max(args.prompt_tokens))
    prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
    t = time.perf_counter()
    engine.generate(prompt, {"temperature": 0.0, "ignore_eos": True, "max_tokens": 8}, "warmup")
    log(f"warm-up request ({n} prompt tokens) took {time.perf_counter() - t:.1f} s")


def build_policy(name: str, cfg: ModelConfig, args: argparse.Namespace) -> Any:
    """``kvdrop.get(name, ...)`` with this run's keep ratio and chunk size; the RoPE parameters
    (and head_dim) come from the layout the engine registers, through the edit context."""
    info = kvdrop.describe(name)
    names = {p.name for p in info.params}
    params: dict[str, Any] = {"keep_ratio": args.keep_ratio, "chunk_size": args.chunk_size}
    if "head_dim" in names:
        params["head_dim"] = cfg.head_dim
    if args.policy_device is not None:
        if "device" in names:
            params["device"] = args.policy_device
        else:
            log(f"{name} takes no device parameter; --policy-device ignored for it")
    fn = kvdrop.get(name, rerotate=not args.no_rerotate, **params)
    return fn


def query_capture(args: argparse.Namespace, policies: list[Any]) -> QueryCapture:
    """What the query engine stores and the runs' contexts read: ``--query-capture``'s mode,
    with the strided sample only when one of ``policies`` reads it
    (:meth:`QueryCapture.for_policies`: snapkv, tova, rkv and finch read the last rows alone)."""
    lean = QueryCapture.for_policies(policies, args.query_capture)
    return QueryCapture(QueryNeed(args.query_capture), stride=lean.stride)


def measure(args: argparse.Namespace, model: Transformer) -> dict[str, Any]:
    """Baseline and every ``--policy`` side by side on one server: the report (setup + rows)."""
    cfg = model.config
    dtype = DTYPES[args.dtype]
    device = torch.device(args.device)
    prompts = make_prompts(args, cfg.vocab_size)
    policies = {name: build_policy(name, cfg, args) for name in args.policy}
    # What each edit reads: needs_of, the one rule (queries, or kvzip's reconstruction scores).
    needs = {name: needs_of(policies[name]) for name in args.policy}
    needs_q = {name: needs[name].reads_queries for name in args.policy}
    scores = {name: needs[name].token_scores for name in args.policy}
    queries = query_capture(args, [policies[n] for n in args.policy if needs_q[n]])

    # Budget: the decode request is prompt + 1 prefill token, then max_tokens more.
    if args.kv_budget_tokens:
        num_blocks = args.kv_budget_tokens // args.block_size
    else:
        num_blocks = budget_blocks(prompts, args)
    bandwidth = copy_bandwidth(device)
    if device.type == "cuda":
        log(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    gb = server_gb(cfg, dtype, prompts, args)
    # The pool is backed at start (--no-l1-use-lazy, sized to this run): no store or edit pays
    # first-touch faults inside a measured phase.
    flags: dict[str, Any] = {
        "chunk_size": args.chunk_size,
        "l1_size_gb": round(gb, 3),
        "no_l1_use_lazy": True,
    }
    if any(needs_q.values()) or any(scores.values()):
        flags["enable"] = ["transfer_query"]
    log(f"starting kvdrop server (pool {gb:.2f} GiB)")
    rows: list[dict[str, Any]] = []
    model_name = f"bench-{cfg.name}"
    token_bytes = 0
    with spawn_server(startup_timeout=300.0, **flags) as server:

        def engine_for(transfer_query: bool) -> tuple[ServerConnector, Engine]:
            connector = ServerConnector(
                server.url,
                server.http_url,
                model_name,
                transfer_query=transfer_query,
                queries=queries,
            )
            engine = Engine(
                model,
                num_blocks=num_blocks,
                block_size=args.block_size,
                max_batch_size=max(256, args.num_requests),
                graph_batch_sizes=range(1, args.num_requests + 1),  # no capture mid-run
                max_prefill_tokens=args.max_prefill_tokens,
                connector=connector,
                # Random weights have no tokenizer: fixed prompt ids (the pass costs the same).
                reconstruction=ReconstructionPrompt.synthetic(cfg.vocab_size),
            )
            log_precapture(engine)
            return connector, engine

        # Runs that need no queries share one engine whose connector captures none; with
        # --share-prefill their prefill loads the baseline's KV (salt "shared").
        connector, engine = engine_for(False)
        token_bytes = engine.cache.bytes_per_token
        # Holds this process's one mapping of the server's segment for the whole measurement
        # (both engines' connectors and every run's contexts share it): its page-locking for
        # the GPU is paid once, here, before any phase is timed.
        holder = connect(CacheKind.KV, server.url, server.http_url, model_name)
        if device.type == "cuda":
            started = time.perf_counter()
            locked = holder.prepare_dma()
            log(
                f"page-locked the server's {gb:.1f} GiB for DMA in "
                f"{time.perf_counter() - started:.1f} s"
                if locked
                else "the server's memory is not page-locked: GPU transfers go through the host"
            )
        with engine:
            if not args.no_warmup:
                warm_up(engine, args, cfg.vocab_size)
            rows.append(
                run(
                    "baseline",
                    engine,
                    server,
                    model_name,
                    prompts,
                    args,
                    None,
                    False,
                    "shared" if args.share_prefill else "baseline",
                )
            )
            if not args.no_job:
                rows[-1].update(
                    job("baseline", engine, server, model_name, prompts, args, None, False)
                )
            for name in (n for n in args.policy if not needs_q[n] and not scores[n]):
                salt = "shared" if args.share_prefill else name
                fn = policies[name]
                rows.append(run(name, engine, server, model_name, prompts, args, fn, False, salt))
                if not args.no_job:
                    rows[-1].update(job(name, engine, server, model_name, prompts, args, fn, False))
        connector.close()
        query_runs = [n for n in args.policy if needs_q[n] or scores[n]]
        if query_runs:
            # The engine is in reference cycles (its loop's callbacks): only the cyclic
            # collector frees its KV cache and decode graphs, so collect before the cache is
            # emptied, or the query engine is built beside the dead one's memory.
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            # Query policies compute their own prefill with query capture (own cache salt).
            connector, engine = engine_for(True)
            with engine:
                if not args.no_warmup:  # as the baseline's engine was, outside every phase
                    warm_up(engine, args, cfg.vocab_size)
                for name in query_runs:
                    fn, q, sc = policies[name], needs_q[name], scores[name]
                    same = (engine, server, model_name, prompts, args, fn, q)
                    rows.append(run(name, *same, name, reconstruct=sc, queries=queries))
                    if not args.no_job:
                        rows[-1].update(job(name, *same, sc, queries))
            connector.close()
        holder.close()
    base = rows[0]
    outputs = [r.pop("outputs") for r in rows]
    wbytes = weight_bytes(model)
    for row, out in zip(rows, outputs):
        same = sum(a == b for a, b in zip(outputs[0], out, strict=True))
        row["identical_outputs"] = f"{same}/{len(prompts)}"
        row["gain"] = (
            row["decode_tok_s"] / base["decode_tok_s"] if base["decode_tok_s"] else math.nan
        )
        step_floor(row, wbytes, token_bytes, bandwidth)
    lengths = [len(p) for p in prompts]
    setup = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
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
        "policies": " ".join(args.policy),
        "query_capture": args.query_capture,
        "query_stride": queries.stride,
        "keep_ratio": args.keep_ratio,
        "chunk_size": args.chunk_size,
        "block_size": args.block_size,
        "kv_budget_tokens": num_blocks * args.block_size,
        "kv_budget_blocks": num_blocks,
        "share_prefill": args.share_prefill,
        "copy_gb_s": bandwidth / 1e9,
        "weight_gb": wbytes / 1e9,
        "kv_bytes_per_token": token_bytes,
    }
    return {"setup": setup, "runs": rows, "end_to_end": end_to_end(rows, args.share_prefill)}


def decode_phases(engine: dict[str, Any], decode_s: float) -> dict[str, float]:
    """Where the decode phase's wall time went on the engine's loop thread (its counters over
    the phase): decode-only steps (graph replays), graph captures, steps that computed prompt
    tokens (uncached tails, recomputes), starting/applying prefix loads, handing results over
    (of which finalising query windows), waiting for work (loads in flight), and the rest
    (sampling, bookkeeping). The counters cover the engine's window (``seconds``: from the
    phase's reset to its snapshot), a little longer than the phase; the loop thread was idle
    for the difference (before the first request came and after the last token went), which is
    taken off ``idle_s``, so every part is >= 0 and they sum to ``decode_s``."""
    outside = max(0.0, float(engine.get("seconds", decode_s)) - decode_s)
    parts = {
        "decode_steps_s": engine["decode_step_seconds"],
        "captures_s": engine["graph_capture_seconds"],
        "prefill_steps_s": engine["prefill_step_seconds"],
        "load_apply_s": engine["load_apply_seconds"],
        "ship_s": engine["ship_seconds"] - engine["window_seconds"],
        "window_s": engine["window_seconds"],
        "idle_s": max(0.0, engine["idle_seconds"] - outside),
    }
    parts = {k: float(v) for k, v in parts.items()}
    parts["other_s"] = decode_s - sum(parts.values())
    return {"decode_s": decode_s, **parts}


def host_memory() -> dict[str, float]:
    """This machine's available memory and this process's page-locked host memory held by
    torch's caching allocator (GB; NaN where unknown), after a run: a pool, its registration
    and cached page-locked buffers together can leave the host short, which slows every later
    run's copies."""
    avail = math.nan
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    pinned = math.nan
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if torch.cuda.is_available() and stats is not None:
        try:
            pinned = float(stats().get("reserved_bytes.current", math.nan)) / 1e9
        except (RuntimeError, AttributeError):
            pass
    return {"host_avail_gb_after": avail, "pinned_gb_after": pinned}


def prefill_phases(engine: dict[str, Any], prefill_s: float, num_requests: int) -> dict[str, Any]:
    """Where the prefill phase's wall time went on the engine's loop thread (its counters, read
    after the modify phase, in which the loop only idles): steps computing prompt tokens,
    finalising the query windows (of ``ship_s``: the log-normalisers of each request's window,
    the capture's one loop-thread cost), the rest of handing results over (starting the KV and
    window stores), starting/applying prefix loads and kvzip's pass; ``rest_s`` is what is left
    of the phase: the loop waiting (for the last stores, which the phase awaits) and
    bookkeeping. A step that also runs a piece of kvzip's pass counts that piece in both
    ``steps_s`` and ``reconstruct_s`` (``rest_s`` is then understated)."""
    parts = {
        "steps_s": float(engine["prefill_step_seconds"]),
        "window_s": float(engine["window_seconds"]),
        "ship_s": float(engine["ship_seconds"] - engine["window_seconds"]),
        "load_apply_s": float(engine["load_apply_seconds"]),
        "reconstruct_s": float(engine.get("reconstruction_seconds", 0.0)),
    }
    return {
        "prefill_s": prefill_s,
        **parts,
        "rest_s": max(0.0, prefill_s - sum(parts.values())),
        "steps": int(engine["steps"]),
        "window_ms_per_req": 1e3 * parts["window_s"] / max(num_requests, 1),
        # Store threads (several at once): seconds per request of the KV and window stores.
        "kv_store_s_per_req": float(engine.get("kv_store_seconds", 0.0)) / max(num_requests, 1),
        "window_store_s_per_req": (
            float(engine.get("window_store_seconds", 0.0)) / max(num_requests, 1)
        ),
    }


def end_to_end(rows: list[dict[str, Any]], share_prefill: bool) -> list[dict[str, Any]]:
    """What a user waits for, per run: prefill + kvzip's pass + modify + decode phase by phase
    (``total_s``, its gain ``e2e_gain_phases``), and the wall time of the same requests as one
    pipelined job (``job_s``; ``e2e_gain`` is the baseline's job over this one's, or the phase
    gain when no job ran). Every run is charged a prefill of its own prompts: with
    ``--share-prefill`` a run whose prefill only loaded the baseline's KV (no queries, no pass) is
    charged the baseline's computed prefill instead of its load time (``prefill_charged``)."""
    base = rows[0]
    out = []
    for row in rows:
        recon = float(row["reconstruct_s"] or 0.0)
        shared = share_prefill and bool(row.get("shared_prefill"))
        prefill = float(base["prefill_s"] if shared else row["prefill_s"]) - recon
        modify = float(row["modify_s"] or 0.0)
        total = prefill + recon + modify + float(row["decode_s"])
        out.append(
            {
                "run": row["run"],
                "prefill_s": prefill,
                "prefill_charged": "baseline's (shared)" if shared else "own",
                "reconstruct_s": recon,
                "modify_s": modify,
                "decode_s": float(row["decode_s"]),
                "total_s": total,
                "job_s": row.get("job_s"),
                "job_failed": row.get("job_failed"),
                "decode_gain": row["gain"],
            }
        )
    timed = all(r["job_s"] for r in out)
    for row in out:
        row["e2e_gain_phases"] = out[0]["total_s"] / row["total_s"] if row["total_s"] else math.nan
        # From the wall time of the pipelined jobs when they ran, else from the phase sums.
        row["e2e_gain"] = out[0]["job_s"] / row["job_s"] if timed else row["e2e_gain_phases"]
    return out


def print_report(report: dict[str, Any], timeline: bool = False) -> None:
    """The setup, the side-by-side table, the step-vs-floor table, the end-to-end table and the
    jobs' stages (``timeline``: and each job's timeline per request)."""
    setup, rows = report["setup"], report["runs"]
    base, bandwidth = rows[0], setup["copy_gb_s"] * 1e9
    print(format_table([setup], list(setup)[:9], title="Setup"))
    print(format_table([setup], list(setup)[9:18]))
    print(format_table([setup], list(setup)[18:]))
    print()
    cols = [
        "run",
        "prefill_s",
        "reconstruct_s",
        "reconstruct_x_prefill",
        "query_B_per_tok",
        "modify_s",
        "modify_s_per_req",
        "edit_path",
        "kv_MB_per_edit",
        "fetch_per_edit",
        "edit_per_edit",
        "store_per_edit",
        "kept_fraction",
        "decode_tokens",
        "decode_s",
        "decode_tok_s",
        "gain",
        "peak_running",
        "decode_steps",
        "loaded_tokens",
        "recomputed_tokens",
        "identical_outputs",
    ]
    print(format_table(rows, cols, title="Baseline vs dropped (same prompts, same budget)"))
    print()
    cols = [
        "run",
        "peak_running",
        "kv_tokens_per_step",
        "gb_per_step",
        "floor_ms",
        "step_ms",
        "step_over_floor",
        "phase_ms_per_step",
        "phase_over_floor",
        "prefix_load_s",
        "load_gb_s",
        "load_gb_s_busy",
        "prefix_copy_s",
        "load_gb_s_phase",
        "graph_capture_s",
    ]
    print(
        format_table(
            rows,
            cols,
            title=f"Decode step vs its floor (bytes per step / {bandwidth / 1e9:.0f} GB/s copy "
            "bandwidth measured in this run)",
        )
    )
    print()
    phases = [{"run": r["run"], **r["phases"]} for r in rows]
    print(
        format_table(
            phases,
            list(phases[0]),
            title="Decode phase on the loop thread (sums to decode_s; load_gb_s above is per load)",
        )
    )
    print()
    pre = [{"run": r["run"], **r["prefill_phases"]} for r in rows if "prefill_phases" in r]
    if pre:
        print(
            format_table(
                pre,
                list(pre[0]),
                title="Prefill phase on the loop thread (window_s: the query capture's part; "
                "rest_s: waiting for the stores the phase awaits; *_store_s_per_req: store "
                "threads; host memory after the run)",
            )
        )
        print()
    e2e = report["end_to_end"]
    print(
        format_table(
            e2e,
            list(e2e[0]),
            title="End to end: the phases summed (prefill + reconstruction pass + modify + "
            "decode) and the pipelined job's wall time (job_s; e2e_gain from it)",
        )
    )
    print()
    timed = [r for r in rows if r.get("job_timeline")]
    if timed:
        spans = [
            {"run": r["run"], **job_spans(r["job_timeline"]), **r["job_engine"]} for r in timed
        ]
        print(
            format_table(
                spans,
                list(spans[0]),
                title="The pipelined job's stages (seconds since it started; decode_before_*_end:"
                " how long decodes ran before the last prefill / edit ended)",
            )
        )
        print()
    if timeline:
        for r in timed:
            marks = [{"request": sid, **m} for sid, m in r["job_timeline"].items()]
            marks.sort(key=lambda m: m.get("prefill_start", m.get("decode_start", 0.0)))
            cols = ["request", "prefill_start", "prefill_end", "modify_start", "modify_end"]
            cols += ["decode_start", "decode_first", "decode_end"]
            print(format_table(marks, cols, title=f"{r['run']}: the job's timeline per request"))
            print()
    for row in rows[1:]:
        print(
            f"decode throughput: baseline {base['decode_tok_s']:.1f} tok/s, {row['run']} "
            f"{row['decode_tok_s']:.1f} tok/s -> gain {row['gain']:.2f}x "
            f"(identical outputs {row['identical_outputs']})"
        )


def sweep(args: argparse.Namespace, model: Transformer) -> list[dict[str, Any]]:
    """``measure`` at every (requests, keep ratio) of ``--sweep-requests`` x ``--sweep-keep``:
    one row per dropped run with its gain over that point's own baseline (same budget)."""
    points = []
    for num_requests in args.sweep_requests:
        for keep in args.sweep_keep:
            point = argparse.Namespace(**{**vars(args), "num_requests": num_requests})
            point.keep_ratio = keep
            log(f"sweep: {num_requests} requests, keep {keep}")
            report = measure(point, model)
            base = report["runs"][0]
            for row in report["runs"][1:]:
                points.append(
                    {
                        "policy": row["run"],
                        "num_requests": num_requests,
                        "keep_ratio": keep,
                        "kept_fraction": row["kept_fraction"],
                        "baseline_tok_s": base["decode_tok_s"],
                        "decode_tok_s": row["decode_tok_s"],
                        "gain": row["gain"],
                        "step_over_floor": row["step_over_floor"],
                        "phase_over_floor": row["phase_over_floor"],
                        "modify_s": row["modify_s"],
                    }
                )
    return points


def plot_sweep(points: list[dict[str, Any]], path: str, title: str) -> None:
    """Gain against keep ratio, one line per (policy, number of requests); needs matplotlib
    (``pip install 'kvdrop[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for pt in points:
        series.setdefault((pt["policy"], pt["num_requests"]), []).append(pt)
    for (policy, num_requests), pts in sorted(series.items()):
        pts.sort(key=lambda pt: pt["keep_ratio"])
        ax.plot(
            [pt["keep_ratio"] for pt in pts],
            [pt["gain"] for pt in pts],
            marker="o",
            label=f"{policy}, {num_requests} requests",
        )
    keeps = sorted({pt["keep_ratio"] for pt in points})
    ax.plot(keeps, [1 / k for k in keeps], "k:", label="1 / keep (ideal)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("keep ratio")
    ax.set_ylabel("decode throughput gain over full KV")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    log(f"building model ({args.model_path or args.model_preset}, {args.dtype}, {args.device})")
    model = build_model(args)
    if args.sweep:
        points = sweep(args, model)
        if args.json:
            print(json.dumps({"sweep": points}, indent=2))
        else:
            print(
                format_table(
                    points, title="Gain against keep ratio (each point vs its own baseline)"
                )
            )
        if args.plot:
            name = args.model_path or args.model_preset
            lengths = "-".join(map(str, args.prompt_tokens))
            title = (
                f"{name} ({args.dtype}, {args.device}), prompts {lengths} tokens, "
                f"{args.max_tokens} decoded"
            )
            plot_sweep(points, args.plot, title)
            log(f"plot written to {args.plot}")
        return 0
    report = measure(args, model)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, timeline=args.timeline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
