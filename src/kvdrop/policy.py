"""The policy contract: what every edit function kvdrop builds is, and what a factory is.

- :class:`Policy`: the one protocol of an edit function (a ``ModifyFnType``) built by kvdrop:
  ``name``, ``needs_query``, ``select_indices(tensors, tokens) -> (kv, index)`` and
  ``__call__(tensors, tokens) -> (kv, tokens)``. Every built-in, every combinator and the adapter
  of a plain plugin function implement it, so wrappers never probe attributes.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from kvdrop.errors import MissingQueryError, PolicyInputError, PolicyParamError
from kvdrop.params import Param, params_of_dataclass, validate_params
from kvdrop.selector import SELECTOR_PARAMS, Selection, Selector, gather
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.types import ModifyFnType, get_tensor

__all__ = [
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
    "info_of",
]


class Scorer:
    """Base of scorer dataclasses: ``score(kv, query) -> [T]`` float scores, higher = keep.

    ``kv`` is ``[2, L, T, D]``; ``query`` is ``[1, L, T, Dq]`` when the scorer declares
    ``needs_query = True``, else ``None``. Scores are combined across heads and layers by the
    scorer, so one kept-token list serves the whole request. NaN scores are an error
    (:class:`~kvdrop.PolicyInputError`).

    A scorer that depends on what the selector will keep (the budget, the always-kept window,
    the chunk size) declares ``needs_selection = True`` and is called as
    ``score(kv, query, selection)`` with a :class:`~kvdrop.selector.Selection`.
    """

    needs_query: ClassVar[bool] = False
    needs_selection: ClassVar[bool] = False

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


def check_inputs(
    tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], *, policy: str, needs_query: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(kv, query)`` from an edit function's arguments, or raise a teaching error.

    ``query`` is cut to the KV's ``T`` tokens, and ``None`` unless ``needs_query``.
    """
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
    if not needs_query:
        return kv, None
    query = get_tensor(tensors, CacheKind.QUERY)
    if query is None:
        raise MissingQueryError(policy)
    if query.dim() != 4 or query.shape[0] != 1 or query.shape[1] != kv.shape[1]:
        raise PolicyInputError(
            f"{policy}: query must be [1, L, T, Dq] with L={kv.shape[1]} like the KV; got "
            f"{tuple(query.shape)}"
        )
    if query.shape[2] < num_tokens:
        raise PolicyInputError(
            f"{policy}: query covers {query.shape[2]} tokens but the KV has {num_tokens}"
        )
    return kv, query[:, :, :num_tokens]


class Policy(abc.ABC):
    """An edit function built by kvdrop (a ``ModifyFnType`` for ``batch.modify(fn)``).

    Subclasses give ``name``, ``needs_query`` and ``select_indices``; calling the policy gathers
    the kept KV rows and token ids (within budget the input comes back as is).
    """

    name: str

    @property
    @abc.abstractmethod
    def needs_query(self) -> bool:
        """Whether the policy reads the prefill query tensor (``tensors[CacheKind.QUERY]``)."""

    @abc.abstractmethod
    def select_indices(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The validated KV and the sorted int64 indices of the tokens this policy keeps (all of
        them when the input is within budget). Wrappers that need positions (RoPE re-rotation)
        use this instead of matching the returned tokens."""

    def __call__(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, list[int]]:
        kv, index = self.select_indices(tensors, tokens)
        if index.numel() == kv.shape[2]:
            return kv, [int(t) for t in tokens]
        return gather(kv, tokens, index)


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

    def scores(
        self, kv: torch.Tensor, query: torch.Tensor | None, budget: int | None = None
    ) -> torch.Tensor:
        """The scorer's ``[T]`` scores of validated inputs (after its own ``check``).

        ``budget`` is what the ranking will be cut at (default: this selector's budget); only a
        scorer with ``needs_selection`` sees it. Raises PolicyInputError on NaN scores.
        """
        self.scorer.check(kv, query)
        num_tokens = kv.shape[2]
        with torch.no_grad():
            if self.scorer.needs_selection:
                selection = self.selector.selection(num_tokens, budget)
                scores = self.scorer.score(kv, query, selection)
            else:
                scores = self.scorer.score(kv, query)
        if scores.shape != (num_tokens,):
            raise PolicyInputError(
                f"{self.name}: scorer returned scores of shape {tuple(scores.shape)}; expected "
                f"({num_tokens},)"
            )
        nan = int(torch.isnan(scores).sum())
        if nan:
            raise PolicyInputError(
                f"{self.name}: the scorer returned {nan} NaN score(s) for {num_tokens} tokens, so "
                "it cannot rank them; expected finite KV (and query) values (NaN or inf in the "
                "cache?)"
            )
        return scores

    def ranking(
        self, kv: torch.Tensor, query: torch.Tensor | None, budget: int | None = None
    ) -> torch.Tensor:
        """Every token index in the order this policy keeps them (its selector's ranking)."""
        return self.selector.ranking(self.scores(kv, query, budget))

    def select_indices(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv, query = check_inputs(tensors, tokens, policy=self.name, needs_query=self.needs_query)
        num_tokens = kv.shape[2]
        budget = self.selector.budget(num_tokens)
        if budget >= num_tokens:
            return kv, torch.arange(num_tokens)
        return kv, self.selector.select(self.scores(kv, query, budget), budget)


class FunctionPolicy(Policy):
    """A plain edit function ``fn(tensors, tokens) -> (kv, tokens)`` seen as a :class:`Policy`.

    Calling it calls ``fn`` unchanged; ``select_indices`` finds the kept rows in the input
    (greedy in order, matching the token id and the layer-0 key row, so repeated ids are told
    apart), for wrappers such as RoPE re-rotation.
    """

    def __init__(self, name: str, fn: ModifyFnType, needs_query: bool = False) -> None:
        self.name = name
        self.fn = fn
        self._needs_query = needs_query

    def __repr__(self) -> str:
        return f"FunctionPolicy({self.name!r}, {self.fn!r})"

    @property
    def needs_query(self) -> bool:
        return self._needs_query

    def select_indices(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv, _ = check_inputs(tensors, tokens, policy=self.name, needs_query=self.needs_query)
        out, kept = self.fn(tensors, tokens)
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
        return kv, torch.tensor(found, dtype=torch.int64)

    def __call__(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, Sequence[int]]:
        return self.fn(tensors, tokens)


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
