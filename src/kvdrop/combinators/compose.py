"""``Compose``: a union of scorer policies sharing one chunk-aligned budget."""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvdrop.combinators.inner import (
    CHUNK_SIZE,
    DEVICE,
    HEAD_DIM,
    KEEP,
    build,
    describe,
    is_spec,
    policy_terms,
)
from kvdrop.errors import PolicyParamError, PolicyWarning
from kvdrop.factories import PolicyFactory, PolicyInfo
from kvdrop.inputs import EditInputs
from kvdrop.params import Param, validate_params
from kvdrop.policy import NeedsPolicy, QueryNeed, ScorerPolicy, SelectorPolicy
from kvdrop.selector import Selector
from kvdrop_sdk.query_capture import Needs, needs_of

__all__ = ["Compose", "ComposeFactory", "compose", "compose_info"]


class Compose(NeedsPolicy, SelectorPolicy):
    """Union of built scorer policies under one budget (like kvpress's ``ComposedPress``).

    Each part gets a share of the chunk-aligned budget (``weights``, default equal, in tokens,
    largest remainders first, ties to the earlier part; in whole chunks when a part keeps whole
    chunks, ``chunked``) and, in order, takes its most preferred tokens not taken yet -- its own
    forced tokens (sinks, recent window) first, then its best scores, exactly its own selector's
    :meth:`~kvdrop.selector.Selector.ranking`. Only the union must fill whole chunks (the server
    stores whole chunks), so two parts share a one-chunk budget. One part alone equals that
    policy. The parts' own budgets are ignored; their chunk size must be the composition's. A
    part whose share rounds to zero (more parts than tokens, or than chunks for chunked parts)
    picks nothing, and a :class:`~kvdrop.PolicyWarning` says so.
    """

    def __init__(
        self,
        parts: Sequence[ScorerPolicy],
        weights: Sequence[float] | None = None,
        *,
        keep_ratio: float | None = None,
        keep_tokens: int | None = None,
        name: str | None = None,
        device: str = "auto",
    ) -> None:
        self.parts = list(parts)
        self.name = name or "+".join(p.name for p in self.parts)
        if not self.parts:
            raise PolicyParamError("compose: no parts; expected one or more scorer policies")
        for part in self.parts:
            if not isinstance(part, ScorerPolicy):
                raise PolicyParamError(
                    f"compose: part {part!r} is a {type(part).__name__}, "
                    "not a scorer policy; only policies built by ScorerFactory (every built-in) "
                    "can be composed"
                )
        sizes = sorted({p.selector.chunk_size for p in self.parts})
        if len(sizes) > 1:
            raise PolicyParamError(
                f"compose: parts use chunk sizes {sizes}; expected one chunk size for all parts"
            )
        weights = [1.0] * len(self.parts) if weights is None else list(weights)
        if len(weights) != len(self.parts) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in weights
        ):
            raise PolicyParamError(
                f"compose: parameter 'weights' got {weights!r}; expected {len(self.parts)} "
                "numbers > 0 (one per part)"
            )
        self.weights = [float(w) for w in weights]
        try:
            self.selector = Selector(
                keep_ratio=keep_ratio, keep_tokens=keep_tokens, chunk_size=sizes[0], device=device
            )
        except PolicyParamError as exc:
            raise PolicyParamError(f"compose: {exc}") from None

    def __repr__(self) -> str:
        return f"Compose({self.name!r}, weights={self.weights}, {self.selector!r})"

    @property
    def needs(self) -> Needs:
        """The widest needs of its parts (``NONE < WINDOW < FULL``; scores if one reads them)."""
        return functools.reduce(operator.or_, map(needs_of, self.parts))

    @property
    def share_unit(self) -> int:
        """What shares are counted in: tokens, or whole chunks when a part keeps whole chunks
        (its share must be whole chunks for its choice to be)."""
        chunked = any(getattr(p.selector, "chunked", False) for p in self.parts)
        return self.selector.chunk_size if chunked else 1

    def quotas(self, budget: int) -> list[int]:
        """Tokens each part picks: ``budget`` split by weight in :attr:`share_unit` (largest
        remainders first, ties to the earlier part)."""
        c = self.share_unit
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

    def _select(self, inputs: EditInputs, budget: int) -> torch.Tensor:
        kv, query, num_tokens = inputs.kv, inputs.query, inputs.num_tokens
        quotas = self.quotas(budget)
        idle = [p.name for p, q in zip(self.parts, quotas) if q == 0]
        if idle:
            from kvdrop_sdk.http_limits import log_field  # each field capped: specs can be long

            warnings.warn(
                f"{log_field(self.name)}: a budget of {budget // self.share_unit} "
                f"{'chunk(s)' if self.share_unit > 1 else 'token(s)'} split by weights "
                f"{log_field(self.weights)} leaves "
                f"{log_field(', '.join(idle))} without tokens ({len(idle)} of "
                f"{len(self.parts)} parts); keep more (keep_ratio/keep_tokens), use a smaller "
                "chunk_size or fewer parts",
                PolicyWarning,
                stacklevel=3,
            )
        chosen = torch.zeros(num_tokens, dtype=torch.bool)
        for part, quota in zip(self.parts, quotas):
            if quota == 0:
                continue
            order = part.ranking(
                kv, query if needs_of(part).reads_queries else None, quota, inputs=inputs
            )
            picked = order[~chosen[order]][:quota]
            chosen[picked] = True
        return chosen.nonzero().squeeze(1)


# The registered factory: names -> built policies -> this combinator

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
        "share of the budget per part, in tokens (whole chunks when a part is chunked; default: "
        "equal shares)",
        "None or one number > 0 per part",
    ),
    *KEEP,
    CHUNK_SIZE,
    HEAD_DIM,
    DEVICE,
)


def _with_shared(name: str, own: dict[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    """``own`` plus each ``shared`` value that is set, that ``name`` takes and ``own`` lacks."""
    takes = {p.name for p in describe(name).params}
    extra = {k: v for k, v in shared.items() if v is not None and k not in own and k in takes}
    return {**own, **extra}


class ComposeFactory(PolicyFactory):
    """``compose``: :class:`~kvdrop.combinators.Compose` of policies given by name."""

    name = "compose"

    def __init__(self) -> None:
        self.info = compose_info("compose", None)

    def __call__(self, **params: Any) -> Compose:
        values = validate_params("compose", _COMPOSE_PARAMS, params)
        terms = policy_terms(values["policies"])
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
            parts.append(build(name, **_with_shared(name, own, shared)))
        return Compose(
            parts,  # type: ignore[arg-type]  # Compose says which part is not a scorer policy
            values["weights"],
            keep_ratio=values["keep_ratio"],
            keep_tokens=values["keep_tokens"],
            device=values["device"],
        )


def compose_info(name: str, terms: Sequence[tuple[str, dict[str, Any]]] | None) -> PolicyInfo:
    details = (
        "Union of scorer policies under one chunk-aligned budget: each part gets a share of "
        "the budget (weights, in tokens; in whole chunks when a part is chunked) and, in order, "
        "takes its most preferred tokens not taken yet (its own sinks/recent window first, then "
        "its best scores). Budget parameters of the parts are ignored; their other parameters "
        "apply. A part whose share rounds to zero gets nothing (a PolicyWarning says so)."
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


compose = ComposeFactory()
