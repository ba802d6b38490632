"""Policy names and spec strings -> built policies: ``kvdrop.get``, ``kvdrop.describe``.

A thin layer above :mod:`kvdrop.registry` (which knows plain names) that parses spec strings and
builds the combinator objects of :mod:`kvdrop.combinators` from them:

- ``"streaming+snapkv"`` or ``"streaming(n_sink=8)+snapkv(window=32)"``: a union,
  :class:`~kvdrop.combinators.Compose` (registered as ``compose``);
- ``"chunk(policy=snapkv)"``: :class:`~kvdrop.combinators.Chunk` (registered as ``chunk``);
- ``"chunkkv(policy=snapkv, chunk_length=20)"``: :class:`~kvdrop.combinators.ChunkKV`
  (registered as ``chunkkv``); ``"block(policy=keydiff, block_size=128)"``:
  :class:`~kvdrop.combinators.Block` (registered as ``block``);
- ``"budget(policy=snapkv, tiers='4096:1.0,*:0.5')"``: :class:`~kvdrop.combinators.Budget`
  (registered as ``budget``); from Python, ``rule=callable(T) -> ratio | tokens``;
- ``kvdrop.get(name, rerotate=rope)``: :class:`~kvdrop.combinators.Rerotate` around any of them
  (fixed RoPE parameters; by default every policy re-rotates with the edit context's, and
  ``rerotate=False`` turns re-rotation off).

Grammar: ``TERM ('+' TERM)*`` with ``TERM = NAME ['(' KEY=VALUE (',' KEY=VALUE)* ')']``. A value
is a quoted string (``'...'`` or ``"..."``), a JSON literal (``8``, ``0.5``, ``true``, ``null``,
``[1, 3]``, ``{"a": 1}``) or a bare word, which may itself be a spec
(``budget(policy=chunk(policy=snapkv), tiers='*:0.5')``). Parameters are validated when the spec
is built, as for any factory.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvdrop import registry
from kvdrop.combinators.block import DEFAULT_BLOCK_SIZE, Block
from kvdrop.combinators.budget import Budget
from kvdrop.combinators.chunk import Chunk
from kvdrop.combinators.chunkkv import DEFAULT_CHUNK_LENGTH, ChunkKV
from kvdrop.combinators.compose import Compose
from kvdrop.combinators.rerotate import Rerotate
from kvdrop.errors import PolicyParamError
from kvdrop.factories import PolicyFactory, PolicyInfo
from kvdrop.params import Param, validate_params
from kvdrop.policy import Policy, QueryNeed
from kvdrop.selector import DEFAULT_KEEP_RATIO, SELECTOR_PARAMS
from kvdrop_sdk.query_capture import needs_of
from kvdrop_sdk.validate import keep_ratio as checked_ratio

__all__ = [
    "KeepBudget",
    "SpecFactory",
    "block",
    "budget",
    "chunk",
    "chunkkv",
    "compose",
    "describe",
    "factory",
    "get",
    "is_spec",
    "keep_budget",
    "parse_spec",
    "source",
    "spec_terms",
]

# ---------------------------------------------------------------------------------------------
# Names and specs -> factories and policies


def is_spec(name: str) -> bool:
    """Whether ``name`` is a spec string rather than a plain registered name."""
    return any(c in name for c in "+()")


def factory(name: str) -> PolicyFactory:
    """The factory of a registered name or of a spec string (validated now)."""
    if not isinstance(name, str):
        raise PolicyParamError(f"policy name must be a string; got {name!r}")
    return SpecFactory(name) if is_spec(name) else registry.factory(name)


def get(name: str, *, rerotate: Any = True, **params: Any) -> Policy:
    """Build policy ``name`` (a registered name or a spec string); ``params`` are validated now,
    not at first use.

    Kept keys are re-rotated to positions ``0..k-1`` (where engines read a kept prefix) with the
    RoPE parameters of the edit context, i.e. the ones the engine registered with the layout
    (``rerotate=True``, the default; ``None`` means the same). ``rerotate=False`` keeps them at
    their old positions; a ``kvdrop_rope.RopeConfig`` or an HF ``config.json`` dict fixes the
    parameters (:class:`~kvdrop.combinators.Rerotate`), for callers without an edit context.
    """
    policy = factory(name)(**params)
    if rerotate is None or rerotate is True:
        return policy
    if rerotate is False:
        policy.rerotate = False
        return policy
    return Rerotate(policy, rerotate, name)


def describe(name: str) -> PolicyInfo:
    """Summary, whether query tensors are needed, and each parameter (type, default, meaning)."""
    return factory(name).info


def source(name: str) -> str:
    """Where policy ``name`` comes from (distribution and object, register() call, or a spec)."""
    if is_spec(name):
        factory(name)
        return "spec string (kvdrop.spec)"
    return registry.source(name)


@dataclasses.dataclass(frozen=True)
class KeepBudget:
    """How much a policy built from a spec keeps: ``keep_ratio`` or ``keep_tokens``, and whose
    value it is (``"spec"``: the spec's own, ``"given"``: the caller's, ``"default"``)."""

    keep_ratio: float | None
    keep_tokens: int | None
    source: str

    @property
    def params(self) -> dict[str, Any]:
        """What to build the spec with (nothing when the spec carries its own budget)."""
        return {} if self.source == "spec" else {"keep_ratio": self.keep_ratio}

    def __str__(self) -> str:
        tokens = self.keep_tokens
        value = f"{tokens} tokens" if tokens is not None else f"{self.keep_ratio:g}"
        return {"given": value, "spec": f"{value} (the spec's)"}.get(
            self.source, f"{value} (default)"
        )


def keep_budget(
    spec: str, keep_ratio: float | None = None, *, default: float | None = None
) -> KeepBudget:
    """The one keep-ratio rule: a spec's own ``keep_ratio``/``keep_tokens``
    (``"snapkv(keep_ratio=0.3)"``) wins over ``default`` (a command's or engine's; None:
    :data:`~kvdrop.selector.DEFAULT_KEEP_RATIO`); an explicit ``keep_ratio`` (a flag, a
    request's field) is used when the spec has none, and beside a different value of the
    spec's own it is a :class:`PolicyParamError` -- never silently one or the other. A
    composition's parts' budgets are ignored (its own is shared), so only a single term's count."""
    if keep_ratio is not None:
        keep_ratio = checked_ratio(keep_ratio)
    terms = parse_spec(spec)
    own = terms[0][1] if len(terms) == 1 else {}
    own_ratio, own_tokens = own.get("keep_ratio"), own.get("keep_tokens")
    if own_ratio is None and own_tokens is None:
        if keep_ratio is not None:
            return KeepBudget(keep_ratio, None, "given")
        if default is not None:
            return KeepBudget(checked_ratio(default), None, "default")
        return KeepBudget(DEFAULT_KEEP_RATIO, None, "default")
    if keep_ratio is not None and (own_tokens is not None or own_ratio != keep_ratio):
        mine = f"keep_tokens={own_tokens}" if own_tokens is not None else f"keep_ratio={own_ratio}"
        raise PolicyParamError(
            f"policy {spec!r} sets {mine} and keep_ratio {keep_ratio:g} was given beside it; "
            "give the budget once (in the spec, or as --keep-ratio / the request's keep_ratio)"
        )
    return KeepBudget(own_ratio, own_tokens, "spec")


# ---------------------------------------------------------------------------------------------
# Spec strings


class _Reader:
    """A cursor over a spec string; every failure says what was expected."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.pos = 0

    def fail(self, what: str) -> PolicyParamError:
        return PolicyParamError(
            f"policy spec {self.spec!r}: {what}; "
            "expected NAME or NAME(key=value, ...) joined by '+'"
        )

    def peek(self) -> str:
        while self.pos < len(self.spec) and self.spec[self.pos].isspace():
            self.pos += 1
        return self.spec[self.pos] if self.pos < len(self.spec) else ""

    def word(self) -> str:
        self.peek()
        start = self.pos
        while self.pos < len(self.spec) and not (
            self.spec[self.pos] in "+(),='\"" or self.spec[self.pos].isspace()
        ):
            self.pos += 1
        return self.spec[start : self.pos]

    def value(self, owner: str) -> Any:
        first = self.peek()
        if first in ("'", '"'):
            end = self.spec.find(first, self.pos + 1)
            if end < 0:
                raise self.fail(f"unclosed quote in the parameters of {owner!r}")
            text, self.pos = self.spec[self.pos + 1 : end], end + 1
            return text
        text = self._balanced(owner)
        if not text:
            raise self.fail(f"bad parameter list after {owner!r}")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            if first in "[{":
                raise self.fail(f"cannot read the JSON value {text!r} given to {owner!r}") from None
            return text  # a bare word: a policy name, or a spec such as chunk(policy=snapkv)

    def _balanced(self, owner: str) -> str:
        """Text up to the next ',' or ')' outside brackets and quotes."""
        start, depth, quote = self.pos, 0, ""
        while self.pos < len(self.spec):
            c = self.spec[self.pos]
            if quote:
                quote = "" if c == quote else quote
            elif c in "'\"":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                if depth == 0:
                    break
                depth -= 1
            elif c == "," and depth == 0:
                break
            self.pos += 1
        if depth or quote:
            raise self.fail(f"unclosed bracket or quote in the parameters of {owner!r}")
        return self.spec[start : self.pos].strip()


def parse_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``"a(x=1)+b"`` -> ``[("a", {"x": 1}), ("b", {})]``; PolicyParamError on bad syntax."""
    r = _Reader(spec)
    terms: list[tuple[str, dict[str, Any]]] = []
    while True:
        name = r.word()
        if not name:
            raise r.fail("missing a policy name")
        params: dict[str, Any] = {}
        if r.peek() == "(":
            r.pos += 1
            while r.peek() != ")":
                if r.peek() == "":
                    raise r.fail(f"unclosed '(' after {name!r}")
                key = r.word()
                if not key.isidentifier() or r.peek() != "=":
                    raise r.fail(f"bad parameter list after {name!r}")
                r.pos += 1
                params[key] = r.value(name)
                if r.peek() == ",":
                    r.pos += 1
                elif r.peek() not in (")", ""):
                    raise r.fail(f"bad parameter list after {name!r}")
            r.pos += 1
        terms.append((name, params))
        nxt = r.peek()
        if nxt == "":
            return terms
        if nxt != "+":
            raise r.fail(f"unexpected {r.spec[r.pos :].split()[0]!r}")
        r.pos += 1


def spec_terms(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """Every policy term ``spec`` builds, nested ones included (a combinator's ``policy=`` and
    ``policies=``), depth first: what a spec asks to run, for whoever bounds it
    (:mod:`kvdrop.limits`). PolicyParamError on bad syntax."""
    out: list[tuple[str, dict[str, Any]]] = []
    todo = list(reversed(parse_spec(spec)))
    while todo:
        name, params = todo.pop()
        out.append((name, params))
        inner: list[tuple[str, dict[str, Any]]] = []
        for key in ("policy", "policies"):
            value = params.get(key)
            if isinstance(value, str) or (key == "policies" and isinstance(value, (list, tuple))):
                inner.extend(_part_list(value))
        todo.extend(reversed(inner))
    return out


class SpecFactory(PolicyFactory):
    """The factory of a spec string: call-time params go over the spec's own.

    One term (``"snapkv(window=32)"``) is that policy with bound parameters; several are their
    :class:`~kvdrop.combinators.Compose`. Built once with the defaults on creation, so a bad
    spec fails now, and ``info.needs`` is the built policy's.
    """

    def __init__(self, spec: str) -> None:
        self.name = spec
        self.terms = parse_spec(spec)
        if len(self.terms) == 1:
            name, bound = self.terms[0]
            self._single: PolicyFactory | None = factory(name)
            base = self._single.info
            info = dataclasses.replace(
                base,
                name=spec,
                # ``kvdrop describe`` shows what the spec builds with: its bound values.
                params=tuple(
                    dataclasses.replace(p, default=bound[p.name]) if p.name in bound else p
                    for p in base.params
                ),
                example={**base.example, **bound},
                details=f"{name} with {bound}\n\n{base.details}".strip(),
            )
        else:
            self._single = None
            info = _compose_info(spec, self.terms)
        self.info = info
        needs = needs_of(self())
        self.info = dataclasses.replace(
            info, queries=needs.queries, token_scores=needs.token_scores
        )

    def __call__(self, **params: Any) -> Policy:
        if self._single is not None:
            return self._single(**{**self.terms[0][1], **params})
        return compose(policies=self.terms, **params)


# ---------------------------------------------------------------------------------------------
# The registered combinator factories: names -> built policies -> combinators

_KEEP = [p for p in SELECTOR_PARAMS if p.name in ("keep_ratio", "keep_tokens")]
_CHUNK_SIZE = next(p for p in SELECTOR_PARAMS if p.name == "chunk_size")
_DEVICE = next(p for p in SELECTOR_PARAMS if p.name == "device")
_HEAD_DIM = Param(
    "head_dim",
    int | None,
    None,
    "per-head dimension, passed to every inner policy that takes head_dim (unless it sets it)",
    "None or an int >= 1",
    lambda d: d >= 1,
)

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
    *_KEEP,
    _CHUNK_SIZE,
    _HEAD_DIM,
    _DEVICE,
)


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


def _with_shared(name: str, own: dict[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    """``own`` plus each ``shared`` value that is set, that ``name`` takes and ``own`` lacks."""
    takes = {p.name for p in describe(name).params}
    extra = {k: v for k, v in shared.items() if v is not None and k not in own and k in takes}
    return {**own, **extra}


class ComposeFactory(PolicyFactory):
    """``compose``: :class:`~kvdrop.combinators.Compose` of policies given by name."""

    name = "compose"

    def __init__(self) -> None:
        self.info = _compose_info("compose", None)

    def __call__(self, **params: Any) -> Compose:
        values = validate_params("compose", _COMPOSE_PARAMS, params)
        terms = _part_list(values["policies"])
        shared = {
            "chunk_size": values["chunk_size"],
            "head_dim": values["head_dim"],
            "device": values["device"],
        }
        parts = []
        for name, own in terms:
            if is_spec(name):
                raise PolicyParamError(f"compose: part {name!r} must be a policy name, not a spec")
            own = {k: v for k, v in own.items() if k not in ("keep_ratio", "keep_tokens")}
            parts.append(get(name, **_with_shared(name, own, shared)))
        return Compose(
            parts,  # type: ignore[arg-type]  # Compose says which part is not a scorer policy
            values["weights"],
            keep_ratio=values["keep_ratio"],
            keep_tokens=values["keep_tokens"],
            device=values["device"],
        )


def _compose_info(name: str, terms: Sequence[tuple[str, dict[str, Any]]] | None) -> PolicyInfo:
    details = (
        "Union of scorer policies under one chunk-aligned budget: each part gets a share of "
        "the budget (weights, in whole chunks) and, in order, takes its most preferred tokens "
        "not taken yet (its own sinks/recent window first, then its best scores). Budget "
        "parameters of the parts are ignored; their other parameters apply. A part whose share "
        "rounds to zero chunks gets nothing (a PolicyWarning says so)."
    )
    queries = QueryNeed.WINDOW  # as its default parts, streaming+snapkv
    if terms is not None:
        infos = [describe(n) for n, _ in terms]
        queries = max((i.queries for i in infos), key=lambda q: q.rank)
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
        queries,
        _COMPOSE_PARAMS,
        details,
        {},
    )


def _inner_params(params: dict[str, Any]) -> dict[str, Any]:
    """Parameters for the inner policy (``head_dim=None`` means: the inner policy's default)."""
    return {k: v for k, v in params.items() if not (k == "head_dim" and v is None)}


def _policy_name(owner: str, policy: Any, *, spec_ok: bool) -> str:
    if not isinstance(policy, str) or (is_spec(policy) and not spec_ok):
        raise PolicyParamError(
            f"{owner}: parameter 'policy' got {policy!r}; expected a registered policy name"
            + (" or a spec" if spec_ok else "")
        )
    return policy


class ChunkFactory(PolicyFactory):
    """``chunk``: :class:`~kvdrop.combinators.Chunk` of a policy given by name."""

    name = "chunk"
    info = PolicyInfo(
        "chunk",
        "Any scorer policy at chunk granularity (ChunkKV-style), e.g. 'chunk(policy=snapkv)'",
        QueryNeed.NONE,  # as its default inner policy (knorm); the inner policy decides
        (
            Param("policy", str, "knorm", "the scorer policy to run at chunk granularity"),
            *(p for p in SELECTOR_PARAMS if p.name != "chunked"),
            _HEAD_DIM,
        ),
        "Runs `policy` with chunked=True: whole chunks are ranked by the sum of their token "
        "scores, so the kept prefix is made of whole server chunks. Every parameter other than "
        "`policy` goes to the inner policy and is validated by it. Needs query tensors if the "
        "inner policy does.",
        {},
    )

    def __call__(self, policy: str = "knorm", **params: Any) -> Chunk:
        name = _policy_name("chunk", policy, spec_ok=False)
        return Chunk(get(name, **_inner_params(params)))  # type: ignore[arg-type]


def _inner_info(name: str, summary: str, own: Param, details: str) -> PolicyInfo:
    """PolicyInfo of a combinator over one policy given by name (``policy`` + ``own``)."""
    return PolicyInfo(
        name,
        summary,
        QueryNeed.NONE,  # as its default inner policy (knorm); the inner policy decides
        (
            Param("policy", str, "knorm", "the scorer policy it runs"),
            own,
            *SELECTOR_PARAMS,
            _HEAD_DIM,
        ),
        details + " Every other parameter goes to the inner policy and is validated by it.",
        {},
    )


class ChunkKVFactory(PolicyFactory):
    """``chunkkv``: :class:`~kvdrop.combinators.ChunkKV` of a policy given by name."""

    name = "chunkkv"
    info = _inner_info(
        "chunkkv",
        "ChunkKV: any scorer policy keeping whole small chunks, e.g. 'chunkkv(policy=snapkv)'",
        Param(
            "chunk_length",
            int,
            DEFAULT_CHUNK_LENGTH,
            "tokens per chunk; chunks are ranked by the mean of their token scores",
            "an int >= 1",
            lambda n: n >= 1,
        ),
        "Scores each token by the mean of its chunk of `chunk_length` tokens (ChunkKV, Liu et "
        "al. 2025), so whole chunks are kept, best first, after the policy's forced tokens; "
        "the last chunk taken may be cut to the chunk-aligned budget.",
    )

    def __call__(
        self, policy: str = "knorm", chunk_length: int = DEFAULT_CHUNK_LENGTH, **params: Any
    ) -> ChunkKV:
        name = _policy_name("chunkkv", policy, spec_ok=False)
        return ChunkKV(get(name, **_inner_params(params)), chunk_length)  # type: ignore[arg-type]


class BlockFactory(PolicyFactory):
    """``block``: :class:`~kvdrop.combinators.Block` of a KV-only policy given by name."""

    name = "block"
    info = _inner_info(
        "block",
        "Block-wise eviction over any KV-only policy, e.g. 'block(policy=keydiff)'",
        Param(
            "block_size",
            int,
            DEFAULT_BLOCK_SIZE,
            "tokens that join the kept ones each round",
            "an int >= 1",
            lambda n: n >= 1,
        ),
        "Keeps the first `budget` tokens, then adds `block_size` tokens at a time and lets the "
        "policy keep `budget` of them (KeyDiff's block-wise prefill, kvpress's BlockPress); "
        "KV-only policies only.",
    )

    def __call__(
        self, policy: str = "knorm", block_size: int = DEFAULT_BLOCK_SIZE, **params: Any
    ) -> Block:
        name = _policy_name("block", policy, spec_ok=False)
        return Block(get(name, **_inner_params(params)), block_size)  # type: ignore[arg-type]


class BudgetFactory(PolicyFactory):
    """``budget``: :class:`~kvdrop.combinators.Budget` of a policy given by name or spec."""

    name = "budget"
    info = PolicyInfo(
        "budget",
        "Per-request budget by prompt length, e.g. tiers '4096:1.0,*:0.5' over any policy",
        QueryNeed.NONE,  # as its default inner policy (knorm); the inner policy decides
        (
            Param(
                "policy", str, "knorm", "the policy (name or spec) whose budget is set per request"
            ),
            Param(
                "tiers",
                str | list | tuple | None,
                None,
                "length tiers 'MAX:VALUE,...,*:VALUE'; VALUE with a '.' is a keep ratio, an int a "
                "token count (None: the keep_ratio/keep_tokens given, as the inner policy)",
            ),
            Param(
                "rule",
                Any,
                None,
                "Python only: callable(T) -> ratio (float) or tokens (int); instead of tiers",
            ),
            *(p for p in SELECTOR_PARAMS if p.name != "chunked"),
            _HEAD_DIM,
        ),
        "Picks keep_ratio or keep_tokens for each request from its length, then runs `policy` "
        "(a name or spec) with that budget, chunk-aligned as always. Other parameters go to the "
        "inner policy. Needs query tensors if the inner policy does.",
        {},
    )

    def __call__(
        self, policy: str = "knorm", tiers: Any = None, rule: Any = None, **params: Any
    ) -> Budget:
        name = _policy_name("budget", policy, spec_ok=True)
        if tiers is not None and rule is not None:
            raise PolicyParamError("budget: give tiers or rule, not both")
        inner = get(name, **_inner_params(params))
        return Budget(inner, rule, tiers=tiers, name=f"budget({name})")  # type: ignore[arg-type]


compose = ComposeFactory()
chunk = ChunkFactory()
chunkkv = ChunkKVFactory()
block = BlockFactory()
budget = BudgetFactory()
