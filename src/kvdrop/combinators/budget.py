"""``Budget``: a policy whose budget is picked per request from its length."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvdrop.combinators.inner import HEAD_DIM, build, inner_params, policy_name
from kvdrop.errors import PolicyInputError, PolicyParamError
from kvdrop.factories import PolicyFactory, PolicyInfo
from kvdrop.params import Param
from kvdrop.policy import PolicyWrapper, QueryNeed, SelectorPolicy
from kvdrop.selector import SELECTOR_PARAMS
from kvdrop_sdk.edit import EditContext

__all__ = ["Budget", "BudgetFactory", "Rule", "TierRule", "budget", "parse_tiers"]

#: ``rule(T)`` -> a keep ratio in (0, 1] (float) or a token count >= 1 (int).
Rule = Callable[[int], "int | float"]


def parse_tiers(tiers: str | Sequence[Any]) -> list[tuple[int | None, int | float]]:
    """``"4096:1.0,16384:0.5,*:8192"`` -> ``[(4096, 1.0), (16384, 0.5), (None, 8192)]``.

    Each tier applies to prompts of at most that many tokens (``*``: any length); a value with a
    decimal point is a keep ratio in (0, 1], an int a token count >= 1. Tiers must grow and end
    with ``*``. A list of ``(bound, value)`` pairs (bound ``None`` for ``*``) works too.
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


class TierRule:
    """A :data:`Rule` from length tiers (see :func:`parse_tiers`)."""

    def __init__(self, tiers: str | Sequence[Any]) -> None:
        self.tiers = parse_tiers(tiers)

    def __call__(self, num_tokens: int) -> int | float:
        for bound, value in self.tiers:
            if bound is None or num_tokens <= bound:
                return value
        raise AssertionError("tiers end with '*'")

    def __repr__(self) -> str:
        return ",".join(f"{'*' if b is None else b}:{v}" for b, v in self.tiers)


class _FixedRule:
    """The inner policy's own budget, for every length."""

    def __init__(self, value: int | float) -> None:
        self.value = value

    def __call__(self, num_tokens: int) -> int | float:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


class Budget(PolicyWrapper):
    """``policy`` (a scorer policy or a composition) with its budget set per request by
    ``rule(N)`` or ``tiers`` (``"4096:1.0,16384:0.5,*:0.25"``); with neither, its own budget.
    ``N`` is the whole prompt's length (the edit context's ``prompt_tokens``; the cached tokens
    without one). The chosen budget is chunk-aligned as always."""

    def __init__(
        self,
        policy: SelectorPolicy,
        rule: Rule | None = None,
        *,
        tiers: str | Sequence[Any] | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(policy, SelectorPolicy):
            raise PolicyParamError(
                f"budget: policy {policy!r} is a {type(policy).__name__}; expected a scorer "
                "policy or a composition (something with a selector)"
            )
        if tiers is not None and rule is not None:
            raise PolicyParamError("budget: give tiers or rule, not both")
        if rule is not None and not callable(rule):
            raise PolicyParamError(
                f"budget: parameter 'rule' got {rule!r}; expected a callable(T) -> ratio or tokens"
            )
        if tiers is not None:
            rule = TierRule(tiers)
        if rule is None:
            sel = policy.selector
            own = sel.keep_tokens if sel.keep_tokens is not None else sel.keep_ratio
            assert own is not None  # the Selector fills keep_ratio when neither is given
            rule = _FixedRule(own)
        super().__init__(policy, name or f"budget({policy.name})")
        self.policy: SelectorPolicy = policy
        self.rule = rule

    def __repr__(self) -> str:
        return f"Budget({self.policy!r}, rule={self.rule!r})"

    def for_length(self, num_tokens: int) -> SelectorPolicy:
        """The inner policy with this request's budget."""
        value = self.rule(num_tokens)
        if isinstance(value, float) and 0 < value <= 1:
            keep = {"keep_ratio": value, "keep_tokens": None}
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            keep = {"keep_ratio": None, "keep_tokens": value}
        else:
            raise PolicyInputError(
                f"{self.name}: budget rule returned {value!r} for {num_tokens} tokens; expected "
                "a ratio 0 < r <= 1 (float) or a token count >= 1 (int)"
            )
        return self.policy.with_selector(dataclasses.replace(self.policy.selector, **keep))

    def select_indices(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        length = len(tokens) if context is None else max(context.prompt_tokens or 0, len(tokens))
        return self.for_length(length).select_indices(tensors, tokens, context=context)


# The registered factory: names -> built policies -> this combinator


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
            HEAD_DIM,
        ),
        "Picks keep_ratio or keep_tokens for each request from its length, then runs `policy` "
        "(a name or spec) with that budget, chunk-aligned as always. Other parameters go to the "
        "inner policy. Needs query tensors if the inner policy does.",
        {},
    )

    def __call__(
        self, policy: str = "knorm", tiers: Any = None, rule: Any = None, **params: Any
    ) -> Budget:
        name = policy_name("budget", policy, spec_ok=True)
        if tiers is not None and rule is not None:
            raise PolicyParamError("budget: give tiers or rule, not both")
        inner = build(name, **inner_params(params))
        return Budget(inner, rule, tiers=tiers, name=f"budget({name})")  # type: ignore[arg-type]


budget = BudgetFactory()
