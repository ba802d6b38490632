"""Connects the reference engine to a real LMCache server (``lmcache server``): the second backend
next to :class:`~kvdrop_engine.connectors.kvdrop.ServerConnector`.

It speaks to the server the way vLLM's LMCache connector does, through LMCache's own engine-side
adapters (optional dependency ``lmcache``; see docs/lmcache.md for the CPU install):

* ``LMCacheMPWorkerAdapter`` in the ``lmcache_driven`` mode registers a paged KV area in vLLM's
  NHD layout (``[2, blocks, 16, Hkv, d]`` per layer; LMCache moves it to shared memory, and the
  server copies blocks in and out of it), stores a prompt's whole chunks and loads a cached prefix.
  The area is a staging buffer of ``staging_tokens`` tokens: the engine keeps its own paged cache,
  and a longer transfer runs in several windows.
* ``LMCacheMPSchedulerAdapter`` looks prefixes up (and locks them until they are read or freed).
* ``QRingBufferAdapter`` registers the query ring (``<model>##query``, all query heads, post-RoPE)
  when the server runs with ``--enable transfer_query``; queries are written into ring blocks and
  stored from there (the SDK cannot store queries on an LMCache server; it reads them).

The SDK side of kvdrop's pipeline on an LMCache server uses ``lmcache.sdk`` contexts
(:func:`connect_sdk`): they speak LMCache's protocol, and kvdrop's request streams, batch,
policies and metrics accept them. Every LMCache call of a connector runs under one lock (LMCache's
adapters are not thread-safe and the staging area is shared), so concurrent requests are
serialised here. The server needs ``--supported-transfer-mode auto`` (or ``lmcache_driven``).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import requests
import torch
from torch import Tensor

from kvdrop_engine.connectors.base import KVConnector, check_server_args
from kvdrop_engine.errors import EngineSetupError
from kvdrop_engine.model import ModelConfig
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.errors import SDKError
from kvdrop_sdk.query_capture import QueryCapture, QueryNeed

__all__ = [
    "LMCacheConnector",
    "connect_sdk",
    "lmcache_config",
    "require_lmcache",
]

logger = logging.getLogger(__name__)

#: Tokens per block of the staging area and query ring (vLLM's default block size).
BLOCK_SIZE = 16
#: How long a store waits for the server to serve what it acknowledged (then warns).
VISIBLE_TIMEOUT_S = 10.0
INSTALL_HINT = (
    "LMCache is not installed: `pip install 'kvdrop[lmcache]'` then `pip install --no-deps "
    "lmcache==0.5.6` (CPU; see docs/lmcache.md), or `pip install lmcache` on a GPU machine"
)


def require_lmcache() -> None:
    """Raise ``EngineSetupError`` with the install recipe unless ``lmcache`` can be imported."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # its loggers read it on import
    try:
        for module in ("lmcache.sdk", "lmcache.integration.vllm.vllm_multi_process_adapter"):
            importlib.import_module(module)
    except ImportError as exc:
        raise EngineSetupError(f"{INSTALL_HINT} ({exc})") from None


def lmcache_config(http_url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The ``"mp"`` section of an LMCache server's ``GET /config``; ``SDKError`` when the address
    does not answer or answers like a kvdrop server."""
    url = http_url.rstrip("/") + "/config"
    try:
        with requests.Session() as session:
            session.trust_env = False
            resp = session.get(url, timeout=timeout)
        resp.raise_for_status()
        body = resp.json()
    except (requests.RequestException, ValueError) as exc:
        raise SDKError(
            f"could not read the LMCache server's config from {url} ({type(exc).__name__}); "
            "start one with `lmcache server ... --http-port PORT --supported-transfer-mode auto`"
        ) from None
    mp = body.get("mp") if isinstance(body, dict) else None
    if not isinstance(mp, dict) or "chunk_size" not in mp:
        hint = (
            " It looks like a kvdrop server: use --cache-server kvdrop (ServerConnector)."
            if isinstance(body, dict) and "chunk_size" in body
            else ""
        )
        raise SDKError(f"{url} is not an LMCache server's config (no 'mp.chunk_size').{hint}")
    return mp


def connect_sdk(
    url: str, http_url: str, model_name: str, *, query: bool, timeout: float = 60.0
) -> list[Any]:
    """``lmcache.sdk`` contexts (KV, plus QUERY when ``query``) for ``model_name``, for kvdrop's
    request streams and batch. A model must be registered (by an engine) when they connect."""
    require_lmcache()
    import lmcache.sdk as lmc_sdk

    contexts = [lmc_sdk.kvcache.connect(url, http_url, model_name, timeout)]
    if query:
        try:
            contexts.append(lmc_sdk.qcache.connect(url, http_url, model_name, timeout))
        except BaseException:
            contexts[0].close()
            raise
    return contexts


def _windows(start: int, end: int, size: int) -> Iterator[tuple[int, int]]:
    for s in range(start, end, size):
        yield s, min(s + size, end)


class _Adapters:
    """LMCache's engine-side adapters of one connector, built step by step by ``bind`` (so a
    failure part-way shuts down exactly what was built)."""

    def __init__(self, url: str, ctx: Any, model_name: str, timeout: float) -> None:
        from lmcache.integration.vllm.vllm_multi_process_adapter import ParallelStrategy

        self.url, self.ctx, self.model_name = url, ctx, model_name
        self.strategy = ParallelStrategy(
            mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
        )
        self.extra = {
            "lmcache.mp.mp_transfer_mode": "lmcache_driven",
            "lmcache.mp.mq_timeout": timeout,
        }
        self.worker: Any = None
        self.sched: Any = None
        self.q_sched: Any = None
        self.q_ring: Any = None

    def _scheduler(self, model_name: str) -> Any:
        from lmcache.integration.vllm.vllm_multi_process_adapter import LMCacheMPSchedulerAdapter

        return LMCacheMPSchedulerAdapter(
            [self.url], self.ctx, model_name, BLOCK_SIZE, self.strategy, extra_config=self.extra
        )

    def register_kv(self, config: ModelConfig, dtype: torch.dtype, blocks: int) -> list[Tensor]:
        """The worker adapter with a staging area of ``blocks`` blocks per layer, and the
        scheduler adapter; returns the areas (LMCache moves them to shared memory)."""
        from lmcache.integration.vllm.vllm_multi_process_adapter import LMCacheMPWorkerAdapter
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo

        self.worker = LMCacheMPWorkerAdapter(
            server_url=self.url,
            context=self.ctx,
            model_name=self.model_name,
            vllm_block_size=BLOCK_SIZE,
            parallel_strategy=self.strategy,
            extra_config=self.extra,
        )
        layers = config.num_layers
        shape = (2, blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        kv = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=dtype)
            for i in range(layers)
        }
        group = EngineGroupInfo(
            engine_group_id=0, layer_indices=tuple(range(layers)), tokens_per_block=BLOCK_SIZE
        )
        self.worker.register_kv_caches(
            kv, engine_group_infos=[group], layout_hints={"kv_layout": "NHD"}
        )
        self.sched = self._scheduler(self.model_name)
        return list(kv.values())

    def register_queries(self, config: ModelConfig, dtype: torch.dtype, blocks: int) -> None:
        """The query ring (``<model>##query``, all query heads) and its scheduler adapter."""
        from lmcache.sdk.qringbuffer import QRingBufferAdapter

        q_name = CacheKind.QUERY.server_model_name(self.model_name)
        self.q_ring = QRingBufferAdapter(self.worker, q_model_name=q_name)
        self.q_ring.register_q_ring(
            num_layers=config.num_layers,
            num_q_heads=config.num_heads,
            head_size=config.head_dim,
            dtype=dtype,
            num_ring_blocks=blocks,
            device=torch.device("cpu"),
        )
        self.q_sched = self._scheduler(q_name)

    def shutdown(self) -> None:
        """Shut down what was built (after a failed ``bind``)."""
        for adapter in (self.q_sched, self.sched, self.worker):
            if adapter is not None:
                adapter.shutdown()
        self.q_ring = None


class LMCacheConnector(KVConnector):
    """The engine's link to an LMCache server (see the module docstring).

    ``transfer_query=None`` follows the server's ``--enable transfer_query``; ``True`` demands it;
    ``False`` never stores queries. Queries are stored only whole, in chunks (upstream's layout:
    the connector stores no windows and no scores), so ``queries`` is a capture of mode "full"
    or "none" (not given: "full"); another is refused (ValueError saying so), never rewritten.
    ``staging_tokens`` (rounded down to whole chunks, at least one) sizes the registered KV area
    and the query ring.
    """

    def __init__(
        self,
        url: str,
        http_url: str,
        model_name: str,
        *,
        queries: QueryCapture | None = None,
        transfer_query: bool | None = None,
        timeout: float = 60.0,
        staging_tokens: int = 2048,
    ) -> None:
        check_server_args(model_name, transfer_query)
        if not isinstance(url, str) or not url.startswith("tcp://"):
            raise ValueError(
                f"url must look like tcp://HOST:PORT (the server's --port), got {url!r}"
            )
        if isinstance(staging_tokens, bool) or not isinstance(staging_tokens, int):
            raise ValueError(f"staging_tokens must be an int, got {staging_tokens!r}")
        q = QueryCapture(QueryNeed.FULL) if queries is None else queries
        if q.mode is QueryNeed.WINDOW or q.scores:
            asked = "token scores" if q.scores else "a query window"
            raise ValueError(
                f"an LMCache server stores queries only whole, in chunks (upstream's layout), "
                f"not {asked}: capture mode 'full' (QueryCapture.for_policies(policies, 'full'), "
                "--query-capture full) or 'none', or use a kvdrop server"
            )
        super().__init__(q)
        self.url = url
        self.http_url = http_url.rstrip("/")
        self.model_name = model_name
        self.timeout = float(timeout)
        self.staging_tokens = staging_tokens
        self._want_query = transfer_query
        self._lock = threading.Lock()
        self._zmq: Any = None
        self._worker: Any = None
        self._sched: Any = None
        self._q_sched: Any = None
        self._q_ring: Any = None
        self._kv: list[Tensor] = []
        self._shape: tuple[int, int, int] = (0, 0, 0)  # num_layers, num_kv_heads, head_dim
        self._q_width = 0
        self._dtype = torch.float32
        self._window = 0

    # ----------------------------------------------------------------- setup
    def _server_setup(self) -> tuple[int, bool]:
        """(chunk size, store queries) from the server's config and ``transfer_query``."""
        mp = lmcache_config(self.http_url, timeout=min(self.timeout, 10.0))
        chunk = int(mp["chunk_size"])
        mode = str(mp.get("supported_transfer_mode", "auto"))
        if mode not in ("auto", "lmcache_driven"):
            raise SDKError(
                f"the LMCache server at {self.http_url} runs with --supported-transfer-mode "
                f"{mode}; restart it with --supported-transfer-mode auto"
            )
        if chunk % BLOCK_SIZE:
            raise SDKError(f"LMCache chunk size {chunk} is not a multiple of {BLOCK_SIZE}")
        server_q = "transfer_query" in (mp.get("enable") or [])
        if self._want_query and not server_q:
            raise SDKError(
                f"transfer_query=True but the LMCache server at {self.http_url} does not enable "
                "it; start it with --enable transfer_query or pass transfer_query=None/False"
            )
        return chunk, server_q if self._want_query is None else self._want_query

    def bind(
        self, config: ModelConfig, dtype: torch.dtype, *, device: torch.device | None = None
    ) -> None:
        """Register the model's KV staging area (and query ring) with the LMCache server."""
        if self._worker is not None:
            raise SDKError("this connector is already bound to an engine; make one per engine")
        require_lmcache()
        import zmq

        chunk, want_q = self._server_setup()
        window = max(chunk, self.staging_tokens // chunk * chunk)
        ctx = zmq.Context()
        adapters = _Adapters(self.url, ctx, self.model_name, self.timeout)
        try:
            kv = adapters.register_kv(config, dtype, window // BLOCK_SIZE)
            if want_q:
                adapters.register_queries(config, dtype, window // BLOCK_SIZE)
        except Exception as exc:
            adapters.shutdown()
            ctx.destroy(linger=0)
            if isinstance(exc, SDKError):
                raise
            raise SDKError(
                f"registering {self.model_name!r} with the LMCache server at {self.url} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._zmq, self._worker, self._sched = ctx, adapters.worker, adapters.sched
        self._q_sched, self._q_ring = adapters.q_sched, adapters.q_ring
        self._kv = kv  # LMCache moved their storage to shared memory in place
        self._shape = (config.num_layers, config.num_kv_heads, config.head_dim)
        self._q_width = config.num_heads * config.head_dim
        self._dtype = dtype
        self._window = window
        self.chunk_size = chunk
        self.transfer_query = adapters.q_sched is not None

    def _bound(self) -> Any:
        if self._worker is None:
            raise SDKError("connector is not bound; pass it to Engine(connector=...) first")
        return self._worker

    # ----------------------------------------------------------------- lookups
    def _lookup(self, sched: Any, toks: list[int], cache_salt: str, rid: str) -> int:
        """Cached chunk-aligned tokens of ``toks`` (their chunks stay locked for ``rid``)."""
        if len(toks) < self.chunk_size:
            return 0
        sched.maybe_submit_lookup_request(rid, toks, cache_salt=cache_salt)
        deadline = time.monotonic() + self.timeout
        while (found := sched.check_lookup_result(rid)) is None:
            if time.monotonic() > deadline:
                sched.end_session(rid)
                raise SDKError(f"LMCache lookup {rid} timed out after {self.timeout:g}s")
            time.sleep(0.002)
        return int(found)

    def _probe_locked(self, sched: Any, toks: list[int], cache_salt: str) -> int:
        """A lookup that releases the chunks it locked (caller holds ``self._lock``)."""
        rid = f"kvdrop-lookup-{uuid.uuid4().hex}"
        try:
            found = self._lookup(sched, toks, cache_salt, rid)
            if found:
                sched.free_lookup_locks(toks, 0, found, rid, cache_salt=cache_salt)
        finally:
            sched.end_session(rid)
        return found

    def _probe(self, sched: Any, tokens: Sequence[int], cache_salt: str) -> int:
        with self._lock:
            return self._probe_locked(sched, list(tokens), cache_salt)

    def _await_visible(self, sched: Any, toks: list[int], cache_salt: str, what: str) -> None:
        """Wait until a lookup finds ``toks`` (the server commits a store shortly after
        acknowledging it): a request right after this store then finds what was stored."""
        deadline = time.monotonic() + min(self.timeout, VISIBLE_TIMEOUT_S)
        while self._probe_locked(sched, toks, cache_salt) < len(toks):
            if time.monotonic() > deadline:
                logger.warning(
                    "the LMCache server acknowledged the %s of %d tokens but a lookup does not "
                    "find them after %.0fs (evicted? is --l1-size-gb large enough?)",
                    what,
                    len(toks),
                    VISIBLE_TIMEOUT_S,
                )
                return
            time.sleep(0.002)

    def lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Length of the longest cached chunk-aligned KV prefix of ``tokens``."""
        self._bound()
        return self._probe(self._sched, tokens, cache_salt)

    def lookup_queries(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Length of the longest cached chunk-aligned query prefix (0 without transfer_query)."""
        self._bound()
        if self._q_sched is None:
            return 0
        return self._probe(self._q_sched, tokens, cache_salt)

    # ----------------------------------------------------------------- load / store
    def _wait(self, future: Any, what: str) -> None:
        if future is None:
            raise SDKError(f"the LMCache server is unhealthy; the {what} was not sent")
        if not future.result(timeout=self.timeout):
            raise SDKError(f"the LMCache server reported a failed {what}")

    def load(self, tokens: Sequence[int], cache_salt: str = "") -> Tensor | None:
        """KV ``[2, L, T, Hkv*d]`` (CPU) of the longest cached prefix of ``tokens``, or None."""
        from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

        worker = self._bound()
        layers, heads, dim = self._shape
        toks = list(tokens)
        rid = f"kvdrop-load-{uuid.uuid4().hex}"
        with self._lock:
            try:
                found = self._lookup(self._sched, toks, cache_salt, rid)
                if found <= 0:
                    return None
                out = torch.empty(2, layers, found, heads * dim, dtype=self._dtype)
                for s, e in _windows(0, found, self._window):
                    nb = (e - s) // BLOCK_SIZE
                    op = LoadStoreOp(
                        token_ids=toks[:e], block_ids=[list(range(nb))], start=s, end=e
                    )
                    worker.submit_retrieve_request(
                        rid, op, worker.create_recorded_event(), cache_salt=cache_salt
                    )
                    future, _ = worker.retrieve_futures.pop(rid, (None, None))
                    worker.retrieve_events.pop(rid, None)
                    self._wait(future, f"retrieve of tokens {s}..{e}")
                    for i, area in enumerate(self._kv):
                        out[:, i, s:e] = area[:, :nb].reshape(2, e - s, heads * dim)
                return out
            finally:
                self._sched.end_session(rid)

    def store(
        self,
        kv: Tensor,
        queries: Tensor | None,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        query_offset: int = 0,
    ) -> int:
        """Store whole chunks of ``kv`` ``[2, L, T, Hkv*d]`` and of the queries ``[1, L,
        T - query_offset, Hq*d]`` (those of tokens ``query_offset..``; the chunks before are
        cached already); returns how many query tokens are cached afterwards. Queries go first, so
        a request that finds this KV prefix also finds its queries."""
        worker = self._bound()
        toks = list(tokens)
        aligned = len(toks) // self.chunk_size * self.chunk_size
        if kv.shape[2] < aligned:
            raise SDKError(f"kv covers {kv.shape[2]} tokens but {aligned} are to be stored")
        if aligned == 0:
            return 0
        with self._lock:
            stored = 0
            if queries is not None and self._q_ring is not None and query_offset < aligned:
                if query_offset % self.chunk_size:
                    raise SDKError(f"query_offset {query_offset} is not chunk aligned")
                if queries.shape[2] < aligned - query_offset:
                    raise SDKError(
                        f"queries cover {queries.shape[2]} tokens but tokens {query_offset}.."
                        f"{aligned} are to be stored"
                    )
                self._store_queries(queries, toks[:aligned], cache_salt, query_offset)
                self._await_visible(self._q_sched, toks[:aligned], cache_salt, "query store")
                stored = aligned
            self._store_kv(worker, kv, toks[:aligned], cache_salt)
            self._await_visible(self._sched, toks[:aligned], cache_salt, "KV store")
        return stored

    def _store_kv(self, worker: Any, kv: Tensor, toks: list[int], cache_salt: str) -> None:
        from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

        heads, dim = self._shape[1], self._shape[2]
        for s, e in _windows(0, len(toks), self._window):
            nb = (e - s) // BLOCK_SIZE
            for i, area in enumerate(self._kv):
                area[:, :nb] = kv[:, i, s:e].reshape(2, nb, BLOCK_SIZE, heads, dim)
            rid = f"kvdrop-store-{uuid.uuid4().hex}"
            op = LoadStoreOp(token_ids=toks[:e], block_ids=[list(range(nb))], start=s, end=e)
            try:
                worker.submit_store_request(
                    rid, op, worker.create_recorded_event(), cache_salt=cache_salt
                )
                future = worker.store_futures.pop(rid, None)
                worker.store_events.pop(rid, None)
                self._wait(future, f"KV store of tokens {s}..{e}")
            finally:
                self._sched.end_session(rid)

    def _store_queries(self, q: Tensor, toks: list[int], cache_salt: str, offset: int) -> None:
        from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

        ring = self._q_ring.q_ring
        for s, e in _windows(offset, len(toks), self._window):
            nb = (e - s) // BLOCK_SIZE
            blocks = ring.allocate(nb)
            if blocks is None:  # never: stores are serialised and the ring holds one window
                raise SDKError(f"query ring has {ring.num_free_blocks()} free blocks, need {nb}")
            rid = f"kvdrop-qstore-{uuid.uuid4().hex}"
            released = False  # LMCache frees the blocks itself when it drops the store
            try:
                rows = q[0, :, s - offset : e - offset].to(ring.dtype)
                for i in range(rows.shape[0]):
                    ring.tensors[f"lmcache_q_layer_{i}"][blocks] = rows[i].reshape(
                        nb, BLOCK_SIZE, self._q_width
                    )
                op = LoadStoreOp(token_ids=toks[:e], block_ids=[blocks], start=s, end=e)
                free_before = ring.num_free_blocks()
                self._q_ring.submit_q_store_request(
                    rid, op, blocks, self._worker.create_recorded_event(), cache_salt=cache_salt
                )
                released = ring.num_free_blocks() > free_before
                pending = list(self._q_ring.q_store_futures.items())
                self._q_ring.q_store_futures.clear()
                self._q_ring.q_store_events.clear()
                if not pending:
                    raise SDKError("the LMCache server is unhealthy; the query store was not sent")
                for _, (future, _) in pending:
                    self._wait(future, f"query store of tokens {s}..{e}")
            finally:
                if not released:
                    ring.free(blocks)
                self._sched.end_session(rid)

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        """Unregister from the server and release LMCache's threads and sockets (idempotent)."""
        with self._lock:
            worker, self._worker = self._worker, None
            if worker is None:
                return
            if self._q_ring is not None:
                self._q_ring.shutdown_q_ring()
            for sched in (self._q_sched, self._sched):
                if sched is not None:
                    sched.shutdown()
            worker.shutdown()
            self._q_ring = self._q_sched = self._sched = None
            self._kv = []
            self._zmq.destroy(linger=0)
            self._zmq = None
