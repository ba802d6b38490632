"""The policy contract: what every edit function kvdrop builds is.

- :class:`Policy`: the one protocol of an edit function (a ``ModifyFnType``) built by kvdrop:
  ``name``, ``queries`` (a :class:`~kvdrop_sdk.query_capture.QueryNeed`: which prefill queries
  it reads), ``select_indices(tensors, tokens, *, context) -> (kv, index)`` and
  ``__call__(tensors, tokens, *, context) -> (kv, tokens)``. Every built-in, every combinator and
  the adapter of a plain plugin function (:mod:`kvdrop.function_policy`) implement it, so
  wrappers never probe attributes. Every policy accepts the SDK's
  :class:`~kvdrop_sdk.edit.EditContext` (``accepts_edit_context``) and re-rotates the keys it
  keeps when it knows the model's RoPE (:mod:`kvdrop.rope`).
- :class:`ScorerPolicy`: a :class:`Scorer` (what a token is worth) under the shared
  :class:`~kvdrop.selector.Selector` (what to keep). Built-in policies are scorer dataclasses
  wrapped by :class:`~kvdrop.factories.ScorerFactory`.

Inputs are validated in :mod:`kvdrop.inputs`, the scoring device is picked in
:mod:`kvdrop.device`, and factories (what the registry hands out) live in :mod:`kvdrop.factories`.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from kvdrop.device import resolve_device
from kvdrop.errors import PolicyInputError, PolicyOutputError, PolicyWarning
from kvdrop.inputs import EditInputs, check_finite, edit_inputs
from kvdrop.rope import rerotate_in_place, rope_from_layout
from kvdrop.selector import Selection, Selector
from kvdrop_rope import RopeConfig
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.keep import KeepPlan
from kvdrop_sdk.query_capture import NO_NEEDS, KVNeed, Needs, QueryNeed, needs_of

__all__ = [
    "DEFAULT_QUERY_HEAD_DIM",
    "Policy",
    "PolicyWrapper",
    "QueryNeed",
    "Scorer",
    "ScorerPolicy",
    "SelectorPolicy",
]

#: ``head_dim`` of a query scorer that leaves it None and is called without an edit context.
DEFAULT_QUERY_HEAD_DIM = 128
#: Warn when chunk alignment keeps less than this fraction of the tokens asked for, or more
#: than its inverse (plus one token of rounding).
BUDGET_WARN_FRACTION = 0.75
#: The flags ``queries`` replaced; a scorer that still sets one gets a TypeError saying so.
_OLD_QUERY_FLAGS = ("needs_query", "needs_full_queries", "sparse_queries")


class Scorer:
    """Base of scorer dataclasses: ``score(kv, query) -> [T]`` float scores, higher = keep.

    ``kv`` is ``[2, L, T, D]``; ``query`` holds the prefill queries when the scorer declares
    ``queries`` other than ``QueryNeed.NONE`` (the default), else ``None``. Scores are combined
    across heads and layers by the scorer, so one kept-token list serves the whole request.
    Non-finite (NaN or inf) scores are an error (:class:`~kvdrop.PolicyInputError`).

    A scorer that depends on what the selector will keep (the budget, the always-kept window,
    the chunk size) declares ``needs_selection = True`` and is called as
    ``score(kv, query, selection)`` with a :class:`~kvdrop.selector.Selection`.

    ``queries = QueryNeed.WINDOW`` (every built-in query scorer) takes query rows at any
    positions: ``query`` is ``[1, L, R, Dq]`` and ``selection.query_positions`` ``[R]`` says where
    each row sits (rows past ``T`` belong to the uncached tail). Engines in the lean query mode
    store only such a window. ``queries = QueryNeed.FULL`` gets ``[1, L, T, Dq]`` rows aligned
    with the KV (the engine must capture every query), or a PolicyInputError when only a window
    exists.

    ``reads_values = False`` says ``score`` never reads ``kv[1]``: when scoring runs on another
    device, only the keys travel there (``kv`` is then ``[1, L, T, D]``), and the SDK fetches
    only the keys from the cache server. ``reads_keys = False`` as well says it reads no KV byte
    at all, only its shape (chunk-halving, streaming, random, kvzip's engine scores): the SDK
    then fetches nothing and the server keeps the chosen rows itself. Both become
    ``Needs.kv`` (:func:`~kvdrop_sdk.query_capture.needs_of`); ``kv`` then still has the shape
    ``[2, L, T, D]``, but the bytes not read are not the cache's (keys stand in for values, a
    broadcast zero for keys).
    """

    queries: ClassVar[QueryNeed] = QueryNeed.NONE
    needs_selection: ClassVar[bool] = False
    reads_values: ClassVar[bool] = True
    #: Reads ``kv[0]`` (the keys); False with ``reads_values = False``: only ``kv``'s shape.
    reads_keys: ClassVar[bool] = True
    #: Reads ``selection.token_scores`` (the engine's reconstruction pass), e.g. ``kvzip``.
    token_scores: ClassVar[bool] = False
    #: A ``WINDOW`` reader that reads only the last query rows (``last_rows``) says False: the
    #: engine then stores no strided sample for it (``Needs.query_sample``).
    reads_query_sample: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        old = [flag for flag in _OLD_QUERY_FLAGS if flag in vars(cls)]
        if old:
            raise TypeError(
                f"{cls.__name__} sets {', '.join(old)}; scorers declare one attribute instead: "
                "queries = QueryNeed.WINDOW (query rows at any positions, with "
                "selection.query_positions) or QueryNeed.FULL (every cached token's query)"
            )
        cls.queries = QueryNeed(cls.queries)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        """Validate shapes the scorer relies on (e.g. D % head_dim); raise PolicyInputError."""


class Policy(abc.ABC):
    """An edit function built by kvdrop (a ``ModifyFnType`` for ``batch.modify(fn)``).

    Subclasses give ``name``, ``queries`` and ``select_indices``; calling the policy gathers
    the kept KV rows and token ids (within budget the input comes back as is) and re-rotates the
    kept keys to positions ``0..k-1`` when the RoPE parameters are known: ``rope`` (explicit, as
    ``kvdrop.get(..., rerotate=config)`` sets it) or the edit context's. ``rerotate = False``
    turns that off (``kvdrop.get(..., rerotate=False)``); with neither known a
    :class:`~kvdrop.PolicyWarning` says why the kept keys stay where they were.
    """

    name: str
    #: The SDK passes ``context=EditContext(...)`` to every kvdrop policy.
    accepts_edit_context: ClassVar[bool] = True
    #: Re-rotate kept keys when RoPE parameters are known (instances may turn it off).
    rerotate: bool = True
    #: Explicit RoPE parameters; they win over the edit context's.
    rope: RopeConfig | None = None

    @property
    @abc.abstractmethod
    def queries(self) -> QueryNeed:
        """Which prefill queries (``tensors[CacheKind.QUERY]``) the policy reads: none, a window
        of rows at any positions, or every cached token's (read through
        :func:`~kvdrop_sdk.query_capture.needs_of`)."""

    @property
    def token_scores(self) -> bool:
        """Whether it reads per-token scores the engine computes with the model
        (``EditContext.token_scores``: KVzip's reconstruction pass), so the engine must run it
        (read through :func:`~kvdrop_sdk.query_capture.needs_of`)."""
        return False

    @property
    def needs(self) -> Needs:
        """Everything it reads beside the KV, as one :class:`~kvdrop_sdk.query_capture.Needs`
        (what :func:`~kvdrop_sdk.query_capture.needs_of` returns for it). Scorer policies read
        their scorer's declarations and wrappers their policy's, so a new kind of input is
        declared on the scorer and reaches every wrapper without a forwarding line."""
        return Needs(self.queries, self.token_scores)

    @abc.abstractmethod
    def select_indices(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The validated KV and the sorted int64 indices (CPU) of the tokens this policy keeps
        (all of them when the input is within budget)."""

    def __call__(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
        positions: Sequence[int] | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        kv, index = self.select_indices(tensors, tokens, context=context)
        return self.keep(kv, tokens, index, context=context, positions=positions)

    def keep_plan(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> KeepPlan:
        """What calling the policy keeps, without the bytes: the checked kept indices and the
        RoPE parameters (JSON) their keys are re-rotated to ``0..k-1`` with, for the cache
        server to apply (:mod:`kvdrop_sdk.keep`; the SDK asks it of policies whose
        ``needs.kv`` is not ``ALL``). Rows sit at ``context.positions``, which must be
        ``0..T-1`` (the SDK's, for a cached prefix)."""
        kv, index = self.select_indices(tensors, tokens, context=context)
        num_tokens = kv.shape[2]
        pos = _row_positions(self.name, num_tokens, None, context)
        if not torch.equal(pos, torch.arange(num_tokens)):
            raise PolicyInputError(
                f"{self.name}: a keep plan is for rows at positions 0..T-1 (a cached prefix); "
                "call the policy to edit rows at other positions"
            )
        index = checked_index(self.name, index, num_tokens)
        rope = self.rope_for(context)
        moved = not torch.equal(index, torch.arange(index.numel()))
        if rope is None and self.rerotate and moved:
            warn_no_rope(self.name)
        return KeepPlan(index, None if rope is None else rope.to_json())

    def rope_for(self, context: EditContext | None) -> RopeConfig | None:
        """The RoPE parameters kept keys are re-rotated with (None: no re-rotation)."""
        if not self.rerotate:
            return None
        if self.rope is not None:
            return self.rope
        return rope_from_layout(None if context is None else context.rope, policy=self.name)

    def keep(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int],
        index: torch.Tensor,
        *,
        context: EditContext | None = None,
        positions: Sequence[int] | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Gather the rows at ``index`` and move their keys to positions ``0..k-1``."""
        num_tokens = kv.shape[2]
        pos = _row_positions(self.name, num_tokens, positions, context)
        index = checked_index(self.name, index, num_tokens)
        kept_tokens = [int(tokens[i]) for i in index.tolist()]
        old = pos[index]
        new = torch.arange(index.numel())
        if index.numel() == num_tokens and torch.equal(old, new):
            return kv, kept_tokens  # within budget and already contiguous: unchanged
        out = kv.index_select(2, index.to(kv.device))  # fresh: keys re-rotated in place in it
        rope = self.rope_for(context)
        if rope is None:
            if self.rerotate and not torch.equal(old, new):
                warn_no_rope(self.name)
            return out, kept_tokens
        rerotate_in_place(out[0], old, new, rope, int(pos.max()) + 1, len(new))
        check_finite(
            self.name,
            out[0],
            "re-rotated keys",
            "check the RoPE parameters (theta, rope_scaling) registered with the layout or "
            "passed as rerotate=, and the cached keys",
        )
        return out, kept_tokens


class NeedsPolicy(Policy):
    """A policy whose one declaration is ``needs``: ``queries`` and ``token_scores`` read it
    (wrappers, combinators and adapters that take their needs from what they hold)."""

    @property
    @abc.abstractmethod
    def needs(self) -> Needs:
        """Everything it reads beside the KV."""

    @property
    def queries(self) -> QueryNeed:
        return self.needs.queries

    @property
    def token_scores(self) -> bool:
        return self.needs.token_scores


class PolicyWrapper(NeedsPolicy):
    """A policy around one inner ``policy`` (``Budget``, ``Rerotate``, a user's wrapper).

    ``name``, ``queries``, ``token_scores``, ``rerotate`` and ``rope`` are the inner policy's
    unless set on the wrapper: declared here once, as properties, so every reader finds them
    (``needs_of`` included: Python 3.12's runtime-checkable Protocols do not see attributes a
    ``__getattr__`` forwards). ``select_indices`` is the inner's; override it to change what is
    kept.
    """

    def __init__(self, policy: Policy, name: str | None = None) -> None:
        self.policy = policy
        self._own: dict[str, Any] = {} if name is None else {"name": name}

    def _get(self, attr: str) -> Any:
        own = self.__dict__.get("_own", {})
        return own[attr] if attr in own else getattr(self.policy, attr)

    def _set(self, attr: str, value: Any) -> None:
        self.__dict__.setdefault("_own", {})[attr] = value

    name = property(lambda self: self._get("name"), lambda self, v: self._set("name", v))
    rerotate = property(  # type: ignore[assignment]
        lambda self: self._get("rerotate"), lambda self, v: self._set("rerotate", v)
    )
    rope = property(  # type: ignore[assignment]
        lambda self: self._get("rope"), lambda self, v: self._set("rope", v)
    )

    @property
    def needs(self) -> Needs:
        return needs_of(self.policy)

    def select_indices(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The validated KV and the sorted indices the inner policy keeps."""
        return self.policy.select_indices(tensors, tokens, context=context)


def checked_index(policy: str, index: object, num_tokens: int) -> torch.Tensor:
    """``index`` as CPU int64 when it is what a policy may keep: a 1-D integer tensor of
    strictly increasing row indices in ``[0, num_tokens)``, at least one. Every policy's choice
    passes here (``Policy.keep``) before its rows are gathered or stored; anything else is a
    ``PolicyOutputError`` naming the policy and the first bad entry."""
    what = f"policy {policy!r} returned kept indices"
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.is_floating_point():
        shown = list(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__
        raise PolicyOutputError(f"{what} {shown}; expected a 1-D integer tensor")
    index = index.to(device="cpu", dtype=torch.int64)
    if index.numel() == 0:
        raise PolicyOutputError(f"{what} that keep nothing; a policy keeps at least one token")
    bad = torch.nonzero((index < 0) | (index >= num_tokens))
    if bad.numel():
        i = int(bad[0])
        raise PolicyOutputError(
            f"{what} with {int(index[i])} at position {i}, outside [0, {num_tokens})"
        )
    step = index[1:] - index[:-1]
    bad = torch.nonzero(step <= 0)
    if bad.numel():
        i = int(bad[0]) + 1
        kind = "a duplicate" if int(step[i - 1]) == 0 else "out of order"
        raise PolicyOutputError(
            f"{what} with {int(index[i])} at position {i} {kind} (after {int(index[i - 1])}); "
            "expected strictly increasing indices, each row kept at most once"
        )
    return index


def _row_positions(
    name: str,
    num_tokens: int,
    positions: Sequence[int] | torch.Tensor | None,
    context: EditContext | None,
) -> torch.Tensor:
    if positions is None:
        return torch.arange(num_tokens) if context is None else context.positions
    pos = torch.as_tensor(positions)
    if pos.shape != (num_tokens,) or pos.dtype.is_floating_point:
        raise PolicyInputError(
            f"{name}: positions must be {num_tokens} ints (one per cached token); "
            f"got shape {tuple(pos.shape)} dtype {pos.dtype}"
        )
    return pos.to(device="cpu", dtype=torch.int64)


def _on_device(kv: torch.Tensor, reads: KVNeed, device: torch.device) -> torch.Tensor:
    """``kv`` on the scoring device, only what the scorer reads moved: all of it, the keys
    (``[1, L, T, D]``), or nothing (a broadcast zero of the keys' shape, made there)."""
    if reads is KVNeed.ALL:
        return kv.to(device)
    if reads is KVNeed.KEYS:
        return kv[:1].to(device)
    return torch.zeros((), dtype=kv.dtype, device=device).expand(1, *kv.shape[1:])


def warn_no_rope(name: str) -> None:
    warnings.warn(
        f"{name}: kept keys stay at their old RoPE positions because no RoPE parameters are "
        "known (the engine registered none with the cache layout, or the policy was called "
        "without an EditContext); engines read a kept prefix at positions 0..k-1, so the model "
        "would see wrong distances. Pass rerotate=<the model's config.json dict or a "
        "kvdrop_rope.RopeConfig> to kvdrop.get, or rerotate=False if your engine keeps the "
        "original positions.",
        PolicyWarning,
        stacklevel=3,
    )


_S = TypeVar("_S", bound="SelectorPolicy")


class SelectorPolicy(Policy):
    """A policy whose budget comes from a :class:`Selector`, so a per-request budget
    (:class:`~kvdrop.combinators.Budget`) can replace it."""

    selector: Selector

    def with_selector(self: _S, selector: Selector) -> _S:
        """The same policy under another selector (e.g. a per-request budget)."""
        out = copy.copy(self)
        out.selector = selector
        return out

    def plan_budget(self, inputs: EditInputs) -> int:
        """This request's cached-token budget; warns (once per policy) when chunk alignment keeps
        far less, or more, of the whole prompt than asked."""
        sel = self.selector
        budget = sel.budget(inputs.num_tokens, inputs.protected)
        asked = sel.requested(inputs.num_tokens, inputs.prompt_tokens)
        kept = budget + inputs.prompt_tokens - inputs.num_tokens
        less = kept < BUDGET_WARN_FRACTION * asked
        more = kept > asked / BUDGET_WARN_FRACTION + 1
        if (less or more) and not getattr(self, "_budget_warned", False):
            self._budget_warned = True
            hint = "a smaller chunk_size or keep more" if less else "a smaller chunk_size"
            warnings.warn(
                f"{self.name}: chunk alignment keeps {kept} of {inputs.prompt_tokens} prompt "
                f"tokens (kept_fraction {kept / max(inputs.prompt_tokens, 1):.2f}), "
                f"{kept / max(asked, 1):.0%} of the {asked:.0f} asked for (budgets are whole "
                f"chunks of {sel.chunk_size}, aligned down but at least one, and the uncached "
                f"tail is kept whole); use {hint}. Shown once per policy.",
                PolicyWarning,
                stacklevel=4,
            )
        return budget

    def select_indices(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The template every selector policy shares: the validated inputs, the budget, every
        token when it covers them, else :meth:`_select`'s choice (what a combinator changes)."""
        inputs = edit_inputs(
            tensors, tokens, policy=self.name, queries=self.queries, context=context
        )
        budget = self.plan_budget(inputs)
        if budget >= inputs.num_tokens:
            return inputs.kv, torch.arange(inputs.num_tokens)
        return inputs.kv, self._select(inputs, budget)

    @abc.abstractmethod
    def _select(self, inputs: EditInputs, budget: int) -> torch.Tensor:
        """The sorted int64 indices (CPU) of the ``budget`` tokens kept of ``inputs``, when
        more than that are cached (the one step a selector policy defines)."""


class ScorerPolicy(NeedsPolicy, SelectorPolicy):
    """The edit function of a scorer + selector pair."""

    def __init__(self, name: str, scorer: Scorer, selector: Selector) -> None:
        self.name = name
        self.scorer = scorer
        self.selector = selector

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.scorer!r}, {self.selector!r})"

    @property
    def needs(self) -> Needs:
        """Its scorer's declarations (a scorer that declares nothing reads only the KV)."""
        return needs_of(self.scorer, default=NO_NEEDS)

    def _scorer_for(self, inputs: EditInputs) -> Scorer:
        """The scorer with a query scorer's ``head_dim=None`` filled in (layout's, else 128)."""
        scorer = self.scorer
        if (
            scorer.queries is not QueryNeed.NONE
            and dataclasses.is_dataclass(scorer)
            and any(f.name == "head_dim" for f in dataclasses.fields(scorer))
            and getattr(scorer, "head_dim", 0) is None
        ):
            head_dim = inputs.head_dim or DEFAULT_QUERY_HEAD_DIM
            scorer = dataclasses.replace(scorer, head_dim=head_dim)  # type: ignore[type-var]
        return scorer

    def _rope_of(self, inputs: EditInputs) -> RopeConfig | None:
        """The RoPE parameters the cached keys carry: explicit ones win over the context's."""
        if self.rope is not None:
            return self.rope
        return rope_from_layout(inputs.rope, policy=self.name)

    def _queries_for(self, scorer: Scorer, inputs: EditInputs) -> torch.Tensor | None:
        """The query rows ``scorer`` can read (those of ``0..T-1`` for a FULL reader; their
        positions are the selection's)."""
        if scorer.queries is QueryNeed.NONE or inputs.query is None:
            return None
        qpos = inputs.query_positions
        assert qpos is not None
        if scorer.queries is QueryNeed.WINDOW:
            return inputs.query
        t = inputs.num_tokens
        if qpos.numel() < t or not torch.equal(qpos[:t], torch.arange(t)):
            raise PolicyInputError(
                f"{self.name}: this scorer reads the query of every cached token ([1, L, T, Dq]) "
                f"but only {qpos.numel()} query rows exist (a query window); declare "
                "queries = QueryNeed.WINDOW and read selection.query_positions, or run the engine "
                "with full query capture (--query-capture full)"
            )
        return inputs.query[:, :, :t]

    def scores(
        self,
        kv: torch.Tensor,
        query: torch.Tensor | None,
        budget: int | None = None,
        *,
        inputs: EditInputs | None = None,
    ) -> torch.Tensor:
        """The scorer's ``[T]`` float32 CPU scores of validated inputs (after its ``check``).

        ``budget`` is what the ranking will be cut at (default: this selector's budget); only a
        scorer with ``needs_selection`` sees it. Scores are computed on the selector's ``device``
        (keys and queries are moved there). Raises PolicyInputError on NaN scores.
        """
        if inputs is None:
            inputs = EditInputs(kv, query)
        scorer = self._scorer_for(inputs)
        q = self._queries_for(scorer, inputs)
        device = resolve_device(self.selector.device, inputs.device, kv)
        reads = needs_of(scorer, default=NO_NEEDS).kv
        if device != kv.device:
            kv = _on_device(kv, reads, device)
        if q is not None and q.device != device:
            q = q.to(device)
        num_tokens = kv.shape[2]
        scorer.check(kv, q)
        # A rank-based scorer (lagkv) turns a NaN key into an ordinary rank: refuse non-finite
        # KV here, once for every scorer, as non-finite scores are refused below.
        if reads is not KVNeed.NONE:  # only the bytes the scorer reads
            check_finite(
                self.name,
                kv if reads is KVNeed.ALL else kv[:1],
                "cached KV",
                "it cannot rank tokens on them; check the model's cached keys and values",
            )
        with torch.no_grad():
            if scorer.needs_selection:
                queries = scorer.queries if q is not None else QueryNeed.NONE
                selection = self.selector.selection(
                    inputs, budget, queries=queries, device=device, rope=self._rope_of(inputs)
                )
                scores = scorer.score(kv, q, selection)
            else:
                scores = scorer.score(kv, q)
        if scores.shape != (num_tokens,):
            raise PolicyInputError(
                f"{self.name}: scorer returned scores of shape {tuple(scores.shape)}; expected "
                f"({num_tokens},)"
            )
        scores = scores.detach().to(device="cpu", dtype=torch.float32)
        check_finite(
            self.name,
            scores,
            "scores",
            "it cannot rank tokens on them; check the cached KV (and query) values for NaN or inf",
        )
        return scores

    def ranking(
        self,
        kv: torch.Tensor,
        query: torch.Tensor | None,
        budget: int | None = None,
        *,
        inputs: EditInputs | None = None,
    ) -> torch.Tensor:
        """Every token index in the order this policy keeps them (its selector's ranking)."""
        scores = self.scores(kv, query, budget, inputs=inputs)
        if inputs is None:
            return self.selector.ranking(scores)
        return self.selector.ranking(
            scores, prompt_tokens=inputs.prompt_tokens, protected=inputs.protected
        )

    def _select(self, inputs: EditInputs, budget: int) -> torch.Tensor:
        """The sorted indices of the ``budget`` tokens kept of ``inputs`` (more than fit):
        the selector's choice over this policy's scores."""
        scores = self.scores(inputs.kv, inputs.query, budget, inputs=inputs)
        return self.selector.select(
            scores, budget, prompt_tokens=inputs.prompt_tokens, protected=inputs.protected
        )
