"""The one experiment harness: cache server, engine connector, engine and SDK contexts.

``kvdrop demo``, ``kvdrop eval`` and ``kvdrop engine`` build their wiring here and nowhere else:

* which queries the engine captures is :meth:`kvdrop_sdk.query_capture.QueryCapture.for_policies`
  (the one owner of that decision); callers build it and hand it to :func:`open_harness`;
* :func:`connect` builds the engine's connector, only through
  :func:`kvdrop_engine.connectors.factory.make_connector`;
* :func:`cache_server` starts (and owns) a cache server, or uses a running one;
* :func:`open_harness` puts server, connector, engine and contexts together and closes them in
  reverse order;
* :func:`kv_bytes_per_token`, :func:`query_bytes_per_token` size the server's pool from the layout;
* :func:`check_policies` runs every policy once on a small input of the model's layout, so a
  policy that cannot edit this model fails before any prefill runs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvdrop_sdk.query_capture import QueryCapture, needs_of

__all__ = [
    "Harness",
    "HarnessError",
    "cache_server",
    "check_policies",
    "connect",
    "kv_bytes_per_token",
    "open_harness",
    "query_bytes_per_token",
    "reconstruction_prompt",
]


class HarnessError(ValueError):
    """The flags, the policies or the machine cannot run the experiment; says what to change."""


def kv_bytes_per_token(cfg: Any, itemsize: int) -> int:
    """Bytes of one token's K and V over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def query_bytes_per_token(cfg: Any, itemsize: int) -> int:
    """Bytes of one token's queries over every layer."""
    return cfg.num_layers * cfg.num_heads * cfg.head_dim * itemsize


def connect(
    kind: str, url: str, http_url: str, model_name: str, queries: QueryCapture, **options: Any
) -> Any:
    """The engine's connector (only through ``make_connector``); a bad address or a missing
    LMCache install is a :class:`HarnessError`."""
    from kvdrop_engine.connectors.factory import make_connector
    from kvdrop_engine.errors import EngineSetupError

    try:
        return make_connector(kind, url, http_url, model_name, queries=queries, **options)
    except (EngineSetupError, ValueError) as exc:
        raise HarnessError(str(exc)) from None


@contextlib.contextmanager
def cache_server(
    kind: str,
    *,
    url: str | None,
    http_url: str | None,
    chunk_size: int,
    pool_gb: float,
    queries: bool,
    shm_prefix: str,
    log: Callable[[str], None] = lambda msg: None,
) -> Iterator[tuple[str, str, Callable[[], dict[str, Any]]]]:
    """``(url, http_url, status())`` of the cache server to use: the one at ``url``, else one
    started here (a kvdrop server in this process, or an ``lmcache server`` subprocess) with a
    ``pool_gb`` pool, storing queries when ``queries``."""
    if url is not None and http_url is not None:
        yield url, http_url, dict
        return
    if kind == "lmcache":
        from kvdrop_engine.testing import spawn_lmcache_server

        log("starting an LMCache server (about 20 s)")
        with spawn_lmcache_server(
            l1_size_gb=round(max(pool_gb, 0.1), 3), chunk_size=chunk_size, transfer_query=queries
        ) as lmc:
            yield lmc.url, lmc.http_url, dict
        return
    from kvdrop_sdk.server.app import Server
    from kvdrop_sdk.server.config import ServerConfig
    from kvdrop_sdk.server.pool import unique_shm_name

    config = ServerConfig(
        port=0,
        http_port=0,
        chunk_size=chunk_size,
        l1_size_gb=pool_gb,
        shm_name=unique_shm_name(shm_prefix),
        enable=("transfer_query",) if queries else (),
    )
    try:
        server = Server(config).start()
    except OSError as exc:
        raise HarnessError(
            f"cannot start the cache server with a {pool_gb:.2f} GiB pool in /dev/shm: {exc}; "
            "use fewer or shorter prompts"
        ) from None
    try:
        yield server.url, server.http_url, server.status_json
    finally:
        server.stop()


def _contexts(
    kind: str, url: str, http_url: str, model_name: str, capture: QueryCapture
) -> list[Any]:
    """The SDK contexts of an edit: KV, plus QUERY when the engine uses the query store, told
    what it captures (``lmcache.sdk``'s for an LMCache server: they speak its protocol, under
    kvdrop's batch)."""
    queries = capture.uses_query_context
    if kind == "lmcache":
        from kvdrop_engine.connectors.lmcache import connect_sdk

        return connect_sdk(url, http_url, model_name, query=queries)
    from kvdrop_sdk import kvcache, qcache

    contexts = [kvcache.connect(url, http_url, model_name)]
    if queries:
        contexts.append(qcache.connect(url, http_url, model_name, capture=capture))
    return contexts


@dataclass
class Harness:
    """What :func:`open_harness` built: the engine, its connector, the SDK contexts (KV first,
    then QUERY when queries are captured), the server's addresses and its last status."""

    engine: Any
    connector: Any
    contexts: list[Any]
    url: str
    http_url: str
    status: Callable[[], dict[str, Any]]
    final_status: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def open_harness(
    model: Any,
    tokenizer: Any,
    model_name: str,
    *,
    capture: QueryCapture,
    kv_budget_tokens: int,
    pool_gb: float,
    chunk_size: int,
    kind: str = "kvdrop",
    url: str | None = None,
    http_url: str | None = None,
    block_size: int = 16,
    shm_prefix: str = "kvdrop_harness",
    log: Callable[[str], None] = lambda msg: None,
) -> Iterator[Harness]:
    """Server (started unless ``url`` is given), connector, started engine and contexts; on exit
    ``final_status`` holds the server's status and everything is closed in reverse order."""
    from kvdrop_engine.engine import Engine

    if capture.scores and kind != "kvdrop":
        raise HarnessError(
            "a policy reads the engine's reconstruction scores (kvzip); they are stored in a "
            "kvdrop server's window store, which an LMCache server does not have: use "
            "--cache-server kvdrop, or a policy that needs no scores (knorm, keydiff, snapkv)"
        )
    with cache_server(
        kind,
        url=url,
        http_url=http_url,
        chunk_size=chunk_size,
        pool_gb=pool_gb,
        queries=capture.uses_query_context,
        shm_prefix=shm_prefix,
        log=log,
    ) as (url_, http_url_, status):
        connector = connect(kind, url_, http_url_, model_name, capture)
        with contextlib.ExitStack() as stack:
            stack.callback(connector.close)
            engine = Engine(
                model,
                tokenizer=tokenizer,
                kv_budget_tokens=kv_budget_tokens,
                block_size=block_size,
                connector=connector,
                reconstruction=reconstruction_prompt(model, tokenizer) if capture.scores else None,
            ).start()
            stack.callback(engine.stop)
            contexts = _contexts(kind, url_, http_url_, model_name, capture)
            for ctx in contexts:
                stack.callback(ctx.close)
            harness = Harness(engine, connector, contexts, url_, http_url_, status)
            try:
                yield harness
            finally:
                harness.final_status = status()


def reconstruction_prompt(model: Any, tokenizer: Any) -> Any:
    """KVzip's reconstruction prompt in ``tokenizer``'s ids (fixed ids without a tokenizer:
    random weights, where only the pass's cost means something)."""
    from kvdrop_engine.reconstruct import ReconstructionPrompt

    if tokenizer is None:
        return ReconstructionPrompt.synthetic(model.config.vocab_size)
    return ReconstructionPrompt.from_tokenizer(tokenizer)


def check_policies(
    policies: Mapping[str, Any], cfg: Any, capture: QueryCapture, chunk_size: int
) -> None:
    """Run every policy once on random tensors of the model's layout (two chunks; query rows as
    the engine captures them): a policy that cannot edit this model's caches (e.g. a ``head_dim``
    that does not divide the widths) raises :class:`HarnessError` before any prefill runs."""
    from kvdrop_sdk.dry_run import dry_run_inputs

    for name, fn in policies.items():
        run = dry_run_inputs(cfg, 2 * chunk_size, needs_of(fn), capture, chunk_size=chunk_size)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a dry run: no RoPE here, no budget advice
                fn(run.tensors, run.tokens, context=run.context)
        except (ValueError, TypeError, RuntimeError, IndexError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise HarnessError(
                f"policy {name!r} cannot edit this model's caches ({cfg.num_layers} layers, "
                f"{cfg.num_kv_heads} KV / {cfg.num_heads} query heads x {cfg.head_dim}): {first}"
            ) from None
