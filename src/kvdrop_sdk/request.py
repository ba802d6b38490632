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
  declares it takes one (``kvdrop_sdk.edit.accepts_edit_context``; every kvdrop policy does) --
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
  ``queries`` is ``QueryNeed.NONE`` get no query tensor.
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
from kvdrop_sdk.capabilities import KeepsOnServer, KnowsLayout
from kvdrop_sdk.context import Context
from kvdrop_sdk.edit import (
    EditContext,
    EditQueries,
    ModifyFnType,
    ModifyResult,
    call_edit,
    call_keep_plan,
    check_edit_tensor,
    check_edit_tokens,
    edit_salt,
    takes_edit_context,
)
from kvdrop_sdk.errors import RequestStreamError
from kvdrop_sdk.events import PostCompletion, TokenEvent
from kvdrop_sdk.foreign import Closeable, StreamContext, as_token_event
from kvdrop_sdk.keep import EditPath, KeepPlan, KeepsRows, edit_path
from kvdrop_sdk.protocol import check_salt
from kvdrop_sdk.query_capture import KVNeed, Needs, needs_of
from kvdrop_sdk.stream_contexts import StreamContexts, edit_device
from kvdrop_sdk.validate import is_int, token_ids
from kvdrop_sdk.window import scores_for

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
_KV_ONLY = (CacheKind.KV,)


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
        self._request_stream_id = uuid.uuid4().hex
        self._cache = StreamContexts(contexts, self._request_stream_id)
        if not callable(post_completion):
            raise TypeError(
                f"post_completion must be callable, got {type(post_completion).__name__}"
            )
        check_salt(cache_salt)
        prompt = token_ids(prompt_token_ids, "prompt_token_ids")
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if not is_int(protected_tokens) or protected_tokens < 0:
            raise ValueError(f"protected_tokens must be an int >= 0, got {protected_tokens!r}")
        self.post_completion = post_completion
        self.cache_salt = cache_salt
        self.protected_tokens = min(protected_tokens, len(prompt))
        self.prompt_token_ids: list[int] = prompt
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
    def contexts(self) -> dict[CacheKind, Any]:
        """The stream's contexts by cache kind."""
        return self._cache.given()

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
    def _collect(
        self, events: Any, start: float, generated: list[int], times: list[float]
    ) -> str | None:
        """Append the engine's tokens (and their times) to ``generated``/``times`` and to the
        stream's state as they arrive; returns the finish reason seen (None: none)."""
        reason: str | None = None
        for raw in events:
            now = time.perf_counter()
            event = as_token_event(raw)
            stamp = event.time
            # Trust the engine's own timestamp only when it is on our clock.
            ok = isinstance(stamp, float) and start <= stamp <= now
            times.append(stamp if ok else now)
            generated.append(event.token_id)
            with self._state:
                self._prefix.append(event.token_id)
                self._output_tokens.append(event.token_id)
                self._text_parts.append(str(event.text or ""))
            reason = event.finish_reason or reason
        return reason

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
        params = _checked_params(sampling_params)
        max_tokens = params.get("max_tokens")
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
            chunk = self._cache.chunk_size()
            self._expected_cached = (len(prompt) // chunk) * chunk if chunk else 0

            generated: list[int] = []
            times: list[float] = []
            reason: str | None = None
            start = time.perf_counter()
            events: Any = None
            try:
                events = self.post_completion(list(prompt), params, self.active_cache_salt)
                reason = self._collect(events, start, generated, times)
            except Exception as exc:
                self._expected_cached = None  # unknown what the engine stored: do not wait
                raise RequestStreamError(
                    f"stream {self._request_stream_id} failed during generation after "
                    f"{len(generated)} token(s): {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                # Release the engine's side (cancel the request, close a connection) at once.
                if isinstance(events, Closeable):
                    try:
                        events.close()
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
        ctx = self._cache.get(kind)
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
            got = self._cache.retrieve_all(self.tokens, self.active_cache_salt)
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
                replaces = self._cache.cached_len(current, self.active_cache_salt)
            if not 0 <= replaces <= len(current):
                raise RequestStreamError(
                    f"replaces={replaces} is outside the stream's {len(current)} tokens"
                )
            new_tokens = check_edit_tokens(tokens, "tokens")
            ctx = self._cache.get(kind)
            reference = None
            if isinstance(ctx, KnowsLayout):
                ref = ctx.layout.shape(kind, 1)
                reference = (ref[1], ref[3], ctx.layout.dtype)
            chunk = int(ctx.chunk_size)
            check_edit_tensor(kind, kv, new_tokens, reference, chunk, self._request_stream_id)
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
        edit_timeout: float | None = None,
        kv_path: str = "auto",
    ) -> ModifyResult:
        """Edit the cached chunk-aligned prefix with ``fn`` and store the result back.

        Waits up to ``timeout`` seconds (polling every ``poll_interval``) for the last prompt's
        whole chunks to appear (engines may store asynchronously; a synchronous engine's are
        there at once), then edits whatever is cached. A stream whose tokens or last
        prompt had no whole chunk is left as it is (``skipped``). ``device``: where ``fn`` runs
        (own stream) with the KV, stored back from there (``edit_transfer``; default: the host)
        and ``EditContext.device``. ``edit_timeout`` bounds ``fn`` itself
        (``EditTimeoutError`` after that many seconds; None: unbounded). Raises
        ``RequestStreamError`` when nothing is cached (e.g. before any generate), ``fn`` fails,
        or its output is invalid; the stream and the server are then unchanged.

        ``kv_path`` (kvdrop's; the rule is :func:`~kvdrop_sdk.keep.edit_path`): ``"least"``
        moves only what ``fn`` reads (an index-only or keys-only kvdrop policy on a kvdrop
        server: the server keeps the rows; on a GPU edit the kept keys are re-rotated on the GPU
        and only they are stored back, the values gathered by index in shared memory);
        ``"client"`` / ``"server"`` re-rotate here / on the server on any device; ``"full"``
        always fetches the whole KV and stores what ``fn`` returns (upstream's path);
        ``"auto"`` (default) is ``least`` but for a keys-reading edit on a GPU (``full``: the
        fastest measured there). ``ModifyResult.path``, ``kv_bytes`` and
        ``fetch_s`` / ``edit_s`` / ``store_s`` say which path ran, what it moved and where
        its time went.
        """
        if not callable(fn):
            raise TypeError(f"modify function must be callable, got {type(fn).__name__}")
        dev = edit_device(device)
        start = time.perf_counter()
        with self._op_lock:
            kv_ctx = self._cache.get(CacheKind.KV)
            try:
                path = edit_path(fn, kv_ctx, kv_path, dev)
            except ValueError as exc:
                raise RequestStreamError(f"stream {self._request_stream_id}: {exc}") from None
            current = self.tokens
            chunk = self._cache.chunk_size()
            if len(current) < chunk:
                return ModifyResult(0, 0, len(self._suffix), False, 0.0, skipped=True)
            expected = min(self._expected_cached or 0, (len(current) // chunk) * chunk)
            salt = self.active_cache_salt
            fetched = 0
            timer = _Phases(start)
            if path is EditPath.FULL:
                got = self._cache.retrieve_when_cached(
                    current, salt, expected, timeout, poll_interval, _KV_ONLY, dev
                )
                if got is not None:
                    fetched = got[0][CacheKind.KV].nbytes
            else:
                fetch = path
                if path is EditPath.CLIENT:  # what it reads: the keys, or nothing yet
                    fetch = EditPath.KEYS if needs_of(fn).kv is KVNeed.KEYS else EditPath.INDEX
                reads = self._cache.retrieve_reads(
                    current, salt, expected, timeout, poll_interval, fetch, dev
                )
                got, fetched = (None, 0) if reads is None else reads
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
            needs, with_context = needs_of(fn), takes_edit_context(fn)
            queries = self._cache.add_queries(tensors, current, salt, needs, with_context)
            timer.mark("fetch_s")
            cached = int(tensors[CacheKind.KV].shape[2])
            kept_input = list(current[:cached])
            context = None
            if with_context:
                context = self._edit_context(kv_ctx, cached, current, queries, device, needs)
            sid = self._request_stream_id
            if path is not EditPath.FULL:
                assert isinstance(fn, KeepsRows)
                plan = call_keep_plan(fn, tensors, kept_input, context, sid, edit_timeout, dev)
                timer.mark("edit_s")
                keys = tensors[CacheKind.KV][:1] if fetched else None
                return self._keep_on_server(
                    plan, kept_input, current, salt, path, fetched, timer, keys, dev
                )
            new_kv, new_tokens = call_edit(fn, tensors, kept_input, context, sid, edit_timeout, dev)
            timer.mark("edit_s")
            edited = tensors[CacheKind.KV]
            reference = (edited.shape[1], edited.shape[3], edited.dtype)
            check_edit_tensor(CacheKind.KV, new_kv, new_tokens, reference, chunk, sid)
            self._check_protected(new_tokens, kept_input)
            stored = self._store_and_commit(
                {CacheKind.KV: new_kv}, new_tokens, current[cached:], timeout
            )
            timer.mark("store_s")
            return ModifyResult(
                total_tokens=cached,
                kept_tokens=len(new_tokens),
                suffix_tokens=len(self._suffix),
                stored=stored,
                duration=time.perf_counter() - start,
                path=path.value,
                kv_bytes=fetched + new_kv.nbytes,
                **timer.parts,
            )

    def _check_protected(self, new_tokens: list[int], kept_input: list[int]) -> None:
        protected = min(self.protected_tokens, len(kept_input))
        if new_tokens[:protected] != kept_input[:protected]:
            raise RequestStreamError(
                f"stream {self._request_stream_id}: the edit dropped some of the first "
                f"{protected} (protected) tokens; an edit must keep the protected prefix "
                "(kvdrop policies read it from EditContext.protected)"
            )

    def _keep_on_server(
        self,
        plan: KeepPlan,
        kept_input: list[int],
        current: list[int],
        salt: str,
        path: EditPath,
        fetched: int,
        timer: _Phases,
        keys: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> ModifyResult:
        """Have the server store the rows ``plan`` keeps of the cached ``kept_input`` under the
        stream's edit salt (:mod:`kvdrop_sdk.keep`), after the checks a returned edit gets. On
        the ``CLIENT`` path the kept keys are re-rotated here, on ``device`` (from ``keys``, the
        prefix's keys when fetched), unless none moves or no RoPE is known: then there is
        nothing to re-rotate and the server's keep is a plain copy."""
        sid, cached = self._request_stream_id, len(kept_input)
        index = plan.index
        if (
            not isinstance(index, torch.Tensor)
            or index.dim() != 1
            or index.is_floating_point()
            or index.numel() == 0
        ):
            raise RequestStreamError(f"stream {sid}: a keep plan's index must be 1-D integers")
        index = index.to(device="cpu", dtype=torch.int64)
        if int(index.min()) < 0 or int(index.max()) >= cached:
            raise RequestStreamError(
                f"stream {sid}: kept indices must lie in [0, {cached}) (the cached rows)"
            )
        new_tokens = [kept_input[i] for i in index.tolist()]
        chunk = self._cache.chunk_size()
        if len(new_tokens) % chunk:
            raise RequestStreamError(
                f"stream {sid}: the edit keeps {len(new_tokens)} tokens, not a non-zero "
                f"multiple of the chunk size {chunk}; round the kept budget to whole chunks"
            )
        self._check_protected(new_tokens, kept_input)
        dst = edit_salt(self.cache_salt, sid)
        ctx = self._cache.get(CacheKind.KV)
        assert isinstance(ctx, KeepsOnServer)
        moves = plan.rope is not None and not torch.equal(index, torch.arange(index.numel()))
        try:
            if path is EditPath.CLIENT and moves:
                stored, moved = ctx.keep_rows(
                    kept_input,
                    KeepPlan(index, plan.rope),
                    salt,
                    dst_salt=dst,
                    device=device,
                    keys=keys,
                )
                fetched += moved
            else:
                stored = ctx.keep(kept_input, KeepPlan(index, plan.rope), salt, dst_salt=dst)
        except Exception as exc:  # kvdrop's SDKError (RpcError: bad_index, not_cached, ...)
            raise RequestStreamError(
                f"stream {sid}: the server could not keep the edited kv: {exc}"
            ) from exc
        self._commit(new_tokens, current[cached:], dst, stored)
        timer.mark("store_s")
        return ModifyResult(
            total_tokens=cached,
            kept_tokens=len(new_tokens),
            suffix_tokens=len(self._suffix),
            stored=stored,
            duration=time.perf_counter() - timer.start,
            path=path.value,
            kv_bytes=fetched,
            **timer.parts,
        )

    def _edit_context(
        self,
        kv_ctx: StreamContext,
        cached: int,
        tokens: list[int],
        queries: EditQueries | None,
        device: str | None,
        needs: Needs,
    ) -> EditContext:
        layout = self._cache.kv_layout()
        scores = None
        if needs.token_scores:
            q_ctx = self._cache.by_kind.get(CacheKind.QUERY)
            scores = scores_for(q_ctx, tokens, self.active_cache_salt)
        return EditContext(
            positions=torch.arange(cached),
            query_positions=None if queries is None else queries.positions,
            query_lse=None if queries is None else queries.lse,
            rope=None if layout is None else layout.rope,
            prompt_tokens=len(tokens),
            protected=min(self.protected_tokens, cached),
            device=device,
            head_dim=None if layout is None else layout.head_dim,
            chunk_size=int(kv_ctx.chunk_size),
            request_id=self._request_stream_id,
            token_scores=scores,
        )

    # ----------------------------------------------------------------- helpers
    def _parse_kind(self, kind: Any) -> CacheKind:
        try:
            return CacheKind.parse(kind)
        except ValueError as exc:
            raise RequestStreamError(f"stream {self._request_stream_id}: {exc}") from None

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
            try:
                results[kind] = self._cache.store(kind, tensors[kind], tokens, salt, timeout)
            except Exception as exc:  # kvdrop's SDKError or lmcache.sdk's LMCacheSDKError
                raise RequestStreamError(
                    f"stream {self._request_stream_id}: storing the edited {kind.value} "
                    f"failed: {exc}"
                ) from exc
        stored = results.get(CacheKind.KV, any(results.values()))
        self._commit(tokens, suffix, salt, stored)
        return stored

    def _commit(self, tokens: list[int], suffix: list[int], salt: str, stored: bool) -> None:
        """Make the stored edit the stream's prefix (under its edit ``salt``)."""
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


class _Phases:
    """Where one edit's time went: each :meth:`mark` charges the time since the last one
    (from ``start``) to a part (``fetch_s``, ``edit_s``, ``store_s`` of :class:`ModifyResult`)."""

    def __init__(self, start: float) -> None:
        self.start = self._last = start
        self.parts: dict[str, float] = {}

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._last
        self._last = now


def _checked_params(sampling_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """``generate``'s sampling parameters as a dict; its ``max_tokens`` (the one value the
    stream itself reads) an int >= 1 when given."""
    if sampling_params is None:
        return {}
    if not isinstance(sampling_params, Mapping):
        raise TypeError(f"sampling_params must be a mapping, got {type(sampling_params).__name__}")
    params = dict(sampling_params)
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise ValueError(f"sampling_params['max_tokens'] must be an int >= 1, got {max_tokens!r}")
    return params
