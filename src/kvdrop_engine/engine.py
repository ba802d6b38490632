"""The reference engine: continuous batching over a block-budgeted paged KV cache.

One loop thread owns the model, the cache and the scheduler. Callers on any thread submit a
request with ``post_completion`` and iterate its ``TokenEvent``s from a per-request queue. Each
engine step runs every admitted request together: decoding requests bring one token, prefilling
requests bring a chunk of their prompt (at most ``max_prefill_tokens`` prompt tokens per step).

Admission reserves blocks for the whole request (prompt + ``max_tokens``) up front, so a running
request never waits for memory and nothing is ever preempted; a request that waits for blocks keeps
its place in line (FIFO, no starvation). Finished requests free their blocks in the step they end.

With a connector (:class:`kvdrop_engine.connector.ServerConnector`) the engine loads the longest
cached prefix of each prompt from the kvdrop server on admission and computes only the rest; when a
prompt's prefill ends it stores the prompt's whole chunks of KV (and, in the full query mode,
post-RoPE queries). The store is started before the first token is handed over and waited for up
to ``store_timeout_s``, so with a healthy server a caller that has seen a token can rely on the
prompt being in the server. With queries on, each request also keeps its query window
(:class:`~kvdrop_engine.capture.WindowCapture`: the last ``W`` computed positions, generated
tokens included, and a strided sample), stored the same way when the request ends, before its
last token is handed over.

Server I/O never runs on the loop thread: up to ``load_concurrency`` loads run on a connector pool
(each also copies its prefix into the request's blocks) while the loop keeps stepping the other
requests; a load still waiting for the server after ``load_timeout_s`` is abandoned and the prompt
is computed instead, as is one that fails. A failed or late store is logged and counted, and the
request goes on. After a failure or a timeout the engine leaves the server alone for
``connector_backoff_s`` seconds (loads recompute at once, stores are skipped), so a hung or dead
server costs the first request one timeout, not every request. ``EngineStats.connector_fallbacks``
and ``store_failures`` count what happened.

The pieces, each small: :func:`plan_step` assembles one step's batch; :mod:`~kvdrop_engine.sampling`
picks tokens; :mod:`~kvdrop_engine.connector` plans and runs the server I/O; the request's own
:class:`~kvdrop_engine.tokenizer.IncrementalDetokenizer` makes its text. :class:`Engine` admits,
schedules and hands out events.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from kvdrop_engine import kernels
from kvdrop_engine.capture import WindowCapture, log_normalisers
from kvdrop_engine.connector import (
    DEFAULT_QUERY_STRIDE,
    DEFAULT_QUERY_WINDOW,
    EngineConnector,
    PrefixPlan,
    StoreJob,
    WindowJob,
    plan_prefix,
    plan_recompute,
)
from kvdrop_engine.errors import EngineError, InvalidRequestError, RequestTooLargeError
from kvdrop_engine.graphs import DecodeGraphs
from kvdrop_engine.paged import (
    PagedAttention,
    PagedKVCache,
    SeqStep,
    blocks_needed,
    to_host,
    use_kernel,
)
from kvdrop_engine.reconstruct import ReconstructionPrompt, ScoresJob, reconstruction_scores
from kvdrop_engine.sampling import SamplingParams, finish_reason, make_generator, sample
from kvdrop_engine.tokenizer import IncrementalDetokenizer, TokenDecoder
from kvdrop_sdk.errors import PartialStoreError
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.validate import positive_int, token_ids

__all__ = ["DEFAULT_BUDGET_TOKENS", "Engine", "EngineStats", "StepPlan", "plan_step"]

DEFAULT_BUDGET_TOKENS = 65536
#: Threads that run stores (each caller waits for its own, up to ``store_timeout_s``).
_STORE_THREADS = 4

logger = logging.getLogger(__name__)

#: Engines whose loop thread runs; stopped at interpreter exit (see ``_stop_running_engines``).
_RUNNING: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _stop_running_engines() -> None:
    """Stop engines the program never stopped, before the interpreter tears down.

    A loop thread still alive at exit is a daemon thread frozen mid-call while torch and Python
    shut down underneath it, which aborted the process (exit 134) in about half of the runs.
    atexit handlers run before that, so every engine ends here as if ``stop()`` had been called.
    """
    for engine in list(_RUNNING):
        engine.stop()


@dataclass
class EngineStats:
    """Counters since construction (or ``reset_stats``); they show what the KV budget allowed."""

    requests_admitted: int = 0
    requests_finished: int = 0
    steps: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    tokens_loaded: int = 0
    kv_tokens_stored: int = 0
    query_tokens_stored: int = 0
    query_rows_stored: int = 0
    query_bytes_stored: int = 0
    peak_running: int = 0
    peak_blocks_used: int = 0
    peak_waiting: int = 0
    #: Steps that only decoded (no prompt chunk), their wall time on the loop thread (plan, launch,
    #: wait for the tokens, hand them out; capturing a new CUDA graph is counted apart, in
    #: ``graph_capture_seconds``) and the cached tokens their attention read.
    #: ``prefix_load_seconds``: time spent loading cached prefixes (asking the server and copying
    #: into the blocks), summed over requests; it runs on connector threads, not the loop.
    #: KVzip's reconstruction pass (``reconstruction`` set): prompts scored, their tokens, the
    #: pass's wall time on the loop thread and the score bytes stored.
    reconstructions: int = 0
    reconstruction_tokens: int = 0
    reconstruction_seconds: float = 0.0
    scores_bytes_stored: int = 0
    decode_only_steps: int = 0
    decode_step_seconds: float = 0.0
    decode_kv_tokens: int = 0
    graph_capture_seconds: float = 0.0
    prefix_load_seconds: float = 0.0
    connector_fallbacks: int = 0  # loads that failed, timed out or were skipped: recomputed
    store_failures: int = 0  # stores that failed, timed out or were skipped

    @property
    def tokens_computed(self) -> int:
        """Tokens the model ran (prefill + decode), i.e. not loaded from the server."""
        return self.prefill_tokens_computed + self.decode_tokens_computed

    def to_dict(self) -> dict[str, float]:
        """Plain dict (JSON-serialisable), including ``tokens_computed``."""
        return {**asdict(self), "tokens_computed": self.tokens_computed}


@dataclass
class _Request:
    """One request's state, owned by the loop thread once admitted."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    cache_salt: str
    out: queue.Queue[Any]
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the blocks
    output: list[int] = field(default_factory=list)
    capture_queries: bool = False
    query_offset: int = 0  # captured queries start here; the server holds the ones before
    store_upto: int = 0  # whole-chunk prompt tokens to store after prefill (0 = none)
    query_parts: list[Tensor] = field(default_factory=list)
    window: WindowCapture | None = None
    cancelled: bool = False
    loading: Future[PrefixPlan] | None = None  # the prefix load in flight (not stepped yet)
    load_deadline: float = float("inf")  # set when the load starts (not while it is queued)
    #: "queued" (waiting for a connector thread), "io" (asking the server), "copy" (into the
    #: blocks), "copied", or "abandoned" (the loop gave up on it)
    load_state: str = "queued"

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    def follow(self, plan: PrefixPlan, conn: EngineConnector | None = None) -> None:
        """Take admission's decision: ``plan.num_loaded`` tokens are in the blocks already."""
        self.num_computed = plan.num_loaded
        self.store_upto = plan.store_upto
        self.capture_queries = plan.capture_queries
        self.query_offset = plan.query_offset
        if plan.capture_window and conn is not None:
            window = getattr(conn, "query_window", DEFAULT_QUERY_WINDOW)
            stride = getattr(conn, "query_stride", DEFAULT_QUERY_STRIDE)
            self.window = WindowCapture(len(self.prompt), window, stride)

    def capture_offsets(self, n: int) -> list[int] | None:
        """Offsets of the next ``n`` computed tokens whose queries this step must capture."""
        if self.prefilling and self.capture_queries and self.num_computed < self.store_upto:
            return list(range(n))  # full mode: every prompt row up to store_upto
        if self.window is not None:
            return self.window.wanted(self.num_computed, n) or None
        return None

    def take_queries(self, rows: Tensor, offsets: list[int]) -> None:
        """Hand this step's captured rows ``[L, r, Hq, d]`` (at ``offsets``) to the chunk store
        (full mode) and the query window."""
        start = self.num_computed
        if self.prefilling and self.capture_queries and start < self.store_upto:
            keep = max(0, min(len(offsets), self.store_upto - start))
            if keep:
                q = rows[:, :keep]
                self.query_parts.append(q.reshape(q.shape[0], keep, -1).cpu())
        if self.window is not None:
            wanted = self.window.wanted(start, max(offsets) + 1)
            if wanted:
                at = {off: i for i, off in enumerate(offsets)}
                pick = [at[off] for off in wanted]
                sel = rows if len(pick) == len(offsets) else rows[:, pick]
                self.window.add([start + off for off in wanted], sel)


@dataclass
class StepPlan:
    """One engine step: the flat token batch, its attention layout, and which rows are sampled.

    ``stepped`` pairs each request with the tokens it computes in this step; ``sampled`` lists the
    requests whose next token comes from ``sample_rows`` (in order).
    """

    seqs: list[SeqStep] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sampled: list[_Request] = field(default_factory=list)
    stepped: list[tuple[_Request, int]] = field(default_factory=list)
    num_prefill: int = 0
    num_decode: int = 0


def plan_step(batch: Sequence[_Request], max_prefill_tokens: int) -> StepPlan:
    """Decodes first (one token each, so they never wait behind prefill chunks), then prompt
    chunks in batch order until ``max_prefill_tokens`` prompt tokens are planned."""
    plan = StepPlan()
    for req in batch:
        if req.prefilling:
            continue
        plan.seqs.append(SeqStep(req.rid, req.blocks, req.num_computed, 1))
        plan.tokens.append(req.output[-1])
        plan.positions.append(req.num_computed)
        plan.sample_rows.append(len(plan.tokens) - 1)
        plan.sampled.append(req)
        plan.stepped.append((req, 1))
        plan.num_decode += 1
    budget = max_prefill_tokens
    for req in batch:
        if not req.prefilling or budget <= 0:
            continue
        start = req.num_computed
        n = min(len(req.prompt) - start, budget)
        budget -= n
        plan.seqs.append(SeqStep(req.rid, req.blocks, start, n))
        plan.tokens.extend(req.prompt[start : start + n])
        plan.positions.extend(range(start, start + n))
        if start + n == len(req.prompt):
            plan.sample_rows.append(len(plan.tokens) - 1)
            plan.sampled.append(req)
        plan.stepped.append((req, n))
        plan.num_prefill += n
    return plan


class Engine:
    """Continuous-batching engine over a paged KV cache of ``num_blocks`` blocks.

    ``model`` is a :class:`kvdrop_engine.model.Transformer` (anything with ``.config`` holding
    ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``eos_token_ids`` and a
    ``forward(tokens, positions, attn, logits_rows)``). Give the budget as ``num_blocks`` or
    ``kv_budget_tokens`` (rounded down to whole blocks); default 65536 tokens. ``tokenizer``
    (anything with ``decode``) gives each ``TokenEvent`` its text.

    On a GPU (with Triton, ``pip install 'kvdrop[gpu]'``) decode attention reads the paged cache
    in place, the model's norms and SwiGLU run fused (``fused_ops``; this sets
    ``model.use_ops``), and decode-only steps replay CUDA graphs (``cuda_graphs``); None means
    "when available". Elsewhere the engine runs plain PyTorch. Up to ``load_concurrency``
    admitted requests load their cached prefixes from the connector at once.
    ``load_timeout_s``, ``store_timeout_s`` and ``connector_backoff_s`` bound what a slow or dead
    cache server can cost (see the module docstring).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tokenizer: TokenDecoder | None = None,
        num_blocks: int | None = None,
        kv_budget_tokens: int | None = None,
        block_size: int = 16,
        max_batch_size: int = 256,
        max_prefill_tokens: int = 2048,
        connector: EngineConnector | None = None,
        cuda_graphs: bool | None = None,
        fused_ops: bool | None = None,
        load_concurrency: int = 4,
        load_timeout_s: float = 10.0,
        store_timeout_s: float = 30.0,
        connector_backoff_s: float = 30.0,
        reconstruction: ReconstructionPrompt | None = None,
    ) -> None:
        cfg = model.config
        try:
            if num_blocks is not None and kv_budget_tokens is not None:
                raise ValueError("give num_blocks or kv_budget_tokens, not both")
            positive_int(block_size, "block_size")
            if num_blocks is None:
                budget = DEFAULT_BUDGET_TOKENS if kv_budget_tokens is None else kv_budget_tokens
                positive_int(budget, "kv_budget_tokens (one block at least)", minimum=block_size)
                num_blocks = budget // block_size
            positive_int(num_blocks, "num_blocks")
            positive_int(max_batch_size, "max_batch_size")
            positive_int(max_prefill_tokens, "max_prefill_tokens")
            positive_int(load_concurrency, "load_concurrency")
            for name, value in (
                ("load_timeout_s", load_timeout_s),
                ("store_timeout_s", store_timeout_s),
                ("connector_backoff_s", connector_backoff_s),
            ):
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.dtype = param.dtype if param is not None else torch.float32
        self.model = model
        self.config = cfg
        self.tokenizer = tokenizer
        #: KVzip's reconstruction prompt: a request with ``reconstruct=True`` has its prompt
        #: scored by the pass when it ends, the scores stored beside its query window (the
        #: ``kvzip`` policy reads them).
        self.reconstruction = reconstruction
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.load_concurrency = load_concurrency
        self.load_timeout_s = float(load_timeout_s)
        self.store_timeout_s = float(store_timeout_s)
        self.connector_backoff_s = float(connector_backoff_s)
        self._load_pool: ThreadPoolExecutor | None = None
        self._store_pool: ThreadPoolExecutor | None = None
        self._load_lock = threading.Lock()  # guards _Request.load_state
        self._io_down_until = 0.0
        self.cache = PagedKVCache(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
        )
        gpu = self.device.type == "cuda" and kernels.available(self.device)
        can_fuse = hasattr(model, "use_ops")
        if fused_ops or (fused_ops is None and gpu and can_fuse):
            if not (kernels.available(self.device) and can_fuse):
                raise InvalidRequestError(
                    "fused_ops=True needs a CUDA model with use_ops (a Transformer) and Triton"
                )
            model.use_ops(kernels)
        elif fused_ops is False and hasattr(model, "use_ops"):
            model.use_ops(None)
        self._graphs: DecodeGraphs | None = None
        dynamic_rope = bool(getattr(getattr(cfg, "rope", None), "dynamic", False))
        if cuda_graphs or (cuda_graphs is None and gpu and not dynamic_rope):
            if not (use_kernel(self.cache) and self.device.type == "cuda") or dynamic_rope:
                raise InvalidRequestError(
                    "cuda_graphs=True needs a CUDA model, Triton, power-of-two head and block "
                    "sizes and a RoPE that does not depend on the sequence length"
                )
            self._graphs = DecodeGraphs(model, self.cache, max_batch_size)
        self.eos_token_ids = frozenset(int(t) for t in (getattr(cfg, "eos_token_ids", ()) or ()))
        self.connector = connector
        if connector is not None:
            connector.bind(cfg, self.dtype)
        self._stats = EngineStats()
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> Engine:
        """Start the loop thread (idempotent)."""
        with self._cv:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="kvdrop-engine", daemon=True)
            self._thread.start()
            _RUNNING.add(self)
        return self

    def stop(self) -> None:
        """Stop the loop; requests still waiting or running fail with ``EngineError``.

        Idempotent. An engine never stopped is stopped at interpreter exit.
        """
        _RUNNING.discard(self)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cv:
            pools = [p for p in (self._load_pool, self._store_pool) if p is not None]
            self._load_pool = self._store_pool = None
        for pool in pools:  # a load or store stuck on a hung server is not waited for
            pool.shutdown(wait=False, cancel_futures=True)
        with self._cv:
            pending = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
        for req in pending:
            self._free(req)
            req.out.put(EngineError("engine stopped before the request finished"))

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- public API
    @property
    def num_blocks(self) -> int:
        """Size of the KV budget in blocks."""
        return self.cache.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not reserved by any running request."""
        return self.cache.allocator.num_free

    def stats(self) -> EngineStats:
        """A snapshot of the counters."""
        with self._cv:
            return EngineStats(**asdict(self._stats))

    def reset_stats(self) -> None:
        """Zero the counters (e.g. between the phases of a benchmark)."""
        with self._cv:
            self._stats = EngineStats()

    def blocks_for(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Blocks a request reserves: room for the prompt and every generated token but the last."""
        return blocks_needed(num_prompt_tokens + max_tokens - 1, self.block_size)

    def post_completion(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        cache_salt: str = "",
    ) -> Iterator[TokenEvent]:
        """Submit a request; iterate the returned generator for its tokens as they are produced.

        Validation happens here (raising ``InvalidRequestError`` / ``RequestTooLargeError``);
        failures while serving raise ``EngineError`` from the iterator. Closing the iterator early
        cancels the request and frees its blocks. Starts the engine if needed.
        """
        params = SamplingParams.from_dict(sampling_params)
        if params.reconstruct and (self.reconstruction is None or self.connector is None):
            raise InvalidRequestError(
                "reconstruct=true needs an engine built with reconstruction=ReconstructionPrompt"
                "(...) and a connector to store the scores in (kvdrop_engine.reconstruct)"
            )
        prompt = self._check_prompt(prompt_token_ids)
        if not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        need = self.blocks_for(len(prompt), params.max_tokens)
        if need > self.cache.num_blocks:
            raise RequestTooLargeError(
                f"request needs {len(prompt)} prompt + {params.max_tokens} max_tokens = "
                f"{need} blocks of {self.block_size} tokens, but the engine's KV budget is "
                f"{self.cache.num_blocks} blocks ({self.cache.capacity_tokens} tokens); "
                "shorten the prompt, lower max_tokens, or give the engine a larger budget"
            )
        req = _Request(
            rid=next(self._ids),
            prompt=prompt,
            params=params,
            cache_salt=cache_salt,
            out=queue.Queue(),
            generator=make_generator(params),
            detok=None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer),
        )
        self.start()
        with self._cv:
            self._waiting.append(req)
            self._stats.peak_waiting = max(self._stats.peak_waiting, len(self._waiting))
            self._cv.notify_all()
        return self._events(req)

    __call__ = post_completion

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        cache_salt: str = "",
    ) -> list[int]:
        """Convenience: run one request to the end and return its generated token ids."""
        return [
            e.token_id for e in self.post_completion(prompt_token_ids, sampling_params, cache_salt)
        ]

    def _check_prompt(self, tokens: Sequence[int]) -> list[int]:
        try:
            prompt = token_ids(
                tokens, "prompt_token_ids", vocab_size=getattr(self.config, "vocab_size", None)
            )
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(str(exc)) from None
        if not prompt:
            raise InvalidRequestError("prompt_token_ids is empty; expected at least one token")
        return prompt

    # ----------------------------------------------------------------- caller side
    def _events(self, req: _Request) -> Iterator[TokenEvent]:
        finished = False
        try:
            while True:
                item = req.out.get()
                if isinstance(item, BaseException):
                    finished = True
                    if isinstance(item, EngineError):
                        raise item
                    raise EngineError(f"request failed: {item!r}") from item
                if isinstance(item, (StoreJob, WindowJob, ScoresJob)):
                    self._store(item)
                    continue
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                req.cancelled = True
                with self._cv:
                    self._cv.notify_all()

    # ----------------------------------------------------------------- loop side
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._has_work_locked():
                    self._cv.wait(self._wait_s_locked())
                if self._stopping:
                    return
                self._drop_cancelled_locked()
                admitted = self._admit_locked()
            for req in admitted:
                self._start_load(req)
            self._finish_loads()
            with self._cv:
                batch = [r for r in self._running.values() if not r.cancelled and r.loading is None]
            if batch:
                try:
                    self._step(batch)
                except Exception as exc:
                    for req in batch:
                        self._fail(req, exc)

    def _has_work_locked(self) -> bool:
        """Something to step, admit or drop, or a load to finish (not just loads in flight)."""
        now = time.monotonic()
        for req in self._running.values():
            if req.loading is None or req.loading.done():
                return True
            if req.load_state == "queued" and (req.cancelled or not self._io_ok()):
                return True
            if req.load_state == "io" and (req.cancelled or now >= req.load_deadline):
                return True
        if self._waiting and len(self._running) < self.max_batch_size:
            head = self._waiting[0]
            need = self.blocks_for(len(head.prompt), head.params.max_tokens)
            return head.cancelled or need <= self.cache.allocator.num_free
        return False

    def _wait_s_locked(self) -> float | None:
        """How long the loop may sleep: until the first load deadline (loads notify when done)."""
        deadlines = [
            r.load_deadline
            for r in self._running.values()
            if r.loading is not None and r.load_state == "io" and r.load_deadline < float("inf")
        ]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _drop_cancelled_locked(self) -> None:
        for rid in [rid for rid, r in self._running.items() if r.cancelled]:
            req = self._running[rid]
            if req.loading is not None and not req.loading.done():
                with self._load_lock:
                    if req.load_state in ("copy", "copied"):
                        continue  # its prefix is being copied into its blocks: free them after
                    req.load_state = "abandoned"
            self._free(self._running.pop(rid))
        if any(r.cancelled for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.cancelled)

    def _admit_locked(self) -> list[_Request]:
        admitted = []
        alloc = self.cache.allocator
        while self._waiting and len(self._running) < self.max_batch_size:
            req = self._waiting[0]
            need = self.blocks_for(len(req.prompt), req.params.max_tokens)
            if need > alloc.num_free:
                break  # FIFO: the head waits for blocks; later requests do not overtake it
            self._waiting.popleft()
            req.blocks = alloc.allocate(need)
            self._running[req.rid] = req
            admitted.append(req)
        st = self._stats
        st.requests_admitted += len(admitted)
        st.peak_running = max(st.peak_running, len(self._running))
        st.peak_blocks_used = max(st.peak_blocks_used, self.cache.num_blocks - alloc.num_free)
        return admitted

    # ----------------------------------------------------------------- server I/O
    def _io_ok(self) -> bool:
        return time.monotonic() >= self._io_down_until

    def _io_failed(self, what: str, reason: str) -> None:
        """Log one line and leave the server alone for ``connector_backoff_s``."""
        self._io_down_until = time.monotonic() + self.connector_backoff_s
        logger.warning(
            "kvdrop server %s %s; computing without it for %g s",
            what,
            reason,
            self.connector_backoff_s,
        )

    def _wake(self, _: object = None) -> None:
        with self._cv:
            self._cv.notify_all()

    def _start_load(self, req: _Request) -> None:
        """Start loading the request's cached prefix on a connector thread (not on the loop)."""
        if self.connector is None:
            return
        if not self._io_ok():
            self._recompute(req)
            return
        with self._cv:
            if self._load_pool is None:
                self._load_pool = ThreadPoolExecutor(
                    self.load_concurrency, thread_name_prefix="kvdrop-load"
                )
            pool = self._load_pool
        req.load_state = "queued"
        req.load_deadline = float("inf")
        req.loading = pool.submit(self._load_prefix, req)
        req.loading.add_done_callback(self._wake)

    def _load_prefix(self, req: _Request) -> PrefixPlan:
        """(connector thread) Ask the server, then copy the prefix into the request's blocks --
        unless the loop gave up on the request meanwhile: then its blocks are not touched.

        Loads run several at once: the host copy out of the server's memory and the copy to the
        device both release the GIL, so one request's host copy overlaps another's transfer. With
        CUDA graphs the copy into the blocks is left to the loop thread: a graph may be captured
        in any step, and another thread's device calls during a capture would break it."""
        assert self.connector is not None
        with self._load_lock:
            if req.load_state != "queued":
                raise EngineError("the engine gave up on this load before it started")
            req.load_state = "io"
            req.load_deadline = time.monotonic() + self.load_timeout_s
        self._wake()  # the loop now has a deadline to wait for
        started = time.perf_counter()
        try:
            plan = plan_prefix(self.connector, req.prompt, req.cache_salt)
            if self._graphs is not None:
                return plan
            with self._load_lock:
                if req.load_state != "io":
                    return plan
                req.load_state = "copy"
            if plan.kv is not None:
                self.cache.load(req.blocks, plan.kv)
            req.load_state = "copied"
            return plan
        finally:
            with self._cv:
                self._stats.prefix_load_seconds += time.perf_counter() - started

    def _finish_loads(self) -> None:
        """Apply finished loads; give up on those still waiting for the server past their
        deadline (those requests compute their prompt)."""
        with self._cv:
            loading = [r for r in self._running.values() if r.loading is not None]
        now = time.monotonic()
        for req in loading:
            future = req.loading
            assert future is not None
            if req.cancelled:
                continue  # dropped by _drop_cancelled_locked
            if not future.done():
                # Late: still asking the server past its deadline. Queued loads are given up
                # while the engine leaves the server alone (their threads are busy with it).
                # A load that is copying into the blocks is local and ends soon.
                with self._load_lock:
                    state = req.load_state
                    late = state == "io" and now >= req.load_deadline
                    skip = state == "queued" and not self._io_ok()
                    if late or skip:
                        req.load_state = "abandoned"
                if late:
                    self._io_failed("load", f"took longer than {self.load_timeout_s:g} s")
                if late or skip:
                    req.loading = None
                    self._recompute(req)
                continue
            req.loading = None
            try:
                plan = future.result()
                if req.load_state != "copied" and plan.kv is not None:
                    self.cache.load(req.blocks, plan.kv)  # (CUDA graphs: on the loop thread)
            except Exception as exc:
                self._io_failed("load failed:", f"{type(exc).__name__}: {exc}")
                self._recompute(req)
                continue
            req.follow(plan, self.connector)
            with self._cv:
                self._stats.tokens_loaded += plan.num_loaded

    def _recompute(self, req: _Request) -> None:
        assert self.connector is not None
        req.follow(plan_recompute(self.connector, req.prompt), self.connector)
        with self._cv:
            self._stats.connector_fallbacks += 1

    def _store(self, job: StoreJob | WindowJob | ScoresJob) -> None:
        """Run a prompt's store or a finished request's window store (caller's thread) for up to
        ``store_timeout_s``; never raises."""
        assert self.connector is not None
        if not self._io_ok():
            with self._cv:
                self._stats.store_failures += 1
            return
        with self._cv:
            if self._store_pool is None:
                self._store_pool = ThreadPoolExecutor(
                    _STORE_THREADS, thread_name_prefix="kvdrop-store"
                )
            pool = self._store_pool
        future = pool.submit(job.run, self.connector)
        future.add_done_callback(lambda f: self._stored(job, f))
        try:
            future.result(timeout=self.store_timeout_s)
        except FutureTimeout:
            self._io_failed("store", f"took longer than {self.store_timeout_s:g} s")
        except Exception as exc:
            if isinstance(exc.__cause__, PartialStoreError):
                logger.warning("%s", exc)  # the server works; its pool is full of pins
            else:
                self._io_failed("store failed:", str(exc))

    def _stored(self, job: StoreJob | WindowJob | ScoresJob, future: Future[Any]) -> None:
        with self._cv:
            if future.cancelled() or future.exception() is not None:
                self._stats.store_failures += 1
                return
            if isinstance(job, ScoresJob):
                self._stats.scores_bytes_stored += future.result()
                return
            if isinstance(job, WindowJob):
                rows, nbytes = future.result()
                self._stats.query_rows_stored += rows
                self._stats.query_bytes_stored += nbytes
                return
            q_stored = future.result()
            self._stats.kv_tokens_stored += job.kv.shape[2]
            self._stats.query_tokens_stored += q_stored
            if q_stored and job.queries is not None:
                q = job.queries  # [1, L, T, Dq]
                self._stats.query_bytes_stored += (
                    q_stored * q.shape[1] * q.shape[3] * q.element_size()
                )

    def _step(self, batch: list[_Request]) -> None:
        started = time.perf_counter()
        plan = plan_step(batch, self.max_prefill_tokens)
        decode_only = plan.num_prefill == 0
        greedy = None
        capture: dict[int, list[int]] = {}
        capture_s = 0.0
        if decode_only and self._graphs is not None:
            # One graph replay; the only host sync is reading the chosen tokens (in sample).
            # Replayed decode steps capture no queries: a window then ends with the prompt.
            before = self._graphs.capture_seconds
            logits, greedy = self._graphs.run(plan.seqs, plan.tokens)
            capture_s = self._graphs.capture_seconds - before
        else:
            for req, n in plan.stepped:
                offsets = req.capture_offsets(n)
                if offsets:
                    capture[req.rid] = offsets
            attn = PagedAttention(self.cache, plan.seqs, capture_rows=capture)
            dev = self.device
            with torch.inference_mode():
                logits = self.model(
                    torch.tensor(plan.tokens, dtype=torch.long, device=dev),
                    torch.tensor(plan.positions, dtype=torch.long, device=dev),
                    attn,
                    logits_rows=torch.tensor(plan.sample_rows, dtype=torch.long, device=dev),
                )
        for req, n in plan.stepped:
            if req.rid in capture:
                req.take_queries(attn.captured_rows(req.rid), capture[req.rid])
            req.num_computed += n
        with self._cv:
            self._stats.steps += 1
            self._stats.prefill_tokens_computed += plan.num_prefill
            self._stats.decode_tokens_computed += plan.num_decode
        reqs = plan.sampled
        next_ids = sample(
            logits, [r.params for r in reqs], [r.generator for r in reqs], greedy=greedy
        )
        for req, tok in zip(reqs, next_ids, strict=True):
            if req.cancelled:
                continue
            if not req.output and req.store_upto:
                req.out.put(self._store_job(req))
            self._emit(req, tok)
        if decode_only:
            with self._cv:
                st = self._stats
                st.decode_only_steps += 1
                st.decode_step_seconds += time.perf_counter() - started - capture_s
                st.graph_capture_seconds += capture_s
                st.decode_kv_tokens += sum(s.start + 1 for s in plan.seqs)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The captured decode steps (None when the engine runs without CUDA graphs)."""
        return self._graphs

    def _store_job(self, req: _Request) -> StoreJob:
        kv = self.cache.read_cpu(req.blocks, req.store_upto)
        queries = None
        if req.capture_queries and req.query_parts:
            queries = torch.cat(req.query_parts, dim=1).unsqueeze(0)
        req.query_parts = []
        return StoreJob(kv, queries, req.prompt[: req.store_upto], req.cache_salt, req.query_offset)

    def _emit(self, req: _Request, tok: int) -> None:
        req.output.append(tok)
        reason = finish_reason(tok, len(req.output), req.params, self.eos_token_ids)
        text = "" if req.detok is None else req.detok.add(tok, final=reason is not None)
        if reason is not None:
            self._finish_jobs(req)
        req.out.put(TokenEvent(token_id=tok, text=text, finish_reason=reason))
        if reason is not None:
            with self._cv:
                self._running.pop(req.rid, None)
                self._stats.requests_finished += 1
            self._free(req)

    def _finish_jobs(self, req: _Request) -> None:
        """Queue what a finished request leaves in the server (run by the caller before the last
        token): the KV of whole chunks its generated tokens completed (``store_decoded``) and its
        query window, keyed by prompt + every generated token."""
        conn = self.connector
        if conn is None or req.cancelled:
            return
        sequence = req.prompt + req.output
        computed = len(sequence) - 1  # the last generated token was never fed back
        if getattr(conn, "store_decoded", False) and conn.chunk_size:
            aligned = computed // conn.chunk_size * conn.chunk_size
            if aligned > max(req.store_upto, len(req.prompt) // conn.chunk_size * conn.chunk_size):
                kv = self.cache.read_cpu(req.blocks, aligned)
                req.out.put(StoreJob(kv, None, sequence[:aligned], req.cache_salt))
        rows = None if req.window is None else req.window.rows()
        req.window = None
        if rows is not None:
            positions, queries = rows
            # Log-normalisers from the request's own keys, while its blocks are still its own.
            with torch.inference_mode():
                lse = log_normalisers(
                    queries,
                    positions,
                    lambda layer: self.cache.keys(req.blocks, layer, computed),
                    self.config.head_dim**-0.5,
                )
            # Copied to the host here (through page-locked memory): the store runs on another
            # thread, and device calls there could meet a CUDA graph capture of the loop thread.
            job = WindowJob(
                to_host(positions), to_host(queries), to_host(lse), sequence, req.cache_salt
            )
            req.out.put(job)
        if req.params.reconstruct:
            req.out.put(self._reconstruct(req, sequence, computed))

    def _reconstruct(self, req: _Request, sequence: list[int], computed: int) -> ScoresJob:
        """KVzip's reconstruction pass over the request's prompt, on its own KV (blocks still
        its own); the scores go to the host here, like the window."""
        assert self.reconstruction is not None
        started = time.perf_counter()
        scores = reconstruction_scores(
            self.model,
            req.prompt,
            computed,
            lambda layer: self.cache.keys(req.blocks, layer, computed),
            lambda layer: self.cache.values(req.blocks, layer, computed),
            self.reconstruction,
        )
        scores = to_host(scores)
        with self._cv:
            self._stats.reconstructions += 1
            self._stats.reconstruction_tokens += len(req.prompt)
            self._stats.reconstruction_seconds += time.perf_counter() - started
        return ScoresJob(scores, sequence, req.cache_salt)

    def _free(self, req: _Request) -> None:
        if req.blocks:
            self.cache.allocator.free(req.blocks)
            req.blocks = []

    def _fail(self, req: _Request, exc: BaseException) -> None:
        with self._cv:
            self._running.pop(req.rid, None)
        self._free(req)
        req.out.put(
            exc if isinstance(exc, EngineError) else EngineError(f"engine step failed: {exc!r}")
        )
