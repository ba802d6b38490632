"""One request's life through the SDK: prefill, edit its cached KV, decode on the edited cache.

A ``RequestStream`` owns a token list and an engine call (``PostCompletion``). The engine stores
whole chunks of every prompt it receives (KV, and queries when asked to) in the kvdrop server as a
side effect of prefill, and on each call reuses the longest cached chunk-aligned prefix.

Token bookkeeping (the rules everything else relies on):

* The stream holds ``prefix`` tokens and ``suffix_tokens``; ``tokens = prefix + suffix_tokens`` is
  exactly the prompt the next ``generate`` sends.
* ``generate`` sends ``tokens``, then folds the suffix into the prefix and appends the generated
  tokens: after a prefill with ``max_tokens=1`` the stream holds ``prompt + [g1]``, while the server
  holds only the whole chunks of ``prompt`` (the engine never saw ``g1`` as input).
* ``modify_kv(fn)`` retrieves the longest cached chunk-aligned prefix of ``tokens`` (``T`` tokens)
  and the query rows the engine saved for exactly ``tokens`` (see below), calls
  ``fn(tensors, tokens[:T])`` (``tensors`` is a :class:`~kvdrop_sdk.cache_kind.KindMap`: LMCache's
  own enum indexes it too) -- or ``fn(tensors, tokens[:T], context=EditContext(...))`` when ``fn``
  declares it takes one (``kvdrop_sdk.types.accepts_edit_context``; every kvdrop policy does) --
  validates the result ``(kv', kept)`` (``[2, L, T', D]``, same L/D/dtype, ``len(kept) == T'``,
  ``T'`` a non-zero multiple of the chunk size, the protected prefix kept), stores it under
  ``kept`` and sets ``prefix = kept``, ``suffix_tokens = tokens[T:]`` -- the un-cached tail of the
  prompt plus every token decoded so far. The next ``generate`` sends ``kept + suffix`` and the
  engine finds the edited KV under the kept tokens' chunk keys, computing only the suffix.
* Edited caches belong to their request: the first edit switches the stream to its own cache
  salt, :func:`edit_salt` (``f"{cache_salt}.edit.{request_stream_id}"``, the stream's
  ``active_cache_salt``); the edit is stored and every later call reads and stores under it, so
  another request whose kept tokens happen to coincide never reads this one's edited KV.
  Unedited prefixes keep sharing ``cache_salt``.
* Queries: an engine in the lean query mode saves, per call, the query rows of the last tokens
  of the whole sequence (the uncached tail and generated tokens included) and a strided sample,
  keyed by the call's token ids (:mod:`kvdrop_sdk.window`); in the full mode it stores every
  prompt token's query in chunks (upstream layout). A function that takes an edit context gets
  ``{QUERY: [1, L, R, Dq]}`` with ``context.query_positions``: the window, or the chunk queries
  followed by the window's rows past them. A plain function gets the chunk queries (cut with the
  KV to a common ``T``), or no query tensor when only a window exists. Functions whose
  ``needs_query`` is False get no query tensor.
* Nothing changes when ``fn`` fails or returns something invalid: the stream keeps its tokens and
  the server keeps what it stored (validation happens before the store).
* The server keeps the first copy of a chunk: an edit that changes values but keeps a chunk's
  tokens (and every token before it) is not stored for that chunk; a warning is logged when the
  whole edit was already cached. Token-dropping edits change the chain and are stored.
* ``is_done`` becomes True when the engine reports ``finish_reason == "stop"`` (EOS or a stop
  token), or, if it reports no reason, when it produced fewer than ``max_tokens`` tokens
  (default 1; the upstream rule). ``"length"`` (budget reached, e.g. a prefill with
  ``max_tokens=1``) is not done. A done stream refuses to ``generate`` again; the batch skips it
  on decode.
* ``output_tokens`` is, as upstream, the whole token sequence the cache stands for (the prompt or
  the kept tokens, then every token generated since; a suffix waiting to be re-sent is not in
  it). ``generated_tokens`` (kvdrop's) lists only the generated tokens over all calls,
  ``output_text`` their text and ``decoded_tokens`` their count (an ``int``, as upstream).

Where the signatures meet upstream's (``retrieve(kind, timeout, poll_interval)``,
``update(kind, kv, tokens)``, ``modify_kv(fn, timeout, poll_interval)``) they take the same
arguments; kvdrop's additions are keyword-only. Contexts may be kvdrop's or ``lmcache.sdk``'s
(anything with ``kind``, ``chunk_size``, ``retrieve`` and ``store``; ``lookup`` is used when
present, else the cache is polled by retrieving, as upstream does).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdrop_sdk.cache_kind import CacheKind, KindMap
from kvdrop_sdk.context import Context
from kvdrop_sdk.errors import RequestStreamError, SDKError
from kvdrop_sdk.events import PostCompletion, TokenEvent
from kvdrop_sdk.query_capture import DeclaresTokenScores
from kvdrop_sdk.types import EditContext, ModifyFnType, takes_edit_context
from kvdrop_sdk.validate import is_int, token_ids
from kvdrop_sdk.window import retrieve_scores, retrieve_window

__all__ = [
    "ModifyFnType",
    "ModifyResult",
    "PostCompletion",
    "RequestStream",
    "RequestStreamError",
    "StreamPerfMetrics",
    "TokenEvent",
    "create_request",
    "edit_salt",
]

logger = logging.getLogger(__name__)
_warned_plain_window = False


#: Longest salt LMCache accepts (it also refuses "@", "/", "\\" and NUL in one).
_MAX_SALT_CHARS = 128


def edit_salt(cache_salt: str, request_stream_id: str) -> str:
    """The salt a stream's edited KV lives under: its own, so no other request can read it.

    Made of characters every server accepts (LMCache refuses "/" and salts over 128 characters):
    ``f"{cache_salt}.edit.{request_stream_id}"``, with a long ``cache_salt`` replaced by its hash.
    """
    salt = f"{cache_salt}.edit.{request_stream_id}"
    if len(salt) > _MAX_SALT_CHARS:
        digest = hashlib.sha256(cache_salt.encode()).hexdigest()[:32]
        salt = f"{digest}.edit.{request_stream_id}"
    return salt


def _warn_plain_window(stream_id: str) -> None:
    """Log once: a plain edit function gets no query tensor when only a window exists."""
    global _warned_plain_window
    if _warned_plain_window:
        return
    _warned_plain_window = True
    logger.warning(
        "stream %s: the engine saved only a query window (lean query mode), which a plain edit "
        "function fn(tensors, tokens) cannot place; it gets no query tensor. Mark it with "
        "kvdrop_sdk.types.accepts_edit_context to receive the window and its positions "
        "(context.query_positions), or run the engine with full query capture",
        stream_id,
    )


@dataclass(frozen=True)
class StreamPerfMetrics:
    """Timing of one ``generate()`` call (seconds; throughputs in tokens per second).

    ``ttft`` is the time from sending the prompt to the first token; ``tpot`` lists the gaps
    between consecutive tokens. ``input_tput`` is ``input_tokens / duration``. Fields are in
    upstream's order (``tpot`` before ``ttft``), so positional construction means the same.
    """

    duration: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    input_tput: float = 0.0
    output_tput: float = 0.0
    tpot: list[float] = field(default_factory=list)
    ttft: float = 0.0


@dataclass(frozen=True)
class ModifyResult:
    """What one ``modify_kv`` did: ``total_tokens`` edited down to ``kept_tokens``.

    ``suffix_tokens`` is how many tokens wait to be re-sent; ``stored`` is False when the server
    already held every chunk of the edit; ``skipped`` is True when the stream had no whole chunk.
    """

    total_tokens: int
    kept_tokens: int
    suffix_tokens: int
    stored: bool
    duration: float
    skipped: bool = False

    @property
    def prompt_tokens(self) -> int:
        """The whole sequence the edit saw: the edited prefix plus the tokens after it."""
        return self.total_tokens + self.suffix_tokens

    @property
    def kept_fraction(self) -> float:
        """Kept share of the whole sequence (the tail is never dropped); 1.0 when skipped."""
        total = self.prompt_tokens
        return (self.kept_tokens + self.suffix_tokens) / total if total else 1.0


def create_request(
    contexts: Iterable[Context] | Context,
    post_completion: PostCompletion,
    prompt_token_ids: Sequence[int],
    cache_salt: str = "",
    *,
    protected_tokens: int = 0,
) -> RequestStream:
    """A new request stream over ``contexts`` (one per cache kind, e.g. KV and QUERY).

    ``protected_tokens``: the first tokens of the prompt (e.g. a system prompt) that no edit may
    drop; edit functions see it as ``EditContext.protected`` and the stream checks the result.
    """
    return RequestStream(
        contexts, post_completion, prompt_token_ids, cache_salt, protected_tokens=protected_tokens
    )


class RequestStream:
    """One logical request across several engine passes; see the module docstring for the rules.

    Thread-safe: operations (generate, modify, update, retrieve) on one stream run one at a time;
    the read-only properties never wait for a running operation.
    """

    def __init__(
        self,
        contexts: Iterable[Context] | Context,
        post_completion: PostCompletion,
        prompt_token_ids: Sequence[int],
        cache_salt: str = "",
        *,
        protected_tokens: int = 0,
    ) -> None:
        if hasattr(contexts, "kind") and hasattr(contexts, "retrieve"):
            contexts = [contexts]  # type: ignore[list-item]
        self._contexts: dict[CacheKind, Context] = {}
        for ctx in contexts:  # type: ignore[union-attr]
            kind = CacheKind.parse(getattr(ctx, "kind", None))
            if kind in self._contexts:
                raise ValueError(f"two contexts for cache kind {kind.value!r}; pass one per kind")
            self._contexts[kind] = ctx
        if not callable(post_completion):
            raise TypeError(
                f"post_completion must be callable, got {type(post_completion).__name__}"
            )
        if not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        prompt = token_ids(prompt_token_ids, "prompt_token_ids")
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if not is_int(protected_tokens) or protected_tokens < 0:
            raise ValueError(f"protected_tokens must be an int >= 0, got {protected_tokens!r}")
        self.post_completion = post_completion
        self.cache_salt = cache_salt
        self.protected_tokens = min(protected_tokens, len(prompt))
        self.prompt_token_ids: list[int] = prompt
        self._request_stream_id = uuid.uuid4().hex
        self._edit_salt: str | None = None  # set by the first edit (see active_cache_salt)
        self._prefix: list[int] = list(prompt)
        self._suffix: list[int] = []
        self._output_tokens: list[int] = []
        self._text_parts: list[str] = []
        self._done = False
        self._finish_reason: str | None = None
        # Chunk-aligned tokens the server should hold once the engine's stores land (async
        # engines); None until the first generate/update.
        self._expected_cached: int | None = None
        self._op_lock = threading.RLock()  # one operation at a time
        self._state = threading.Lock()  # guards the token lists, held only briefly

    # ----------------------------------------------------------------- read-only state
    @property
    def request_stream_id(self) -> str:
        """Unique id of this stream (a uuid4 hex string)."""
        return self._request_stream_id

    @property
    def active_cache_salt(self) -> str:
        """The salt the next call uses: ``cache_salt`` until the first edit, then the stream's
        own :func:`edit_salt` (its edited KV is nobody else's)."""
        return self._edit_salt if self._edit_salt is not None else self.cache_salt

    @property
    def contexts(self) -> dict[CacheKind, Context]:
        """The stream's contexts by cache kind."""
        return dict(self._contexts)

    @property
    def tokens(self) -> list[int]:
        """The prompt the next ``generate`` sends: prefix (kept / cached) + suffix."""
        with self._state:
            return self._prefix + self._suffix

    @property
    def suffix_tokens(self) -> list[int]:
        """Tokens after the edited prefix that the next ``generate`` re-sends (empty otherwise)."""
        with self._state:
            return list(self._suffix)

    @property
    def decoded_tokens(self) -> int:
        """How many tokens were generated so far over all ``generate`` calls."""
        return len(self._output_tokens)

    @property
    def output_tokens(self) -> list[int]:
        """The whole token sequence, as upstream: prompt (or kept tokens) plus every token
        generated since, without a suffix still waiting to be re-sent. A copy."""
        with self._state:
            return list(self._prefix)

    @property
    def generated_tokens(self) -> list[int]:
        """Every generated token id, in order, over all ``generate`` calls (kvdrop's)."""
        with self._state:
            return list(self._output_tokens)

    @property
    def output_text(self) -> str:
        """The generated text (concatenated ``TokenEvent.text``)."""
        with self._state:
            return "".join(self._text_parts)

    @property
    def is_done(self) -> bool:
        """True once the engine stopped on its own (``finish_reason == "stop"``)."""
        return self._done

    done = is_done

    @property
    def finish_reason(self) -> str | None:
        """The last ``finish_reason`` the engine reported (None if it never reported one)."""
        return self._finish_reason

    def __repr__(self) -> str:
        return (
            f"RequestStream(id={self._request_stream_id[:8]}, tokens={len(self._prefix)}"
            f"+{len(self._suffix)}, decoded={self.decoded_tokens}, done={self._done})"
        )

    # ----------------------------------------------------------------- generate
    def generate(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        suffix_tokens: Sequence[int] = (),
    ) -> StreamPerfMetrics:
        """Send ``tokens`` (plus extra ``suffix_tokens``, e.g. a next user turn) to the engine,
        collect its tokens and time them.

        Tokens received before an engine failure are kept; the failure is raised as
        ``RequestStreamError`` (naming the stream).
        """
        extra = token_ids(suffix_tokens, "suffix_tokens")
        if sampling_params is None:
            sampling_params = {}
        if not isinstance(sampling_params, Mapping):
            raise TypeError(
                f"sampling_params must be a mapping, got {type(sampling_params).__name__}"
            )
        params = dict(sampling_params)
        max_tokens = params.get("max_tokens")
        if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
            raise ValueError(
                f"sampling_params['max_tokens'] must be an int >= 1, got {max_tokens!r}"
            )
        with self._op_lock:
            if self._done:
                raise RequestStreamError(
                    f"stream {self._request_stream_id} is done (engine finished with "
                    f"{self._finish_reason!r}); create a new request to continue"
                )
            with self._state:
                prompt = self._prefix + self._suffix + extra
                self._prefix = list(prompt)
                self._suffix = []
            chunk = self._chunk_size()
            self._expected_cached = (len(prompt) // chunk) * chunk if chunk else 0

            generated: list[int] = []
            times: list[float] = []
            reason: str | None = None
            start = time.perf_counter()
            events: Any = None
            try:
                events = self.post_completion(list(prompt), params, self.active_cache_salt)
                for event in events:
                    now = time.perf_counter()
                    token_id = getattr(event, "token_id", None)
                    if not is_int(token_id):
                        raise TypeError(
                            f"post_completion yielded {type(event).__name__} without an int "
                            f"token_id; expected TokenEvent"
                        )
                    stamp = getattr(event, "time", None)
                    # Trust the engine's own timestamp only when it is on our clock.
                    ok = isinstance(stamp, float) and start <= stamp <= now
                    times.append(stamp if ok else now)  # type: ignore[arg-type]
                    generated.append(token_id)
                    with self._state:
                        self._prefix.append(token_id)
                        self._output_tokens.append(token_id)
                        self._text_parts.append(str(getattr(event, "text", "") or ""))
                    reason = getattr(event, "finish_reason", None) or reason
            except Exception as exc:
                self._expected_cached = None  # unknown what the engine stored: do not wait
                raise RequestStreamError(
                    f"stream {self._request_stream_id} failed during generation after "
                    f"{len(generated)} token(s): {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                # Release the engine's side (cancel the request, close a connection) at once.
                close = getattr(events, "close", None)
                if callable(close):
                    try:
                        close()
                    except Exception:
                        logger.warning("closing the engine's token stream failed", exc_info=True)
            duration = time.perf_counter() - start

            self._finish_reason = reason
            if reason is not None:
                self._done = reason == "stop"
            else:  # upstream's rule: fewer tokens than asked for (default 1) means EOS
                self._done = len(generated) < (1 if max_tokens is None else max_tokens)

        gaps = [b - a for a, b in itertools.pairwise(times)]
        return StreamPerfMetrics(
            duration=duration,
            input_tokens=len(prompt),
            output_tokens=len(generated),
            input_tput=len(prompt) / duration if duration > 0 else 0.0,
            output_tput=len(generated) / duration if duration > 0 else 0.0,
            ttft=(times[0] - start) if times else 0.0,
            tpot=gaps,
        )

    # ----------------------------------------------------------------- retrieve / update
    def retrieve(
        self, kind: Any, timeout: float = 30.0, poll_interval: float = 0.2
    ) -> torch.Tensor:
        """The cached ``kind`` tensor of the longest chunk-aligned prefix of ``tokens``, polling
        every ``poll_interval`` seconds for up to ``timeout`` until one is cached (as upstream).

        ``kind`` is a ``CacheKind``, any enum of the same value (LMCache's) or "kv"/"query".
        Raises ``RequestStreamError`` when nothing is cached by then.
        """
        kind = self._parse_kind(kind)
        ctx = self._context(kind)
        deadline = time.monotonic() + max(float(timeout), 0.0)
        while True:
            tokens = self.tokens
            tensor = ctx.retrieve(tokens, self.active_cache_salt)
            if tensor is not None and tensor.shape[2] > 0:
                return tensor
            if time.monotonic() >= deadline:
                raise RequestStreamError(
                    f"stream {self._request_stream_id}: no cached {kind.value} for its "
                    f"{len(tokens)} tokens after {timeout:g}s"
                )
            time.sleep(poll_interval)

    def retrieve_all(self) -> KindMap | None:
        """Every context's tensor for the longest cached chunk-aligned prefix of ``tokens``, all
        cut to the same (shortest) length (kvdrop's); None when no KV is cached. Other kinds with
        nothing cached (e.g. queries of an engine in the lean mode) are left out."""
        with self._op_lock:
            got = self._retrieve_all(self.tokens)
        return None if got is None else KindMap(got[0])

    def update(
        self,
        kind: Any,
        kv: torch.Tensor,
        tokens: Sequence[int],
        *,
        replaces: int | None = None,
    ) -> bool:
        """Store an edited ``kind`` tensor under ``tokens`` and make ``tokens`` the stream's
        prefix (upstream's signature; afterwards the stream is not done).

        The edit replaces the first ``replaces`` tokens of the stream's ``tokens`` (default: the
        currently cached chunk-aligned prefix, as ``retrieve`` returned it); the rest become
        ``suffix_tokens`` (upstream drops them). Returns the store's result (False: the server
        already held every chunk).
        """
        kind = self._parse_kind(kind)
        with self._op_lock:
            current = self.tokens
            if replaces is None:
                replaces = self._cached_len(current)
            if not 0 <= replaces <= len(current):
                raise RequestStreamError(
                    f"replaces={replaces} is outside the stream's {len(current)} tokens"
                )
            new_tokens = self._check_tokens(tokens, "tokens")
            ctx = self._context(kind)
            self._check_tensor(kind, kv, new_tokens, self._layout_reference(ctx, kind))
            stored = self._store_and_commit({kind: kv}, new_tokens, current[replaces:], 30.0)
            self._done = False
            return stored

    # ----------------------------------------------------------------- modify
    def modify_kv(
        self,
        fn: ModifyFnType,
        timeout: float = 30.0,
        poll_interval: float = 0.2,
        *,
        device: str | None = None,
    ) -> ModifyResult:
        """Edit the cached chunk-aligned prefix with ``fn`` and store the result back.

        Waits up to ``timeout`` seconds (polling every ``poll_interval``) for the last prompt's
        whole chunks to appear (engines may store asynchronously; a synchronous engine's are
        there at once), then edits whatever is cached. A stream whose tokens or last
        prompt had no whole chunk is left as it is (``skipped``). ``device`` reaches ``fn`` as
        ``EditContext.device`` (where to score). Raises ``RequestStreamError`` when nothing is
        cached (e.g. before any generate), ``fn`` fails, or its output is invalid; the stream
        and the server are then unchanged.
        """
        if not callable(fn):
            raise TypeError(f"modify function must be callable, got {type(fn).__name__}")
        start = time.perf_counter()
        with self._op_lock:
            kv_ctx = self._context(CacheKind.KV)
            current = self.tokens
            chunk = self._chunk_size()
            if len(current) < chunk:
                return ModifyResult(0, 0, len(self._suffix), False, 0.0, skipped=True)
            got = self._retrieve_when_cached(current, timeout, poll_interval, kinds=(CacheKind.KV,))
            if got is None and self._expected_cached == 0:
                # The last prompt had no whole chunk: there was never anything to edit.
                return ModifyResult(0, 0, len(self._suffix), False, 0.0, skipped=True)
            if got is None:
                raise RequestStreamError(
                    f"stream {self._request_stream_id}: the server holds no cached chunk of its "
                    f"{len(current)} tokens (chunk size {chunk}); run generate()/prefill first "
                    "(and check the engine stores its KV in this server under this model name "
                    "and cache_salt)"
                )
            tensors, cached = got
            with_context = takes_edit_context(fn)
            query_positions = query_lse = None
            q_ctx = self._contexts.get(CacheKind.QUERY)
            if q_ctx is not None and getattr(fn, "needs_query", True) is not False:
                query, query_positions, query_lse, cached = self._queries(
                    q_ctx, current, cached, with_context
                )
                if query is not None:
                    tensors[CacheKind.QUERY] = query
                kv = tensors[CacheKind.KV]
                if kv.shape[2] != cached:
                    tensors[CacheKind.KV] = kv[:, :, :cached].contiguous()
            kept_input = list(current[:cached])
            scores = self._token_scores(fn, current) if with_context else None
            try:
                if with_context:
                    context = self._edit_context(
                        kv_ctx, cached, len(current), query_positions, query_lse, device, scores
                    )
                    result = fn(KindMap(tensors), kept_input, context=context)  # type: ignore[call-arg]
                else:
                    result = fn(KindMap(tensors), kept_input)
            except Exception as exc:
                raise RequestStreamError(
                    f"stream {self._request_stream_id}: edit function failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(result, tuple) or len(result) != 2:
                raise RequestStreamError(
                    f"stream {self._request_stream_id}: edit function must return "
                    f"(kv, tokens), got {type(result).__name__}"
                )
            new_kv, new_tokens_raw = result
            try:
                new_tokens = self._check_tokens(new_tokens_raw, "tokens returned by fn")
            except (TypeError, ValueError) as exc:
                raise RequestStreamError(f"stream {self._request_stream_id}: {exc}") from None
            self._check_tensor(CacheKind.KV, new_kv, new_tokens, tensors[CacheKind.KV])
            protected = min(self.protected_tokens, cached)
            if new_tokens[:protected] != kept_input[:protected]:
                raise RequestStreamError(
                    f"stream {self._request_stream_id}: the edit dropped some of the first "
                    f"{protected} (protected) tokens; an edit must keep the protected prefix "
                    "(kvdrop policies read it from EditContext.protected)"
                )
            stored = self._store_and_commit(
                {CacheKind.KV: new_kv}, new_tokens, current[cached:], timeout
            )
            return ModifyResult(
                total_tokens=cached,
                kept_tokens=len(new_tokens),
                suffix_tokens=len(self._suffix),
                stored=stored,
                duration=time.perf_counter() - start,
            )

    def _queries(
        self, q_ctx: Any, tokens: list[int], cached: int, with_context: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int]:
        """``(query, positions, lse, T)`` for an edit of the first ``cached`` tokens (see the
        module docstring): chunk queries (upstream layout, cut to a common ``T`` with the KV)
        and/or the engine's window of the call that produced ``tokens`` (kvdrop servers only)."""
        salt = self.active_cache_salt
        dense = q_ctx.retrieve(tokens, salt)
        if dense is not None and dense.shape[2] == 0:
            dense = None
        window = None
        if isinstance(q_ctx, Context) and (with_context or dense is None):
            window = retrieve_window(q_ctx, tokens, salt)
        if dense is not None:
            cached = min(cached, int(dense.shape[2]))
            if dense.shape[2] != cached:
                dense = dense[:, :, :cached].contiguous()
            if not with_context:
                return dense, None, None, cached
            positions = torch.arange(cached)
            lse = None
            if window is not None:
                later = window.positions >= cached
                if bool(later.any()):
                    dense = torch.cat([dense, window.queries[:, :, later]], dim=2)
                    positions = torch.cat([positions, window.positions[later]])
                    if window.lse is not None:  # unknown (NaN) for the chunk rows
                        known = window.lse[:, :, later]
                        unknown = torch.full(
                            (1, known.shape[1], cached, known.shape[3]), float("nan")
                        )
                        lse = torch.cat([unknown, known], dim=2)
            return dense, positions, lse, cached
        if window is None:
            return None, None, None, cached
        if not with_context:
            _warn_plain_window(self._request_stream_id)
            return None, None, None, cached
        return window.queries, window.positions, window.lse, cached

    def _token_scores(self, fn: Any, tokens: list[int]) -> torch.Tensor | None:
        """The engine's per-token scores of the call over ``tokens`` for an ``fn`` that declares
        ``token_scores`` (kvdrop servers only: read through the query context), else None."""
        if not (isinstance(fn, DeclaresTokenScores) and fn.token_scores):
            return None
        q_ctx = self._contexts.get(CacheKind.QUERY)
        if not isinstance(q_ctx, Context):
            return None
        found = retrieve_scores(q_ctx, tokens, self.active_cache_salt)
        return None if found is None else found.scores

    def _edit_context(
        self,
        kv_ctx: Any,
        cached: int,
        prompt_tokens: int,
        query_positions: torch.Tensor | None,
        query_lse: torch.Tensor | None,
        device: str | None,
        token_scores: torch.Tensor | None = None,
    ) -> EditContext:
        layout = getattr(kv_ctx, "layout", None)
        if isinstance(kv_ctx, Context) and layout is not None and layout.rope is None:
            # The engine may have registered its RoPE after this context read the layout.
            try:
                layout = kv_ctx.register_caches()
            except SDKError:
                pass
        return EditContext(
            positions=torch.arange(cached),
            query_positions=query_positions,
            query_lse=query_lse,
            rope=getattr(layout, "rope", None),
            prompt_tokens=prompt_tokens,
            protected=min(self.protected_tokens, cached),
            device=device,
            head_dim=getattr(layout, "head_dim", None),
            chunk_size=int(kv_ctx.chunk_size),
            request_id=self._request_stream_id,
            token_scores=token_scores,
        )

    # ----------------------------------------------------------------- helpers
    def _context(self, kind: CacheKind) -> Context:
        try:
            return self._contexts[kind]
        except KeyError:
            have = ", ".join(k.value for k in self._contexts) or "none"
            raise RequestStreamError(
                f"stream {self._request_stream_id} has no {kind.value!r} context (has: {have}); "
                f"pass one to create_request"
            ) from None

    def _chunk_size(self) -> int:
        ctx = self._contexts.get(CacheKind.KV) or next(iter(self._contexts.values()), None)
        return int(ctx.chunk_size) if ctx is not None else 0

    def _parse_kind(self, kind: Any) -> CacheKind:
        try:
            return CacheKind.parse(kind)
        except ValueError as exc:
            raise RequestStreamError(f"stream {self._request_stream_id}: {exc}") from None

    def _lookup(self, ctx: Any, tokens: list[int], salt: str | None = None) -> int:
        """Cached chunk-aligned tokens of ``tokens`` in ``ctx`` (under ``salt``, default the
        active one): its ``lookup`` when it has one (kvdrop's), else the length ``retrieve``
        returns (``lmcache.sdk``'s contexts)."""
        salt = self.active_cache_salt if salt is None else salt
        lookup = getattr(ctx, "lookup", None)
        if callable(lookup):
            return int(lookup(tokens, salt))
        tensor = ctx.retrieve(tokens, salt)
        return 0 if tensor is None else int(tensor.shape[2])

    def _cached_len(self, tokens: list[int]) -> int:
        """Chunk-aligned cached length of the KV (queries may legitimately hold nothing), or
        the length common to every context without a KV one (0 without contexts)."""
        kv_ctx = self._contexts.get(CacheKind.KV)
        if kv_ctx is not None:
            return self._lookup(kv_ctx, tokens)
        if not self._contexts:
            return 0
        return min(self._lookup(ctx, tokens) for ctx in self._contexts.values())

    def _retrieve_when_cached(
        self,
        tokens: list[int],
        timeout: float,
        poll_interval: float,
        kinds: Sequence[CacheKind] | None = None,
    ) -> tuple[dict[CacheKind, torch.Tensor], int] | None:
        """``_retrieve_all(tokens, kinds)`` once the last prompt's whole chunks are cached, or
        whatever is cached when ``timeout`` runs out."""
        chunk = self._chunk_size()
        expected = min(self._expected_cached or 0, (len(tokens) // chunk) * chunk)
        deadline = time.monotonic() + max(timeout, 0.0)
        kv_ctx = self._contexts[CacheKind.KV]
        salt = self.active_cache_salt
        if callable(getattr(kv_ctx, "lookup", None)):
            while (
                expected > 0
                and kv_ctx.lookup(tokens, salt) < expected
                and time.monotonic() < deadline
            ):
                time.sleep(poll_interval)
            return self._retrieve_all(tokens, kinds)
        while True:  # no cheap lookup (lmcache.sdk's contexts): poll by retrieving, as upstream
            got = self._retrieve_all(tokens, kinds)
            have = 0 if got is None else got[1]
            if expected <= 0 or have >= expected or time.monotonic() >= deadline:
                return got
            time.sleep(poll_interval)

    def _retrieve_all(
        self, tokens: list[int], kinds: Sequence[CacheKind] | None = None
    ) -> tuple[dict[CacheKind, torch.Tensor], int] | None:
        """Tensors of ``kinds`` (default every context's) cut to their common cached length;
        None when the KV (or, without a KV context, any kind) has nothing cached."""
        if not self._contexts:
            raise RequestStreamError(
                f"stream {self._request_stream_id} has no contexts; pass them to create_request"
            )
        got: dict[CacheKind, torch.Tensor] = {}
        salt = self.active_cache_salt
        for kind, ctx in self._contexts.items():
            if kinds is not None and kind not in kinds:
                continue
            tensor = ctx.retrieve(tokens, salt)
            if tensor is None or tensor.shape[2] == 0:
                if kind is CacheKind.KV or CacheKind.KV not in self._contexts:
                    return None
                continue
            got[kind] = tensor
        if not got:
            return None
        common = min(t.shape[2] for t in got.values())
        for kind, tensor in got.items():
            if tensor.shape[2] != common:
                got[kind] = tensor[:, :, :common].contiguous()
        return got, common

    def _await_visible(self, ctx: Any, tokens: list[int], timeout: float, salt: str) -> None:
        """Poll until ``ctx`` serves the whole chunks just stored under ``tokens``.

        An LMCache server acknowledges a store before it commits it; without this wait the next
        request (the decode after a modify) could miss the edit and recompute the kept tokens.
        kvdrop's server commits before it answers (its contexts have ``lookup``; no wait).
        """
        whole = len(tokens) // self._chunk_size() * self._chunk_size()
        deadline = time.monotonic() + max(timeout, 0.0)
        while self._lookup(ctx, tokens, salt) < whole:
            if time.monotonic() >= deadline:
                logger.warning(
                    "stream %s: the server does not serve the %d stored tokens after %gs",
                    self._request_stream_id,
                    whole,
                    timeout,
                )
                return
            time.sleep(0.005)

    def _check_tokens(self, tokens: Any, what: str) -> list[int]:
        out = token_ids(tokens, what)
        if not out:
            raise ValueError(f"{what} must not be empty (an edit must keep at least one chunk)")
        return out

    def _layout_reference(self, ctx: Context, kind: CacheKind) -> torch.Tensor | None:
        """A 1-token meta tensor with the context's layout (shape/dtype), for validation."""
        layout = getattr(ctx, "layout", None)
        if layout is None:
            return None
        shape = tuple(layout.shape(kind, 1))
        return torch.empty(shape, dtype=layout.dtype, device="meta")

    def _check_tensor(
        self,
        kind: CacheKind,
        tensor: Any,
        tokens: list[int],
        reference: torch.Tensor | None,
    ) -> None:
        """Raise ``RequestStreamError`` unless ``tensor`` can be stored under ``tokens``."""
        sid = self._request_stream_id
        if not isinstance(tensor, torch.Tensor):
            raise RequestStreamError(
                f"stream {sid}: {kind.value} must be a torch.Tensor, got {type(tensor).__name__}"
            )
        lead = 1 if kind is CacheKind.QUERY else 2
        if tensor.dim() != 4 or tensor.shape[0] != lead:
            raise RequestStreamError(
                f"stream {sid}: {kind.value} tensor must be [{lead}, L, T, D], "
                f"got {list(tensor.shape)}"
            )
        if reference is not None:
            if tensor.shape[1] != reference.shape[1] or tensor.shape[3] != reference.shape[3]:
                raise RequestStreamError(
                    f"stream {sid}: {kind.value} tensor has L={tensor.shape[1]}, "
                    f"D={tensor.shape[3]}; expected L={reference.shape[1]}, "
                    f"D={reference.shape[3]} (shape {list(tensor.shape)})"
                )
            if tensor.dtype != reference.dtype:
                raise RequestStreamError(
                    f"stream {sid}: {kind.value} tensor has dtype {tensor.dtype}; expected "
                    f"{reference.dtype}"
                )
        t = tensor.shape[2]
        if len(tokens) != t:
            raise RequestStreamError(
                f"stream {sid}: {len(tokens)} tokens for a {kind.value} tensor of T={t}; "
                "the edit must return one token id per kept row"
            )
        chunk = int(self._contexts[kind].chunk_size)
        if t == 0 or t % chunk:
            raise RequestStreamError(
                f"stream {sid}: edited {kind.value} has T={t} tokens, not a non-zero multiple of "
                f"the chunk size {chunk}; round the kept budget to whole chunks"
            )

    def _store_and_commit(
        self,
        tensors: dict[CacheKind, torch.Tensor],
        tokens: list[int],
        suffix: list[int],
        timeout: float = 30.0,
    ) -> bool:
        """Store an edit under the stream's own salt, then make ``tokens`` its prefix."""
        salt = edit_salt(self.cache_salt, self._request_stream_id)
        results: dict[CacheKind, bool] = {}
        for kind in sorted(tensors, key=lambda k: k is CacheKind.KV):  # KV last
            ctx = self._contexts[kind]
            try:
                results[kind] = bool(ctx.store(tensors[kind], tokens, salt))
                if results[kind] and not callable(getattr(ctx, "lookup", None)):
                    self._await_visible(ctx, tokens, timeout, salt)
            except Exception as exc:  # kvdrop's SDKError or lmcache.sdk's LMCacheSDKError
                raise RequestStreamError(
                    f"stream {self._request_stream_id}: storing the edited {kind.value} "
                    f"failed: {exc}"
                ) from exc
        stored = results.get(CacheKind.KV, any(results.values()))
        if not stored:
            logger.warning(
                "stream %s: the server already held every chunk of the edit (first copy wins); "
                "an edit that keeps the same tokens is not stored",
                self._request_stream_id,
            )
        with self._state:
            self._prefix = list(tokens)
            self._suffix = list(suffix)
            self._edit_salt = salt
        self._expected_cached = len(tokens)
        return stored
