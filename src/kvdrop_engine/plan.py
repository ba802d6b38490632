"""A request's plan: what the engine does with it, decided once at submission.

:func:`plan_request` builds the frozen :class:`RequestPlan`: the prompt cut and the decode cut
its options and the engine's defaults give it, the window the connector stores, and the
ordered actions after prefill (store the prompt, cut it) and after the last token (store the
decoded chunks, the window, kvzip's scores), each an object of the module that owns it;
``Engine._ship`` walks them. The request itself keeps only its progress.

What a request captures while it runs is the plan's too (:meth:`RequestPlan.window`; the
request's one writer of it is ``Request.restart_window``). Two readers want a request's query
rows: the prompt cut after prefill (its policy's
:class:`~kvdrop_sdk.query_capture.Needs`, sized by ``--query-window`` / ``--query-stride``
through :meth:`QueryCapture.for_policies`) and the connector's window store (the
:class:`QueryCapture` it was built with, where it stores windows). :func:`window_for` joins
them into the one :class:`~kvdrop_engine.capture.WindowCapture` the request keeps: every row
the cut reads (all prompt rows for a ``FULL`` reader, else the wider of both windows) and the
store's strided sample. After the cut the kept keys sit at new positions, so the window
restarts on the kept sequence with the store's sizes (:func:`window_after_cut`): the stored
window then holds the rows computed after the cut.

A third reader, the cut while decoding (:mod:`kvdrop_engine.decode_cut`), reads the last rows
computed since its previous cut: its ``decode`` capture widens the window the same way, and the
window restarts after each of its cuts (such a request stores no window).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvdrop_engine.capture import WindowCapture
from kvdrop_sdk.query_capture import QueryCapture

__all__ = [
    "NO_PLAN",
    "RequestPlan",
    "ShipHost",
    "Shipped",
    "plan_request",
    "store_capture",
    "window_after_cut",
    "window_for",
]


def store_capture(
    capture: QueryCapture, stores_windows: bool, transfer_query: bool
) -> QueryCapture | None:
    """The window a bound connector stores per request (None: it stores none). Only a connector
    that stores windows and talks queries with its server keeps one; the others (an LMCache
    server's) take every prompt query in chunks, the upstream layout."""
    if stores_windows and transfer_query and capture.enabled:
        return capture
    return None


def window_for(
    num_prompt: int,
    cut: QueryCapture | None,
    store: QueryCapture | None,
    decode: QueryCapture | None = None,
) -> WindowCapture | None:
    """The one window a request of ``num_prompt`` tokens keeps for its ``cut``'s policy, the
    connector's window ``store`` and its ``decode`` cut's policy (each None: not wanted); None
    when none reads a row."""
    reads = cut is not None and cut.enabled
    decode = decode if decode is not None and decode.enabled else None
    if not reads and store is None and decode is None:
        return None
    if reads and cut is not None and cut.full:
        return WindowCapture(num_prompt, num_prompt, 0)  # every prompt row
    sizes = [c for c in (cut if reads else None, store, decode) if c is not None]
    window = max(c.window for c in sizes)
    stride = (store if store is not None else sizes[0]).stride
    return WindowCapture(num_prompt, window, stride)


def window_after_cut(
    num_kept: int, store: QueryCapture | None, decode: QueryCapture | None = None
) -> WindowCapture | None:
    """The window a request keeps once its cache was cut to ``num_kept`` tokens: the store's
    and its decode cut's, over the kept sequence (the rows captured before sit at positions the
    cache no longer has)."""
    return window_for(num_kept, None, store, decode)


@dataclass(frozen=True)
class RequestPlan:
    """What the engine does with one request, decided once at submission
    (:func:`plan_request`) and never changed: its prompt ``cut`` after prefill (a
    :class:`~kvdrop_engine.drop.PromptCut`, None: kept whole), its ``decode`` cut (a
    :class:`~kvdrop_engine.decode_cut.DecodeCut`, None: none), the query window the connector
    stores for it (``store``), and the ordered actions that run ``after_prefill`` (as the first
    token is handed over) and ``after_finish`` (before the last one is), each an object of
    the module that owns it with ``run(host, req, step) -> held``. Whether it loads a cached
    prefix is ``load``; the :class:`~kvdrop_engine.scheduler.PrefixPlan` of admission says what.
    """

    cut: Any = None
    decode: Any = None
    store: QueryCapture | None = None
    load: bool = False
    after_prefill: tuple[Any, ...] = ()
    after_finish: tuple[Any, ...] = ()

    def window(self, num_tokens: int, *, cut_pending: bool) -> WindowCapture | None:
        """The one query capture of the request over its first ``num_tokens`` positions: the
        rows of its prompt cut while that is ``cut_pending``, the stored window's, the decode
        cut's (:func:`window_for`)."""
        cut = self.cut.capture if cut_pending and self.cut is not None else None
        decode = None if self.decode is None else self.decode.capture
        return window_for(num_tokens, cut, self.store, decode)

    @property
    def stores_window(self) -> bool:
        """Whether the request's query window goes to the server when it ends."""
        return self.store is not None


#: The plan of a request that asked for nothing (and of one built by hand).
NO_PLAN = RequestPlan()


@dataclass
class Shipped:
    """One step's result of one request, as the plan's actions see it: the sampled ``token``
    and its ``logprobs``, the finish ``reason`` (None: it goes on), the query ``windows`` the
    step computed for the requests it ends, and the ``event`` about to be handed over (set
    before the ``after_finish`` actions run)."""

    token: int
    logprobs: Any
    reason: str | None
    windows: Mapping[int, Any]
    event: Any = None


class ShipHost(Protocol):
    """What the plan's actions use of the engine."""

    runner: Any
    connector: Any
    reconstruction: Any

    @property
    def transfers(self) -> Any: ...

    def start_cut(self, req: Any, token: int, logprobs: Any) -> None: ...

    def add_seconds(self, counter: str, seconds: float) -> None: ...


def plan_request(
    req: Any,
    *,
    dropper: Any,
    compressor: Any,
    connector: Any,
    store: QueryCapture | None,
) -> RequestPlan:
    """``req``'s plan (validated at submission: an override the engine cannot serve is an
    ``InvalidRequestError``): the cuts its options and the engine's defaults give it, then the
    actions in their order -- store the prompt, cut it; store the decoded chunks, the window,
    and score the prompt (kvzip's pass, when asked)."""
    from kvdrop_engine.decode_cut import prepare_decode
    from kvdrop_engine.drop import CutPrompt, prepare_cut
    from kvdrop_engine.reconstruct import ScorePrompt
    from kvdrop_engine.transfer import StoreDecoded, StorePrompt, StoreWindow

    options = req.options
    cut = prepare_cut(dropper, req, options.prompt_cut)
    decode = prepare_decode(compressor, req, options.decode_cut)
    if decode is not None:  # its cache no longer matches its tokens at the end
        store = None
    after_prefill: list[Any] = []
    after_finish: list[Any] = []
    if connector is not None:
        after_prefill.append(StorePrompt())
        if connector.store_decoded and decode is None:
            after_finish.append(StoreDecoded())
        if store is not None:
            after_finish.append(StoreWindow())
        if options.reconstruct:
            after_finish.append(ScorePrompt())
    if cut is not None:
        after_prefill.append(CutPrompt())
    return RequestPlan(
        cut, decode, store, connector is not None, tuple(after_prefill), tuple(after_finish)
    )
