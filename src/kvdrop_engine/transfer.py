"""Server I/O of the engine: prefix loads and stores on their own pools, with deadlines and
back-off, off the loop thread.

Up to ``load_concurrency`` loads run on a connector pool (each also copies its prefix into the
request's blocks) while the loop keeps stepping the other requests; a load still waiting for the
server after ``load_timeout_s`` is abandoned and the prompt is computed instead, as is one that
fails. Stores are submitted by the loop to a store pool and attached to their request
(:attr:`Request.stores`); the request's caller waits for them, up to ``store_timeout_s``, before
it hands over the next token -- so with a healthy server a caller that has seen a token can rely
on the prompt being in the server. After a failure or a timeout the engine leaves the server alone
for ``backoff_s`` seconds (loads recompute at once, stores are skipped), so a hung or dead server
costs the first request one timeout, not every request.

The jobs (:class:`StoreJob`, :class:`WindowJob`, :class:`ScoresJob`) only ship results: what
they carry was decided by the scheduler and computed by the
:class:`~kvdrop_engine.runner.ModelRunner`, on the host already.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvdrop_engine.connectors.base import KVConnector
from kvdrop_engine.errors import EngineError
from kvdrop_engine.paged import PagedKVCache, to_device
from kvdrop_engine.scheduler import (
    PrefixPlan,
    decoded_store_upto,
    follow,
    plan_prefix,
    plan_recompute,
)
from kvdrop_engine.sequence import LoadState, Request
from kvdrop_engine.stats import EngineStats
from kvdrop_sdk.errors import PartialStoreError, SDKError, ServerUnavailableError
from kvdrop_sdk.window import QueryWindow, TokenScores

__all__ = [
    "STORE_THREADS",
    "ScoresJob",
    "StoreDecoded",
    "StoreJob",
    "StorePrompt",
    "StoreWindow",
    "Transfers",
    "WindowJob",
    "check_seconds",
    "refused",
]

#: Threads that run stores (each caller waits for its own, up to ``store_timeout_s``).
STORE_THREADS = 4

logger = logging.getLogger("kvdrop_engine.engine")


def check_seconds(**values: float) -> None:
    """``ValueError`` unless every value (a timeout, a back-off) is a number >= 0."""
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is a kvdrop SDK error other than "server unavailable":
    the server answered and refused this request, so it is up and needs no back-off."""
    seen: BaseException | None = exc
    found = False
    while seen is not None:
        if isinstance(seen, ServerUnavailableError):
            return False
        found = found or isinstance(seen, SDKError)
        seen = seen.__cause__
    return found


@dataclass
class StoreJob:
    """A prompt's KV (and queries) to push to the server, from the caller's thread."""

    kv: Tensor
    queries: Tensor | None
    tokens: list[int]
    cache_salt: str
    query_offset: int = 0

    def run(self, conn: KVConnector) -> int:
        """Store it; returns the query tokens stored. ``EngineError`` when the store fails (the
        prompt is then not in the server, which the caller must hear about)."""
        try:
            stored = conn.store(
                self.kv, self.queries, self.tokens, self.cache_salt, query_offset=self.query_offset
            )
        except Exception as exc:
            raise EngineError(
                f"storing the prompt's KV in the kvdrop server failed: {exc}"
            ) from exc
        return int(stored or 0)


@dataclass
class WindowJob:
    """A finished request's query window to push to the server, from the caller's thread (before
    its last token is handed over, so a caller that saw the end finds the window):
    ``positions`` ``[R]``, ``queries`` ``[L, R, Hq, d]`` and log-normalisers ``lse``
    ``[L, R, Hq]`` (on the host), for the call over ``tokens``."""

    positions: Tensor
    queries: Tensor
    lse: Tensor
    tokens: list[int]
    cache_salt: str

    def run(self, conn: KVConnector) -> tuple[int, int]:
        """Store it; returns ``(rows, bytes)`` sent."""
        q = self.queries
        queries = q.reshape(q.shape[0], q.shape[1], -1).unsqueeze(0).to("cpu")
        lse = self.lse.unsqueeze(0).to(device="cpu", dtype=torch.float32)
        positions = self.positions
        try:
            conn.store_window(self.tokens, QueryWindow(queries, positions, lse), self.cache_salt)
        except Exception as exc:
            raise EngineError(
                f"storing the request's query window in the kvdrop server failed: {exc}"
            ) from exc
        nbytes = queries.numel() * queries.element_size() + lse.numel() * lse.element_size()
        return int(positions.numel()), nbytes


@dataclass(frozen=True)
class StorePrompt:
    """(after prefill) Store the prompt's whole chunks of KV (and chunk queries), before the
    cut changes them; nothing when admission found them all cached. A plan action
    (:class:`~kvdrop_engine.plan.RequestPlan`)."""

    def run(self, host: Any, req: Request, step: Any) -> bool:
        if req.store_upto:
            kv = host.runner.read_kv(req.blocks, req.store_upto)
            queries = req.take_chunk_queries()
            tokens = req.prompt[: req.store_upto]
            host.transfers.submit(
                req, StoreJob(kv, queries, tokens, req.cache_salt, req.query_offset)
            )
        return False


@dataclass(frozen=True)
class StoreDecoded:
    """(before the last token) Store the KV of the whole chunks the generated tokens completed,
    keyed by prompt + generated tokens (``store_decoded`` connectors). A plan action."""

    def run(self, host: Any, req: Request, step: Any) -> bool:
        conn = host.connector
        upto = decoded_store_upto(req, conn.chunk_size, conn.store_decoded)
        if upto:
            kv = host.runner.read_kv(req.blocks, upto)
            sequence = req.prompt + req.output
            host.transfers.submit(req, StoreJob(kv, None, sequence[:upto], req.cache_salt))
        return False


@dataclass(frozen=True)
class StoreWindow:
    """(before the last token) Store the request's query window with its log-normalisers,
    keyed by prompt + generated tokens: the one the step computed for every request it ends
    (``step.windows``), else its own. A plan action."""

    def run(self, host: Any, req: Request, step: Any) -> bool:
        if req.rid in step.windows:
            record = step.windows[req.rid]
        elif req.window is not None:
            started = time.perf_counter()
            computed = len(req.prompt) + len(req.output) - 1  # the last token never fed back
            record = host.runner.window_record(req.blocks, computed, req.window)
            host.add_seconds("window_seconds", time.perf_counter() - started)
        else:
            record = None
        if record is not None:
            sequence = req.prompt + req.output
            host.transfers.submit(req, WindowJob(*record, sequence, req.cache_salt))
        return False


@dataclass
class ScoresJob:
    """A finished request's reconstruction scores ``[L, Hkv, N]`` to push to the server from the
    caller's thread (before its last token is handed over), keyed like its query window by
    ``tokens`` (prompt + every generated token)."""

    scores: Tensor
    tokens: list[int]
    cache_salt: str

    def run(self, conn: KVConnector) -> int:
        """Store it; returns the bytes sent. ``EngineError`` when the store fails."""
        if not conn.stores_scores:
            raise EngineError(
                "the engine's connector cannot store reconstruction scores (kvzip): use a kvdrop "
                "server (kvdrop_engine.connectors.kvdrop.ServerConnector with transfer_query); "
                "LMCache servers have no store for them"
            )
        scores = self.scores.to(device="cpu", dtype=torch.float32)
        try:
            conn.store_scores(self.tokens, TokenScores(scores), self.cache_salt)
        except Exception as exc:
            raise EngineError(f"storing the reconstruction scores failed: {exc}") from exc
        return scores.numel() * 4


class Transfers:
    """The loads and stores of one engine over ``connector`` (see the module docstring).

    ``copy_on_loop``: copy loaded prefixes into the blocks on the loop thread (CUDA graphs: a
    graph may be captured in any step, and another thread's device calls would break it).
    ``wake`` tells the loop that a load changed state; ``stats`` gives the engine's current
    counters, which are only changed under ``lock`` (the engine's condition).
    """

    def __init__(
        self,
        connector: KVConnector,
        cache: PagedKVCache,
        *,
        load_concurrency: int,
        load_timeout_s: float,
        store_timeout_s: float,
        backoff_s: float,
        copy_on_loop: bool,
        wake: Callable[[], None],
        stats: Callable[[], EngineStats],
        lock: threading.Condition,
    ) -> None:
        self.connector = connector
        #: The engine's query capture (what the policies read), passed to every plan.
        self.capture = connector.queries
        self.cache = cache
        self.load_concurrency = load_concurrency
        self.load_timeout_s = load_timeout_s
        self.store_timeout_s = store_timeout_s
        self.backoff_s = backoff_s
        self.copy_on_loop = copy_on_loop
        self.load_lock = threading.Lock()  # guards Request.load_state
        self._wake = wake
        self._stats = stats
        self._lock = lock
        self._pools_lock = threading.Lock()
        self._load_pool: ThreadPoolExecutor | None = None
        self._store_pool: ThreadPoolExecutor | None = None
        self._down_until = 0.0
        self._local = threading.local()  # each load thread's CUDA stream
        self._loads_running = 0  # with _busy_since: prefix_load_busy_seconds (under _lock)
        self._busy_since = 0.0

    @contextlib.contextmanager
    def _counters(self) -> Iterator[EngineStats]:
        """The engine's counters, under its lock."""
        with self._lock:
            yield self._stats()

    # ----------------------------------------------------------------- health
    def io_ok(self) -> bool:
        """Whether the server may be asked (no back-off running)."""
        return time.monotonic() >= self._down_until

    def io_failed(self, what: str, reason: str, exc: BaseException | None = None) -> None:
        """Log one line and leave the server alone for ``backoff_s`` -- unless ``exc`` says the
        server answered and refused this one request (bad input is no outage)."""
        if exc is not None and refused(exc):
            logger.warning("kvdrop server %s %s (this request only)", what, reason)
            return
        self._down_until = time.monotonic() + self.backoff_s
        logger.warning(
            "kvdrop server %s %s; computing without it for %g s", what, reason, self.backoff_s
        )

    def _pool(self, kind: str) -> ThreadPoolExecutor:
        with self._pools_lock:
            if kind == "load":
                if self._load_pool is None:
                    self._load_pool = ThreadPoolExecutor(
                        self.load_concurrency, thread_name_prefix="kvdrop-load"
                    )
                return self._load_pool
            if self._store_pool is None:
                self._store_pool = ThreadPoolExecutor(
                    STORE_THREADS, thread_name_prefix="kvdrop-store"
                )
            return self._store_pool

    def shutdown(self) -> None:
        """Drop both pools; a load or store stuck on a hung server is not waited for."""
        with self._pools_lock:
            pools = [p for p in (self._load_pool, self._store_pool) if p is not None]
            self._load_pool = self._store_pool = None
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- loads
    def start_load(self, req: Request) -> None:
        """Start loading the request's cached prefix on a connector thread (not on the loop)."""
        if not self.io_ok():
            self.recompute(req)
            return
        pool = self._pool("load")
        req.load_state = LoadState.QUEUED
        req.load_deadline = float("inf")
        req.loading = pool.submit(self._load_prefix, req)
        req.loading.add_done_callback(lambda _: self._wake())

    def _load_prefix(self, req: Request) -> PrefixPlan:
        """(connector thread) Ask the server, then copy the prefix into the request's blocks --
        unless the loop gave up on the request meanwhile: then its blocks are not touched.

        Loads run several at once: the host copy out of the server's memory and the copy to the
        device both release the GIL, so one request's host copy overlaps another's transfer."""
        with self.load_lock:
            if req.load_state is not LoadState.QUEUED:
                raise EngineError("the engine gave up on this load before it started")
            req.load_state = LoadState.IO
            req.load_deadline = time.monotonic() + self.load_timeout_s
        self._wake()  # the loop now has a deadline to wait for
        started = time.perf_counter()
        copied = 0.0
        with self._counters():
            if self._loads_running == 0:
                self._busy_since = started
            self._loads_running += 1
        try:
            plan = plan_prefix(
                self.connector, self.capture, req.lookup_tokens, req.cache_salt, req.load_limit
            )
            if self.copy_on_loop:
                return self._staged(plan)
            with self.load_lock:
                if req.load_state is not LoadState.IO:
                    return plan
                req.load_state = LoadState.COPY
            if plan.kv is not None:
                copying = time.perf_counter()
                self.cache.load(req.blocks, plan.kv)
                if plan.kv.is_cuda:  # loaded on the connector's copy stream, read on this one
                    plan.kv.record_stream(torch.cuda.current_stream(plan.kv.device))
                copied = time.perf_counter() - copying
            req.load_state = LoadState.COPIED
            return plan
        finally:
            now = time.perf_counter()
            with self._counters() as st:
                st.prefix_load_seconds += now - started
                st.prefix_copy_seconds += copied
                self._loads_running -= 1
                if self._loads_running == 0:
                    st.prefix_load_busy_seconds += now - self._busy_since

    def _staged(self, plan: PrefixPlan) -> PrefixPlan:
        """(connector thread) ``plan`` with its prefix already on the cache's GPU: copied there
        through page-locked staging on this thread's own stream, complete on return, so the
        loop only scatters it into the blocks (a device-to-device copy of about a millisecond
        instead of the whole host-to-device transfer on the loop thread, between decode steps).
        Another thread's copies on its own stream do not disturb a graph capture of the loop
        (captured with ``capture_error_mode="thread_local"``). Without room on the device the
        host copy is handed on as before."""
        kv = plan.kv
        if kv is None or kv.device.type != "cpu" or self.cache.device.type != "cuda":
            return plan
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.cache.device)
        try:
            with torch.cuda.stream(stream):
                staged = to_device(kv.to(self.cache.dtype), self.cache.device)
            stream.synchronize()
        except torch.OutOfMemoryError:
            return plan
        return dataclasses.replace(plan, kv=staged)

    def _give_up_late(self, req: Request, now: float) -> None:
        """A load not done yet: give it up when it is past its deadline, or still queued while
        the server is left alone (its threads are busy with it); one copying ends soon."""
        with self.load_lock:
            state = req.load_state
            late = state is LoadState.IO and now >= req.load_deadline
            skip = state is LoadState.QUEUED and not self.io_ok()
            if late or skip:
                req.load_state = LoadState.ABANDONED
        if late:
            self.io_failed("load", f"took longer than {self.load_timeout_s:g} s")
        if late or skip:
            req.loading = None
            self.recompute(req)

    def finish_loads(self, loading: list[Request]) -> None:
        """(loop) Apply finished loads; give up on those still waiting for the server past their
        deadline (those requests compute their prompt)."""
        now = time.monotonic()
        for req in loading:
            future = req.loading
            if future is None or req.cancelled:
                continue  # dropped by the scheduler
            if not future.done():
                self._give_up_late(req, now)
                continue
            req.loading = None
            try:
                plan = future.result()
                if req.load_state is not LoadState.COPIED and plan.kv is not None:
                    self.cache.load(req.blocks, plan.kv)  # (CUDA graphs: on the loop thread)
                    if plan.kv.is_cuda:  # staged on a load stream, read on this one
                        plan.kv.record_stream(torch.cuda.current_stream(plan.kv.device))
            except Exception as exc:
                self.io_failed("load failed:", f"{type(exc).__name__}: {exc}", exc)
                self.recompute(req)
                continue
            follow(req, plan)
            with self._counters() as st:
                st.tokens_loaded += plan.num_loaded
                if req.preempted:  # counted as recomputed when preempted: loaded instead
                    st.recomputed_tokens -= plan.num_loaded

    def recompute(self, req: Request) -> None:
        """The request computes its whole prompt (the server could not be asked)."""
        follow(req, plan_recompute(self.connector, self.capture, req.prompt))
        with self._counters() as st:
            st.connector_fallbacks += 1

    # ----------------------------------------------------------------- stores
    def submit(self, req: Request, job: StoreJob | WindowJob | ScoresJob) -> None:
        """(loop) Start ``job`` on the store pool and attach it to ``req`` (its caller waits)."""
        if not self.io_ok():
            with self._counters() as st:
                st.store_failures += 1
            return
        future = self._pool("store").submit(self._run_store, job)
        future.add_done_callback(lambda f: self._stored(job, f))
        req.stores.append(future)

    def _run_store(self, job: StoreJob | WindowJob | ScoresJob) -> Any:
        """(store thread) ``job.run``, its seconds added to its kind's store counter."""
        started = time.perf_counter()
        try:
            return job.run(self.connector)
        finally:
            with self._counters() as st:
                seconds = time.perf_counter() - started
                if isinstance(job, WindowJob):
                    st.window_store_seconds += seconds
                elif isinstance(job, ScoresJob):
                    st.scores_store_seconds += seconds
                else:
                    st.kv_store_seconds += seconds

    def await_stores(self, req: Request) -> None:
        """(caller) Wait for ``req``'s started stores, each up to ``store_timeout_s``; never
        raises (a failed or late store is logged and counted; the request goes on)."""
        while req.stores:
            future = req.stores.pop(0)
            try:
                future.result(timeout=self.store_timeout_s)
            except FutureTimeout:
                self.io_failed("store", f"took longer than {self.store_timeout_s:g} s")
            except CancelledError:
                pass  # the engine stopped
            except Exception as exc:
                if isinstance(exc.__cause__, PartialStoreError):
                    logger.warning("%s", exc)  # the server works; its pool is full of pins
                else:
                    self.io_failed("store failed:", str(exc), exc)

    def _stored(self, job: StoreJob | WindowJob | ScoresJob, future: Future[Any]) -> None:
        failed = future.cancelled() or future.exception() is not None
        with self._counters() as st:
            if failed:
                st.store_failures += 1
            elif isinstance(job, ScoresJob):
                st.scores_bytes_stored += future.result()
            elif isinstance(job, WindowJob):
                rows, nbytes = future.result()
                st.query_rows_stored += rows
                st.query_bytes_stored += nbytes
            else:
                q_stored = future.result()
                st.kv_tokens_stored += job.kv.shape[2]
                st.query_tokens_stored += q_stored
                if q_stored and job.queries is not None:
                    q = job.queries  # [1, L, T, Dq]
                    st.query_bytes_stored += q_stored * q.shape[1] * q.shape[3] * q.element_size()
