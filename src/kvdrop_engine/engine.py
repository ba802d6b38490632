"""The reference engine: continuous batching over a block-budgeted paged KV cache.

One loop thread owns the model, the cache and the scheduler. Callers on any thread submit a
request with ``post_completion`` and iterate its ``TokenEvent``s from a per-request queue. Each
engine step runs every admitted request together: decoding requests bring one token, prefilling
requests bring a chunk of their prompt (at most ``max_prefill_tokens`` prompt tokens per step).

Admission reserves blocks for the whole request (prompt + ``max_tokens``) up front, so a running
request never waits for memory and nothing is ever preempted; a request that waits for blocks keeps
its place in line (FIFO, no starvation). Finished requests free their blocks in the step they end.

With a connector (``kvdrop_engine.connector.ServerConnector``) the engine loads the longest
cached prefix of each prompt from the kvdrop server on admission and computes only the rest; when a
prompt's prefill ends it stores the prompt's whole chunks of KV (and post-RoPE queries). The store
runs on the caller's thread before the first token is handed over, so a caller that has seen a
token can rely on the prompt being in the server.
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from kvdrop_engine.errors import EngineError, InvalidRequestError, RequestTooLargeError
from kvdrop_engine.paged import PagedAttention, PagedKVCache, SeqStep, blocks_needed
from kvdrop_sdk.events import TokenEvent

__all__ = [
    "Engine",
    "EngineConnector",
    "EngineError",
    "EngineStats",
    "InvalidRequestError",
    "RequestTooLargeError",
    "SamplingParams",
]

DEFAULT_BUDGET_TOKENS = 65536


class EngineConnector(Protocol):
    """What the engine needs from a KV-cache connector (see ``ServerConnector``)."""

    chunk_size: int
    transfer_query: bool

    def bind(self, config: Any, dtype: torch.dtype) -> None:
        """Register the model's KV (and query) layout; called once by the engine."""

    def load(self, tokens: Sequence[int], cache_salt: str) -> Tensor | None:
        """KV ``[2, L, T, Hkv*d]`` of the longest cached chunk-aligned prefix, or None."""

    def lookup_queries(self, tokens: Sequence[int], cache_salt: str) -> int:
        """Length of the longest cached chunk-aligned query prefix of ``tokens``."""

    def store(
        self,
        kv: Tensor,
        queries: Tensor | None,
        tokens: Sequence[int],
        cache_salt: str,
        *,
        query_offset: int = 0,
    ) -> int:
        """Store whole chunks of ``kv`` (and ``queries`` ``[1, L, T - query_offset, Hq*d]`` of
        tokens ``query_offset..``, the cached query prefix completing them) under ``tokens``;
        returns how many query tokens were stored."""


_TOLERATED_KEYS = frozenset({"stream", "logprobs", "model", "user", "echo", "n"})


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy; ``top_k <= 0`` and ``top_p == 1`` off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | SamplingParams | None) -> SamplingParams:
        """Validate an OpenAI/vLLM-style dict; unknown keys and bad values raise with the reason."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, Mapping):
            raise InvalidRequestError(
                f"sampling_params must be a dict, got {type(params).__name__}"
            )
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(params) - known - _TOLERATED_KEYS)
        if unknown:
            raise InvalidRequestError(
                f"unsupported sampling parameter(s) {unknown}; supported: {sorted(known)}"
            )
        if params.get("n", 1) != 1:
            raise InvalidRequestError("only n=1 is supported")
        kw = {k: params[k] for k in known if k in params and params[k] is not None}
        if "stop_token_ids" in kw:
            kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
        sp = cls(**kw)
        sp._check()
        return sp

    def _check(self) -> None:
        def bad(name: str, expected: str) -> InvalidRequestError:
            value = getattr(self, name)
            return InvalidRequestError(f"sampling parameter {name}={value!r}; expected {expected}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k):
            raise bad("top_k", "an int (<= 0 disables)")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "an int or None")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of ints")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
    peak_running: int = 0
    peak_blocks_used: int = 0
    peak_waiting: int = 0

    @property
    def tokens_computed(self) -> int:
        """Tokens the model ran (prefill + decode), i.e. not loaded from the server."""
        return self.prefill_tokens_computed + self.decode_tokens_computed

    def to_dict(self) -> dict[str, int]:
        """Plain dict (JSON-serialisable), including ``tokens_computed``."""
        return {**asdict(self), "tokens_computed": self.tokens_computed}


@dataclass
class _StoreJob:
    """Prompt KV/queries to push to the server from the caller's thread."""

    kv: Tensor
    queries: Tensor | None
    tokens: list[int]
    cache_salt: str
    query_offset: int = 0


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    cache_salt: str
    out: queue.Queue[Any]
    generator: torch.Generator | None
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the blocks
    num_loaded: int = 0
    output: list[int] = field(default_factory=list)
    text_from: int = 0  # detokenisation window: output[text_from:text_upto] is emitted text
    text_upto: int = 0
    capture_queries: bool = False
    query_offset: int = 0  # captured queries start here; the server holds the ones before
    store_upto: int = 0  # whole-chunk prompt tokens to store after prefill (0 = none)
    query_parts: list[Tensor] = field(default_factory=list)
    cancelled: bool = False

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)


class Engine:
    """Continuous-batching engine over a paged KV cache of ``num_blocks`` blocks.

    ``model`` is a ``kvdrop_engine.model.Transformer`` (anything with ``.config`` holding
    ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``eos_token_ids`` and a
    ``forward(tokens, positions, attn, logits_rows)``). Give the budget as ``num_blocks`` or
    ``kv_budget_tokens`` (rounded down to whole blocks); default 65536 tokens.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tokenizer: Any = None,
        num_blocks: int | None = None,
        kv_budget_tokens: int | None = None,
        block_size: int = 16,
        max_batch_size: int = 256,
        max_prefill_tokens: int = 2048,
        connector: EngineConnector | None = None,
    ) -> None:
        cfg = model.config
        if num_blocks is not None and kv_budget_tokens is not None:
            raise InvalidRequestError("give num_blocks or kv_budget_tokens, not both")
        if not _is_int(block_size) or block_size <= 0:
            raise InvalidRequestError(f"block_size must be a positive int, got {block_size!r}")
        if num_blocks is None:
            budget = DEFAULT_BUDGET_TOKENS if kv_budget_tokens is None else kv_budget_tokens
            if not _is_int(budget) or budget < block_size:
                raise InvalidRequestError(
                    f"kv_budget_tokens must be an int >= block_size ({block_size}), got {budget!r}"
                )
            num_blocks = budget // block_size
        if not _is_int(num_blocks) or num_blocks <= 0:
            raise InvalidRequestError(f"num_blocks must be a positive int, got {num_blocks!r}")
        for name, value in (
            ("max_batch_size", max_batch_size),
            ("max_prefill_tokens", max_prefill_tokens),
        ):
            if not _is_int(value) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive int, got {value!r}")
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.dtype = param.dtype if param is not None else torch.float32
        self.model = model
        self.config = cfg
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.cache = PagedKVCache(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
        )
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
        return self

    def stop(self) -> None:
        """Stop the loop; requests still waiting or running fail with ``EngineError``."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
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
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        gen = None if params.temperature == 0 else torch.Generator().manual_seed(seed)
        req = _Request(
            rid=next(self._ids),
            prompt=prompt,
            params=params,
            cache_salt=cache_salt,
            out=queue.Queue(),
            generator=gen,
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
                if isinstance(item, _StoreJob):
                    self._run_store(item)
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

    def _run_store(self, job: _StoreJob) -> None:
        assert self.connector is not None
        try:
            q_stored = self.connector.store(
                job.kv, job.queries, job.tokens, job.cache_salt, query_offset=job.query_offset
            )
        except Exception as exc:  # surface to the caller: the prompt is not in the server
            raise EngineError(
                f"storing the prompt's KV in the kvdrop server failed: {exc}"
            ) from exc
        with self._cv:
            self._stats.kv_tokens_stored += job.kv.shape[2]
            self._stats.query_tokens_stored += int(q_stored or 0)

    def _check_prompt(self, tokens: Sequence[int]) -> list[int]:
        if isinstance(tokens, Tensor):
            tokens = tokens.tolist()
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise InvalidRequestError(
                f"prompt_token_ids must be a list of ints, got {type(tokens).__name__}"
            )
        prompt = list(tokens)
        if not prompt:
            raise InvalidRequestError("prompt_token_ids is empty; expected at least one token")
        vocab = getattr(self.config, "vocab_size", None)
        for t in prompt:
            if not _is_int(t) or t < 0 or (vocab is not None and t >= vocab):
                limit = f"0 <= id < {vocab}" if vocab is not None else "non-negative ints"
                raise InvalidRequestError(f"prompt token {t!r} is invalid; expected {limit}")
        return prompt

    # ----------------------------------------------------------------- loop side
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._has_work_locked():
                    self._cv.wait()
                if self._stopping:
                    return
                self._drop_cancelled_locked()
                admitted = self._admit_locked()
            for req in admitted:
                self._load_prefix(req)
            with self._cv:
                batch = [r for r in self._running.values() if not r.cancelled]
            if batch:
                try:
                    self._step(batch)
                except Exception as exc:
                    for req in batch:
                        self._fail(req, exc)

    def _has_work_locked(self) -> bool:
        if self._running:
            return True
        return bool(self._waiting)

    def _drop_cancelled_locked(self) -> None:
        for rid in [rid for rid, r in self._running.items() if r.cancelled]:
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

    def _load_prefix(self, req: _Request) -> None:
        """Load the cached prefix from the server and decide what to store after prefill."""
        conn = self.connector
        if conn is None:
            return
        try:
            kv = conn.load(req.prompt, req.cache_salt)
        except Exception as exc:
            self._fail(req, EngineError(f"loading the cached prefix from the server failed: {exc}"))
            return
        cached = 0 if kv is None else int(kv.shape[2])
        # At least the last prompt token is computed: its logits pick the first output token.
        n = min(cached, len(req.prompt) - 1)
        if n > 0:
            assert kv is not None
            self.cache.load(req.blocks, kv[:, :, :n])
        req.num_computed = req.num_loaded = n
        aligned = len(req.prompt) // conn.chunk_size * conn.chunk_size
        if aligned > cached:
            req.store_upto = aligned
            # Queries are captured for the computed tokens; a loaded prefix (shared with an
            # earlier prompt) must have its queries cached too, or the query cache would hold
            # a hole. After a modify the kept tokens have none: their prompt stores KV only.
            if conn.transfer_query:
                try:
                    q_cached = conn.lookup_queries(req.prompt, req.cache_salt) if n else 0
                except Exception as exc:
                    self._fail(req, EngineError(f"query lookup in the server failed: {exc}"))
                    return
                req.capture_queries = n == 0 or q_cached >= n
                req.query_offset = n
        with self._cv:
            self._stats.tokens_loaded += n

    def _step(self, batch: list[_Request]) -> None:
        seqs: list[SeqStep] = []
        tokens: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampling: list[_Request] = []
        prefill_budget = self.max_prefill_tokens
        n_prefill = n_decode = 0
        stepped: list[tuple[_Request, int]] = []
        for req in batch:  # decodes first, so they never wait behind prefill chunks
            if req.prefilling:
                continue
            seqs.append(SeqStep(req.rid, req.blocks, req.num_computed, 1))
            tokens.append(req.output[-1])
            positions.append(req.num_computed)
            sample_rows.append(len(tokens) - 1)
            sampling.append(req)
            stepped.append((req, 1))
            n_decode += 1
        for req in batch:
            if not req.prefilling or prefill_budget <= 0:
                continue
            n = min(len(req.prompt) - req.num_computed, prefill_budget)
            prefill_budget -= n
            seqs.append(SeqStep(req.rid, req.blocks, req.num_computed, n))
            tokens.extend(req.prompt[req.num_computed : req.num_computed + n])
            positions.extend(range(req.num_computed, req.num_computed + n))
            if req.num_computed + n == len(req.prompt):
                sample_rows.append(len(tokens) - 1)
                sampling.append(req)
            stepped.append((req, n))
            n_prefill += n
        capture = {r.rid for r, _ in stepped if r.prefilling and r.capture_queries}
        attn = PagedAttention(self.cache, seqs, capture=capture)
        dev = self.device
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(tokens, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                attn,
                logits_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            )
        for req, n in stepped:
            if req.rid in attn.captured:
                start = req.num_computed
                keep = max(0, min(n, req.store_upto - start))
                if keep:
                    q = torch.stack([t[:keep] for t in attn.captured[req.rid]])  # [L, n, Hq, d]
                    req.query_parts.append(q.reshape(q.shape[0], keep, -1).cpu())
            req.num_computed += n
        with self._cv:
            self._stats.steps += 1
            self._stats.prefill_tokens_computed += n_prefill
            self._stats.decode_tokens_computed += n_decode
        next_ids = self._sample(logits, sampling)
        for req, tok in zip(sampling, next_ids, strict=True):
            if req.cancelled:
                continue
            if not req.output and req.store_upto:
                req.out.put(self._store_job(req))
            self._emit(req, tok)

    def _store_job(self, req: _Request) -> _StoreJob:
        kv = self.cache.read(req.blocks, req.store_upto).cpu()
        queries = None
        if req.capture_queries and req.query_parts:
            queries = torch.cat(req.query_parts, dim=1).unsqueeze(0)
        req.query_parts = []
        return _StoreJob(
            kv, queries, req.prompt[: req.store_upto], req.cache_salt, req.query_offset
        )

    def _sample(self, logits: Tensor, reqs: list[_Request]) -> list[int]:
        if not reqs:
            return []
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, req in enumerate(reqs):
            p = req.params
            if p.temperature == 0:
                out.append(int(greedy[i]))
                continue
            row = logits[i].float().cpu() / p.temperature
            if p.top_k > 0 and p.top_k < row.numel():
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_logits, order = torch.sort(row, descending=True)
                probs = torch.softmax(sorted_logits, dim=-1)
                # Drop a token when the tokens ranked above it already reach top_p.
                drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
                row = row.scatter(0, order[drop], float("-inf"))
            probs = torch.softmax(row, dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=req.generator)))
        return out

    def _emit(self, req: _Request, tok: int) -> None:
        req.output.append(tok)
        p = req.params
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            reason = "stop"
        elif len(req.output) >= p.max_tokens:
            reason = "length"
        req.out.put(
            TokenEvent(
                token_id=tok, text=self._text_delta(req, reason is not None), finish_reason=reason
            )
        )
        if reason is not None:
            with self._cv:
                self._running.pop(req.rid, None)
                self._stats.requests_finished += 1
            self._free(req)

    def _text_delta(self, req: _Request, final: bool) -> str:
        """Text of the newest token(s), decoding only a short window (not the whole output).

        The window starts at the last emitted boundary (``text_from``); text is held back while
        it ends in an incomplete UTF-8 sequence, and flushed on the last token.
        """
        tok = self.tokenizer
        if tok is None:
            return ""
        ids = req.output
        before = tok.decode(ids[req.text_from : req.text_upto])
        now = tok.decode(ids[req.text_from :])
        if len(now) <= len(before) or (not final and now.endswith("\ufffd")):
            return ""
        delta = now[len(before) :] if now.startswith(before) else now
        req.text_from, req.text_upto = req.text_upto, len(ids)
        return delta

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
