"""``kvdrop engine``: the reference engine behind an OpenAI-compatible HTTP server.

Loads a model (a ``.gguf`` file, a local HF folder, the installed SmolLM2 GGUF by default, or
random weights from a preset), starts the continuous-batching engine with a KV budget, optionally
connects it to a cache server (a kvdrop server, or a real LMCache server with ``--cache-server
lmcache``), and serves ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and
``/health`` until SIGINT/SIGTERM. The connector comes from the one factory
(:func:`kvdrop_engine.connectors.factory.make_connector`), as for the demo and eval. User errors
(bad flags, a missing or unreadable model, a busy port) are one line on stderr and exit code 2.
Heavy imports (torch, the model) happen inside ``run``; the model is loaded by
:func:`kvdrop_engine.loading.load_model`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvdrop_engine.errors import EngineSetupError, InvalidRequestError
from kvdrop_engine.options import (
    add_connector_arguments,
    add_keep_ratio_argument,
    add_model_arguments,
)
from kvdrop_engine.request_fields import MAX_BODY_BYTES
from kvdrop_sdk.http_limits import (
    HTTPLimits,
    bound_heap,
    capped_warnings,
    freeze_heap,
    log_field,
)
from kvdrop_sdk.query_capture import QueryCapture, QueryNeed

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvdrop engine`` (no heavy imports here: ``--help`` must stay fast)."""
    _http_arguments(parser)
    _model_arguments(parser)
    _engine_arguments(parser)
    _drop_arguments(parser)
    _connector_arguments(parser)


def _http_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("HTTP server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    net.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 = any)")
    net.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients send and the kvdrop cache is keyed by (default: the model's name)",
    )
    net.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs tokens read "token_id:N" (as vLLM\'s flag; needed by make_post_completion)',
    )
    net.add_argument(
        "--api-key",
        default=os.environ.get("KVDROP_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /version "
        "and /metrics (401 without it; default: $KVDROP_API_KEY, else none)",
    )
    net.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + max_tokens a request may ask for (default: the model's context)",
    )
    limits = HTTPLimits()
    net.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"largest request body; larger is 413 before it is read (default {MAX_BODY_BYTES})",
    )
    net.add_argument(
        "--request-timeout-s",
        type=float,
        default=limits.request_timeout_s,
        help="seconds a request's line, headers and body have to arrive, counted from its first "
        f"byte (default {limits.request_timeout_s:g})",
    )
    net.add_argument(
        "--max-connections",
        type=int,
        default=limits.max_connections,
        help=f"connections served at once; more get 503 (default {limits.max_connections})",
    )


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    model = add_model_arguments(parser)
    model.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    eng = parser.add_argument_group("engine")
    eng.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=65536,
        help="KV cache budget in tokens, shared by all running requests (default 65536)",
    )
    eng.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    eng.add_argument(
        "--max-batch-size", type=int, default=256, help="most requests run at once (default 256)"
    )
    eng.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=2048,
        help="prompt tokens computed per engine step (default 2048)",
    )
    eng.add_argument(
        "--max-client-prefill-tokens",
        type=int,
        default=None,
        help="prompt tokens one client (one cache_salt with its streams' edit salts, or one "
        "unsalted request) may have in a "
        "step that carries another client's work, so about max-prefill / this many long prompts "
        "are prefilled at once, first come, first served; 0: no cap, the oldest prompt may take "
        "the whole step (default: a quarter of --max-prefill-tokens)",
    )


def _drop_arguments(parser: argparse.ArgumentParser) -> None:
    drop = parser.add_argument_group(
        "dropping while serving (each prompt's cache cut after its prefill; a request's "
        '"kvdrop": {"policy": ..., "keep_ratio": ...} or "kvdrop": null overrides it)'
    )
    drop.add_argument(
        "--policy",
        default=None,
        metavar="SPEC",
        help="drop policy: a registered name or spec string, plugins included (default: none)",
    )
    add_keep_ratio_argument(drop)
    drop.add_argument(
        "--min-drop-tokens",
        type=int,
        default=128,
        help="prompts shorter than this are left whole (default 128)",
    )
    drop.add_argument(
        "--cut-timeout-s",
        type=float,
        default=30.0,
        help="a prompt cut (its policy runs beside the loop, which steps other requests) still "
        "running after this many seconds fails its request (default 30)",
    )
    drop.add_argument(
        "--client-policies",
        default="builtin",
        metavar="WHICH",
        help='which policies a request\'s "kvdrop" override (prompt or decode cut) may name: '
        "'builtin' (the server's own --policy/--decode-policy and kvdrop's built-ins; "
        "default), 'all' (plugins too) or a comma-separated list; parameters stay within "
        "their declared serving bounds",
    )
    decode = parser.add_argument_group(
        "compression while decoding (each request's cache kept within a token budget; a "
        'request\'s "kvdrop": {"decode": {"policy": ..., "budget": ..., "every": ...}} or '
        '{"decode": null} overrides it)'
    )
    decode.add_argument(
        "--decode-policy",
        default=None,
        metavar="SPEC",
        help="policy that cuts a decoding request's cache back to --decode-budget tokens, "
        "e.g. rkv, snapkv, tova, knorm (default: none)",
    )
    decode.add_argument(
        "--decode-budget",
        type=int,
        default=None,
        metavar="TOKENS",
        help="KV tokens a decoding request keeps after each cut (needed with --decode-policy)",
    )
    decode.add_argument(
        "--decode-every",
        type=int,
        default=None,
        metavar="N",
        help="generated tokens between cuts: a request holds at most budget + N tokens "
        "(default 128, R-KV's buffer)",
    )


def _connector_arguments(parser: argparse.ArgumentParser) -> None:
    kv = add_connector_arguments(
        parser,
        title="cache server connector (optional)",
        url_help="ZMQ address of the cache server, e.g. tcp://127.0.0.1:6555; enables storing "
        "prompts' KV (and queries) there and loading cached prefixes from it",
        http_url_default="http://127.0.0.1:8080",
        url_dest="kvdrop_url",
    )
    kv.add_argument(
        "--query-window",
        type=int,
        default=64,
        help="W: queries of the last W computed tokens are saved (default 64, SnapKV's window)",
    )
    kv.add_argument(
        "--query-stride",
        type=int,
        default=64,
        help="S: queries of every S-th position are saved too (H2O's sample; 0 = none; default 64)",
    )
    kv.add_argument(
        "--store-decoded-kv",
        action="store_true",
        help="also store the KV of whole chunks completed by generated tokens when a request "
        "ends, so a later edit can drop from them",
    )


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise EngineSetupError(f"{name} must be a positive integer, got {value}")


def _check_policy(args: argparse.Namespace) -> None:
    """``--policy`` built without a model (a typo fails in a second, not after the model's
    load); what needs the model's layout is checked once it is loaded."""
    if args.policy is None:
        return
    from kvdrop_engine.drop import serving_policy

    try:
        serving_policy(args.policy, args.keep_ratio)
    except InvalidRequestError as exc:
        raise EngineSetupError(f"--policy {args.policy}: {exc}") from None


def _check_args(args: argparse.Namespace) -> None:
    """Validate flags before anything heavy is loaded."""
    if args.model is not None and args.random_preset is not None:
        raise EngineSetupError("give --model or --random-preset, not both")
    if not 0 <= args.port <= 65535:
        raise EngineSetupError(f"--port must be in 0..65535, got {args.port}")
    _positive("--kv-budget-tokens", args.kv_budget_tokens)
    _positive("--block-size", args.block_size)
    _positive("--max-batch-size", args.max_batch_size)
    _positive("--max-prefill-tokens", args.max_prefill_tokens)
    if args.max_client_prefill_tokens is not None and args.max_client_prefill_tokens < 0:
        raise EngineSetupError(
            f"--max-client-prefill-tokens must be >= 0, got {args.max_client_prefill_tokens}"
        )
    if args.kv_budget_tokens < args.block_size:
        raise EngineSetupError(
            f"--kv-budget-tokens ({args.kv_budget_tokens}) must be at least one block "
            f"(--block-size {args.block_size})"
        )
    _positive("--min-drop-tokens", args.min_drop_tokens)
    if args.decode_every is not None:
        _positive("--decode-every", args.decode_every)
    if args.decode_budget is not None:
        _positive("--decode-budget", args.decode_budget)
    if args.decode_policy is not None and args.decode_budget is None:
        raise EngineSetupError("--decode-policy needs --decode-budget TOKENS")
    if args.threads is not None:
        _positive("--threads", args.threads)
    _positive("--query-window", args.query_window)
    if args.query_stride < 0:
        raise EngineSetupError(f"--query-stride must be >= 0, got {args.query_stride}")
    if args.max_model_len is not None:
        _positive("--max-model-len", args.max_model_len)
    if args.api_key is not None:
        from kvdrop_engine.http import check_api_key

        try:
            check_api_key(args.api_key, "--api-key")
        except ValueError as exc:
            raise EngineSetupError(str(exc)) from None
    try:
        _limits_of(args)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0].removeprefix("HTTPLimits.")
        flag = {"max_body_bytes": "max_request_bytes"}.get(field, field).replace("_", "-")
        raise EngineSetupError(f"--{flag}: {exc}") from None
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise EngineSetupError("--served-model-name must not be empty")
    if args.model is not None and not Path(args.model).exists():
        raise EngineSetupError(f"--model {args.model}: no such file or folder")


def query_capture_of(args: argparse.Namespace) -> QueryCapture:
    """The capture the flags ask for, as the ``--cache-server`` kind serves it (an LMCache
    server keeps only chunk queries: full), handed to the connector unchanged."""
    from kvdrop_engine.connectors.factory import capture_mode

    mode = capture_mode(args.cache_server, args.query_capture)
    return QueryCapture(QueryNeed(mode), args.query_window, args.query_stride)


def _limits_of(args: argparse.Namespace) -> HTTPLimits:
    """The HTTP server's limits from the flags (the shared module checks them)."""
    return HTTPLimits(
        max_body_bytes=args.max_request_bytes,
        request_timeout_s=args.request_timeout_s,
        max_connections=args.max_connections,
    )


def _max_model_len(args: argparse.Namespace, cfg: Any) -> int:
    """``--max-model-len``, at most the model's context (its position embeddings)."""
    if args.max_model_len is None:
        return int(cfg.max_position_embeddings)
    if args.max_model_len > cfg.max_position_embeddings:
        raise EngineSetupError(
            f"--max-model-len {args.max_model_len} is over the model's context of "
            f"{cfg.max_position_embeddings} tokens"
        )
    return int(args.max_model_len)


def prompt_scorer(engine: Any) -> Any:
    """``(prompt, top, salt) -> ScoreHandle`` for ``prompt_logprobs`` and ``echo``: the
    model's teacher-forced log-probabilities of each prompt token after the first, as a scoring
    request through the engine (batched with the others, its cached prefix loaded, scored in
    bounded slices: ``Engine.post_prompt_scoring``)."""
    return engine.post_prompt_scoring


def _fail(message: str) -> int:
    print(f"kvdrop engine: error: {message}", file=sys.stderr)
    return 2


def _load(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """The model, tokenizer and served name; one line saying what was loaded."""
    import torch

    from kvdrop_engine.loading import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    print("kvdrop engine: loading the model ...", flush=True)
    model, tokenizer, default_name = load_model(args)
    name = args.served_model_name or default_name
    cfg = model.config
    print(
        f"kvdrop engine: loaded {name} ({cfg.num_layers} layers, {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads, head dim {cfg.head_dim}, vocab {cfg.vocab_size}, "
        f"{args.dtype} on {args.device}) in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return model, tokenizer, name


def connector_of(args: argparse.Namespace, name: str) -> Any:
    """The connector of ``--cache-server`` at ``--url`` for the served model ``name`` (None
    without ``--url``); ``EngineSetupError`` for a bad address or a missing LMCache install."""
    from kvdrop_engine.connectors.factory import make_connector

    if args.kvdrop_url is None:
        return None
    options: dict[str, Any] = {}
    if args.cache_server == "kvdrop":
        options["store_decoded"] = args.store_decoded_kv
    capture = query_capture_of(args)
    if not capture.full:
        options["transfer_query"] = None  # the lean window follows the server; full demands it
    try:
        return make_connector(
            args.cache_server,
            args.kvdrop_url,
            args.kvdrop_http_url,
            name,
            queries=capture,
            **options,
        )
    except ValueError as exc:
        raise EngineSetupError(str(exc)) from None


def _build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """Connector, engine and HTTP server (not started); EngineSetupError on a user error."""
    from kvdrop_engine.engine import Engine
    from kvdrop_engine.http import CompletionHTTPServer
    from kvdrop_engine.metrics import engine_load

    try:
        model, tokenizer, name = _load(args)
        max_model_len = _max_model_len(args, model.config)
    except (EngineSetupError, OSError, ValueError, ImportError, RuntimeError) as exc:
        # Missing files, bad checkpoints, missing extras, an unavailable --device.
        raise EngineSetupError(str(exc)) from None
    dropper = _dropper(args, model.config)
    compressor = _compressor(args, model.config)
    connector = connector_of(args, name)
    try:
        engine = Engine(
            model,
            tokenizer=tokenizer,
            kv_budget_tokens=args.kv_budget_tokens,
            block_size=args.block_size,
            max_batch_size=args.max_batch_size,
            max_prefill_tokens=args.max_prefill_tokens,
            max_client_prefill_tokens=args.max_client_prefill_tokens,
            connector=connector,
            dropper=dropper,
            compressor=compressor,
        )
    except Exception as exc:
        if connector is not None:
            connector.close()
        raise EngineSetupError(f"could not start the engine: {exc}") from None
    cfg = model.config
    try:
        server = CompletionHTTPServer(
            engine.post_completion,
            model_name=name,
            tokenizer=tokenizer,
            host=args.host,
            port=args.port,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            vocab_size=cfg.vocab_size,
            max_model_len=max_model_len,
            stats=lambda: engine.stats().to_dict(),
            gauges=lambda: engine_load(engine),
            limits=_limits_of(args),
            score_prompt=prompt_scorer(engine),
            api_key=args.api_key,
        )
    except OSError as exc:
        if connector is not None:
            connector.close()
        raise EngineSetupError(f"cannot bind {args.host}:{args.port}: {exc}") from None
    return connector, engine, server


def _dropper(args: argparse.Namespace, config: Any) -> Any:
    """The engine's :class:`~kvdrop_engine.drop.PromptDropper`: ``--policy`` checked against the
    model's layout now (EngineSetupError in one line), so requests may also ask for a cut."""
    from kvdrop_engine.drop import PromptDropper

    return PromptDropper(
        config,
        args.policy,
        keep_ratio=args.keep_ratio,
        min_prompt_tokens=args.min_drop_tokens,
        query_window=args.query_window,
        query_stride=args.query_stride,
        client_policies=args.client_policies,
        cut_timeout_s=args.cut_timeout_s,
    )


def _compressor(args: argparse.Namespace, config: Any) -> Any:
    """The engine's :class:`~kvdrop_engine.decode_cut.DecodeCompressor`: ``--decode-policy``
    checked against the model's layout now, so requests may also ask for a cut."""
    from kvdrop_engine.decode_cut import DecodeCompressor

    return DecodeCompressor(
        config,
        args.decode_policy,
        budget=args.decode_budget,
        every=args.decode_every,
        query_window=args.query_window,
        client_policies=args.client_policies,
    )


def run(args: argparse.Namespace) -> int:
    """Start the engine (with its connector, when ``--url`` is given) and the HTTP server; block
    until SIGINT/SIGTERM; stop both cleanly."""
    try:
        _check_args(args)
        _check_policy(args)
    except EngineSetupError as exc:
        return _fail(str(exc))
    bound_heap()  # freed request bodies are reused, not kept per thread (kvdrop_sdk.http_limits)
    # The HTTP layer logs what a user should see (a client that disconnected) in one line.
    logging.basicConfig(level=logging.WARNING, format="kvdrop engine: %(message)s")
    logging.getLogger("kvdrop_engine").setLevel(logging.INFO)
    # Warnings (a client-chosen policy's, a plugin's) as capped log lines, not raw stderr text.
    with capped_warnings(logging.getLogger("kvdrop_engine.warnings")):
        try:
            connector, engine, server = _build(args)
        except EngineSetupError as exc:
            return _fail(str(exc))
        return _serve(args, connector, engine, server)


def _serve(args: argparse.Namespace, connector: Any, engine: Any, server: Any) -> int:
    """Serve until SIGINT/SIGTERM, then stop server, engine and connector."""
    from kvdrop_engine.http import ROUTES

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    freeze_heap()  # collections while serving skip the start-up heap (kvdrop_sdk.http_limits)
    engine.start()
    kv_note = f", {args.cache_server} KV store {args.kvdrop_url}" if connector is not None else ""
    default = engine.dropper.default if engine.dropper is not None else None
    if default is not None:
        kv_note += (
            f", prompts of {args.min_drop_tokens}+ tokens cut by {log_field(default.spec)} to keep "
            f"{default.budget}"
        )
    if args.decode_policy is not None:
        kv_note += (
            f", decoding requests cut by {args.decode_policy} to {args.decode_budget} tokens "
            f"every {engine.compressor.every}"
        )
    print(
        f"kvdrop engine: serving {server.model_name!r} on {server.url} (KV budget "
        f"{engine.num_blocks} blocks of {args.block_size} tokens{kv_note}); {ROUTES}, GET /stats",
        flush=True,
    )
    server.start()  # after the line above: a client that sees /health answer can read it in the log
    try:
        while not stop.wait(0.5):
            pass
    finally:
        print("kvdrop engine: stopping", flush=True)
        server.stop()
        engine.stop()
        if connector is not None:
            connector.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("kvdrop engine: stopped", flush=True)
    return 0
