"""What an edit reads beside the KV, and what the engine captures for it: one owner.

An edit function declares what it reads with these attributes:

* ``queries`` (a :class:`QueryNeed`): ``NONE`` (keys and values only), ``WINDOW`` (query rows at
  any positions: the lean window, the last ``window`` positions of the whole sequence plus every
  ``stride``-th one, with log-normalisers) or ``FULL`` (the query of every cached token, in whole
  chunks: upstream's layout);
* ``token_scores`` (a bool): per-token scores the engine computes with the model after prefill
  (KVzip's reconstruction pass, ``EditContext.token_scores``);
* ``reads_values`` and ``reads_keys`` (bools, default True): whether it reads ``kv[1]`` and
  ``kv[0]``. Together they are ``Needs.kv`` (a :class:`KVNeed`): ``NONE`` (an index-only edit,
  e.g. chunk-halving: the SDK has the server keep the chosen rows, no KV crosses the link),
  ``KEYS`` (e.g. knorm, snapkv: only the keys are fetched) or ``ALL`` (values too, or undeclared:
  the whole KV is fetched and the edit's bytes are stored, upstream's path);
* ``reads_query_sample`` (a bool, default True): whether a ``WINDOW`` reader reads the strided
  sample of rows besides the last ``window`` (H2O's accumulated attention does; SnapKV, TOVA,
  R-KV and FINCH read only the last rows). ``Needs.query_sample``; a capture for policies that
  read none stores no sample (``stride`` 0): at 14K tokens, 64 rows a layer instead of 288.

:func:`needs_of` reads them into one frozen :class:`Needs`, with one default for a function that
declares nothing (upstream's: every query, no scores); it is the only place that tests the
declarations. :meth:`QueryCapture.for_policies` derives the engine's capture from the needs of
every policy it will serve; demo, eval, benchmarks and the engine's command call it, connectors
take the result unchanged, and the SDK's query context carries it, so a request stream reads
chunk queries only when the engine stores them (``capture.full``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from kvdrop_sdk.validate import check_fields

__all__ = [
    "CAPTURE_CHOICES",
    "CAPTURE_FLAG_CHOICES",
    "DEFAULT_QUERY_STRIDE",
    "DEFAULT_QUERY_WINDOW",
    "UPSTREAM_CAPTURE",
    "UPSTREAM_NEEDS",
    "KVNeed",
    "Needs",
    "QueryCapture",
    "QueryNeed",
    "needs_of",
]

#: Default W: at least the largest observation window of a built-in policy (SnapKV's 64).
DEFAULT_QUERY_WINDOW = 64
#: Default S of the strided sample (H2O's queries): ``T / 64`` rows over a ``T``-token sequence.
DEFAULT_QUERY_STRIDE = 64
#: What a user may ask of :meth:`QueryCapture.for_policies`: ``auto`` and ``window`` are the
#: least capture that serves the policies; ``full`` stores every query. The one list of capture
#: modes: ``--query-capture`` offers the named ones (:data:`CAPTURE_FLAG_CHOICES`).
CAPTURE_CHOICES = ("auto", "window", "full")
#: ``--query-capture``'s choices (``auto`` is the default of the Python API only).
CAPTURE_FLAG_CHOICES = tuple(m for m in CAPTURE_CHOICES if m != "auto")


class QueryNeed(str, enum.Enum):
    """What a policy reads of the prefill queries; ordered ``NONE < WINDOW < FULL``."""

    NONE = "none"
    WINDOW = "window"
    FULL = "full"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {QueryNeed.NONE: 0, QueryNeed.WINDOW: 1, QueryNeed.FULL: 2}


class KVNeed(str, enum.Enum):
    """Which of the cached KV an edit reads; ordered ``NONE < KEYS < ALL``."""

    NONE = "none"
    KEYS = "keys"
    ALL = "all"

    @property
    def rank(self) -> int:
        return _KV_RANK[self]


_KV_RANK = {KVNeed.NONE: 0, KVNeed.KEYS: 1, KVNeed.ALL: 2}


@runtime_checkable
class _DeclaresNeeds(Protocol):
    @property
    def needs(self) -> Needs: ...


@runtime_checkable
class _DeclaresQueries(Protocol):
    @property
    def queries(self) -> QueryNeed: ...


@runtime_checkable
class _DeclaresTokenScores(Protocol):
    @property
    def token_scores(self) -> bool: ...


@runtime_checkable
class _DeclaresValueReads(Protocol):
    @property
    def reads_values(self) -> bool: ...


@runtime_checkable
class _DeclaresKeyReads(Protocol):
    @property
    def reads_keys(self) -> bool: ...


@runtime_checkable
class _DeclaresSampleReads(Protocol):
    @property
    def reads_query_sample(self) -> bool: ...


@dataclass(frozen=True)
class Needs:
    """What one edit function reads: which ``queries``, whether the engine's ``token_scores``,
    and which of the cached ``kv`` (a :class:`KVNeed`; the SDK moves only that); a ``WINDOW``
    reader's ``query_sample`` says whether it reads the strided sample besides the last rows.
    Combine with ``|`` (the widest of both)."""

    queries: QueryNeed = QueryNeed.FULL
    token_scores: bool = False
    kv: KVNeed = KVNeed.ALL
    query_sample: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "queries", QueryNeed(self.queries))
        except ValueError:
            modes = [m.value for m in QueryNeed]
            raise ValueError(f"queries must be one of {modes}, got {self.queries!r}") from None
        if not isinstance(self.token_scores, bool):
            raise ValueError(f"token_scores must be a bool, got {self.token_scores!r}")
        try:
            object.__setattr__(self, "kv", KVNeed(self.kv))
        except ValueError:
            modes = [m.value for m in KVNeed]
            raise ValueError(f"kv must be one of {modes}, got {self.kv!r}") from None
        if not isinstance(self.query_sample, bool):
            raise ValueError(f"query_sample must be a bool, got {self.query_sample!r}")

    @property
    def reads_queries(self) -> bool:
        """Whether any query row is read."""
        return self.queries is not QueryNeed.NONE

    def __or__(self, other: Needs) -> Needs:
        wider = max(self.queries, other.queries, key=lambda q: q.rank)
        kv = max(self.kv, other.kv, key=lambda k: k.rank)
        # Only a part that reads queries can want their sample.
        sample = any(n.query_sample for n in (self, other) if n.reads_queries)
        return Needs(wider, self.token_scores or other.token_scores, kv, sample)


#: The needs of a function that declares nothing: upstream's edit functions read the full
#: queries (when the engine stores them), the whole KV, and know no token scores.
UPSTREAM_NEEDS = Needs(QueryNeed.FULL, False, KVNeed.ALL)
#: Nothing at all (the start of a union).
NO_NEEDS = Needs(QueryNeed.NONE, False, KVNeed.NONE, query_sample=False)


def needs_of(fn: object, default: Needs = UPSTREAM_NEEDS) -> Needs:
    """What ``fn`` reads: its ``needs`` when it declares them whole (every kvdrop policy), else
    its declared ``queries``, ``token_scores``, ``reads_values`` / ``reads_keys`` and
    ``reads_query_sample``, each defaulting to ``default``'s (upstream's; a plugin factory's
    declaration for the functions it builds). The one reader of those declarations."""
    if isinstance(fn, _DeclaresNeeds) and isinstance(fn.needs, Needs):
        return fn.needs
    queries = fn.queries if isinstance(fn, _DeclaresQueries) else default.queries
    scores = fn.token_scores if isinstance(fn, _DeclaresTokenScores) else default.token_scores
    sample = fn.reads_query_sample if isinstance(fn, _DeclaresSampleReads) else default.query_sample
    return Needs(QueryNeed(queries), bool(scores), _kv_need(fn, default.kv), bool(sample))


def _kv_need(fn: object, default: KVNeed) -> KVNeed:
    """``Needs.kv`` from ``reads_values`` and ``reads_keys`` (each True when not declared);
    ``default`` when neither is declared."""
    values = fn.reads_values if isinstance(fn, _DeclaresValueReads) else None
    keys = fn.reads_keys if isinstance(fn, _DeclaresKeyReads) else None
    if values is None and keys is None:
        return default
    if values is None or bool(values):
        return KVNeed.ALL
    return KVNeed.NONE if keys is not None and not bool(keys) else KVNeed.KEYS


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

    def serves(self, needs: Needs) -> Needs:
        """What of ``needs`` this capture hands an edit: the queries it reads (none when none
        are captured; a window reader reads the chunk queries of a full capture too) and the
        scores when they are computed."""
        queries = needs.queries if self.enabled else QueryNeed.NONE
        return Needs(queries, needs.token_scores and self.scores)

    @classmethod
    def for_policies(
        cls,
        policies: Iterable[object],
        mode: Literal["auto", "window", "full"] = "auto",
        *,
        window: int = DEFAULT_QUERY_WINDOW,
        stride: int = DEFAULT_QUERY_STRIDE,
    ) -> QueryCapture:
        """The final capture for ``policies`` (their :func:`needs_of`): none when none reads
        queries, else the lean window (its strided sample, every ``stride``-th row, only when
        one reads it: ``Needs.query_sample``), or every query when one needs them all or
        ``mode`` is ``"full"``; ``scores`` when one reads token scores. ``"auto"`` and
        ``"window"`` are the least capture that serves them all."""
        if mode not in CAPTURE_CHOICES:
            raise ValueError(f"query capture must be one of {CAPTURE_CHOICES}, got {mode!r}")
        needs = NO_NEEDS
        for policy in policies:
            needs = needs | needs_of(policy)
        queries = needs.queries
        if queries is not QueryNeed.NONE and mode == "full":
            queries = QueryNeed.FULL
        if queries is QueryNeed.WINDOW and not needs.query_sample:
            stride = 0
        return cls(queries, window, stride, needs.token_scores)


#: What a query context assumes when not told: upstream's every prompt query in chunks.
UPSTREAM_CAPTURE = QueryCapture(QueryNeed.FULL)
