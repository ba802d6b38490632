"""One request inside the engine: its tokens, blocks, query capture and prefix-load state.

The loop thread owns a :class:`Request` once it is admitted; a connector thread touches only
``load_state`` (under the engine's load lock) and the blocks it copies a prefix into.
"""

from __future__ import annotations

import enum
import queue
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch import Tensor

from kvdrop_engine.capture import WindowCapture
from kvdrop_engine.errors import EngineError, InvalidRequestError
from kvdrop_engine.plan import NO_PLAN, RequestPlan
from kvdrop_engine.reconstruct import ReconstructionPass
from kvdrop_engine.request_options import RequestOptions
from kvdrop_engine.sampling import SamplingParams, make_generator
from kvdrop_engine.tokenizer import IncrementalDetokenizer
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.validate import token_ids

__all__ = [
    "LoadState",
    "Request",
    "ScoreHandle",
    "TokenStream",
    "new_request",
    "raise_failure",
    "scored_rows",
]


#: The options of a request that asked for nothing beyond sampling.
NO_OPTIONS = RequestOptions()


class LoadState(enum.Enum):
    """Where a request's prefix load stands (guarded by the engine's load lock)."""

    QUEUED = "queued"  # waiting for a connector thread
    IO = "io"  # asking the server (its deadline runs)
    COPY = "copy"  # copying the prefix into the request's blocks
    COPIED = "copied"  # in the blocks
    ABANDONED = "abandoned"  # the loop gave up on it: its blocks are not touched


@dataclass
class Request:
    """One request's state, owned by the loop thread once admitted."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    cache_salt: str
    out: queue.Queue[Any]
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    #: Replaced, never changed in place (a tuple): the decode graphs compare it by identity.
    blocks: tuple[int, ...] = ()
    num_computed: int = 0  # tokens whose KV is in the blocks
    output: list[int] = field(default_factory=list)
    capture_queries: bool = False
    query_offset: int = 0  # captured queries start here; the server holds the ones before
    store_upto: int = 0  # whole-chunk prompt tokens to store after prefill (0 = none)
    query_parts: list[Tensor] = field(default_factory=list)
    window: WindowCapture | None = None
    cancelled: bool = False
    #: The prefix load in flight (a :class:`~kvdrop_engine.scheduler.PrefixPlan` to come).
    loading: Future[Any] | None = None
    load_deadline: float = float("inf")  # set when the load starts (not while it is queued)
    load_state: LoadState = LoadState.QUEUED
    #: Stores started for this request; the caller waits for them before its next token.
    stores: list[Future[Any]] = field(default_factory=list)
    #: Once the prompt cut ran, the prompt tokens it kept (the first event reports them).
    kept_prompt: int | None = None
    #: The cut while its policy runs off the loop (a ``kvdrop_engine.drop.PendingCut``: the
    #: request is not stepped meanwhile), and once applied the prompt before it and the kept
    #: indices (a preempted cut request recomputes the whole prompt and keeps the same rows).
    cutting: Any = None
    uncut_prompt: list[int] | None = None
    kept_index: Tensor | None = None
    #: Preempted after its cut: it prefills ``uncut_prompt`` again, keeps ``kept_index`` of
    #: it (no policy call), then recomputes its generated tokens after the kept rows.
    recut: bool = False
    #: The structured output's grammar matcher (``xgrammar.GrammarMatcher``; None: free text):
    #: it masks the request's logits each step and is fed each token (:mod:`structured`).
    guide: Any = None
    #: A scoring request (teacher-forced log-probs, no sampling) keeps the log-softmax rows of
    #: positions ``score_from..`` of its prompt; -1 for a request that generates.
    score_from: int = -1
    score_parts: list[Any] = field(default_factory=list)
    #: Prompt scoring (``prompt_logprobs``): each slice of rows is reduced as it is computed
    #: to the log-probability of its ``score_targets`` token, its rank and the ``score_top``
    #: best (``kvdrop_engine.sampling.reduce_rows``), so ``[T, V]`` rows never exist at once.
    score_top: int | None = None
    score_targets: list[int] | None = None
    #: KVzip's pass over the prompt, run in pieces after the last token; that token's event is
    #: ``held`` until the pass ends (its scores are stored before the caller sees the end).
    reconstruction: ReconstructionPass | None = None
    held: TokenEvent | None = None

    #: Preempted (its blocks taken back) and waiting to recompute what it had computed.
    preempted: bool = False
    #: What the request asked beyond sampling (its cut override, reconstruction, salt).
    options: RequestOptions = NO_OPTIONS
    #: What the engine does with it, decided once at submission (:mod:`kvdrop_engine.plan`):
    #: its cuts, its query capture, the actions after prefill and after the last token.
    plan: RequestPlan = NO_PLAN
    #: The cuts while decoding done, the tokens they dropped (the next token's RoPE position is
    #: its slot plus this), the true positions of the rows kept by the last one (slots
    #: ``0..k-1``), and the cache held in host memory while preempted (such a request is
    #: swapped, never recomputed).
    decode_cuts: int = 0
    dropped: int = 0
    kept_positions: Tensor | None = None
    swapped: Tensor | None = None
    #: Prompt tokens its first admission loaded from the server (None before it; written by
    #: ``scheduler.follow``); a preempted request loads as many again (:attr:`loads_prefix`),
    #: so its cache is what it was.
    loaded_first: int | None = None

    @property
    def cut(self) -> Any:
        """The prompt cut after prefill (a ``kvdrop_engine.drop.PromptCut``; None: kept
        whole): the plan's."""
        return self.plan.cut

    @property
    def decode_cut(self) -> Any:
        """The cut while decoding (a ``kvdrop_engine.decode_cut.DecodeCut``; None): the plan's."""
        return self.plan.decode

    def restart_window(self, num_tokens: int | None) -> None:
        """(Re)start the request's query capture over its first ``num_tokens`` positions, as its
        plan says (the prompt cut's rows until that cut is applied); None drops it. The one
        writer of ``window``: at submission, after each cut, on a preemption."""
        if num_tokens is None:
            self.window = None
            return
        pending = self.plan.cut is not None and self.kept_index is None
        self.window = self.plan.window(num_tokens, cut_pending=pending)

    @property
    def prefill_tokens(self) -> list[int]:
        """The tokens computed as a prefill: the prompt, and after a preemption every generated
        token but the last too (the last is fed by the next decode step)."""
        return self.prompt + self.output[:-1]

    @property
    def peak_tokens(self) -> int:
        """KV tokens the request ever holds (what admission reserves): prompt and every generated
        token but the last, or less when its prompt is cut after prefill."""
        n, max_tokens = len(self.prompt), self.params.max_tokens
        peak = n + max_tokens - 1
        start = n  # cached tokens when decoding starts
        if self.cut is not None:
            peak = int(self.cut.peak_tokens(n, max_tokens))
            start = int(self.cut.kept_bound(n))
        if self.decode_cut is not None:
            peak = int(self.decode_cut.peak_tokens(n, start, max_tokens))
        return peak

    @property
    def recut_tokens(self) -> int:
        """KV tokens a preempted cut request holds once its prompt is cut again: the kept rows
        and its generated tokens but the last (what its recompute needs at most, beside the
        whole prompt)."""
        assert self.kept_index is not None
        return int(self.kept_index.numel()) + max(0, len(self.output) - 1)

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens (or, after a preemption, generated ones) are to be computed."""
        return self.num_computed + self.dropped < len(self.prompt) + max(0, len(self.output) - 1)

    @property
    def admission_tokens(self) -> int:
        """Tokens the request's blocks must hold on admission: what it computes before its first
        sample (its prompt; after a preemption everything it had; a cut one its whole prompt
        first), or its swapped cache and the token it decodes next (it decodes at once: the
        blocks it grows by were given out). A request with a decode cut reserves all it may
        grow to from there (:meth:`hold_tokens`, at most ``budget + every`` past its prompt),
        so the cut requests admitted never outgrow the budget and preempt each other."""
        if self.swapped is not None:
            need = int(self.swapped.shape[2]) + 1
        elif self.recut:  # its whole prompt, or its kept rows and generated tokens if more
            need = max(len(self.prompt), self.recut_tokens)
        else:
            need = len(self.prefill_tokens)
        if self.decode_cut is not None:
            need = int(self.decode_cut.held_tokens(need, self._entering))
        return need

    @property
    def _entering(self) -> int:
        """Generated tokens still to enter the cache (every one but the last is fed back)."""
        return self.params.max_tokens - max(1, len(self.output))

    def hold_tokens(self, cached: int) -> int:
        """KV tokens whose blocks the request keeps while it holds ``cached``: the next token's
        slot too; with a decode cut, all it may grow to before that cut
        (``DecodeCut.held_tokens`` of the generated tokens still to enter its cache)."""
        if self.decode_cut is None:
            return cached + 1
        return max(cached + 1, int(self.decode_cut.held_tokens(cached, self._entering)))

    def slot_positions(self, n: int) -> Tensor:
        """True RoPE positions (CPU int64) of the rows in slots ``0..n-1``."""
        kept = self.kept_positions
        if kept is None:
            return torch.arange(n)
        return torch.cat([kept, torch.arange(kept.numel(), n) + self.dropped])[:n]

    def preempt(self) -> None:
        """Forget what is computed (its blocks are taken back): it is recomputed from token 0,
        its query capture restarted so that it keeps the same rows (vLLM's recompute)."""
        self.num_computed, self.preempted = 0, True
        self.query_parts, self.query_offset, self.score_parts = [], 0, []
        cut = self.kept_index is not None and self.uncut_prompt is not None
        if cut and self.swapped is None:  # (a swapped one keeps its cache: nothing to redo)
            # Cut already: the kept rows need the whole prompt's context, so the prompt is
            # prefilled whole and the same rows kept again (``Engine._recut``), not prefilled
            # as the kept tokens alone (another cache: another answer).
            self.prompt, self.recut = self.uncut_prompt, True
            self.restart_window(None)  # restarted once the same rows are kept again
            self.capture_queries = False  # the prompt's chunk queries were stored already
            return
        if self.output:
            self.capture_queries = False  # the prompt's chunk queries were stored already
        if self.window is not None and self.swapped is None:  # a swapped one keeps its rows
            self.restart_window(self.window.num_prompt)

    @property
    def loads_prefix(self) -> bool:
        """Whether admission asks the server for the request's cached prefix: on its first
        admission, and again after a preemption took its cache when the first loaded some
        (``loaded_first``; vLLM asks its KV connector again too): an SDK stream's edited KV is
        not what its kept tokens compute alone, so a stream recomputed from its tokens answered
        otherwise. Not a cut request (it prefills its whole prompt and keeps the same rows
        again: ``recut``), nor one swapped back in."""
        if not self.preempted:
            return True
        return bool(self.loaded_first) and not self.recut and self.num_computed == 0

    @property
    def scoring(self) -> bool:
        """Whether this request scores its prompt's tail instead of generating."""
        return self.score_from >= 0

    @property
    def lookup_tokens(self) -> list[int]:
        """The tokens whose cached prefix admission may load: a scoring request computes every
        row it scores, so only its prefix up to ``score_from`` is looked up."""
        return self.prompt if not self.scoring else self.prompt[: self.score_from + 1]

    @property
    def load_limit(self) -> int | None:
        """The most cached tokens admission loads: after a preemption what its first admission
        loaded, so that its cache is what it was and it computes again what it computed then
        (chunks it stored since are not loaded); None: all that is cached."""
        return self.loaded_first if self.preempted else None

    def take_chunk_queries(self) -> Tensor | None:
        """The prompt's captured chunk queries ``[1, L, T, Hq*d]`` (full mode), handed over once."""
        parts, self.query_parts = self.query_parts, []
        if not self.capture_queries or not parts:
            return None
        return torch.cat(parts, dim=1).unsqueeze(0)

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


def new_request(
    rid: int,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    options: RequestOptions,
    *,
    vocab_size: int,
    detok: IncrementalDetokenizer | None,
) -> Request:
    """A submitted request of validated ``params`` and ``options``
    (:func:`~kvdrop_engine.request_options.submission`); its prompt and the vocabulary-bound
    checks here: ``InvalidRequestError`` says what was wrong."""
    try:
        prompt = token_ids(prompt_token_ids, "prompt_token_ids", vocab_size=vocab_size)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(str(exc)) from None
    if not prompt:
        raise InvalidRequestError("prompt_token_ids is empty; expected at least one token")
    params.check_vocab(vocab_size)
    generator = make_generator(params)
    out: queue.Queue[Any] = queue.Queue()
    return Request(rid, prompt, params, options.cache_salt, out, generator, detok, options=options)


class ScoreHandle:
    """A prompt-scoring request in flight (``Engine.post_prompt_scoring``): :meth:`result`
    waits for its :data:`~kvdrop_engine.sampling.PromptScores`; :meth:`close` (from any thread:
    a client that left) cancels it, and the loop drops it on its next turn."""

    def __init__(self, req: Request | None, wake: Callable[[], None]) -> None:
        self.req, self._wake = req, wake

    def result(self) -> Any:
        from kvdrop_engine.sampling import scores_of

        if self.req is None:
            return []  # a one-token prompt: nothing to score
        item = self.req.out.get()
        if item is _CLOSED:
            raise EngineError("the prompt scoring was cancelled (its client left)")
        if isinstance(item, BaseException):
            raise_failure(item)
        assert self.req.score_targets is not None
        return scores_of(item, self.req.score_targets)

    def close(self) -> None:
        if self.req is not None and not self.req.cancelled:
            self.req.cancelled = True
            self.req.out.put(_CLOSED)
            self._wake()


def scored_rows(req: Request) -> Tensor:
    """Wait for a scoring request's log-softmax rows (its failure raised)."""
    item = req.out.get()
    if isinstance(item, BaseException):
        raise_failure(item)
    return item


def raise_failure(item: BaseException) -> NoReturn:
    """Raise a request's failure as the ``EngineError`` its caller expects."""
    if isinstance(item, EngineError):
        raise item
    raise EngineError(f"request failed: {item!r}") from item


#: Put on a request's queue by :meth:`TokenStream.close`: wakes a reader blocked on it.
_CLOSED = object()


class TokenStream(Iterator[TokenEvent]):
    """A request's ``TokenEvent``s as the engine produces them.

    Closing it -- :meth:`close`, from any thread (also while another thread waits in
    ``next()``), or dropping the last reference -- cancels the request at once, whether or not a
    token was read: the loop frees its blocks and abandons its pending load on its next turn (at
    most the step in flight still computes it). ``wake`` tells the loop; ``before_event`` runs
    before each event is handed over (the engine waits there for the request's stores).
    """

    def __init__(
        self,
        req: Request,
        wake: Callable[[], None],
        before_event: Callable[[Request], None] | None = None,
    ) -> None:
        self.req = req
        self._wake = wake
        self._before_event = before_event
        self._ended = False  # the last event was handed over, a failure raised, or closed

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> TokenEvent:
        if self._ended:
            raise StopIteration
        item = self.req.out.get()
        if item is _CLOSED:
            raise StopIteration
        if isinstance(item, BaseException):
            self._ended = True
            raise_failure(item)
        if self._before_event is not None:
            self._before_event(self.req)  # started before this token was queued
        if item.finish_reason is not None:
            self._ended = True
        return item

    def close(self) -> None:
        """Cancel the request unless it ended (idempotent, thread-safe)."""
        if self._ended:
            return
        self._ended = True
        self.req.cancelled = True
        self.req.out.put(_CLOSED)
        self._wake()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to tell
            pass
