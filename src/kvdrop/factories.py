"""Factories: what the registry hands out, ``factory(**params) -> Policy`` with an ``info``.

- :class:`PolicyInfo`: what ``kvdrop describe`` shows of a registered policy.
- :class:`ScorerFactory`: a scorer dataclass under the shared selector (every built-in).
- :class:`FunctionFactory`: a plain callable registered as a policy; it validates parameter
  names and adapts what the callable returns (:func:`~kvdrop.function_policy.as_policy`).
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvdrop.errors import PolicyParamError
from kvdrop.function_policy import as_policy
from kvdrop.params import Param, params_of_dataclass, validate_params
from kvdrop.policy import Policy, Scorer, ScorerPolicy
from kvdrop.selector import SELECTOR_PARAMS, Selector
from kvdrop_sdk.query_capture import Needs, QueryNeed, needs_of

__all__ = [
    "FunctionFactory",
    "PolicyFactory",
    "PolicyInfo",
    "ScorerFactory",
    "as_factory",
    "info_of",
]


@dataclass(frozen=True)
class PolicyInfo:
    """What ``kvdrop describe`` shows: summary, which queries are read, every parameter.

    ``queries`` and ``token_scores`` are those of the policy built from ``example`` (the
    defaults, for most); :attr:`needs` puts them together.
    """

    name: str
    summary: str
    queries: QueryNeed
    params: tuple[Param, ...]
    details: str = ""
    #: Parameters a minimal working instance needs beyond the defaults (e.g. the inner policies of
    #: a composition); docs and the property tests over every registered policy use them.
    example: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    token_scores: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "queries", QueryNeed(self.queries))

    @property
    def needs(self) -> Needs:
        """What the policy reads beside the KV."""
        return Needs(self.queries, self.token_scores)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary,
            "queries": self.queries.value,
            "token_scores": self.token_scores,
            "details": self.details,
            "params": [p.describe() for p in self.params],
            "example": dict(self.example),
        }


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
            name,
            summary,
            scorer_cls.queries,
            self.params,
            doc,
            dict(example or {}),
            scorer_cls.token_scores,
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
    ``queries``, ``token_scores`` and ``example`` attributes where set: a factory that declares
    nothing builds functions that read upstream's full queries). Parameter names are
    checked before
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
        built = self.fn(**params)
        return as_policy(built, self.name, needs_of(built, default=self.info.needs))


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
        queries=needs_of(factory).queries,
        token_scores=needs_of(factory).token_scores,
        params=tuple(params),
        details=doc,
    )
