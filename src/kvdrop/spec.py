"""Policies built from other policies without code: union, chunk-level variant, per-request budget.

Three registered factories and a small spec language used by :func:`kvdrop.get`,
``kvdrop describe`` and anything else that takes a policy name:

- ``compose``: a union of scorer policies sharing one budget. Each part gets a share of the
  chunk-aligned budget (``weights``, default equal, in whole chunks) and, in order, takes its
  most preferred tokens not taken yet -- its own forced tokens (sinks, recent window) first,
  then its best scores, exactly the order its own selector uses. One part alone equals that
  policy. Spec: ``"streaming+snapkv"`` or ``"streaming(n_sink=8)+snapkv(window=32)"``.
- ``chunk``: any scorer policy at chunk granularity (ChunkKV-style: whole chunks ranked by the sum
  of their token scores). Spec: ``"chunk(policy=snapkv)"``.
- ``budget``: a per-request budget: ``tiers="4096:1.0,16384:0.5,*:0.25"`` keeps all of prompts up
  to 4096 tokens, half up to 16384, a quarter beyond (an int instead of a ratio is a token
  count); from Python, ``rule=callable(T) -> ratio (float) | tokens (int)``.
  Spec: ``"budget(policy=snapkv, tiers='4096:1.0,*:0.5')"``.

Spec grammar: ``TERM ('+' TERM)*`` with ``TERM = NAME ['(' KEY=VALUE (',' KEY=VALUE)* ')']``;
values are JSON literals (``8``, ``0.5``, ``true``, ``null``), quoted strings, or bare words.
Parameters are validated when the spec is built, as for any factory.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvdrop.errors import PolicyInputError, PolicyParamError
from kvdrop.params import Param, validate_params
from kvdrop.policy import IndexPolicy, PolicyInfo, ScorerFactory, ScorerPolicy, check_inputs
from kvdrop.selector import SELECTOR_PARAMS, Selector, _first_unique

__all__ = [
    "BudgetPolicy",
    "ComposePolicy",
    "budget",
    "chunk",
    "compose",
    "is_spec",
    "needs_query",
    "parse_spec",
    "ranking",
    "spec_factory",
]

_BUDGET = {p.name: p for p in SELECTOR_PARAMS if p.name in ("keep_ratio", "keep_tokens")}
_CHUNK_SIZE = next(p for p in SELECTOR_PARAMS if p.name == "chunk_size")
_HEAD_DIM = Param(
    "head_dim",
    int | None,
    None,
    "per-head dimension, passed to every part that takes head_dim (unless the part sets it)",
    "None or an int >= 1",
    lambda d: d >= 1,
)

# ---------------------------------------------------------------------------------------------
# Spec strings


def is_spec(name: str) -> bool:
    """Whether ``name`` is a composition spec rather than a plain registered name."""
    return any(c in name for c in "+()")


_TOKEN = re.compile(r"\s*(?:(?P<str>'[^']*'|\"[^\"]*\")|(?P<punct>[+(),=])|(?P<word>[^\s+(),=]+))")


def _tokens(spec: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(spec):
        if spec[pos:].strip() == "":
            break
        m = _TOKEN.match(spec, pos)
        if m is None:
            raise PolicyParamError(f"policy spec {spec!r}: cannot read from position {pos}")
        kind = m.lastgroup or "word"
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def _value(kind: str, text: str) -> Any:
    if kind == "str":
        return text[1:-1]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a bare word, e.g. a policy name


def parse_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``"a(x=1)+b"`` -> ``[("a", {"x": 1}), ("b", {})]``; PolicyParamError on bad syntax."""
    toks = _tokens(spec)
    terms: list[tuple[str, dict[str, Any]]] = []
    i = 0

    def fail(what: str) -> PolicyParamError:
        return PolicyParamError(
            f"policy spec {spec!r}: {what}; expected NAME or NAME(key=value, ...) joined by '+'"
        )

    while True:
        if i >= len(toks) or toks[i][0] != "word":
            raise fail("missing a policy name")
        name, params = toks[i][1], {}
        i += 1
        if i < len(toks) and toks[i] == ("punct", "("):
            i += 1
            while i < len(toks) and toks[i] != ("punct", ")"):
                if (
                    i + 2 >= len(toks)
                    or toks[i][0] != "word"
                    or toks[i + 1] != ("punct", "=")
                    or toks[i + 2][0] not in ("word", "str")
                ):
                    raise fail(f"bad parameter list after {name!r}")
                params[toks[i][1]] = _value(*toks[i + 2])
                i += 3
                if i < len(toks) and toks[i] == ("punct", ","):
                    i += 1
            if i >= len(toks):
                raise fail(f"unclosed '(' after {name!r}")
            i += 1
        terms.append((name, params))
        if i == len(toks):
            return terms
        if toks[i] != ("punct", "+"):
            raise fail(f"unexpected {toks[i][1]!r}")
        i += 1


class SpecFactory:
    """The factory of a spec string: builds it with call-time params over the spec's own."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.terms = parse_spec(spec)
        from kvdrop import registry

        if len(self.terms) == 1:
            name, bound = self.terms[0]
            self._build: Callable[..., Any] = lambda **p: registry.get(name, **{**bound, **p})
            base = registry.describe(name)
            self.info = dataclasses.replace(
                base,
                name=spec,
                example={**base.example, **bound},
                details=f"{name} with {bound}\n\n{base.details}".strip(),
            )
        else:
            self._build = lambda **p: compose(policies=self.terms, **p)
            self.info = _compose_info(spec, self.terms)
        # Build once with the defaults so a bad spec fails now, not at first use.
        self.info = dataclasses.replace(self.info, needs_query=needs_query(self._build()))

    def __call__(self, **params: Any) -> Any:
        return self._build(**params)


def needs_query(fn: Any) -> bool:
    """Whether an edit function built by kvdrop needs the query tensor (False if unknown)."""
    if isinstance(fn, (ComposePolicy, BudgetPolicy)):
        return fn.needs_query
    scorer = getattr(fn, "scorer", None)
    if scorer is not None:
        return bool(scorer.needs_query)
    inner = getattr(fn, "inner", None)
    return needs_query(inner) if inner is not None else bool(getattr(fn, "needs_query", False))


def spec_factory(spec: str) -> SpecFactory:
    """A validated factory (with ``.info`` for ``kvdrop describe``) for a spec string."""
    return SpecFactory(spec)


# ---------------------------------------------------------------------------------------------
# Ranking: the order in which a selector would keep tokens


def ranking(selector: Selector, scores: torch.Tensor) -> torch.Tensor:
    """Every token index in the order ``selector`` keeps them (``select(scores, k)`` is the first
    ``k`` of it, sorted): forced recent tokens, then sinks, then by score (ties: earlier first).
    Chunked selectors rank whole chunks; a partial tail chunk comes last."""
    scores = torch.nan_to_num(scores.detach().to(torch.float32).cpu(), nan=-torch.inf)
    if not selector.chunked:
        return _token_ranking(scores, selector.n_sink, selector.window)
    c = selector.chunk_size
    n_chunks = scores.shape[0] // c
    full = n_chunks * c
    chunk_scores = scores[:full].view(n_chunks, c).sum(dim=1)
    sink_chunks = -(-min(selector.n_sink, full) // c)
    window_chunks = -(-min(selector.window, full) // c)
    order = _token_ranking(chunk_scores, sink_chunks, window_chunks)
    tokens = (order[:, None] * c + torch.arange(c)).reshape(-1)
    return torch.cat([tokens, torch.arange(full, scores.shape[0])])


def _token_ranking(scores: torch.Tensor, n_sink: int, window: int) -> torch.Tensor:
    num_tokens = scores.shape[0]
    recent = torch.arange(num_tokens - 1, max(num_tokens - window, 0) - 1, -1)
    sinks = torch.arange(min(n_sink, num_tokens))
    forced = _first_unique(torch.cat([recent, sinks]))
    free = torch.ones(num_tokens, dtype=torch.bool)
    free[forced] = False
    candidates = free.nonzero().squeeze(1)
    order = torch.sort(scores[candidates], descending=True, stable=True).indices
    return torch.cat([forced, candidates[order]])


# ---------------------------------------------------------------------------------------------
# compose


class ComposePolicy(IndexPolicy):
    """Union of scorer policies under one budget (see the module docstring)."""

    def __init__(
        self, name: str, parts: Sequence[ScorerPolicy], weights: Sequence[float], selector: Selector
    ) -> None:
        self.name = name
        self.parts = list(parts)
        self.weights = list(weights)
        self.selector = selector
        self.needs_query = any(p.scorer.needs_query for p in self.parts)

    def __repr__(self) -> str:
        names = "+".join(p.name for p in self.parts)
        return f"ComposePolicy({names!r}, weights={self.weights}, {self.selector!r})"

    def with_selector(self, selector: Selector) -> ComposePolicy:
        """The same union under another budget (chunk size stays the parts')."""
        return ComposePolicy(self.name, self.parts, self.weights, selector)

    def quotas(self, budget: int) -> list[int]:
        """Tokens each part picks: ``budget`` split by weight in whole chunks (largest remainders
        first, ties to the earlier part)."""
        c = self.selector.chunk_size
        units, extra = divmod(budget, c)
        total = sum(self.weights)
        exact = [units * w / total for w in self.weights]
        whole = [int(x) for x in exact]
        left = units - sum(whole)
        order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - whole[i]), i))
        for i in order[:left]:
            whole[i] += 1
        out = [w * c for w in whole]
        out[0] += extra  # budget is chunk-aligned unless it is all of T
        return out

    def select_indices(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The validated KV and the sorted indices of the union's kept tokens."""
        kv, query = check_inputs(tensors, tokens, policy=self.name, needs_query=self.needs_query)
        num_tokens = kv.shape[2]
        budget = self.selector.budget(num_tokens)
        if budget >= num_tokens:
            return kv, torch.arange(num_tokens)
        chosen = torch.zeros(num_tokens, dtype=torch.bool)
        for part, quota in zip(self.parts, self.quotas(budget)):
            if quota == 0:
                continue
            q = query if part.scorer.needs_query else None
            order = ranking(part.selector, part.scores(kv, q))
            picked = order[~chosen[order]][:quota]
            chosen[picked] = True
        return kv, chosen.nonzero().squeeze(1)


def _part_list(policies: Any) -> list[tuple[str, dict[str, Any]]]:
    """Normalise ``policies`` (spec string, or list of names / (name, params) / dicts)."""
    if isinstance(policies, str):
        return parse_spec(policies)
    if not isinstance(policies, (list, tuple)) or not policies:
        raise PolicyParamError(
            f"compose: parameter 'policies' got {policies!r}; expected a spec string like "
            "'streaming+snapkv' or a non-empty list of names, (name, params) pairs or dicts "
            "with a 'name' key"
        )
    out = []
    for item in policies:
        if isinstance(item, str):
            out.extend(parse_spec(item))
        elif isinstance(item, Mapping) and isinstance(item.get("name"), str):
            out.append((item["name"], {k: v for k, v in item.items() if k != "name"}))
        elif (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], Mapping)
        ):
            out.append((item[0], dict(item[1])))
        else:
            raise PolicyParamError(
                f"compose: cannot read policy {item!r}; expected a name, a (name, params) pair "
                "or a dict with a 'name' key"
            )
    return out


_COMPOSE_PARAMS: tuple[Param, ...] = (
    Param(
        "policies",
        str | list | tuple,
        "streaming+snapkv",
        "the parts: a spec 'a+b(x=1)' or a list of names, (name, params) pairs or dicts; "
        "each must be a scorer policy (budget parameters of parts are ignored)",
    ),
    Param(
        "weights",
        list | tuple | None,
        None,
        "share of the budget per part, in whole chunks (default: equal shares)",
        "None or one number > 0 per part",
    ),
    _BUDGET["keep_ratio"],
    _BUDGET["keep_tokens"],
    _CHUNK_SIZE,
    _HEAD_DIM,
)


def _takes(name: str, param: str) -> bool:
    from kvdrop import registry

    return param in {p.name for p in registry.describe(name).params}


def _build_part(owner: str, name: str, params: dict[str, Any], shared: dict[str, Any]) -> Any:
    from kvdrop import registry

    if is_spec(name):
        raise PolicyParamError(f"{owner}: part {name!r} must be a policy name, not a spec")
    own = {k: v for k, v in params.items() if k not in ("keep_ratio", "keep_tokens")}
    for key, value in shared.items():
        if value is not None and key not in own and _takes(name, key):
            own[key] = value
    return registry.get(name, **own)


def compose(**params: Any) -> ComposePolicy:
    """Union of scorer policies sharing one chunk-aligned budget (``policies="a+b"``)."""
    values = validate_params("compose", _COMPOSE_PARAMS, params)
    parts_spec = _part_list(values["policies"])
    try:
        selector = Selector(
            keep_ratio=values["keep_ratio"],
            keep_tokens=values["keep_tokens"],
            chunk_size=values["chunk_size"],
        )
    except PolicyParamError as exc:
        raise PolicyParamError(f"compose: {exc}") from None
    shared = {"chunk_size": values["chunk_size"], "head_dim": values["head_dim"]}
    parts = []
    for name, own in parts_spec:
        part = _build_part("compose", name, own, shared)
        if not isinstance(part, ScorerPolicy):
            raise PolicyParamError(
                f"compose: part {name!r} is a {type(part).__name__}, not a scorer policy; only "
                "policies built by ScorerFactory (every built-in) can be composed"
            )
        parts.append(part)
    weights = values["weights"]
    if weights is None:
        weights = [1.0] * len(parts)
    if len(weights) != len(parts) or not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in weights
    ):
        raise PolicyParamError(
            f"compose: parameter 'weights' got {weights!r}; expected {len(parts)} numbers > 0 "
            "(one per part)"
        )
    name = "+".join(n for n, _ in parts_spec)
    return ComposePolicy(name, parts, [float(w) for w in weights], selector)


def _compose_info(name: str, terms: Sequence[tuple[str, dict[str, Any]]] | None) -> PolicyInfo:
    from kvdrop import registry

    details = (
        "Union of scorer policies under one chunk-aligned budget: each part gets a share of "
        "the budget (weights, in whole chunks) and, in order, takes its most preferred tokens "
        "not taken yet (its own sinks/recent window first, then its best scores). Budget "
        "parameters of the parts are ignored; their other parameters apply."
    )
    needs_query = True
    if terms is not None:
        infos = [registry.describe(n) for n, _ in terms]
        needs_query = any(i.needs_query for i in infos)
        lines = [
            f"  {n}{'(' + ', '.join(f'{k}={v!r}' for k, v in p.items()) + ')' if p else ''}: "
            f"{i.summary} [params: {', '.join(x.name for x in i.params)}]"
            for (n, p), i in zip(terms, infos)
        ]
        details += "\n\nParts:\n" + "\n".join(lines)
    return PolicyInfo(
        name,
        "Union of policies sharing one budget, e.g. 'streaming+snapkv' (needs queries if a "
        "part does)",
        needs_query,
        _COMPOSE_PARAMS,
        details,
        {},
    )


compose.info = _compose_info("compose", None)  # type: ignore[attr-defined]

# ---------------------------------------------------------------------------------------------
# chunk


_CHUNK_PARAMS: tuple[Param, ...] = (
    Param("policy", str, "knorm", "the scorer policy to run at chunk granularity"),
    *(p for p in SELECTOR_PARAMS if p.name != "chunked"),
    _HEAD_DIM,
)


def chunk(policy: str = "knorm", **params: Any) -> Any:
    """``policy`` selecting whole chunks by the sum of their token scores (ChunkKV-style).

    Every other parameter goes to ``policy`` (validated by it).
    """
    from kvdrop import registry

    if not isinstance(policy, str) or is_spec(policy):
        raise PolicyParamError(
            f"chunk: parameter 'policy' got {policy!r}; expected a registered policy name"
        )
    factory = registry._entry(policy)
    declared = {p.name for p in registry.describe(policy).params}
    if "head_dim" in params and params["head_dim"] is None:
        params.pop("head_dim")
    if "chunked" in declared:
        return registry.get(policy, **params, chunked=True)
    if isinstance(factory, ScorerFactory) and factory._fixed.get("chunked"):
        return registry.get(policy, **params)  # already chunk-level (e.g. chunk-halving)
    raise PolicyParamError(
        f"chunk: policy {policy!r} has no chunk-level mode (no 'chunked' parameter); expected a "
        "scorer policy (`kvdrop describe NAME` lists its parameters)"
    )


chunk.info = PolicyInfo(  # type: ignore[attr-defined]
    "chunk",
    "Any scorer policy at chunk granularity (ChunkKV-style), e.g. 'chunk(policy=snapkv)'",
    False,  # as its default inner policy (knorm); the inner policy decides
    _CHUNK_PARAMS,
    "Runs `policy` with chunked=True: whole chunks are ranked by the sum of their token scores, "
    "so the kept prefix is made of whole server chunks. Every parameter other than `policy` "
    "goes to the inner policy and is validated by it. Needs query tensors if the inner policy "
    "does.",
    {},
)

# ---------------------------------------------------------------------------------------------
# budget

Rule = Callable[[int], "int | float"]


def parse_tiers(tiers: str | Sequence[Any]) -> list[tuple[int | None, int | float]]:
    """``"4096:1.0,16384:0.5,*:8192"`` -> ``[(4096, 1.0), (16384, 0.5), (None, 8192)]``.

    Each tier applies to prompts of at most that many tokens (``*``: any length); a value with a
    decimal point is a keep ratio in (0, 1], an int a token count >= 1. Tiers must grow and end
    with ``*``.
    """
    items: list[tuple[Any, Any]]
    if isinstance(tiers, str):
        items = []
        for part in tiers.split(","):
            bound, sep, value = part.strip().partition(":")
            if not sep:
                raise PolicyParamError(
                    f"budget: tier {part.strip()!r} in {tiers!r} has no ':'; expected "
                    "MAX_TOKENS:VALUE or *:VALUE"
                )
            b = None if bound.strip() == "*" else _int_or_fail(bound, tiers)
            v = value.strip()
            items.append((b, float(v) if "." in v else _int_or_fail(v, tiers)))
    else:
        items = [tuple(x) for x in tiers]
    out: list[tuple[int | None, int | float]] = []
    last = 0
    for b, v in items:
        ok_v = (isinstance(v, float) and 0 < v <= 1) or (
            isinstance(v, int) and not isinstance(v, bool) and v >= 1
        )
        if not ok_v:
            raise PolicyParamError(
                f"budget: tier value {v!r} in {tiers!r}; expected a ratio 0 < r <= 1 (with a "
                "decimal point) or a token count >= 1"
            )
        if b is not None and (not isinstance(b, int) or b <= last):
            raise PolicyParamError(
                f"budget: tier bound {b!r} in {tiers!r}; bounds must be increasing ints"
            )
        if out and out[-1][0] is None:
            raise PolicyParamError(f"budget: tiers {tiers!r} continue after '*'")
        out.append((b, v))
        last = b if b is not None else last
    if not out or out[-1][0] is not None:
        raise PolicyParamError(
            f"budget: tiers {tiers!r} must end with a '*' tier covering any length"
        )
    return out


def _int_or_fail(text: str, tiers: Any) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise PolicyParamError(
            f"budget: cannot read {text.strip()!r} in tiers {tiers!r}; expected an int"
        ) from None


class BudgetPolicy:
    """An inner policy whose budget is decided per request from its length."""

    def __init__(self, name: str, inner: ScorerPolicy | ComposePolicy, rule: Rule) -> None:
        self.name = name
        self.inner = inner
        self.rule = rule
        self.needs_query = needs_query(inner)

    def __repr__(self) -> str:
        return f"BudgetPolicy({self.inner!r}, rule={self.rule!r})"

    def for_length(self, num_tokens: int) -> ScorerPolicy | ComposePolicy:
        """The inner policy with this request's budget."""
        value = self.rule(num_tokens)
        if isinstance(value, float) and 0 < value <= 1:
            sel = dataclasses.replace(self.inner.selector, keep_ratio=value, keep_tokens=None)
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            sel = dataclasses.replace(self.inner.selector, keep_ratio=None, keep_tokens=value)
        else:
            raise PolicyInputError(
                f"{self.name}: budget rule returned {value!r} for {num_tokens} tokens; expected "
                "a ratio 0 < r <= 1 (float) or a token count >= 1 (int)"
            )
        return self.inner.with_selector(sel)

    def select_indices(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The validated KV and the indices kept under this request's budget."""
        return self.for_length(len(tokens)).select_indices(tensors, tokens)

    def __call__(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, list[int]]:
        return self.for_length(len(tokens))(tensors, tokens)


class _TierRule:
    def __init__(self, tiers: list[tuple[int | None, int | float]]) -> None:
        self.tiers = tiers

    def __call__(self, num_tokens: int) -> int | float:
        for bound, value in self.tiers:
            if bound is None or num_tokens <= bound:
                return value
        raise AssertionError("tiers end with '*'")

    def __repr__(self) -> str:
        return ",".join(f"{'*' if b is None else b}:{v}" for b, v in self.tiers)


_BUDGET_PARAMS: tuple[Param, ...] = (
    Param("policy", str, "knorm", "the policy (name or spec) whose budget is set per request"),
    Param(
        "tiers",
        str | list | tuple | None,
        None,
        "length tiers 'MAX:VALUE,...,*:VALUE'; VALUE with a '.' is a keep ratio, an int a token "
        "count (None: the keep_ratio/keep_tokens given, as the inner policy)",
    ),
    Param(
        "rule",
        Any,
        None,
        "Python only: callable(T) -> ratio (float) or tokens (int); instead of tiers",
    ),
    *(p for p in SELECTOR_PARAMS if p.name != "chunked"),
    _HEAD_DIM,
)


def budget(
    policy: str = "knorm", tiers: Any = None, rule: Rule | None = None, **params: Any
) -> BudgetPolicy:
    """``policy`` with a budget picked per request by its length (``tiers`` or ``rule``)."""
    from kvdrop import registry

    if tiers is not None and rule is not None:
        raise PolicyParamError("budget: give tiers or rule, not both")
    if rule is not None and not callable(rule):
        raise PolicyParamError(
            f"budget: parameter 'rule' got {rule!r}; expected a callable(T) -> ratio or tokens"
        )
    if not isinstance(policy, str):
        raise PolicyParamError(f"budget: parameter 'policy' got {policy!r}; expected a name/spec")
    if params.get("head_dim", 0) is None:
        params.pop("head_dim")
    inner = registry.get(policy, **params)
    if not isinstance(inner, (ScorerPolicy, ComposePolicy)):
        raise PolicyParamError(
            f"budget: policy {policy!r} is a {type(inner).__name__}; expected a scorer policy or "
            "a composition (something with a selector)"
        )
    if tiers is not None:
        rule = _TierRule(parse_tiers(tiers))
    if rule is None:
        sel = inner.selector
        fixed: int | float = sel.keep_tokens if sel.keep_tokens is not None else sel.keep_ratio  # type: ignore[assignment]

        def rule(num_tokens: int) -> int | float:
            return fixed

    return BudgetPolicy(f"budget({policy})", inner, rule)


budget.info = PolicyInfo(  # type: ignore[attr-defined]
    "budget",
    "Per-request budget by prompt length, e.g. tiers '4096:1.0,*:0.5' over any policy",
    False,  # as its default inner policy (knorm); the inner policy decides
    _BUDGET_PARAMS,
    "Picks keep_ratio or keep_tokens for each request from its length, then runs `policy` "
    "(a name or spec) with that budget, chunk-aligned as always. Other parameters go to the "
    "inner policy. Needs query tensors if the inner policy does.",
    {},
)
