"""The policy contract: a scorer (what a token is worth) plus the shared selector (what to keep).

A *policy* is a factory ``factory(**params) -> ModifyFnType``. Built-in policies are scorer
dataclasses wrapped by :class:`ScorerFactory`; anyone can register a plain callable factory too.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvdrop.errors import MissingQueryError, PolicyInputError, PolicyParamError
from kvdrop.params import Param, params_of_dataclass, validate_params
from kvdrop.selector import SELECTOR_PARAMS, Selector, gather
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.types import ModifyFnType, get_tensor

__all__ = [
    "IndexPolicy",
    "PolicyInfo",
    "Scorer",
    "ScorerFactory",
    "ScorerPolicy",
    "check_inputs",
    "info_of",
]


class Scorer:
    """Base of scorer dataclasses: ``score(kv, query) -> [T]`` float scores, higher = keep.

    ``kv`` is ``[2, L, T, D]``; ``query`` is ``[1, L, T, Dq]`` or ``None`` (only policies with
    ``needs_query = True`` get one). Scores are combined across heads and layers by the scorer, so
    one kept-token list serves the whole request.
    """

    needs_query: ClassVar[bool] = False

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        """Validate shapes the scorer relies on (e.g. D % head_dim); raise PolicyInputError."""


@dataclass(frozen=True)
class PolicyInfo:
    """What ``kvdrop describe`` shows: summary, whether queries are needed, every parameter."""

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


def check_inputs(
    tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], *, policy: str, needs_query: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(kv, query)`` from an edit function's arguments, or raise a teaching error."""
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
    query = get_tensor(tensors, CacheKind.QUERY)
    if needs_query and query is None:
        raise MissingQueryError(policy)
    if query is not None and needs_query:
        if query.dim() != 4 or query.shape[0] != 1 or query.shape[1] != kv.shape[1]:
            raise PolicyInputError(
                f"{policy}: query must be [1, L, T, Dq] with L={kv.shape[1]} like the KV; got "
                f"{tuple(query.shape)}"
            )
        if query.shape[2] < num_tokens:
            raise PolicyInputError(
                f"{policy}: query covers {query.shape[2]} tokens but the KV has {num_tokens}"
            )
        query = query[:, :, :num_tokens]
    return kv, (query if needs_query else None)


class IndexPolicy:
    """An edit function defined by the indices it keeps: subclasses give ``select_indices``.

    Calling it gathers the kept KV rows and token ids; within budget the input comes back as is.
    """

    def select_indices(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __call__(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, list[int]]:
        kv, index = self.select_indices(tensors, tokens)
        if index.numel() == kv.shape[2]:
            return kv, [int(t) for t in tokens]
        return gather(kv, tokens, index)


class ScorerPolicy(IndexPolicy):
    """The edit function (ModifyFnType) of a scorer + selector pair."""

    def __init__(self, name: str, scorer: Scorer, selector: Selector) -> None:
        self.name = name
        self.scorer = scorer
        self.selector = selector

    def __repr__(self) -> str:
        return f"ScorerPolicy({self.name!r}, {self.scorer!r}, {self.selector!r})"

    def scores(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        """The scorer's ``[T]`` scores of validated inputs (after its own ``check``)."""
        self.scorer.check(kv, query)
        with torch.no_grad():
            scores = self.scorer.score(kv, query)
        if scores.shape != (kv.shape[2],):
            raise PolicyInputError(
                f"{self.name}: scorer returned scores of shape {tuple(scores.shape)}; expected "
                f"({kv.shape[2]},)"
            )
        return scores

    def select_indices(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The validated KV and the sorted int64 indices of the tokens this policy keeps.

        All indices when the input is within budget. Wrappers that need positions (RoPE
        re-rotation, composition) use this instead of matching the returned tokens.
        """
        kv, query = check_inputs(
            tensors, tokens, policy=self.name, needs_query=self.scorer.needs_query
        )
        num_tokens = kv.shape[2]
        budget = self.selector.budget(num_tokens)
        if budget >= num_tokens:
            return kv, torch.arange(num_tokens)
        return kv, self.selector.select(self.scores(kv, query), budget)

    def with_selector(self, selector: Selector) -> ScorerPolicy:
        """The same scorer under another selector (e.g. a per-request budget)."""
        return ScorerPolicy(self.name, _sync_scorer(self.scorer, selector), selector)


def _sync_scorer(scorer: Scorer, selector: Selector) -> Scorer:
    """``scorer`` with its plain fields named like selector parameters (``chunk_size``,
    ``window``, ...) set from ``selector``, so budget-aware scorers see the selector's values."""
    names = _selector_fields(type(scorer))
    if not names or not dataclasses.is_dataclass(scorer):
        return scorer
    return dataclasses.replace(scorer, **{n: getattr(selector, n) for n in names})  # type: ignore[type-var]


def _selector_fields(scorer_cls: type) -> set[str]:
    if not dataclasses.is_dataclass(scorer_cls):
        return set()
    return {f.name for f in dataclasses.fields(scorer_cls) if f.init} & {
        p.name for p in SELECTOR_PARAMS
    }


class ScorerFactory:
    """A registered policy built from a scorer dataclass: validates params, returns a ScorerPolicy.

    ``defaults`` overrides selector defaults for this policy (e.g. ``window=256``).
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
        unknown = set(defaults) - {p.name for p in SELECTOR_PARAMS}
        if unknown:
            raise TypeError(f"{name}: defaults for unknown selector parameters {sorted(unknown)}")
        selector_params = [
            dataclasses.replace(p, default=defaults.get(p.name, p.default)) for p in SELECTOR_PARAMS
        ]
        # Hidden selector parameters are fixed by the policy (e.g. chunk-halving is always chunked).
        self._fixed = {p.name: p.default for p in selector_params if p.name in hidden}
        exposed = [p for p in selector_params if p.name not in hidden]
        self.params: tuple[Param, ...] = (*exposed, *params_of_dataclass(scorer_cls))
        doc = inspect.cleandoc(scorer_cls.__doc__ or "")
        self.info = PolicyInfo(
            name, summary, scorer_cls.needs_query, self.params, doc, dict(example or {})
        )

    def __call__(self, **params: Any) -> ScorerPolicy:
        values = validate_params(self.name, self.params, params)
        selector_names = {p.name for p in SELECTOR_PARAMS}
        sel = {**self._fixed, **{k: v for k, v in values.items() if k in selector_names}}
        try:
            selector = Selector(**sel)
        except PolicyParamError as exc:
            raise PolicyParamError(f"{self.name}: {exc}") from None
        scorer_args = {k: v for k, v in values.items() if k not in selector_names}
        # Budget/chunk-aware scorers declare plain fields named like selector parameters.
        for field_name in _selector_fields(self.scorer_cls):
            scorer_args[field_name] = getattr(selector, field_name)
        scorer = self.scorer_cls(**scorer_args)
        return ScorerPolicy(self.name, scorer, selector)

    def __repr__(self) -> str:
        return f"ScorerFactory({self.name!r}, {self.scorer_cls.__name__})"


def info_of(name: str, factory: Callable[..., ModifyFnType]) -> PolicyInfo:
    """PolicyInfo of any factory: its ``.info`` if it has one, else read from its signature."""
    info = getattr(factory, "info", None)
    if isinstance(info, PolicyInfo):
        return info
    doc = inspect.getdoc(factory) or ""
    params = []
    for p in inspect.signature(factory).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = None if p.default is p.empty else p.default
        tp = Any if p.annotation is p.empty else p.annotation
        params.append(Param(p.name, tp, default, ""))
    return PolicyInfo(
        example=dict(getattr(factory, "example", {}) or {}),
        name=name,
        summary=doc.splitlines()[0] if doc else "",
        needs_query=bool(getattr(factory, "needs_query", False)),
        params=tuple(params),
        details=doc,
    )
