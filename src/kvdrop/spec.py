"""Policy names and spec strings -> built policies: ``kvdrop.get``, ``kvdrop.describe``.

A thin layer above :mod:`kvdrop.registry` (which knows plain names) that parses spec strings and
builds the combinator objects of :mod:`kvdrop.combinators` from them, through the factory each
combinator's module owns (``kvdrop.combinators.compose.compose`` and so on; re-exported here):

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
from collections.abc import Mapping
from typing import Any

from kvdrop import registry
from kvdrop.combinators.block import block
from kvdrop.combinators.budget import budget
from kvdrop.combinators.chunk import chunk
from kvdrop.combinators.chunkkv import chunkkv
from kvdrop.combinators.compose import compose, compose_info
from kvdrop.combinators.rerotate import Rerotate
from kvdrop.errors import PolicyParamError
from kvdrop.factories import PolicyFactory, PolicyInfo
from kvdrop.policy import Policy
from kvdrop.selector import DEFAULT_KEEP_RATIO
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
    "policy_terms",
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
                inner.extend(policy_terms(value))
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
            info = compose_info(spec, self.terms)
        self.info = info
        needs = needs_of(self())
        self.info = dataclasses.replace(
            info, queries=needs.queries, token_scores=needs.token_scores
        )

    def __call__(self, **params: Any) -> Policy:
        if self._single is not None:
            return self._single(**{**self.terms[0][1], **params})
        return compose(policies=self.terms, **params)


def policy_terms(policies: Any) -> list[tuple[str, dict[str, Any]]]:
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
