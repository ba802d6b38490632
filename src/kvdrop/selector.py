"""The selector shared by every scoring policy: budget, always-kept tokens, chunk alignment.

A policy only says how much each token is worth (a ``[T]`` score, higher = keep). The selector
turns scores into one kept-token list for the whole request (all layers and heads: the cache is
keyed by token ids, so per-head selection cannot be stored).

The edit sees the ``T`` cached (chunk-aligned) tokens of a prompt of ``N >= T`` tokens; the other
``N - T`` (the uncached tail, and tokens generated so far) are recomputed by the engine and never
dropped, so they count as kept: the kept fraction of the whole prompt is ``(k + N - T) / N``.

1. budget ``k`` of the cached part: ``keep_ratio * T`` or ``keep_tokens``, aligned DOWN to a
   multiple of ``chunk_size`` and never below one chunk (nor below the protected prefix, rounded
   up to whole chunks); if ``k >= T`` the input is returned unchanged. Policies warn when that
   keeps far less of the whole prompt than asked (alignment at short lengths);
2. forced tokens: the protected prefix (never dropped), the last ``window`` tokens of the whole
   prompt that are cached (``window - (N - T)`` of them, the tail holds the rest) and the first
   ``n_sink`` (attention sinks). If they exceed ``k``, protected come first, then the most recent,
   then sinks;
3. the rest of the budget goes to the highest-scoring remaining tokens (ties: earlier token first);
   with ``chunked=True`` whole chunks are picked by the sum of their token scores (ChunkKV-style);
4. kept indices are sorted, and KV rows and token ids are gathered at exactly those indices.

Steps 2-3 are one order over all tokens, :meth:`Selector.ranking`; the kept tokens are its first
``k``. Compositions cut several rankings at their shares of one budget, so there is exactly one
implementation of the order. Without an edit context ``N == T``: the plain upstream behaviour.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdrop.device import device_ok
from kvdrop.errors import PolicyParamError
from kvdrop.inputs import EditInputs
from kvdrop.params import Param, param, params_of_dataclass
from kvdrop_rope import RopeConfig
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import QueryNeed

__all__ = ["DEFAULT_KEEP_RATIO", "SELECTOR_PARAMS", "Selection", "Selector"]

#: The fraction kept when neither ``keep_ratio`` nor ``keep_tokens`` is given (by a policy's
#: parameters, its spec string or a command's ``--keep-ratio``: :func:`kvdrop.spec.keep_budget`).
DEFAULT_KEEP_RATIO = 0.5


def _positive(x: int) -> bool:
    return x > 0


def _non_negative(x: int) -> bool:
    return x >= 0


@dataclass(frozen=True)
class Selector:
    """Budget and selection rules (see the module docstring); built from validated parameters.

    Its fields are the parameters every scoring policy accepts (:data:`SELECTOR_PARAMS` is read
    from them; a policy may change the defaults)."""

    keep_ratio: float | None = param(
        None,
        f"fraction of tokens to keep (default {DEFAULT_KEEP_RATIO} when keep_tokens is not given)",
        allowed="0 < r <= 1",
        check=lambda r: 0 < r <= 1,
    )
    keep_tokens: int | None = param(
        None,
        "number of tokens to keep (instead of keep_ratio)",
        allowed="an int >= 1",
        check=lambda n: n >= 1,
    )
    chunk_size: int = param(
        256,
        "the server's chunk size: the kept count is a multiple of it",
        allowed="an int >= 1",
        check=_positive,
    )
    n_sink: int = param(
        0, "first tokens always kept (attention sinks)", allowed="an int >= 0", check=_non_negative
    )
    window: int = param(
        0, "last tokens always kept (recent window)", allowed="an int >= 0", check=_non_negative
    )
    chunked: bool = param(
        False,
        "select whole chunks by the sum of their token scores "
        "(ChunkKV-style) instead of single tokens",
    )
    device: str = param(
        "auto",
        "where scores are computed: 'auto' (the edit context's device, else CUDA when available, "
        "else where the tensors are), or a torch device ('cpu', 'cuda', 'cuda:1'); only the "
        "kept indices come back",
        allowed="'auto' or a torch device string",
        check=device_ok,
    )

    def __post_init__(self) -> None:
        if self.keep_ratio is not None and self.keep_tokens is not None:
            raise PolicyParamError(
                f"give keep_ratio or keep_tokens, not both (got keep_ratio={self.keep_ratio}, "
                f"keep_tokens={self.keep_tokens})"
            )
        if self.keep_ratio is None and self.keep_tokens is None:
            object.__setattr__(self, "keep_ratio", DEFAULT_KEEP_RATIO)

    def requested(self, num_tokens: int, prompt_tokens: int | None = None) -> float:
        """Tokens of the whole prompt this selector is asked to keep (unaligned):
        ``keep_ratio`` of all ``prompt_tokens``, or ``keep_tokens`` plus the tail (never
        dropped)."""
        total = num_tokens if prompt_tokens is None else max(prompt_tokens, num_tokens)
        if self.keep_tokens is not None:
            return float(min(self.keep_tokens, num_tokens) + total - num_tokens)
        assert self.keep_ratio is not None
        return self.keep_ratio * total

    def budget(self, num_tokens: int, protected: int = 0) -> int:
        """Cached tokens to keep out of ``num_tokens``: chunk-aligned down, at least one chunk
        and the protected prefix, at most ``T``."""
        if self.keep_tokens is not None:
            raw = self.keep_tokens
        else:
            assert self.keep_ratio is not None
            # A tiny epsilon keeps e.g. 0.3 * 1000 == 300 from flooring to 299.
            raw = int(self.keep_ratio * num_tokens + 1e-9)
        c = self.chunk_size
        aligned = max(c, raw - raw % c)
        if protected:
            aligned = max(aligned, -(-min(protected, num_tokens) // c) * c)
        return min(aligned, num_tokens)

    def selection(
        self,
        inputs: EditInputs | int,
        budget: int | None = None,
        *,
        queries: QueryNeed = QueryNeed.WINDOW,
        device: torch.device | None = None,
        rope: RopeConfig | None = None,
        **fields: Any,
    ) -> Selection:
        """What this selector keeps of one request's ``inputs``, at ``budget`` tokens (default:
        its own budget) for a scorer that reads ``queries`` on ``device``; ``rope``: the RoPE
        parameters its keys carry (the policy's). A bare token count builds shape-only inputs
        from the edit-context ``fields`` it is given (``prompt_tokens``, ``query_positions``,
        ``head_dim``, ...: tests, docs and the form before issue 24)."""
        if not isinstance(inputs, EditInputs):
            inputs = _bare_inputs(int(inputs), fields)
        elif fields:
            raise TypeError(f"selection() of EditInputs takes no fields, got {sorted(fields)}")
        if budget is None:
            budget = self.budget(inputs.num_tokens, inputs.protected)
        return Selection(self, budget, inputs, QueryNeed(queries), device, rope)

    def ranking(
        self, scores: torch.Tensor, *, prompt_tokens: int | None = None, protected: int = 0
    ) -> torch.Tensor:
        """Every token index in the order this selector keeps them, given ``[T]`` scores.

        Protected tokens first, then the forced recent tokens (most recent first), then sinks,
        then by score (ties: earlier first; NaN ranks lowest). Chunked selectors rank whole chunks
        the same way by the sum of their token scores; a partial tail chunk comes last.
        :meth:`select` keeps a prefix of it.
        """
        scores = torch.nan_to_num(scores.detach().to(torch.float32).cpu(), nan=-torch.inf)
        num_tokens = scores.shape[0]
        total = num_tokens if prompt_tokens is None else max(prompt_tokens, num_tokens)
        recent = max(0, min(num_tokens, self.window - (total - num_tokens)))
        protected = min(protected, num_tokens)
        if not self.chunked:
            return _token_ranking(scores, self.n_sink, recent, protected)
        c = self.chunk_size
        n_chunks = num_tokens // c
        full = n_chunks * c
        chunk_scores = scores[:full].view(n_chunks, c).sum(dim=1)
        sink_chunks = -(-min(self.n_sink, full) // c)
        window_chunks = -(-min(recent, full) // c)
        protected_chunks = -(-min(protected, full) // c)
        order = _token_ranking(chunk_scores, sink_chunks, window_chunks, protected_chunks)
        tokens = (order[:, None] * c + torch.arange(c)).reshape(-1)
        return torch.cat([tokens, torch.arange(full, num_tokens)])

    def select(
        self,
        scores: torch.Tensor,
        budget: int | None = None,
        *,
        prompt_tokens: int | None = None,
        protected: int = 0,
    ) -> torch.Tensor:
        """Sorted int64 indices of the kept tokens: the first ``budget`` of :meth:`ranking`."""
        num_tokens = scores.shape[0]
        k = self.budget(num_tokens, protected) if budget is None else budget
        if k >= num_tokens:
            return torch.arange(num_tokens)
        order = self.ranking(scores, prompt_tokens=prompt_tokens, protected=protected)
        return torch.sort(order[:k]).values


def _bare_inputs(num_tokens: int, fields: dict[str, Any]) -> EditInputs:
    """Shape-only inputs of ``num_tokens`` rows (and query rows at ``query_positions``) whose
    context holds ``fields``."""
    qpos = fields.get("query_positions")
    query = None if qpos is None else torch.empty(1, 0, len(qpos), 0)
    kv = torch.empty(2, 0, num_tokens, 0)
    if not fields:
        return EditInputs(kv)
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(EditContext)})
    if unknown:
        raise TypeError(f"selection() got unknown edit-context fields {unknown}")
    given = {k: v for k, v in fields.items() if v is not None}
    given["prompt_tokens"] = max(num_tokens, int(given.get("prompt_tokens") or 0))
    return EditInputs(kv, query).with_context(**given)


@dataclass(frozen=True, init=False)
class Selection:
    """What the selector keeps of one request, handed to scorers that declare
    ``needs_selection = True`` (e.g. H2O gives a share of ``budget`` to recent tokens, SnapKV
    observes the last ``window`` queries): the selector's rules, the ``budget`` (the number of
    cached tokens this scorer's ranking will be cut at; in a composition, the part's share) and
    the edit's inputs, read through (nothing is copied).

    ``prompt_tokens`` is the length ``N`` of the whole prompt (the ``N - T`` tokens after the
    cached ones are recomputed, never dropped); ``query_positions`` the position of each row of
    the query tensor the scorer gets (rows may lie past ``T``: the uncached tail);
    ``query_lse`` ``[1, L, R, Hq]`` the rows' attention log-normalisers over every key they saw
    (NaN where unknown; see ``kvdrop_sdk.edit.EditContext``), for window readers; ``head_dim``
    the layout's, when known; ``token_scores`` ``[L, H, S]`` the engine's per-token scores
    (KVzip's reconstruction pass), when the edit context has them.

    Other edit-context fields: ``dataclasses.replace(selection,
    inputs=selection.inputs.with_context(head_dim=4))``.
    ``rope`` is the RoPE parameters the cached keys carry and ``positions`` ``[T]`` each cached
    row's RoPE position (scorers that read pre-RoPE keys or queries undo the rotation with them,
    e.g. ``leverage``).
    """

    selector: Selector
    budget: int
    inputs: EditInputs = field(compare=False, repr=False)
    #: Which query rows the scorer reads (a FULL reader gets the rows of the cached tokens).
    queries: QueryNeed = QueryNeed.WINDOW
    #: Where the scorer runs (its log-normalisers are read there); None: where they are.
    device: torch.device | None = field(default=None, compare=False)
    #: The RoPE parameters the cached keys carry (the policy's own, else the context's), for
    #: scorers that undo the rotation (None: unknown).
    rope: RopeConfig | None = field(default=None, compare=False)

    def __init__(
        self,
        selector: Selector,
        budget: int,
        inputs: EditInputs,
        queries: QueryNeed = QueryNeed.WINDOW,
        device: torch.device | None = None,
        rope: RopeConfig | None = None,
    ) -> None:
        for name, value in (
            ("selector", selector),
            ("budget", budget),
            ("inputs", inputs),
            ("queries", QueryNeed(queries)),
            ("device", device),
            ("rope", rope),
        ):
            object.__setattr__(self, name, value)

    @property
    def num_tokens(self) -> int:
        return self.inputs.num_tokens

    @property
    def chunk_size(self) -> int:
        return self.selector.chunk_size

    @property
    def n_sink(self) -> int:
        return self.selector.n_sink

    @property
    def window(self) -> int:
        return self.selector.window

    @property
    def chunked(self) -> bool:
        return self.selector.chunked

    @property
    def prompt_tokens(self) -> int:
        return self.inputs.prompt_tokens

    @property
    def protected(self) -> int:
        return min(self.inputs.protected, self.num_tokens)

    @property
    def head_dim(self) -> int | None:
        return self.inputs.head_dim

    @property
    def positions(self) -> torch.Tensor:
        """``[T]``: each cached row's RoPE position."""
        return self.inputs.positions

    @property
    def token_scores(self) -> torch.Tensor | None:
        return self.inputs.token_scores

    @property
    def query_positions(self) -> torch.Tensor | None:
        if self.queries is QueryNeed.NONE or self.inputs.query_positions is None:
            return None
        if self.queries is QueryNeed.FULL:
            return self.inputs.query_positions[: self.num_tokens]
        return self.inputs.query_positions

    @property
    def query_lse(self) -> torch.Tensor | None:
        lse = self.inputs.query_lse if self.queries is QueryNeed.WINDOW else None
        return lse if lse is None or self.device is None else lse.to(self.device)

    @property
    def total_tokens(self) -> int:
        """``N``: the whole prompt (``num_tokens`` when no longer prompt is known)."""
        return self.prompt_tokens

    @property
    def tail(self) -> int:
        """Tokens after the cached ones (recomputed by the engine, never dropped)."""
        return self.total_tokens - self.num_tokens

    @property
    def recent(self) -> int:
        """Cached tokens the selector keeps as the recent window (the tail counts towards it)."""
        return max(0, min(self.num_tokens, self.window - self.tail))


def _token_ranking(
    scores: torch.Tensor, n_sink: int, window: int, protected: int = 0
) -> torch.Tensor:
    num_tokens = scores.shape[0]
    recent = torch.arange(num_tokens - 1, max(num_tokens - window, 0) - 1, -1)
    sinks = torch.arange(min(n_sink, num_tokens))
    first = torch.arange(min(protected, num_tokens))
    forced = _first_unique(torch.cat([first, recent, sinks]))
    free = torch.ones(num_tokens, dtype=torch.bool)
    free[forced] = False
    candidates = free.nonzero().squeeze(1)
    order = torch.sort(scores[candidates], descending=True, stable=True).indices
    return torch.cat([forced, candidates[order]])


def _first_unique(x: torch.Tensor) -> torch.Tensor:
    """``x`` without repeats, keeping the first occurrence order."""
    seen: set[int] = set()
    keep = [i for i, v in enumerate(x.tolist()) if not (v in seen or seen.add(v))]
    return x[keep]


#: Parameters every scoring policy accepts: the :class:`Selector` fields, in order.
SELECTOR_PARAMS: tuple[Param, ...] = tuple(params_of_dataclass(Selector))
