"""The reference engine: continuous batching over a block-budgeted paged KV cache.

One loop thread owns the model, the cache and the scheduler; callers on any thread submit a
request with ``post_completion`` and iterate its ``TokenEvent``s from a per-request queue. Each
step runs every admitted request together: decodes bring one token, prefills a chunk of their
prompt. This module holds the lifecycle, the loop, one step and emitting; docs/engine.md maps
the rest (sequence, scheduler, transfer, runner, sampling, connector). A step failure fails only
the requests that caused it (see :meth:`Engine._step`).
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from torch import Tensor, nn

from kvdrop_engine.connectors.base import KVConnector
from kvdrop_engine.errors import EngineError, InvalidRequestError
from kvdrop_engine.graphs import DecodeGraphs
from kvdrop_engine.model import ModelConfig
from kvdrop_engine.paged import to_host
from kvdrop_engine.reconstruct import ReconstructionPrompt, reconstruction_scores
from kvdrop_engine.runner import ModelRunner
from kvdrop_engine.sampling import (
    SamplingParams,
    TokenLogprobs,
    finish_reason,
    pick_tokens,
    sample_row,
    token_logprobs,
)
from kvdrop_engine.scheduler import (
    DEFAULT_BUDGET_TOKENS,
    Scheduler,
    StepPlan,
    budget_blocks,
    plan_step,
)
from kvdrop_engine.sequence import Request, new_request
from kvdrop_engine.stats import EngineStats
from kvdrop_engine.tokenizer import IncrementalDetokenizer, TokenDecoder
from kvdrop_engine.transfer import ScoresJob, Transfers, check_seconds
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.validate import positive_int

__all__ = ["DEFAULT_BUDGET_TOKENS", "Engine", "EngineStats", "StepPlan", "plan_step"]

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


class Engine:
    """Continuous-batching engine over a paged KV cache of ``num_blocks`` blocks.

    ``model`` is a :class:`kvdrop_engine.model.Transformer` (anything with a ``ModelConfig``
    ``.config`` and ``forward(tokens, positions, attn, logits_rows)``). Give the budget as
    ``num_blocks`` or ``kv_budget_tokens`` (whole blocks; default 65536 tokens). ``tokenizer``
    (anything with ``decode``) gives each ``TokenEvent`` its text. On a GPU with Triton, decode
    attention reads the paged cache in place, norms and SwiGLU run fused (``fused_ops``, on a
    model that declares ``FusesOps``) and decode steps replay CUDA graphs (``cuda_graphs``);
    None means "when available". ``load_concurrency``, ``load_timeout_s``, ``store_timeout_s``
    and ``connector_backoff_s`` bound what a slow or dead cache server costs
    (:mod:`kvdrop_engine.transfer`).
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
        connector: KVConnector | None = None,
        cuda_graphs: bool | None = None,
        fused_ops: bool | None = None,
        load_concurrency: int = 4,
        load_timeout_s: float = 10.0,
        store_timeout_s: float = 30.0,
        connector_backoff_s: float = 30.0,
        reconstruction: ReconstructionPrompt | None = None,
    ) -> None:
        cfg: ModelConfig = model.config
        try:
            num_blocks = budget_blocks(num_blocks, kv_budget_tokens, block_size)
            positive_int(max_batch_size, "max_batch_size")
            positive_int(max_prefill_tokens, "max_prefill_tokens")
            positive_int(load_concurrency, "load_concurrency")
            check_seconds(
                load_timeout_s=load_timeout_s,
                store_timeout_s=store_timeout_s,
                connector_backoff_s=connector_backoff_s,
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        self.model, self.config, self.tokenizer = model, cfg, tokenizer
        #: KVzip's reconstruction prompt: a request with ``reconstruct=True`` has its prompt
        #: scored by the pass when it ends, the scores stored beside its query window (the
        #: ``kvzip`` policy reads them; :mod:`kvdrop_engine.reconstruct`).
        self.reconstruction = reconstruction
        self.runner = ModelRunner(
            model,
            cfg,
            num_blocks=num_blocks,
            block_size=block_size,
            max_batch_size=max_batch_size,
            fused_ops=fused_ops,
            cuda_graphs=cuda_graphs,
        )
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.cache = self.runner.cache
        self._graphs = self.runner.graphs
        self.block_size, self.max_batch_size = block_size, max_batch_size
        self.max_prefill_tokens, self.load_concurrency = max_prefill_tokens, load_concurrency
        self.load_timeout_s = float(load_timeout_s)
        self.store_timeout_s = float(store_timeout_s)
        self.connector_backoff_s = float(connector_backoff_s)
        self.eos_token_ids = frozenset(int(t) for t in cfg.eos_token_ids)
        self._stats = EngineStats()
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self.connector = connector
        self._transfers: Transfers | None = None
        if connector is not None:
            connector.bind(cfg, self.dtype, device=self.cache.device)
            self._transfers = Transfers(
                connector,
                self.cache,
                load_concurrency=load_concurrency,
                load_timeout_s=self.load_timeout_s,
                store_timeout_s=self.store_timeout_s,
                backoff_s=self.connector_backoff_s,
                copy_on_loop=self._graphs is not None,
                wake=self._wake,
                stats=lambda: self._stats,
                lock=self._cv,
            )
        load_lock = threading.Lock() if self._transfers is None else self._transfers.load_lock
        self._sched = Scheduler(self.cache.allocator, block_size, max_batch_size, load_lock)
        self._thread: threading.Thread | None = None
        self._stopping = False

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
        if self._transfers is not None:
            self._transfers.shutdown()
        with self._cv:
            pending = self._sched.drain()
        for req in pending:
            self._sched.free(req)
            req.out.put(EngineError("engine stopped before the request finished"))

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def num_blocks(self) -> int:
        """Size of the KV budget in blocks."""
        return self.cache.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not reserved by any running request."""
        return self.cache.allocator.num_free

    def load(self) -> tuple[int, int]:
        """Requests running (admitted: prefilling or decoding) and waiting for admission now."""
        with self._cv:
            return len(self._sched.running), len(self._sched.waiting)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The captured decode steps (None when the engine runs without CUDA graphs)."""
        return self._graphs

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
        return self._sched.blocks_for(num_prompt_tokens, max_tokens)

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
        detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer)
        req = new_request(
            next(self._ids),
            prompt_token_ids,
            sampling_params,
            cache_salt,
            vocab_size=self.config.vocab_size,
            detok=detok,
        )
        self._sched.check_fits(req)
        if req.params.reconstruct and (self.reconstruction is None or self._transfers is None):
            raise InvalidRequestError(
                "reconstruct=true needs an engine built with reconstruction=ReconstructionPrompt"
                "(...) and a connector to store the scores in (kvdrop_engine.reconstruct)"
            )
        self.start()
        with self._cv:
            self._sched.waiting.append(req)
            self._stats.peak_waiting = max(self._stats.peak_waiting, len(self._sched.waiting))
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

    def _events(self, req: Request) -> Iterator[TokenEvent]:
        finished = False
        try:
            while True:
                item = req.out.get()
                if isinstance(item, BaseException):
                    finished = True
                    if isinstance(item, EngineError):
                        raise item
                    raise EngineError(f"request failed: {item!r}") from item
                if self._transfers is not None:
                    self._transfers.await_stores(req)  # started before this token was queued
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                req.cancelled = True
                with self._cv:
                    self._cv.notify_all()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _loop(self) -> None:
        sched, transfers = self._sched, self._transfers
        while True:
            with self._cv:
                io_ok = transfers is None or transfers.io_ok()
                while not self._stopping and not sched.has_work(io_ok):
                    self._cv.wait(sched.wait_s())
                    io_ok = transfers is None or transfers.io_ok()
                if self._stopping:
                    return
                sched.drop_cancelled()
                admitted = sched.admit()
                st = self._stats
                st.requests_admitted += len(admitted)
                st.peak_running = max(st.peak_running, len(sched.running))
                st.peak_blocks_used = max(
                    st.peak_blocks_used, self.num_blocks - self.num_free_blocks
                )
                loading = sched.loading()
            if transfers is not None:
                try:
                    for req in admitted:
                        transfers.start_load(req)
                    transfers.finish_loads(loading)
                except Exception as exc:  # a broken connector: fail its requests, keep looping
                    for req in admitted + loading:
                        if req.loading is None or req.loading.done():
                            self._fail(req, exc)
            with self._cv:
                batch = sched.runnable()
            try:
                if batch:
                    self._step(batch)
            except Exception as exc:  # a bug outside the per-request guards: never stop the loop
                for req in batch:
                    self._fail(req, exc)

    def _step(self, batch: list[Request]) -> None:
        """One forward over ``batch``, then each request's token. A forward that raises is
        retried with each request alone, so its failure reaches only the requests causing it;
        after the forward every failure is one request's own."""
        started = time.perf_counter()
        plan = plan_step(batch, self.max_prefill_tokens)
        try:
            out = self.runner.forward(plan)
            picked = pick_tokens(out.logits, out.greedy)
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0], exc)
            else:
                for req in batch:
                    self._step([req])
            return
        for req, n in plan.stepped:
            try:
                if out.attn is not None and req.rid in out.capture:
                    req.take_queries(out.attn.captured_rows(req.rid), out.capture[req.rid])
            except Exception as exc:
                self._fail(req, exc)
            req.num_computed += n
        with self._cv:  # counted before the tokens go out: a caller that saw one sees them
            st = self._stats
            st.steps += 1
            st.prefill_tokens_computed += plan.num_prefill
            st.decode_tokens_computed += plan.num_decode
            if plan.num_prefill == 0:
                st.decode_only_steps += 1
                st.decode_step_seconds += time.perf_counter() - started - out.capture_seconds
                st.graph_capture_seconds += out.capture_seconds
                st.decode_kv_tokens += sum(s.start + 1 for s in plan.seqs)
        for i, req in enumerate(plan.sampled):
            if not req.cancelled and req.rid in self._sched.running:
                self._next_token(req, out.logits[i], picked[i])

    def _next_token(self, req: Request, row: Tensor, argmax: int | None) -> None:
        """Sample, store and emit one request's token; any failure fails only this request."""
        try:
            if argmax is None:
                raise EngineError(
                    "the model's logits for this request are not finite (NaN or inf: corrupt "
                    "cached KV or weights?); the request is stopped, others go on"
                )
            tok = argmax if req.params.greedy else sample_row(row, req.params, req.generator)
            logprobs = None
            if req.params.logprobs is not None:
                logprobs = token_logprobs(row[None], [tok], [req.params.logprobs])[0]
            if not req.output and req.store_upto and self._transfers is not None:
                self._transfers.submit(req, self._transfers.prompt_job(req))
            self._emit(req, tok, logprobs)
        except Exception as exc:
            self._fail(req, exc)

    def _emit(self, req: Request, tok: int, logprobs: TokenLogprobs | None = None) -> None:
        req.output.append(tok)
        reason = finish_reason(tok, len(req.output), req.params, self.eos_token_ids)
        text = "" if req.detok is None else req.detok.add(tok, final=reason is not None)
        if reason is not None and self._transfers is not None and not req.cancelled:
            for job in self._transfers.finish_jobs(req, self.config.head_dim**-0.5):
                self._transfers.submit(req, job)
            if req.params.reconstruct:
                self._transfers.submit(req, self._reconstruct(req))
        lp, top = (None, ()) if logprobs is None else logprobs
        req.out.put(TokenEvent(tok, text, reason, logprob=lp, top_logprobs=top))
        if reason is not None:
            with self._cv:
                self._sched.finish(req)
                self._stats.requests_finished += 1

    def _reconstruct(self, req: Request) -> ScoresJob:
        """(loop, before the last token) KVzip's reconstruction pass over the request's prompt,
        on its own KV (its blocks are still its own); the scores go to the host here."""
        assert self.reconstruction is not None
        started = time.perf_counter()
        computed = len(req.prompt) + len(req.output) - 1  # the last token was never fed back
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
        return ScoresJob(scores, req.prompt + req.output, req.cache_salt)

    def _fail(self, req: Request, exc: BaseException) -> None:
        with self._cv:
            self._sched.finish(req)
        req.out.put(
            exc if isinstance(exc, EngineError) else EngineError(f"engine step failed: {exc!r}")
        )
