"""The policy contract: what every edit function kvdrop builds is, and what a factory is.

- :class:`Policy`: the one protocol of an edit function (a ``ModifyFnType``) built by kvdrop:
  ``name``, ``needs_query``, ``select_indices(tensors, tokens, *, context) -> (kv, index)`` and
  ``__call__(tensors, tokens, *, context) -> (kv, tokens)``. Every built-in, every combinator and
  the adapter of a plain plugin function implement it, so wrappers never probe attributes. Every
  policy accepts the SDK's :class:`~kvdrop_sdk.types.EditContext` (``accepts_edit_context``) and
  re-rotates the keys it keeps when it knows the model's RoPE (:mod:`kvdrop.rope`).
- :class:`ScorerPolicy`: a :class:`Scorer` (what a token is worth) under the shared
  :class:`~kvdrop.selector.Selector` (what to keep). Built-in policies are scorer dataclasses
  wrapped by :class:`ScorerFactory`.
- :class:`PolicyFactory`: what the registry hands out, ``factory(**params) -> Policy`` with an
  ``info`` (:class:`PolicyInfo`, what ``kvdrop describe`` shows). A plain callable registered as a
  policy is adapted by :class:`FunctionFactory`, which validates parameter names.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import difflib
import inspect
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from kvdrop.errors import MissingQueryError, PolicyInputError, PolicyParamError, PolicyWarning
from kvdrop.params import Param, params_of_dataclass, validate_params
from kvdrop.rope import rerotate_in_place, rope_from_layout
from kvdrop.selector import SELECTOR_PARAMS, Selection, Selector
from kvdrop_rope import RopeConfig
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.types import EditContext, ModifyFnType, get_tensor, takes_edit_context

__all__ = [
    "DEFAULT_QUERY_HEAD_DIM",
    "EditInputs",
    "FunctionFactory",
    "FunctionPolicy",
    "Policy",
    "PolicyFactory",
    "PolicyInfo",
    "Scorer",
    "ScorerFactory",
    "ScorerPolicy",
    "SelectorPolicy",
    "as_factory",
    "as_policy",
    "check_inputs",
    "edit_inputs",
    "info_of",
    "resolve_device",
]

#: ``head_dim`` of a query scorer that leaves it None and is called without an edit context.
DEFAULT_QUERY_HEAD_DIM = 128
#: Warn when chunk alignment keeps less than this fraction of the tokens asked for.
BUDGET_WARN_FRACTION = 0.75


class Scorer:
    """Base of scorer dataclasses: ``score(kv, query) -> [T]`` float scores, higher = keep.

    ``kv`` is ``[2, L, T, D]``; ``query`` is ``[1, L, T, Dq]`` when the scorer declares
    ``needs_query = True``, else ``None``. Scores are combined across heads and layers by the
    scorer, so one kept-token list serves the whole request. NaN scores are an error
    (:class:`~kvdrop.PolicyInputError`).

    A scorer that depends on what the selector will keep (the budget, the always-kept window,
    the chunk size) declares ``needs_selection = True`` and is called as
    ``score(kv, query, selection)`` with a :class:`~kvdrop.selector.Selection`.

    A query scorer that declares ``sparse_queries = True`` (every built-in one) takes query rows
    at any positions: ``query`` is ``[1, L, R, Dq]`` and ``selection.query_positions`` ``[R]``
    says where each row sits (rows past ``T`` belong to the uncached tail). Engines in the lean
    query mode store only such a window; a scorer without the flag gets ``[1, L, T, Dq]`` rows
    aligned with the KV, or a PolicyInputError when only a window exists.

    ``reads_values = False`` says ``score`` never reads ``kv[1]``: when scoring runs on another
    device, only the keys travel there (``kv`` is then ``[1, L, T, D]``).
    """

    needs_query: ClassVar[bool] = False
    needs_selection: ClassVar[bool] = False
    sparse_queries: ClassVar[bool] = False
    reads_values: ClassVar[bool] = True
    #: Reads ``selection.token_scores`` (the engine's reconstruction pass), e.g. ``kvzip``.
    token_scores: ClassVar[bool] = False

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        """Validate shapes the scorer relies on (e.g. D % head_dim); raise PolicyInputError."""


@dataclass(frozen=True)
class PolicyInfo:
    """What ``kvdrop describe`` shows: summary, whether queries are needed, every parameter.

    ``needs_query`` is that of the policy built from ``example`` (the defaults, for most).
    """

    name: str
    summary: str
    needs_query: bool
    params: tuple[Param, ...]
    details: str = ""
    #: Parameters a minimal working instance needs beyond the defaults (e.g. the inner policies of
    #: a composition); docs and the property tests over every registered policy use them.
    example: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary,
            "needs_query": self.needs_query,
            "details": self.details,
            "params": [p.describe() for p in self.params],
            "example": dict(self.example),
        }


@dataclass(frozen=True)
class EditInputs:
    """One edit's validated inputs as a policy sees them (see :func:`edit_inputs`).

    ``query`` ``[1, L, R, Dq]`` with ``query_positions`` ``[R]`` (None when not needed) and
    ``query_lse`` ``[1, L, R, Hq]`` (the rows' attention log-normalisers, or None);
    ``prompt_tokens`` is ``N >= T``; ``positions`` the RoPE position of each KV row.
    """

    kv: torch.Tensor
    query: torch.Tensor | None
    query_positions: torch.Tensor | None
    prompt_tokens: int
    positions: torch.Tensor
    protected: int = 0
    query_lse: torch.Tensor | None = None
    head_dim: int | None = None
    device: str | None = None
    rope: Mapping[str, Any] | None = None
    token_scores: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[2])


def edit_inputs(
    tensors: Mapping[Any, torch.Tensor],
    tokens: Sequence[int],
    *,
    policy: str,
    needs_query: bool,
    context: EditContext | None = None,
) -> EditInputs:
    """Validate an edit function's arguments once; raise a teaching error when they are wrong.

    Without a context the query must cover the KV's ``T`` tokens and is cut to them (positions
    ``0..T-1``, the upstream layout). With one, its ``query_positions`` place the rows (default
    ``0..R-1``), which may lie past ``T`` up to ``context.prompt_tokens``.
    """
    if context is not None and not isinstance(context, EditContext):
        raise PolicyInputError(
            f"{policy}: context must be a kvdrop_sdk.types.EditContext, got "
            f"{type(context).__name__}"
        )
    kv = get_tensor(tensors, CacheKind.KV)
    if kv is None:
        keys = ", ".join(repr(k) for k in tensors)
        raise PolicyInputError(
            f"{policy}: no KV tensor in the mapping (keys: {keys}); expected "
            "a key whose value is 'kv' (CacheKind.KV)"
        )
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[0] != 2:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise PolicyInputError(f"{policy}: KV must be a [2, L, T, D] tensor; got {shape}")
    if not kv.is_floating_point():
        raise PolicyInputError(f"{policy}: KV must be a floating-point tensor; got {kv.dtype}")
    num_tokens = kv.shape[2]
    if len(tokens) != num_tokens or num_tokens == 0:
        raise PolicyInputError(
            f"{policy}: got {len(tokens)} token ids for a KV of {num_tokens} tokens; they must "
            "match and be non-empty"
        )
    if context is not None and context.num_tokens != num_tokens:
        raise PolicyInputError(
            f"{policy}: the edit context describes {context.num_tokens} KV rows but the KV has "
            f"{num_tokens}"
        )
    total = num_tokens if context is None else int(context.prompt_tokens or num_tokens)
    positions = torch.arange(num_tokens) if context is None else context.positions
    query = qpos = lse = None
    if needs_query:
        query = get_tensor(tensors, CacheKind.QUERY)
        if query is None:
            raise MissingQueryError(policy)
        if (
            not isinstance(query, torch.Tensor)
            or query.dim() != 4
            or query.shape[0] != 1
            or query.shape[1] != kv.shape[1]
        ):
            shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query)
            raise PolicyInputError(
                f"{policy}: query must be [1, L, R, Dq] with L={kv.shape[1]} like the KV; got "
                f"{shape}"
            )
        rows = query.shape[2]
        if context is None or context.query_positions is None:
            if context is None:
                if rows < num_tokens:
                    raise PolicyInputError(
                        f"{policy}: query covers {rows} tokens but the KV has {num_tokens}"
                    )
                query, rows = query[:, :, :num_tokens], num_tokens
            qpos = torch.arange(rows)
        else:
            qpos = context.query_positions
            if qpos.numel() != rows:
                raise PolicyInputError(
                    f"{policy}: the edit context has {qpos.numel()} query positions for "
                    f"{rows} query rows"
                )
            lse = context.query_lse
            if lse is not None and tuple(lse.shape[1:3]) != (kv.shape[1], rows):
                raise PolicyInputError(
                    f"{policy}: the edit context's query_lse {tuple(lse.shape)} does not match "
                    f"the {rows} query rows of {kv.shape[1]} layers"
                )
        if rows == 0:
            raise PolicyInputError(f"{policy}: the query tensor has no rows")
        total = max(total, int(qpos[-1]) + 1)
    return EditInputs(
        kv=kv,
        query=query,
        query_positions=qpos,
        prompt_tokens=total,
        positions=positions,
        protected=0 if context is None else context.protected,
        query_lse=lse,
        head_dim=None if context is None else context.head_dim,
        device=None if context is None else context.device,
        rope=None if context is None else context.rope,
        token_scores=None if context is None else context.token_scores,
    )


def check_inputs(
    tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], *, policy: str, needs_query: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(kv, query)`` from an edit function's plain arguments, or raise a teaching error.

    ``query`` is cut to the KV's ``T`` tokens, and ``None`` unless ``needs_query``.
    """
    inputs = edit_inputs(tensors, tokens, policy=policy, needs_query=needs_query)
    return inputs.kv, inputs.query


def resolve_device(requested: str, hint: str | None, tensor: torch.Tensor) -> torch.device:
    """Where to score: ``requested`` unless "auto"; then the context's ``hint``; then CUDA when
    available; else ``tensor``'s device."""
    if requested != "auto":
        return torch.device(requested)
    if hint:
        return torch.device(hint)
    if tensor.device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda")
    return tensor.device


class Policy(abc.ABC):
    """An edit function built by kvdrop (a ``ModifyFnType`` for ``batch.modify(fn)``).

    Subclasses give ``name``, ``needs_query`` and ``select_indices``; calling the policy gathers
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
    def needs_query(self) -> bool:
        """Whether the policy reads the prefill query tensor (``tensors[CacheKind.QUERY]``)."""

    @property
    def needs_full_queries(self) -> bool:
        """Whether it reads the query of every cached token, so the engine must capture them all
        (``--query-capture full``); False when the lean query window is enough. A function
        policy is assumed to read them all."""
        return self.needs_query

    @property
    def token_scores(self) -> bool:
        """Whether it reads per-token scores the engine computes with the model
        (``EditContext.token_scores``: KVzip's reconstruction pass), so the engine must run it."""
        return False

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
        index = index.to(device="cpu", dtype=torch.int64)
        kept_tokens = [int(tokens[i]) for i in index.tolist()]
        old = pos[index]
        new = torch.arange(index.numel())
        if index.numel() == num_tokens and torch.equal(old, new):
            return kv, kept_tokens  # within budget and already contiguous: unchanged
        out = kv.index_select(2, index.to(kv.device))  # fresh: keys re-rotated in place in it
        rope = self.rope_for(context)
        if rope is None:
            if self.rerotate and not torch.equal(old, new):
                _warn_no_rope(self.name)
            return out, kept_tokens
        rerotate_in_place(out[0], old, new, rope, int(pos.max()) + 1, len(new))
        return out, kept_tokens


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


def _warn_no_rope(name: str) -> None:
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
        far less of the whole prompt than asked."""
        sel = self.selector
        budget = sel.budget(inputs.num_tokens, inputs.protected)
        asked = sel.requested(inputs.num_tokens, inputs.prompt_tokens)
        kept = budget + inputs.prompt_tokens - inputs.num_tokens
        if kept < BUDGET_WARN_FRACTION * asked and not getattr(self, "_budget_warned", False):
            self._budget_warned = True
            warnings.warn(
                f"{self.name}: chunk alignment keeps {kept} of {inputs.prompt_tokens} prompt "
                f"tokens, {kept / max(asked, 1):.0%} of the {asked:.0f} asked for (budgets are "
                f"whole chunks of {sel.chunk_size}, aligned down); use a smaller chunk_size or "
                "keep more. Shown once per policy.",
                PolicyWarning,
                stacklevel=4,
            )
        return budget


class ScorerPolicy(SelectorPolicy):
    """The edit function of a scorer + selector pair."""

    def __init__(self, name: str, scorer: Scorer, selector: Selector) -> None:
        self.name = name
        self.scorer = scorer
        self.selector = selector

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.scorer!r}, {self.selector!r})"

    @property
    def needs_query(self) -> bool:
        return self.scorer.needs_query

    @property
    def needs_full_queries(self) -> bool:
        return self.scorer.needs_query and not self.scorer.sparse_queries

    @property
    def token_scores(self) -> bool:
        return self.scorer.token_scores

    def _scorer_for(self, inputs: EditInputs) -> Scorer:
        """The scorer with a query scorer's ``head_dim=None`` filled in (layout's, else 128)."""
        scorer = self.scorer
        if (
            scorer.needs_query
            and dataclasses.is_dataclass(scorer)
            and any(f.name == "head_dim" for f in dataclasses.fields(scorer))
            and getattr(scorer, "head_dim", 0) is None
        ):
            head_dim = inputs.head_dim or DEFAULT_QUERY_HEAD_DIM
            scorer = dataclasses.replace(scorer, head_dim=head_dim)  # type: ignore[type-var]
        return scorer

    def _queries_for(
        self, scorer: Scorer, inputs: EditInputs
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The query rows and positions ``scorer`` can read (dense ``0..T-1`` unless sparse)."""
        if not scorer.needs_query or inputs.query is None:
            return None, None
        qpos = inputs.query_positions
        assert qpos is not None
        if scorer.sparse_queries:
            return inputs.query, qpos
        t = inputs.num_tokens
        if qpos.numel() < t or not torch.equal(qpos[:t], torch.arange(t)):
            raise PolicyInputError(
                f"{self.name}: this scorer reads the query of every cached token ([1, L, T, Dq]) "
                f"but only {qpos.numel()} query rows exist (a query window); declare "
                "sparse_queries = True and read selection.query_positions, or run the engine "
                "with full query capture (--query-capture full)"
            )
        return inputs.query[:, :, :t], qpos[:t]

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
            qpos = None if query is None else torch.arange(query.shape[2])
            inputs = EditInputs(kv, query, qpos, kv.shape[2], torch.arange(kv.shape[2]))
        scorer = self._scorer_for(inputs)
        q, qpos = self._queries_for(scorer, inputs)
        lse = inputs.query_lse if scorer.sparse_queries and q is not None else None
        device = resolve_device(self.selector.device, inputs.device, kv)
        if device != kv.device:
            kv = (kv if scorer.reads_values else kv[:1]).to(device)
        if q is not None and q.device != device:
            q = q.to(device)
        if lse is not None and lse.device != device:
            lse = lse.to(device)
        num_tokens = kv.shape[2]
        scorer.check(kv, q)
        with torch.no_grad():
            if scorer.needs_selection:
                selection = self.selector.selection(
                    num_tokens,
                    budget,
                    prompt_tokens=inputs.prompt_tokens,
                    protected=inputs.protected,
                    query_positions=qpos,
                    query_lse=lse,
                    head_dim=inputs.head_dim,
                    token_scores=inputs.token_scores,
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
        nan = int(torch.isnan(scores).sum())
        if nan:
            raise PolicyInputError(
                f"{self.name}: the scorer returned {nan} NaN score(s) for {num_tokens} tokens, so "
                "it cannot rank them; expected finite KV (and query) values (NaN or inf in the "
                "cache?)"
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

    def select_indices(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = edit_inputs(
            tensors, tokens, policy=self.name, needs_query=self.needs_query, context=context
        )
        kv, num_tokens = inputs.kv, inputs.num_tokens
        budget = self.plan_budget(inputs)
        if budget >= num_tokens:
            return kv, torch.arange(num_tokens)
        scores = self.scores(kv, inputs.query, budget, inputs=inputs)
        return kv, self.selector.select(
            scores, budget, prompt_tokens=inputs.prompt_tokens, protected=inputs.protected
        )


class FunctionPolicy(Policy):
    """A plain edit function ``fn(tensors, tokens) -> (kv, tokens)`` seen as a :class:`Policy`.

    ``fn`` gets ``context=`` too when it declares so (``kvdrop_sdk.types.accepts_edit_context``)
    and then re-rotates on its own. For a plain ``fn``, calling the policy finds the kept rows in
    the input (greedy in order, matching the token id and the layer-0 key row, so repeated ids are
    told apart) and re-rotates their keys when RoPE parameters are known; a ``fn`` whose output
    rows are not input rows (e.g. it changed values) is returned as it is, with a warning.
    """

    def __init__(self, name: str, fn: ModifyFnType, needs_query: bool = False) -> None:
        self.name = name
        self.fn = fn
        self._needs_query = needs_query
        self._takes_context = takes_edit_context(fn)

    def __repr__(self) -> str:
        return f"FunctionPolicy({self.name!r}, {self.fn!r})"

    @property
    def needs_query(self) -> bool:
        return self._needs_query

    def _call_fn(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        context: EditContext | None,
    ) -> tuple[torch.Tensor, Sequence[int]]:
        if self._takes_context:
            return self.fn(tensors, tokens, context=context)  # type: ignore[call-arg]
        return self.fn(tensors, tokens)

    def _match(
        self, kv: torch.Tensor, tokens: Sequence[int], out: torch.Tensor, kept: Sequence[int]
    ) -> torch.Tensor:
        found: list[int] = []
        i = 0
        for j, tok in enumerate(kept):
            while i < len(tokens) and not (
                int(tokens[i]) == int(tok) and torch.equal(kv[0, 0, i], out[0, 0, j])
            ):
                i += 1
            if i == len(tokens):
                raise PolicyInputError(
                    f"{self.name}: kept row {j} (token {tok}) is not an input row at a later "
                    "index; expected a policy that keeps input rows in order"
                )
            found.append(i)
            i += 1
        return torch.tensor(found, dtype=torch.int64)

    def select_indices(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv = edit_inputs(
            tensors, tokens, policy=self.name, needs_query=self.needs_query, context=context
        ).kv
        out, kept = self._call_fn(tensors, tokens, context)
        return kv, self._match(kv, tokens, out, kept)

    def __call__(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
        positions: Sequence[int] | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Sequence[int]]:
        out, kept = self._call_fn(tensors, tokens, context)
        if self._takes_context and self.rope is None:
            return out, kept  # it saw the context: its own choice of positions
        rope = self.rope_for(context)
        moved = len(kept) != len(tokens) or list(kept) != [int(t) for t in tokens]
        if rope is None:
            if self.rerotate and moved:
                _warn_no_rope(self.name)
            return out, kept
        kv = edit_inputs(tensors, tokens, policy=self.name, needs_query=False, context=context).kv
        try:
            index = self._match(kv, tokens, out, kept)
        except PolicyInputError:
            warnings.warn(
                f"{self.name}: its output rows are not input rows, so they cannot be re-rotated; "
                "returned as they are",
                PolicyWarning,
                stacklevel=2,
            )
            return out, kept
        return self.keep(kv, tokens, index, context=context, positions=positions)


def as_policy(fn: Policy | ModifyFnType, name: str, needs_query: bool = False) -> Policy:
    """``fn`` itself if it is a :class:`Policy`, else a :class:`FunctionPolicy` around it."""
    if isinstance(fn, Policy):
        return fn
    if not callable(fn):
        raise TypeError(f"{name}: expected an edit function fn(tensors, tokens); got {fn!r}")
    return FunctionPolicy(name, fn, needs_query)


class PolicyFactory(abc.ABC):
    """A registered policy: ``factory(**params) -> Policy``, parameters validated on call."""

    name: str
    info: PolicyInfo

    @abc.abstractmethod
    def __call__(self, **params: Any) -> Policy: ...


class ScorerFactory(PolicyFactory):
    """A registered policy built from a scorer dataclass: validates params, returns a ScorerPolicy.

    Its parameters are the selector's (``keep_ratio``, ``keep_tokens``, ``chunk_size``,
    ``n_sink``, ``window``, ``chunked``) followed by the scorer's fields declared with
    :func:`~kvdrop.param`. ``defaults`` changes selector defaults for this policy (e.g.
    ``window=64``); ``hidden`` selector parameters are fixed at their default and not exposed
    (e.g. chunk-halving is always chunked); ``example`` is what :class:`PolicyInfo` shows as a
    minimal working set of parameters. A scorer field declared with ``param`` under a selector
    parameter's name (say ``window``) is the scorer's own: that selector parameter is hidden.
    """

    def __init__(
        self,
        name: str,
        scorer_cls: type[Scorer],
        summary: str,
        *,
        defaults: Mapping[str, Any] | None = None,
        hidden: Sequence[str] = (),
        example: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.scorer_cls = scorer_cls
        defaults = dict(defaults or {})
        selector_names = {p.name for p in SELECTOR_PARAMS}
        unknown = set(defaults) - selector_names
        if unknown:
            raise TypeError(f"{name}: defaults for unknown selector parameters {sorted(unknown)}")
        scorer_params = params_of_dataclass(scorer_cls)
        own = {p.name for p in scorer_params}
        if dataclasses.is_dataclass(scorer_cls):
            plain = {f.name for f in dataclasses.fields(scorer_cls) if f.init} - own
            if plain & selector_names:
                field = sorted(plain & selector_names)[0]
                raise TypeError(
                    f"{name}: {scorer_cls.__name__}.{field} is named like the selector parameter "
                    f"{field!r} but not declared with param(); kvdrop does not copy selector "
                    f"values into scorer fields: set needs_selection = True and read "
                    f"selection.{field} in score(kv, query, selection), or declare the field "
                    f"with param() to make it the scorer's own parameter"
                )
        selector_params = [
            dataclasses.replace(p, default=defaults.get(p.name, p.default)) for p in SELECTOR_PARAMS
        ]
        hidden_names = set(hidden) | (own & selector_names)
        self._selector_fixed = {
            p.name: p.default for p in selector_params if p.name in hidden_names
        }
        self._selector_names = selector_names - hidden_names
        exposed = [p for p in selector_params if p.name not in hidden_names]
        self.params: tuple[Param, ...] = (*exposed, *scorer_params)
        doc = inspect.cleandoc(scorer_cls.__doc__ or "")
        self.info = PolicyInfo(
            name, summary, scorer_cls.needs_query, self.params, doc, dict(example or {})
        )

    def __call__(self, **params: Any) -> ScorerPolicy:
        values = validate_params(self.name, self.params, params)
        sel = {k: v for k, v in values.items() if k in self._selector_names}
        try:
            selector = Selector(**self._selector_fixed, **sel)
        except PolicyParamError as exc:
            raise PolicyParamError(f"{self.name}: {exc}") from None
        scorer = self.scorer_cls(
            **{k: v for k, v in values.items() if k not in self._selector_names}
        )
        return ScorerPolicy(self.name, scorer, selector)

    def __repr__(self) -> str:
        return f"ScorerFactory({self.name!r}, {self.scorer_cls.__name__})"


class FunctionFactory(PolicyFactory):
    """A plain callable ``factory(**params) -> edit function`` registered as a policy.

    ``kvdrop describe`` reads its signature and docstring (or its ``info``, a PolicyInfo; its
    ``needs_query`` and ``example`` attributes where set). Parameter names are checked before
    the call (an unknown or missing one raises PolicyParamError, unless it takes ``**kwargs``);
    what it returns is adapted to a :class:`Policy`.
    """

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self.fn = fn
        self.info = info_of(name, fn)
        try:
            parameters = list(inspect.signature(fn).parameters.values())
            self._open = any(p.kind is p.VAR_KEYWORD for p in parameters)
        except (TypeError, ValueError):  # a builtin without a signature: take anything
            parameters, self._open = [], True
        self._names = [
            p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        self._required = [
            p.name
            for p in parameters
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]

    def __repr__(self) -> str:
        return f"FunctionFactory({self.name!r}, {self.fn!r})"

    def __call__(self, **params: Any) -> Policy:
        if not self._open:
            for key in params:
                if key not in self._names:
                    close = difflib.get_close_matches(key, self._names, n=3)
                    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
                    raise PolicyParamError(
                        f"{self.name}: unknown parameter {key!r}.{hint} Allowed: "
                        f"{', '.join(sorted(self._names)) or '(none)'}"
                    )
        missing = [n for n in self._required if n not in params]
        if missing:
            raise PolicyParamError(
                f"{self.name}: missing parameter(s) {', '.join(map(repr, missing))}; expected "
                "values for them (`kvdrop describe` lists every parameter)"
            )
        return as_policy(self.fn(**params), self.name, self.info.needs_query)


def as_factory(name: str, obj: Any) -> PolicyFactory:
    """``obj`` itself if it is a :class:`PolicyFactory`, else a :class:`FunctionFactory`."""
    if isinstance(obj, PolicyFactory):
        return obj
    if not callable(obj):
        raise TypeError(f"policy {name!r}: expected a factory; got a {type(obj).__name__}")
    return FunctionFactory(name, obj)


def info_of(name: str, factory: Callable[..., Any]) -> PolicyInfo:
    """PolicyInfo of a plain factory: its ``info`` if it has one, else read from its signature."""
    info = getattr(factory, "info", None)
    if isinstance(info, PolicyInfo):
        return info
    doc = inspect.getdoc(factory) or ""
    try:
        hints = typing.get_type_hints(factory)
    except Exception:  # unresolvable annotations: describe them as Any
        hints = {}
    params = []
    for p in inspect.signature(factory).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = None if p.default is p.empty else p.default
        params.append(Param(p.name, hints.get(p.name, Any), default, ""))
    return PolicyInfo(
        example=dict(getattr(factory, "example", {}) or {}),
        name=name,
        summary=doc.splitlines()[0] if doc else "",
        needs_query=bool(getattr(factory, "needs_query", False)),
        params=tuple(params),
        details=doc,
    )
