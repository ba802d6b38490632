"""Which queries an engine captures for the policies that will edit its caches: one owner.

A policy declares what it reads with one attribute, ``queries`` (a :class:`QueryNeed`):

* ``QueryNeed.NONE``: keys and values only;
* ``QueryNeed.WINDOW``: query rows at any positions (the lean window: the last ``window``
  positions of the whole sequence plus every ``stride``-th one, with log-normalisers);
* ``QueryNeed.FULL``: the query of every cached token, in whole chunks (upstream's layout).

:meth:`QueryCapture.for_policies` derives the engine's capture from the policies once; demo,
eval, benchmarks and ``kvdrop engine`` all call it, and connectors are built with the result.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvdrop_sdk.validate import check_fields

__all__ = [
    "DEFAULT_QUERY_STRIDE",
    "DEFAULT_QUERY_WINDOW",
    "DeclaresQueries",
    "DeclaresTokenScores",
    "QueryCapture",
    "QueryNeed",
]

#: Default W: at least the largest observation window of a built-in policy (SnapKV's 64).
DEFAULT_QUERY_WINDOW = 64
#: Default S of the strided sample (H2O's queries): ``T / 64`` rows over a ``T``-token sequence.
DEFAULT_QUERY_STRIDE = 64


class QueryNeed(str, enum.Enum):
    """What a policy reads of the prefill queries; ordered ``NONE < WINDOW < FULL``."""

    NONE = "none"
    WINDOW = "window"
    FULL = "full"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {QueryNeed.NONE: 0, QueryNeed.WINDOW: 1, QueryNeed.FULL: 2}


@runtime_checkable
class DeclaresQueries(Protocol):
    """A policy (or any edit function) that says which queries it reads."""

    @property
    def queries(self) -> QueryNeed: ...


@runtime_checkable
class DeclaresTokenScores(Protocol):
    """A policy that says whether it reads per-token scores the engine computes with the model
    (``EditContext.token_scores``: KVzip's reconstruction pass after prefill)."""

    @property
    def token_scores(self) -> bool: ...


@dataclass(frozen=True)
class QueryCapture:
    """What the engine captures: ``mode`` ("none", "window" or "full"), and the window's size
    (``window`` last positions, every ``stride``-th position; 0 = no strided sample), and
    ``scores``: whether the engine also runs the reconstruction pass after each prompt and stores
    its per-token scores (``kvdrop_sdk.window.TokenScores``) through the query context."""

    mode: QueryNeed = QueryNeed.NONE
    window: int = DEFAULT_QUERY_WINDOW
    stride: int = DEFAULT_QUERY_STRIDE
    scores: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", QueryNeed(self.mode))
        except ValueError:
            modes = [m.value for m in QueryNeed]
            raise ValueError(
                f"query capture mode must be one of {modes}, got {self.mode!r}"
            ) from None
        check_fields(self, ints={"window": 1, "stride": 0}, bools=("scores",))

    @property
    def enabled(self) -> bool:
        """Whether any query is captured."""
        return self.mode is not QueryNeed.NONE

    @property
    def uses_query_context(self) -> bool:
        """Whether the engine talks to the server's query store (queries or scores)."""
        return self.enabled or self.scores

    @property
    def full(self) -> bool:
        """Whether every prompt query is stored in chunks."""
        return self.mode is QueryNeed.FULL

    @classmethod
    def for_policies(
        cls,
        policies: Iterable[object],
        *,
        floor: QueryNeed | str = QueryNeed.NONE,
        window: int = DEFAULT_QUERY_WINDOW,
        stride: int = DEFAULT_QUERY_STRIDE,
    ) -> QueryCapture:
        """The least capture that serves every policy: the widest ``queries`` they declare, at
        least ``floor`` (``"full"`` where a user asked for it). An object that declares nothing
        (a plain edit function) is served the full queries, the upstream layout it was written
        for. ``scores`` is on when a policy declares ``token_scores``."""
        need = QueryNeed(floor)
        policies = list(policies)
        scores = any(isinstance(p, DeclaresTokenScores) and p.token_scores for p in policies)
        for policy in policies:
            declared = policy.queries if isinstance(policy, DeclaresQueries) else QueryNeed.FULL
            declared = QueryNeed(declared)
            if declared.rank > need.rank:
                need = declared
        return cls(need, window, stride, scores)
