"""The edit-function contract shared by the SDK and every kvdrop policy, and one edit's inputs
and result checks as the SDK builds them.

An edit function is ``fn(tensors, tokens) -> (kv, kept_tokens)`` (:data:`ModifyFnType`, as
upstream). A function that wants to know more about the request -- where its rows sit (RoPE
positions), which positions its query rows belong to, how long the whole prompt is, the model's
RoPE parameters -- declares it once with :func:`accepts_edit_context` (or a true
``accepts_edit_context`` attribute, as every kvdrop policy has); the SDK then calls
``fn(tensors, tokens, context=EditContext(...))``. Plain functions keep getting
``fn(tensors, tokens)``.

The rest of the module is the SDK's side of one edit, kept out of the request stream's token
bookkeeping: :func:`merge_queries` (the query rows a function gets: chunk queries and/or the
engine's window, with NaN log-normalisers where unknown), :func:`call_edit` (call the function
the way it declared) and :func:`check_edit_tensor` / :func:`check_edit_tokens` (what may be
stored).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvdrop_sdk.cache_kind import CacheKind, KindMap, kind_value
from kvdrop_sdk.errors import EditTimeoutError, RequestStreamError
from kvdrop_sdk.keep import KeepPlan, KeepsRows
from kvdrop_sdk.protocol import EDIT_SCOPE, scoped_salt
from kvdrop_sdk.validate import check_fields, is_int, token_ids

__all__ = [
    "EDIT_CONTEXT_ATTR",
    "EditContext",
    "EditQueries",
    "ModifyFnType",
    "ModifyResult",
    "accepts_edit_context",
    "call_edit",
    "call_keep_plan",
    "check_edit_tensor",
    "check_edit_tokens",
    "edit_salt",
    "get_tensor",
    "merge_queries",
    "takes_edit_context",
    "warn_plain_window",
]

#: An edit function: given the retrieved tensors of one request (``{KV: [2, L, T, D]}`` and
#: optionally ``{QUERY: [1, L, W, Dq]}``) and its T chunk-aligned token ids, return the edited KV
#: ``[2, L, T', D]`` and the T' token ids it is stored under.
ModifyFnType = Callable[
    [Mapping[CacheKind, torch.Tensor], Sequence[int]], tuple[torch.Tensor, Sequence[int]]
]

#: The marker attribute: an edit function whose ``accepts_edit_context`` is True is called with
#: ``context=EditContext(...)``.
EDIT_CONTEXT_ATTR = "accepts_edit_context"

_F = TypeVar("_F", bound=Callable[..., Any])
logger = logging.getLogger(__name__)
_warned_plain_window = False


def accepts_edit_context(fn: _F) -> _F:
    """Mark ``fn`` (a function or callable object) as taking ``context=EditContext``; returns it."""
    setattr(fn, EDIT_CONTEXT_ATTR, True)
    return fn


def takes_edit_context(fn: Any) -> bool:
    """Whether ``fn`` declared that it takes ``context=`` (see :func:`accepts_edit_context`)."""
    return getattr(fn, EDIT_CONTEXT_ATTR, False) is True


def _int_vector(value: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"EditContext.{name} must be a 1-D integer tensor, got {value!r}")
    t = t.to(device="cpu", dtype=torch.int64)
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"EditContext.{name} must be non-negative")
    return t


@dataclass(frozen=True)
class EditContext:
    """What the SDK knows about one edit beyond ``(tensors, tokens)``.

    - ``positions`` ``[T]``: the RoPE position of each KV row. The engine reads a cached prefix as
      positions ``0..T-1``, so this is ``arange(T)`` for a fresh prompt and after a re-rotated
      edit (the SDK does not track the angles of keys an earlier edit left un-rotated).
    - ``query_positions`` ``[W]``: the position of each row of ``tensors[QUERY]``, strictly
      increasing; rows may lie past ``T`` (the uncached tail and tokens generated so far). None
      when no query tensor is passed.
    - ``query_lse`` ``[1, L, W, Hq]`` float32: per query row, layer and head, the log-sum-exp of
      the row's scaled attention logits over every key it attended to when the engine computed
      it, the uncached tail's keys included; ``exp(q.k / sqrt(d) - lse)`` is then its true
      attention probability on a cached key. NaN where unknown (e.g. chunk-stored queries).
    - ``rope``: the RoPE parameters the engine registered with the layout (a JSON dict, see
      ``CacheLayout.rope``), or None when unknown.
    - ``prompt_tokens``: length of the whole sequence the next call sends (cached prefix +
      uncached tail + generated tokens), so budgets can be of the whole prompt.
    - ``protected``: the first tokens that must never be dropped (e.g. a system prompt).
    - ``device``: where the caller wants scoring to run (None: the function decides).
    - ``head_dim`` and ``chunk_size``: from the layout and the server, when known.
    - ``request_id``: the request stream's id (for logs).
    - ``token_scores`` ``[L, H, S]`` float32: per-token importance the engine computed with the
      model for the call's first ``S`` tokens (KVzip's reconstruction pass; see
      ``kvdrop_sdk.window.TokenScores``), for policies that declare ``token_scores``; ``S`` may
      be more or fewer than the ``T`` KV rows (tokens decoded after the pass have none).
    """

    positions: torch.Tensor
    query_positions: torch.Tensor | None = None
    query_lse: torch.Tensor | None = None
    rope: Mapping[str, Any] | None = None
    prompt_tokens: int | None = None
    protected: int = 0
    device: str | None = None
    head_dim: int | None = None
    chunk_size: int | None = None
    request_id: str = ""
    token_scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        pos = _int_vector(self.positions, "positions")
        object.__setattr__(self, "positions", pos)
        num_tokens = pos.numel()
        if self.query_positions is not None:
            qpos = _int_vector(self.query_positions, "query_positions")
            if qpos.numel() > 1 and bool((qpos[1:] <= qpos[:-1]).any()):
                raise ValueError("EditContext.query_positions must be strictly increasing")
            object.__setattr__(self, "query_positions", qpos)
        lse = self.query_lse
        if lse is not None:
            rows = None if self.query_positions is None else self.query_positions.numel()
            if (
                not isinstance(lse, torch.Tensor)
                or lse.dim() != 4
                or lse.shape[0] != 1
                or not lse.is_floating_point()
                or (rows is not None and lse.shape[2] != rows)
            ):
                raise ValueError(
                    "EditContext.query_lse must be a float [1, L, W, Hq] tensor with one row per "
                    f"query position, got {getattr(lse, 'shape', lse)!r}"
                )
        if self.prompt_tokens is None:
            object.__setattr__(self, "prompt_tokens", num_tokens)
        if not is_int(self.prompt_tokens) or self.prompt_tokens < num_tokens:
            raise ValueError(
                f"EditContext.prompt_tokens must be an int >= the {num_tokens} KV rows, got "
                f"{self.prompt_tokens!r}"
            )
        if not is_int(self.protected) or self.protected < 0:
            raise ValueError(f"EditContext.protected must be an int >= 0, got {self.protected!r}")
        if self.rope is not None and not isinstance(self.rope, Mapping):
            raise ValueError(f"EditContext.rope must be a mapping or None, got {self.rope!r}")
        check_fields(self, optional_ints={"head_dim": 1, "chunk_size": 1})
        ts = self.token_scores
        if ts is not None and (
            not isinstance(ts, torch.Tensor) or ts.dim() != 3 or not ts.is_floating_point()
        ):
            raise ValueError(
                "EditContext.token_scores must be a float [L, H, S] tensor, got "
                f"{getattr(ts, 'shape', ts)!r}"
            )
        if self.device is not None and not isinstance(self.device, str):
            object.__setattr__(self, "device", str(self.device))

    @classmethod
    def of(cls, num_tokens: int, **fields: Any) -> EditContext:
        """A context for a fresh ``num_tokens``-row prefix (positions ``0..T-1``)."""
        return cls(positions=torch.arange(num_tokens), **fields)

    @property
    def num_tokens(self) -> int:
        """KV rows handed to the function (``T``)."""
        return int(self.positions.numel())


def get_tensor(tensors: Mapping[Any, torch.Tensor], kind: CacheKind) -> torch.Tensor | None:
    """Look up ``kind`` in a mapping keyed by any enum (or string) whose value matches."""
    for key, value in tensors.items():
        if kind_value(key) == kind.value:
            return value
    return None


@dataclass(frozen=True)
class EditQueries:
    """The query rows one edit function gets, with their positions and log-normalisers.

    ``rows`` is ``T``: the KV rows the edit covers (chunk queries may shorten it)."""

    query: torch.Tensor | None
    positions: torch.Tensor | None
    lse: torch.Tensor | None
    rows: int


def merge_queries(
    dense: torch.Tensor | None,
    window: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
    cached: int,
    with_context: bool,
) -> EditQueries:
    """The queries for an edit of the first ``cached`` KV rows.

    ``dense`` are the chunk-stored queries (upstream's layout, cut to a common ``T`` with the
    KV); ``window`` the engine's ``(queries, positions, lse)`` of the call (kvdrop servers). A
    function with an edit context gets the chunk rows followed by the window's rows past them
    (their log-normalisers NaN: unknown), or the window alone; a plain function gets only chunk
    rows, or nothing when only a window exists (``query`` None with ``window`` given: the caller
    may say why).
    """
    if dense is not None and dense.shape[2] == 0:
        dense = None
    if dense is None:
        if window is None or not with_context:
            return EditQueries(None, None, None, cached)
        return EditQueries(window[0], window[1], window[2], cached)
    cached = min(cached, int(dense.shape[2]))
    if dense.shape[2] != cached:
        dense = dense[:, :, :cached].contiguous()
    if not with_context:
        return EditQueries(dense, None, None, cached)
    positions = torch.arange(cached)
    lse = None
    if window is not None:
        rows, wpos, wlse = window
        later = wpos >= cached
        if bool(later.any()):
            dense = torch.cat([dense, rows[:, :, later]], dim=2)
            positions = torch.cat([positions, wpos[later]])
            if wlse is not None:  # unknown (NaN) for the chunk rows
                known = wlse[:, :, later]
                unknown = torch.full((1, known.shape[1], cached, known.shape[3]), float("nan"))
                lse = torch.cat([unknown, known], dim=2)
    return EditQueries(dense, positions, lse, cached)


def call_edit(
    fn: ModifyFnType,
    tensors: Mapping[CacheKind, torch.Tensor],
    tokens: list[int],
    context: EditContext | None,
    stream_id: str,
    timeout: float | None = None,
    device: torch.device | None = None,
) -> tuple[Any, list[int]]:
    """Call ``fn`` (with ``context=`` when given) and return its ``(kv, tokens)``, the token ids
    checked; RequestStreamError naming the stream when it fails or returns something else.

    On a CUDA ``device`` the call runs on a stream of its own (edits of concurrent streams
    overlap on the GPU instead of queueing on the default stream), complete on return.

    With a ``timeout`` the call runs in a daemon thread that is abandoned after ``timeout``
    seconds (:class:`~kvdrop_sdk.errors.EditTimeoutError`): Python cannot stop a running
    function, so a hung one keeps its thread, but its late result is dropped and nothing is
    stored.
    """

    def call() -> Any:
        with _edit_stream(device, tensors.values()):
            if context is not None:
                return fn(KindMap(tensors), tokens, context=context)  # type: ignore[call-arg]
            return fn(KindMap(tensors), tokens)

    result = _run_edit(call, timeout, stream_id)
    if not isinstance(result, tuple) or len(result) != 2:
        raise RequestStreamError(
            f"stream {stream_id}: edit function must return (kv, tokens), got "
            f"{type(result).__name__}"
        )
    new_kv, raw = result
    try:
        return new_kv, check_edit_tokens(raw, "tokens returned by fn")
    except (TypeError, ValueError) as exc:
        raise RequestStreamError(f"stream {stream_id}: {exc}") from None


def _run_edit(call: Callable[[], Any], timeout: float | None, stream_id: str) -> Any:
    """``call()`` within ``timeout`` (EditTimeoutError after it); any other failure of the
    edit function as a RequestStreamError naming the stream."""
    try:
        return call() if timeout is None else _bounded(call, timeout, stream_id)
    except EditTimeoutError:
        raise
    except Exception as exc:
        raise RequestStreamError(
            f"stream {stream_id}: edit function failed: {type(exc).__name__}: {exc}"
        ) from exc


def call_keep_plan(
    fn: KeepsRows,
    tensors: Mapping[CacheKind, torch.Tensor],
    tokens: list[int],
    context: EditContext | None,
    stream_id: str,
    timeout: float | None = None,
    device: torch.device | None = None,
) -> KeepPlan:
    """:func:`call_edit` for an edit the server applies: ``fn.keep_plan(...)``, its result
    checked to be a :class:`~kvdrop_sdk.keep.KeepPlan` (RequestStreamError naming the stream
    otherwise, or when it fails)."""

    def call() -> Any:
        with _edit_stream(device, tensors.values()):
            return fn.keep_plan(KindMap(tensors), tokens, context=context)

    result = _run_edit(call, timeout, stream_id)
    if not isinstance(result, KeepPlan):
        raise RequestStreamError(
            f"stream {stream_id}: keep_plan must return a KeepPlan, got {type(result).__name__}"
        )
    return result


@contextlib.contextmanager
def _edit_stream(device: torch.device | None, inputs: Iterable[torch.Tensor]) -> Iterator[None]:
    """Run the body on a pooled CUDA stream of ``device`` and wait for it at the end (no-op
    off CUDA). Inputs made on another stream (the SDK's copy stream) are marked as used here,
    so the caching allocator does not hand their memory out while this stream reads them."""
    if device is None or device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)  # from torch's per-device pool: cheap
    stream.wait_stream(torch.cuda.current_stream(device))
    for tensor in inputs:
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()


def _bounded(call: Callable[[], Any], timeout: float, stream_id: str) -> Any:
    """``call()`` in a daemon thread, waited for at most ``timeout`` seconds."""
    box: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            box.append((True, call()))
        except BaseException as exc:  # handed to the waiting caller below
            box.append((False, exc))

    worker = threading.Thread(target=target, name=f"kvdrop-edit-{stream_id[:8]}", daemon=True)
    worker.start()
    worker.join(max(float(timeout), 0.0))
    if worker.is_alive() or not box:
        raise EditTimeoutError(
            f"stream {stream_id}: the edit function did not return within {timeout:g}s; it was "
            "abandoned (its thread may still run; a late result is dropped), and the stream and "
            "the server are unchanged. Raise modify(timeout=...) for slow edits"
        )
    ok, value = box[0]
    if not ok:
        raise value
    return value


def check_edit_tokens(tokens: Any, what: str) -> list[int]:
    """The token ids of an edit as ints; ValueError/TypeError when empty or not ids."""
    out = token_ids(tokens, what)
    if not out:
        raise ValueError(f"{what} must not be empty (an edit must keep at least one chunk)")
    return out


def check_edit_tensor(
    kind: CacheKind,
    tensor: Any,
    tokens: list[int],
    reference: tuple[int, int, torch.dtype] | None,
    chunk: int,
    stream_id: str,
) -> None:
    """Raise RequestStreamError unless ``tensor`` can be stored under ``tokens``.

    ``reference`` is ``(L, D, dtype)`` of the layout (or of the tensor that was edited);
    the kept rows must be a non-zero multiple of the server's ``chunk`` size.
    """
    sid = stream_id
    if not isinstance(tensor, torch.Tensor):
        raise RequestStreamError(
            f"stream {sid}: {kind.value} must be a torch.Tensor, got {type(tensor).__name__}"
        )
    lead = 1 if kind is CacheKind.QUERY else 2
    if tensor.dim() != 4 or tensor.shape[0] != lead:
        raise RequestStreamError(
            f"stream {sid}: {kind.value} tensor must be [{lead}, L, T, D], got {list(tensor.shape)}"
        )
    if reference is not None:
        layers, width, dtype = reference
        if tensor.shape[1] != layers or tensor.shape[3] != width:
            raise RequestStreamError(
                f"stream {sid}: {kind.value} tensor has L={tensor.shape[1]}, "
                f"D={tensor.shape[3]}; expected L={layers}, D={width} (shape "
                f"{list(tensor.shape)})"
            )
        if tensor.dtype != dtype:
            raise RequestStreamError(
                f"stream {sid}: {kind.value} tensor has dtype {tensor.dtype}; expected {dtype}"
            )
    t = tensor.shape[2]
    if len(tokens) != t:
        raise RequestStreamError(
            f"stream {sid}: {len(tokens)} tokens for a {kind.value} tensor of T={t}; the edit "
            "must return one token id per kept row"
        )
    if t == 0 or t % chunk:
        raise RequestStreamError(
            f"stream {sid}: edited {kind.value} has T={t} tokens, not a non-zero multiple of "
            f"the chunk size {chunk}; round the kept budget to whole chunks"
        )


def warn_plain_window(stream_id: str) -> None:
    """Log once: a plain edit function gets no query tensor when only a window exists."""
    global _warned_plain_window
    if _warned_plain_window:
        return
    _warned_plain_window = True
    logger.warning(
        "stream %s: the engine saved only a query window (lean query mode), which a plain edit "
        "function fn(tensors, tokens) cannot place; it gets no query tensor. Mark it with "
        "kvdrop_sdk.edit.accepts_edit_context to receive the window and its positions "
        "(context.query_positions), or run the engine with full query capture",
        stream_id,
    )


@dataclass(frozen=True)
class ModifyResult:
    """What one ``modify_kv`` did: ``total_tokens`` edited down to ``kept_tokens``, moving
    ``kv_bytes`` of KV over ``path``.

    ``suffix_tokens`` is how many tokens wait to be re-sent; ``stored`` is False when the server
    already held every chunk of the edit; ``skipped`` is True when the stream had no whole chunk.
    """

    total_tokens: int
    kept_tokens: int
    suffix_tokens: int
    stored: bool
    duration: float
    skipped: bool = False
    #: How the KV travelled (:class:`~kvdrop_sdk.keep.EditPath` value): "full", "keys", "index".
    path: str = "full"
    #: KV bytes that crossed between the server and this process for the edit (fetched +
    #: stored): 0 for an index-only edit, the keys for a keys-only one.
    kv_bytes: int = 0
    #: Where ``duration`` went: waiting for and fetching the KV (and queries) the edit reads,
    #: the edit function (or its keep plan), and storing the result (or the server's keep).
    fetch_s: float = 0.0
    edit_s: float = 0.0
    store_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        """The whole sequence the edit saw: the edited prefix plus the tokens after it."""
        return self.total_tokens + self.suffix_tokens

    @property
    def kept_fraction(self) -> float:
        """Kept share of the whole sequence (the tail is never dropped); 1.0 when skipped."""
        total = self.prompt_tokens
        return (self.kept_tokens + self.suffix_tokens) / total if total else 1.0


def edit_salt(cache_salt: str, request_stream_id: str) -> str:
    """The salt a stream's edited KV lives under: its own, so no other request can read it
    (``f"{cache_salt}.edit.{request_stream_id}"``; the rule is
    :func:`kvdrop_sdk.protocol.scoped_salt`'s). Engines count it as ``cache_salt``'s tenant
    (:func:`kvdrop_sdk.protocol.tenant_salt`)."""
    return scoped_salt(cache_salt, f"{EDIT_SCOPE}.{request_stream_id}")
