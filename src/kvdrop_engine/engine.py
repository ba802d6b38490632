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
import functools
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn

from kvdrop_engine.connectors.base import KVConnector
from kvdrop_engine.decode_cut import DecodeCompressor, KVSwap
from kvdrop_engine.draw import draw_tokens
from kvdrop_engine.drop import PendingCut, PromptDropper
from kvdrop_engine.errors import EngineError, InvalidRequestError
from kvdrop_engine.graphs import DecodeGraphs
from kvdrop_engine.model import ModelConfig
from kvdrop_engine.penalties import edit_logits
from kvdrop_engine.plan import RequestPlan, Shipped, plan_request, store_capture
from kvdrop_engine.reconstruct import ReconstructionPrompt
from kvdrop_engine.request_options import RequestOptions, submission
from kvdrop_engine.runner import Forward, ModelRunner, WindowRecord
from kvdrop_engine.sampling import (
    SamplingParams,
    TokenLogprobs,
    pick_tokens,
    reduce_rows,
)
from kvdrop_engine.scheduler import (
    DEFAULT_BUDGET_TOKENS,
    Scheduler,
    StepPlan,
    budget_blocks,
    plan_step,
)
from kvdrop_engine.sequence import Request, ScoreHandle, TokenStream, new_request, scored_rows
from kvdrop_engine.stats import EngineStats
from kvdrop_engine.structured import Grammars, accept, guide_of, mask_logits
from kvdrop_engine.tokenizer import IncrementalDetokenizer, TokenDecoder
from kvdrop_engine.transfer import ScoresJob, Transfers, check_seconds
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.validate import positive_int
from kvdrop_sdk.validate import token_ids as checked_ids

__all__ = ["DEFAULT_BUDGET_TOKENS", "Engine", "EngineStats", "StepPlan", "plan_step"]

#: A scoring request's sampling: one greedy token (never handed out).
SCORING = SamplingParams(max_tokens=1, temperature=0.0)

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
    None means "when available". The graphs of the batch sizes ``graph_batch_sizes`` (None: every
    bucket up to ``max_batch_size``; ``()``: none) are captured here, so no step captures one.
    ``load_concurrency``, ``load_timeout_s``, ``store_timeout_s``
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
        max_client_prefill_tokens: int | None = None,
        connector: KVConnector | None = None,
        cuda_graphs: bool | None = None,
        graph_batch_sizes: Sequence[int] | None = None,
        fused_ops: bool | None = None,
        load_concurrency: int = 4,
        load_timeout_s: float = 10.0,
        store_timeout_s: float = 30.0,
        connector_backoff_s: float = 30.0,
        reconstruction: ReconstructionPrompt | None = None,
        dropper: PromptDropper | None = None,
        compressor: DecodeCompressor | None = None,
    ) -> None:
        cfg: ModelConfig = model.config
        try:
            num_blocks = budget_blocks(num_blocks, kv_budget_tokens, block_size)
            positive_int(max_batch_size, "max_batch_size")
            positive_int(max_prefill_tokens, "max_prefill_tokens")
            if max_client_prefill_tokens:  # None: a quarter of max_prefill_tokens; 0: no cap
                positive_int(max_client_prefill_tokens, "max_client_prefill_tokens")
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
        #: Cuts each prompt's cache after its prefill (``kvdrop engine --policy``; a request's
        #: ``"kvdrop"`` sampling key overrides it): :mod:`kvdrop_engine.drop`.
        self.dropper = dropper
        #: Keeps each decoding request's cache within a token budget (``kvdrop engine
        #: --decode-policy``; a request's ``"kvdrop": {"decode": ...}`` overrides it):
        #: :mod:`kvdrop_engine.decode_cut`.
        self.compressor = compressor
        self.runner = ModelRunner(
            model,
            cfg,
            num_blocks=num_blocks,
            block_size=block_size,
            max_batch_size=max_batch_size,
            fused_ops=fused_ops,
            cuda_graphs=cuda_graphs,
            graph_batch_sizes=graph_batch_sizes,
        )
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.cache = self.runner.cache
        self._graphs = self.runner.graphs
        self.block_size, self.max_batch_size = block_size, max_batch_size
        self.max_prefill_tokens, self.load_concurrency = max_prefill_tokens, load_concurrency
        self.max_client_prefill_tokens = max_client_prefill_tokens
        self.load_timeout_s = float(load_timeout_s)
        self.store_timeout_s = float(store_timeout_s)
        self.connector_backoff_s = float(connector_backoff_s)
        self.eos_token_ids = frozenset(int(t) for t in cfg.eos_token_ids)
        self._stats = EngineStats()
        self._stats_since = time.perf_counter()  # idle time is counted from here
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self.connector = connector
        self._transfers = None if connector is None else self._bind(connector)
        #: The query window the connector stores per request (None: none), once it is bound.
        self._store = None
        if connector is not None:
            self._store = store_capture(
                connector.queries, connector.stores_windows, connector.transfer_query
            )
        load_lock = threading.Lock() if self._transfers is None else self._transfers.load_lock
        self._sched = Scheduler(
            self.cache.allocator,
            block_size,
            max_batch_size,
            load_lock,
            self.eos_token_ids,
            swap=KVSwap(self.cache),
        )
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._grammars: Grammars | None = None  # structured outputs, on the first guided request

    def _bind(self, connector: KVConnector) -> Transfers:
        """Bind ``connector`` to the model and build the server I/O over it."""
        connector.bind(self.config, self.dtype, device=self.cache.device)
        return Transfers(
            connector,
            self.cache,
            load_concurrency=self.load_concurrency,
            load_timeout_s=self.load_timeout_s,
            store_timeout_s=self.store_timeout_s,
            backoff_s=self.connector_backoff_s,
            copy_on_loop=self._graphs is not None,
            wake=self._wake,
            stats=lambda: self._stats,
            lock=self._cv,
        )

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
            snapshot = EngineStats(**asdict(self._stats))
            snapshot.seconds = time.perf_counter() - self._stats_since
            return snapshot

    def reset_stats(self) -> None:
        """Zero the counters (e.g. between the phases of a benchmark)."""
        with self._cv:
            self._stats = EngineStats()
            self._stats_since = time.perf_counter()

    def blocks_for(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The most blocks a request holds: its prompt and every generated token but the last."""
        return self._sched.blocks_for(num_prompt_tokens, max_tokens)

    def post_completion(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        cache_salt: str | RequestOptions = "",
    ) -> Iterator[TokenEvent]:
        """Submit a request; iterate the returned generator for its tokens as they are produced.

        ``sampling_params`` is a ``SamplingParams`` or a dict (which may carry the request
        options ``"kvdrop"`` and ``"reconstruct"``); ``cache_salt`` is the salt, or the
        request's whole :class:`~kvdrop_engine.request_options.RequestOptions` (the OpenAI
        server's form, built once from the body). Validation happens here, once (raising
        ``InvalidRequestError`` / ``RequestTooLargeError``); failures while serving raise
        ``EngineError`` from the iterator. Closing the iterator (from any thread, before or
        after its first token) or dropping it cancels the request and frees its blocks at once
        (:class:`~kvdrop_engine.sequence.TokenStream`). Starts the engine if needed.
        """
        req = self._request(prompt_token_ids, sampling_params, cache_salt)
        self._submit(req)
        transfers = self._transfers
        return TokenStream(req, self._wake, None if transfers is None else transfers.await_stores)

    __call__ = post_completion

    def plan(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None = None,
        cache_salt: str | RequestOptions = "",
    ) -> RequestPlan:
        """The :class:`~kvdrop_engine.plan.RequestPlan` this request would get (validated as
        :meth:`post_completion` validates it; nothing is submitted)."""
        return self._request(prompt_token_ids, sampling_params, cache_salt).plan

    def _request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | SamplingParams | None,
        cache_salt: str | RequestOptions,
    ) -> Request:
        """A validated, planned request (not submitted)."""
        params, options = submission(sampling_params, cache_salt)
        detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer)
        req = new_request(
            next(self._ids),
            prompt_token_ids,
            params,
            options,
            vocab_size=self.config.vocab_size,
            detok=detok,
        )
        if options.reconstruct and (self.reconstruction is None or self._transfers is None):
            raise InvalidRequestError(
                "reconstruct=true needs an engine built with reconstruction=ReconstructionPrompt"
                "(...) and a connector to store the scores in (kvdrop_engine.reconstruct)"
            )
        req.plan = plan_request(
            req,
            dropper=self.dropper,
            compressor=self.compressor,
            connector=self.connector,
            store=self._store,
        )
        req.restart_window(len(req.prompt))
        if options.guide is not None:
            req.guide = self._matcher(options.guide, req)
        return req

    def _matcher(self, guide: Any, req: Request) -> Any:
        """A structured output's matcher, compiled on the caller's thread (the grammars of this
        engine's tokenizer are built on the first guided request): :mod:`structured`."""
        if self.tokenizer is None or not hasattr(self.tokenizer, "backend"):
            raise InvalidRequestError("structured outputs need an engine with a tokenizer")
        with self._cv:
            if self._grammars is None:
                self._grammars = Grammars(
                    self.tokenizer, self.config.vocab_size, self.eos_token_ids
                )
            grammars = self._grammars
        return grammars.matcher(guide_of(guide))

    def post_scoring(
        self, token_ids: Sequence[int], score_from: int, cache_salt: str = ""
    ) -> Callable[[], Tensor]:
        """Submit a scoring request: ``token_ids`` teacher-forced through the model (a cached
        prefix loaded as on any admission, at most up to position ``score_from``), nothing
        sampled or stored. Returns a function that waits for its float32 log-softmax rows
        ``[len(token_ids) - score_from, V]`` (row ``i``: the distribution after position
        ``score_from + i``); :func:`kvdrop_engine.logprobs.continuation_logprobs` uses it."""
        req = self._scoring_request(token_ids, score_from, cache_salt)
        self._submit(req)
        return functools.partial(scored_rows, req)

    def _scoring_request(
        self, token_ids: Sequence[int], score_from: int, cache_salt: str
    ) -> Request:
        params, options = submission(SCORING, cache_salt)
        req = new_request(
            next(self._ids),
            token_ids,
            params,
            options,
            vocab_size=self.config.vocab_size,
            detok=None,
        )
        if not isinstance(score_from, int) or not 0 <= score_from < len(req.prompt):
            raise InvalidRequestError(
                f"score_from must be an int in 0..{len(req.prompt) - 1}, got {score_from!r}"
            )
        req.score_from = score_from
        return req

    def post_prompt_scoring(
        self, prompt: Sequence[int], top: int, cache_salt: str = ""
    ) -> ScoreHandle:
        """Submit ``prompt_logprobs``: each token of ``prompt`` after the first with its
        log-probability, rank and ``top`` alternatives. Scored in slices of at most
        :data:`~kvdrop_engine.scheduler.SCORE_ROWS_PER_STEP` rows per step, each reduced as it
        is computed (memory ``O(slice x vocabulary)``, not ``O(tokens x vocabulary)``); the
        handle waits for the scores, or cancels them (a client that left)."""
        try:
            tokens = checked_ids(prompt, "prompt", vocab_size=self.config.vocab_size)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(str(exc)) from None
        if not isinstance(top, int) or isinstance(top, bool) or top < 0:
            raise InvalidRequestError(f"top must be an int >= 0, got {top!r}")
        if len(tokens) < 2:
            return ScoreHandle(None, self._wake)
        req = self._scoring_request(tokens[:-1], 0, cache_salt)
        req.score_top, req.score_targets = top, tokens[1:]
        self._submit(req)
        return ScoreHandle(req, self._wake)

    def _submit(self, req: Request) -> None:
        """Put a validated request in the waiting line (``RequestTooLargeError`` first)."""
        self._sched.check_fits(req)
        self.start()
        with self._cv:
            self._sched.waiting.append(req)
            self._stats.peak_waiting = max(self._stats.peak_waiting, len(self._sched.waiting))
            self._cv.notify_all()

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

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _loop(self) -> None:
        sched, transfers = self._sched, self._transfers
        while True:
            with self._cv:
                io_ok = transfers is None or transfers.io_ok()
                waited = time.perf_counter()
                while not self._stopping and not sched.has_work(io_ok):
                    self._cv.wait(sched.wait_s())
                    io_ok = transfers is None or transfers.io_ok()
                since = max(waited, self._stats_since)
                self._stats.idle_seconds += max(0.0, time.perf_counter() - since)
                if self._stopping:
                    return
                sched.drop_cancelled()
                cuts = sched.cuts_ready(time.monotonic())
                st = self._stats
                for victim, computed in sched.grow() + sched.reclaim():
                    st.preemptions += 1
                    st.recomputed_tokens += computed
                    st.swaps += victim.swapped is not None
                admitted = sched.admit()
                st.requests_admitted += len(admitted)
                st.peak_running = max(st.peak_running, len(sched.running))
                st.peak_blocks_used = max(
                    st.peak_blocks_used, self.num_blocks - self.num_free_blocks
                )
                loading = sched.loading()
            if transfers is not None:
                applying = time.perf_counter()
                try:
                    for req in admitted:
                        if req.loads_prefix:  # a preempted one too, unless cut or swapped
                            transfers.start_load(req)
                    transfers.finish_loads(loading)
                except Exception as exc:  # a broken connector: fail its requests, keep looping
                    for req in admitted + loading:
                        if req.loading is None or req.loading.done():
                            self._fail(req, exc)
                with self._cv:
                    self._stats.load_apply_seconds += time.perf_counter() - applying
            for req in cuts:
                self._finish_cut(req)
            with self._cv:
                batch = sched.runnable()
            try:
                if batch:
                    self._step(batch)
            except Exception as exc:  # a bug outside the per-request guards: never stop the loop
                for req in batch:
                    self._fail(req, exc)

    def _step(self, batch: list[Request]) -> None:
        """One step over ``batch``: plan -> run -> sample -> postprocess -> ship. A forward that
        raises is retried with each request alone, so its failure reaches only the requests
        causing it; after the forward every failure is one request's own."""
        started = time.perf_counter()
        plan = plan_step(
            batch,
            self.max_prefill_tokens,
            self.max_client_prefill_tokens,
            self.config.attention_keys_per_token,
        )
        self._reconstruct(plan)
        if not plan.seqs:
            return
        try:
            out = self.runner.forward(plan)
            hist = [(r.params, r.prompt, r.output) for r in plan.sampled]
            edited = edit_logits(out.logits, hist, self.eos_token_ids)
            guided = [(i, r.guide) for i, r in enumerate(plan.sampled) if r.guide is not None]
            if guided and self._grammars is not None:  # structured outputs: one batched mask
                edited = mask_logits(edited, guided, self._grammars)
            same = edited is out.logits  # nothing to edit: the graph's argmax stands
            picked = pick_tokens(edited, out.greedy if same else None, raw=out.logits)
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0], exc)
            else:
                for req in batch:
                    if req.reconstruction is None:  # its piece ran already
                        self._step([req])
            return
        self._advance(plan, out)
        for req, _ in plan.stepped:
            if req.recut and req.num_computed >= len(req.prompt) and not req.cancelled:
                self._recut(req)
        self._count(plan, out, started)
        sampled = self._sample(plan, out, picked, edited)
        self._feed_guides(plan, sampled)
        with self._cv:
            ended = self._sched.postprocess(plan, {rid: tok for rid, (tok, _) in sampled.items()})
        shipping = time.perf_counter()  # window_seconds is a part of ship_seconds
        windows = self._finished_windows(ended)
        for req, tok, reason in ended:
            lp = sampled[req.rid][1] if tok is not None else None
            self._ship(req, tok, lp, reason, windows)
        with self._cv:
            self._stats.ship_seconds += time.perf_counter() - shipping
        self._decode_cut([req for req, tok, reason in ended if tok is not None and reason is None])

    def _feed_guides(
        self, plan: StepPlan, sampled: dict[int, tuple[int, TokenLogprobs | None]]
    ) -> None:
        """Each guided request's sampled token into its matcher (a failure is its own)."""
        for req in plan.sampled:
            if req.guide is not None and req.rid in sampled:
                try:
                    accept(req.guide, sampled[req.rid][0])
                except Exception as exc:
                    sampled.pop(req.rid)
                    self._fail(req, exc)

    def _advance(self, plan: StepPlan, out: Forward) -> None:
        """Each request's computed tokens, captured query rows and scored rows of this step."""
        row = 0
        scored = dict((req.rid, k) for req, k in plan.scored)
        for req, n in plan.stepped:
            try:
                if req.rid in out.capture:
                    req.take_queries(out.captured_rows(req.rid), out.capture[req.rid])
                k = scored.get(req.rid, 0)
                if k and out.scores is not None:
                    rows = out.scores[row : row + k]
                    if req.score_top is not None and req.score_targets is not None:
                        done = sum(int(part[0].numel()) for part in req.score_parts)
                        targets = req.score_targets[done : done + k]
                        rows = reduce_rows(rows, targets, req.score_top)
                    req.score_parts.append(rows)
                row += k
            except Exception as exc:
                self._fail(req, exc)
            req.num_computed += n

    def _count(self, plan: StepPlan, out: Forward, started: float) -> None:
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
            # The decodes lead the plan (a 1-token prefill chunk is no decode: not counted)
            held = [s.start + 1 for s in plan.seqs[: plan.num_decode]]
            if held:
                st.peak_decode_kv_tokens = max(st.peak_decode_kv_tokens, max(held))
            else:
                st.prefill_step_seconds += time.perf_counter() - started

    def _sample(
        self, plan: StepPlan, out: Forward, picked: list[int | None], edited: Tensor
    ) -> dict[int, tuple[int, TokenLogprobs | None]]:
        """:func:`~kvdrop_engine.draw.draw_tokens` for the requests still running."""
        live = [
            req if not req.cancelled and req.rid in self._sched.running else None
            for req in plan.sampled
        ]
        return draw_tokens(live, out.logits, picked, edited, self._fail)

    def _finished_windows(
        self, ended: Sequence[tuple[Request, int | None, str | None]]
    ) -> dict[int, WindowRecord | None]:
        """The query windows of the requests this step ends, in one batched call
        (:meth:`ModelRunner.finished_windows`); the plan's ``StoreWindow`` reads them. Counted as
        ``window_seconds``."""
        if self._transfers is None:
            return {}
        started = time.perf_counter()
        windows = self.runner.finished_windows([e for e in ended if e[0].plan.stores_window])
        with self._cv:
            self._stats.window_seconds += time.perf_counter() - started
        return windows

    def _ship(
        self,
        req: Request,
        tok: int | None,
        logprobs: TokenLogprobs | None,
        reason: str | None,
        windows: Mapping[int, WindowRecord | None] | None = None,
    ) -> None:
        """Hand a request's step result over by walking its plan (:mod:`kvdrop_engine.plan`):
        after its prefill the ``after_prefill`` actions (store the prompt, start its cut: the
        first token, from the prefill's logits, goes out meanwhile), then its event, and before
        the last one the ``after_finish`` actions (stores, kvzip's pass, which holds the
        event). A scoring request hands over its rows."""
        try:
            if tok is None:
                parts = req.score_parts
                self._finish(req, list(parts) if req.score_top is not None else torch.cat(parts))
                return
            step = Shipped(tok, logprobs, reason, windows or {})
            if len(req.output) == 1:
                for action in req.plan.after_prefill:
                    if action.run(self, req, step):
                        return  # held: the action hands the event over later
            text = "" if req.detok is None else req.detok.add(tok, final=reason is not None)
            lp, top = (None, ()) if logprobs is None else logprobs
            kept = None
            if req.cutting is None:  # reported once, by the first event that knows it
                kept, req.kept_prompt = req.kept_prompt, None
            step.event = TokenEvent(
                tok, text, reason, logprob=lp, top_logprobs=top, kept_prompt_tokens=kept
            )
            if reason is None:
                req.out.put(step.event)
                return
            if not req.cancelled:
                for action in req.plan.after_finish:
                    if action.run(self, req, step):
                        return  # held (kvzip's pass): ``_reconstruct`` finishes it
        except Exception as exc:
            self._fail(req, exc)
            return
        self._finish(req, step.event)

    def _finish(self, req: Request, item: TokenEvent | Tensor | list | BaseException) -> None:
        """The one place a request ends: its last item (its last event, a scoring request's
        rows, or its failure) handed over and its blocks freed (a failure's first, so nothing
        of it runs on)."""
        if isinstance(item, BaseException):
            with self._cv:
                self._sched.finish(req)
            req.out.put(
                item
                if isinstance(item, EngineError)
                else EngineError(f"engine step failed: {item!r}")
            )
            return
        req.out.put(item)
        with self._cv:
            self._sched.finish(req)
            self._stats.requests_finished += 1

    @property
    def transfers(self) -> Transfers | None:
        """The server I/O (None without a connector); the plan's store actions submit to it."""
        return self._transfers

    def start_cut(self, req: Request) -> None:
        """(the plan's :class:`~kvdrop_engine.drop.CutPrompt`) Start the prompt cut."""
        self._start_cut(req)

    def add_seconds(self, counter: str, seconds: float) -> None:
        """Add ``seconds`` to the counter ``counter`` of :class:`EngineStats`."""
        with self._cv:
            setattr(self._stats, counter, getattr(self._stats, counter) + seconds)

    def _recut(self, req: Request) -> None:
        """(a preempted cut request whose whole prompt is computed again) Keep the same rows
        as its cut did (:meth:`~kvdrop_engine.drop.PromptDropper.recut`), so its answer is
        the one it would have had without the preemption."""
        assert self.dropper is not None
        with self._cv:
            if self._sched.running.get(req.rid) is not req:
                return
        try:
            self.dropper.recut(self.cache, req)
            req.restart_window(len(req.prompt))
        except Exception as exc:
            self._fail(req, exc)

    def _start_cut(self, req: Request) -> None:
        """(after prefill) Start cutting the prompt's cache by its policy on a thread of its own
        (:class:`~kvdrop_engine.drop.PendingCut`): the loop steps the other requests
        meanwhile (this one's first token is handed over now; it decodes on once the cut is
        applied), and :meth:`_finish_cut` applies it once it ends or its deadline passes."""
        assert self.dropper is not None
        job = self.dropper.start(self.cache, req, req.cut)
        pending = PendingCut(job, self.dropper.cut_timeout_s, self._wake)
        with self._cv:
            req.cutting = pending

    def _finish_cut(self, req: Request) -> None:
        """(on the loop) Apply a cut whose policy ended; its request's next event reports the
        kept prompt tokens. A failed or late cut fails its request only (its blocks were never
        changed; its first token was handed over already)."""
        pending, req.cutting = req.cutting, None
        with self._cv:
            running = self._sched.running.get(req.rid) is req
        if not running or req.cancelled:
            return  # freed meanwhile (cancelled): nothing to apply
        try:
            self._cut(req, pending)
        except Exception as exc:
            self._fail(req, exc)

    def _cut(self, req: Request, pending: PendingCut) -> None:
        """Apply ``pending``'s kept rows (:meth:`~kvdrop_engine.drop.PromptDropper.apply`);
        the request's next event reports the kept prompt tokens. A decode cut that is due
        already (more kept than ``budget + every``) runs at once, before its first decode step
        (:meth:`DecodeCompressor.after_prompt_cut`)."""
        assert self.dropper is not None
        chosen = pending.result()
        rows = None if req.window is None else req.window.rows()  # the prompt's, before the cut
        done = self.dropper.apply(self.cache, req, pending.job, chosen, pending.started)
        req.restart_window(done.num_kept)
        req.kept_prompt = done.num_kept
        if self.compressor is not None:  # a kept prompt past budget + every: cut before decoding
            self.compressor.after_prompt_cut(req, rows, done.num_prompt)
            self._decode_cut([req])
        with self._cv:
            st = self._stats
            st.prompt_cuts += 1
            st.prompt_tokens_kept += done.num_kept
            st.prompt_tokens_dropped += done.num_prompt - done.num_kept
            st.cut_seconds += done.seconds

    def _decode_cut(self, stepped: Sequence[Request]) -> None:
        """(after a step) Cut every request of ``stepped`` whose cache passed its decode budget,
        together (:meth:`DecodeCompressor.cut`); a failed batch is retried one by one, so a
        failure reaches only its own request."""
        compressor = self.compressor
        if compressor is None:
            return
        due = [
            r
            for r in stepped
            if not r.cancelled
            and r.cutting is None  # its prompt cut runs: decode cuts follow it
            and r.rid in self._sched.running
            and compressor.due(r)
        ]
        if not due:
            return
        try:
            done = [compressor.cut(self.cache, due)]
        except Exception:
            done = []
            for req in due:
                try:
                    done.append(compressor.cut(self.cache, [req]))
                except Exception as exc:
                    self._fail(req, exc)
        with self._cv:
            st = self._stats
            for d in done:
                st.decode_cuts += d.num_requests
                st.decode_tokens_dropped += d.tokens_before - d.tokens_kept
                st.decode_cut_seconds += d.seconds

    def _reconstruct(self, plan: StepPlan) -> None:
        """This step's pieces of kvzip's passes; a pass that ends stores its scores (before the
        request's held last event is handed over) and ends its request."""
        for req, rows in plan.pieces:
            run = req.reconstruction
            assert run is not None and self._transfers is not None
            started = time.perf_counter()
            try:
                scores = self.runner.reconstruct_piece(run, rows)
                if scores is not None:
                    job = ScoresJob(scores, req.prompt + req.output, req.cache_salt)
                    self._transfers.submit(req, job)
            except Exception as exc:
                self._fail(req, exc)
                continue
            with self._cv:
                self._stats.reconstruction_seconds += time.perf_counter() - started
                if scores is not None:
                    self._stats.reconstructions += 1
                    self._stats.reconstruction_tokens += len(req.prompt)
            if scores is not None:
                req.reconstruction = None
                self._finish(req, req.held)

    def _fail(self, req: Request, exc: BaseException) -> None:
        self._finish(req, exc)
