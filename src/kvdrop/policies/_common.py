"""Helpers shared by the built-in policies (private): parameter declarations, shape checks and
how per-head and per-layer scores combine into the one ``[T]`` score a request keeps.

The cache is keyed by token ids, so every layer and head must keep the same tokens; how their
scores are combined is a documented, configurable choice of each scorer. The attention math
itself (blocked softmax mass, R-KV's redundancy, pooling) is the public :mod:`kvdrop.attention`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from kvdrop.errors import PolicyInputError, PolicyWarning
from kvdrop.params import param
from kvdrop.selector import Selection

__all__ = [
    "HEAD_AGG",
    "KEEP",
    "KEEP_LAST",
    "LAYER_AGG",
    "check_head_dim",
    "check_query_shapes",
    "group_heads",
    "head_agg_param",
    "heads",
    "kv_head_dim",
    "last_rows",
    "layer_agg_param",
    "layer_lse",
    "odd_kernel",
    "per_layer",
    "query_head_dim",
    "reduce",
    "spread_rows",
    "window_fill",
]

HEAD_AGG = ("mean", "max")
LAYER_AGG = ("mean", "max", "sum")

#: A score that outranks every real score (tokens a scorer wants kept under any budget).
KEEP = 1e30
#: Outranks :data:`KEEP` (e.g. chunk-halving's last chunk over its first).
KEEP_LAST = 2e30


def kv_head_dim() -> Any:
    """The ``head_dim`` parameter of KV-only scorers (None: each D row is one vector)."""
    return param(
        None,
        "per-head dimension (D = heads * head_dim); None treats each D row as one vector",
        allowed="None or an int >= 1 dividing D",
        check=lambda d: d >= 1,
    )


def query_head_dim() -> Any:
    """The ``head_dim`` parameter of query scorers (D and Dq are multiples of it)."""
    return param(
        None,
        "per-head dimension: D and Dq must be multiples of it (GQA group = Dq / D); None = the "
        "layout's head_dim from the edit context (128 when called without one)",
        allowed="None or an int >= 1 dividing D and Dq",
        check=lambda d: d >= 1,
    )


def head_agg_param(default: str = "mean", help: str = "how per-head scores combine") -> Any:
    return param(default, help, choices=HEAD_AGG)


def layer_agg_param(default: str = "mean", help: str = "how per-layer scores combine") -> Any:
    return param(default, help, choices=LAYER_AGG)


def odd_kernel(default: int) -> Any:
    """A 1-D pooling kernel parameter (odd, >= 1)."""
    return param(
        default,
        "1-D pooling kernel over token scores (same-size, padding kernel // 2); 1 = none",
        allowed="an odd int >= 1",
        check=lambda k: k >= 1 and k % 2 == 1,
    )


def reduce(x: torch.Tensor, dim: int, how: str) -> torch.Tensor:
    """Reduce ``x`` over ``dim`` with ``how`` in mean | max | min | sum."""
    if how == "mean":
        return x.mean(dim)
    if how == "max":
        return x.amax(dim)
    if how == "min":
        return x.amin(dim)
    if how == "sum":
        return x.sum(dim)
    raise ValueError(f"unknown aggregation {how!r}; expected mean, max, min or sum")


def check_head_dim(policy: str, width: int, head_dim: int | None, what: str = "KV") -> None:
    """Raise PolicyInputError unless ``width`` (D) is a multiple of ``head_dim``."""
    if head_dim is not None and width % head_dim:
        raise PolicyInputError(
            f"{policy}: {what} width D={width} is not a multiple of head_dim={head_dim}; "
            "D must be num_heads * head_dim"
        )


def check_query_shapes(
    policy: str, kv: torch.Tensor, query: torch.Tensor | None, head_dim: int
) -> None:
    """Raise PolicyInputError unless D, Dq are multiples of head_dim and Hq of Hkv."""
    if query is None:  # edit_inputs already raised MissingQueryError; be defensive
        raise PolicyInputError(f"{policy}: needs the query tensor")
    width, q_width = kv.shape[3], query.shape[3]
    for what, w in (("KV", width), ("query", q_width)):
        if w % head_dim:
            raise PolicyInputError(
                f"{policy}: {what} width {w} is not a multiple of head_dim={head_dim}; "
                "expected num_heads * head_dim"
            )
    if (q_width // head_dim) % (width // head_dim):
        raise PolicyInputError(
            f"{policy}: {q_width // head_dim} query heads (Dq={q_width}) are not a multiple of "
            f"{width // head_dim} KV heads (D={width}); GQA needs Dq a multiple of D"
        )


def heads(x: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    """View ``[T, D]`` as ``[H, T, d]`` (HND order inside D); ``head_dim=None`` means one head."""
    num_tokens, width = x.shape
    d = width if head_dim is None else head_dim
    return x.view(num_tokens, width // d, d).transpose(0, 1)


def per_layer(kv_or_q: torch.Tensor, index: int = 0) -> Iterator[torch.Tensor]:
    """Yield ``[T, D]`` slices of ``kv_or_q[index]`` layer by layer (bounded float32 memory)."""
    for layer in range(kv_or_q.shape[1]):
        yield kv_or_q[index, layer]


def group_heads(x: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """``[Hq, ...]`` -> ``[Hkv, ...]`` by ``how`` over each GQA group."""
    return reduce(x.view(num_kv_heads, x.shape[0] // num_kv_heads, *x.shape[1:]), 1, how)


def window_fill(prefix_scores: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T]`` scores: the prefix's, then the window (always kept by the selector) at the max."""
    out = torch.zeros(num_tokens, dtype=torch.float32, device=prefix_scores.device)
    n = prefix_scores.numel()
    out[:n] = prefix_scores
    if n:
        out[n:] = prefix_scores.max()
    return out


def _positions(query: torch.Tensor, selection: Selection) -> torch.Tensor:
    qpos = selection.query_positions
    return torch.arange(query.shape[2]) if qpos is None else qpos.to("cpu")


def _take(
    query: torch.Tensor, selection: Selection, rows: torch.Tensor, qpos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    index = rows.to(query.device)
    lse = selection.query_lse
    if lse is not None:
        lse = lse.index_select(2, rows.to(lse.device))
    return query.index_select(2, index), qpos[rows], lse


def layer_lse(lse: torch.Tensor | None, layer: int) -> torch.Tensor | None:
    """Layer ``layer`` of ``[1, L, r, Hq]`` log-normalisers as ``[Hq, r]`` (None stays None)."""
    return None if lse is None else lse[0, layer].transpose(0, 1)


def last_rows(
    policy: str, query: torch.Tensor, selection: Selection, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The query rows of the last ``count`` positions of the WHOLE prompt (its uncached tail
    included), their positions and log-normalisers: ``([1, L, r, Dq], [r], [1, L, r, Hq])``.

    When the saved queries miss some of those positions (an engine window smaller than
    ``count``), the rows that exist are used and a PolicyWarning says so; with none of them, the
    latest ``count`` rows that exist stand in.
    """
    qpos = _positions(query, selection)
    first = max(selection.total_tokens - count, 0)
    rows = (qpos >= first).nonzero().squeeze(1)
    # Positions after the last saved row (the token generated last, never fed back) cannot have
    # a query: only the ones up to it are expected.
    expected = max(0, int(qpos[-1]) - first + 1)
    if rows.numel() < expected:
        warnings.warn(
            f"{policy}: the saved queries cover only part of the last {count} prompt tokens it "
            "observes; raise the engine's query window (--query-window) or lower the policy's",
            PolicyWarning,
            stacklevel=4,
        )
    if rows.numel() == 0:
        rows = torch.arange(max(qpos.numel() - count, 0), qpos.numel())
    return _take(query, selection, rows, qpos)


def spread_rows(
    query: torch.Tensor, selection: Selection, count: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``count`` query rows spread evenly over the whole prompt (always the last row): for each
    of ``count`` evenly spaced target positions the nearest row that exists, without repeats.
    With every position present this is exactly the evenly strided positions; ``None`` or more
    rows than exist: all rows."""
    qpos = _positions(query, selection)
    n = qpos.numel()
    if count is None or count >= n:
        return query, qpos, selection.query_lse
    total = selection.total_tokens
    if count == 1:
        rows = torch.tensor([n - 1])
    else:
        targets = torch.linspace(0, total - 1, count, dtype=torch.float64).round().long()
        right = torch.searchsorted(qpos, targets).clamp(max=n - 1)
        left = (right - 1).clamp(min=0)
        closer_left = (targets - qpos[left]).abs() <= (qpos[right] - targets).abs()
        rows = torch.unique(torch.where(closer_left, left, right))
        if int(rows[-1]) != n - 1:
            rows = torch.cat([rows, torch.tensor([n - 1])])
    return _take(query, selection, rows, qpos)
