"""The selector shared by every scoring policy: budget, always-kept tokens, chunk alignment, gather.

A policy only says how much each token is worth (a ``[T]`` score, higher = keep). The selector
turns scores into one kept-token list for the whole request (all layers and heads: the cache is
keyed by token ids, so per-head selection cannot be stored):

1. budget ``k``: ``keep_ratio * T`` or ``keep_tokens``, aligned DOWN to a multiple of
   ``chunk_size`` and never below one chunk; if ``k >= T`` the input is returned unchanged;
2. forced tokens: the first ``n_sink`` (attention sinks) and the last ``window`` (recent /
   observation window). If they alone exceed ``k``, the most recent are kept first, then sinks;
3. the rest of the budget goes to the highest-scoring remaining tokens (ties: earlier token first);
   with ``chunked=True`` whole chunks are picked by the sum of their token scores (ChunkKV-style);
4. kept indices are sorted, and KV rows and token ids are gathered at exactly those indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdrop.errors import PolicyParamError
from kvdrop.params import Param

__all__ = ["SELECTOR_PARAMS", "Selector", "gather"]


def _positive(x: int) -> bool:
    return x > 0


def _non_negative(x: int) -> bool:
    return x >= 0


#: Parameters every scoring policy accepts (a policy may change the defaults).
SELECTOR_PARAMS: tuple[Param, ...] = (
    Param(
        "keep_ratio",
        float | None,
        None,
        "fraction of tokens to keep (default 0.5 when keep_tokens is not given)",
        "0 < r <= 1",
        lambda r: 0 < r <= 1,
    ),
    Param(
        "keep_tokens",
        int | None,
        None,
        "number of tokens to keep (instead of keep_ratio)",
        "an int >= 1",
        lambda n: n >= 1,
    ),
    Param(
        "chunk_size",
        int,
        256,
        "the server's chunk size: the kept count is a multiple of it",
        "an int >= 1",
        _positive,
    ),
    Param(
        "n_sink", int, 0, "first tokens always kept (attention sinks)", "an int >= 0", _non_negative
    ),
    Param(
        "window", int, 0, "last tokens always kept (recent window)", "an int >= 0", _non_negative
    ),
    Param(
        "chunked",
        bool,
        False,
        "select whole chunks by the sum of their token scores "
        "(ChunkKV-style) instead of single tokens",
    ),
)


@dataclass(frozen=True)
class Selector:
    """Budget and selection rules (see the module docstring); built from validated parameters."""

    keep_ratio: float | None = None
    keep_tokens: int | None = None
    chunk_size: int = 256
    n_sink: int = 0
    window: int = 0
    chunked: bool = False

    def __post_init__(self) -> None:
        if self.keep_ratio is not None and self.keep_tokens is not None:
            raise PolicyParamError(
                f"give keep_ratio or keep_tokens, not both (got keep_ratio={self.keep_ratio}, "
                f"keep_tokens={self.keep_tokens})"
            )
        if self.keep_ratio is None and self.keep_tokens is None:
            object.__setattr__(self, "keep_ratio", 0.5)

    def budget(self, num_tokens: int) -> int:
        """Tokens to keep out of ``num_tokens``: chunk-aligned down, at least one chunk, <= T."""
        if self.keep_tokens is not None:
            raw = self.keep_tokens
        else:
            assert self.keep_ratio is not None
            # A tiny epsilon keeps e.g. 0.3 * 1000 == 300 from flooring to 299.
            raw = int(self.keep_ratio * num_tokens + 1e-9)
        aligned = max(self.chunk_size, raw - raw % self.chunk_size)
        return min(aligned, num_tokens)

    def select(self, scores: torch.Tensor, budget: int | None = None) -> torch.Tensor:
        """Sorted int64 indices of the kept tokens, given ``[T]`` scores (higher = keep)."""
        num_tokens = scores.shape[0]
        k = self.budget(num_tokens) if budget is None else budget
        if k >= num_tokens:
            return torch.arange(num_tokens)
        scores = torch.nan_to_num(scores.detach().to(torch.float32).cpu(), nan=-torch.inf)
        if self.chunked:
            return self._select_chunks(scores, k)
        return self._select_tokens(scores, k, self.n_sink, self.window)

    def _select_tokens(
        self, scores: torch.Tensor, k: int, n_sink: int, window: int
    ) -> torch.Tensor:
        num_tokens = scores.shape[0]
        recent = torch.arange(num_tokens - 1, max(num_tokens - window, 0) - 1, -1)
        sinks = torch.arange(min(n_sink, num_tokens))
        forced = _first_unique(torch.cat([recent, sinks]))[:k]
        if forced.numel() < k:
            free = torch.ones(num_tokens, dtype=torch.bool)
            free[forced] = False
            candidates = free.nonzero().squeeze(1)
            order = torch.sort(scores[candidates], descending=True, stable=True).indices
            forced = torch.cat([forced, candidates[order[: k - forced.numel()]]])
        return torch.sort(forced).values

    def _select_chunks(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        # Only whole chunks are candidates; a partial tail chunk is never kept in chunked mode
        # (the SDK hands policies chunk-aligned prefixes, so there is none in practice).
        c = self.chunk_size
        n_chunks = scores.shape[0] // c
        chunk_scores = scores[: n_chunks * c].view(n_chunks, c).sum(dim=1)
        full = n_chunks * c
        sink_chunks = -(-min(self.n_sink, full) // c)
        window_chunks = -(-min(self.window, full) // c)
        chosen = self._select_tokens(chunk_scores, k // c, sink_chunks, window_chunks)
        return (chosen[:, None] * c + torch.arange(c)).reshape(-1)


def _first_unique(x: torch.Tensor) -> torch.Tensor:
    """``x`` without repeats, keeping the first occurrence order."""
    seen: set[int] = set()
    keep = [i for i, v in enumerate(x.tolist()) if not (v in seen or seen.add(v))]
    return x[keep]


def gather(
    kv: torch.Tensor, tokens: Sequence[int], index: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """The KV rows (dim 2) and token ids at ``index`` (sorted); KV stays on its device and dtype."""
    kept = kv.index_select(2, index.to(kv.device))
    return kept, [int(tokens[i]) for i in index.tolist()]
