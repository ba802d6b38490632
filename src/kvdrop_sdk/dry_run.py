"""The one dry run of an edit function on a model's layout: random inputs, shaped as an engine
would hand them over, so a function that cannot edit this model's caches (a ``head_dim`` that
does not divide the widths, say) fails before any request does.

:func:`dry_run_inputs` builds them: KV ``[2, L, T, Hkv*d]``, the query rows a capture keeps
(the last ``window`` positions and every ``stride``-th, or every row for a full capture) and
per-token scores when the function reads them, with the :class:`~kvdrop_sdk.edit.EditContext`
that describes them. The reference engine's prompt and decode cuts and the experiment
harness call it; what each does with a failure (its own error type) stays with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import Needs, QueryCapture

__all__ = ["DryRun", "capture_positions", "dry_run_inputs"]


def capture_positions(num_tokens: int, capture: QueryCapture) -> list[int]:
    """Positions of the query rows ``capture`` keeps of a ``num_tokens``-token prompt."""
    if capture.full:
        return list(range(num_tokens))
    strided = set(range(0, num_tokens, capture.stride)) if capture.stride else set()
    return sorted(strided | set(range(max(0, num_tokens - capture.window), num_tokens)))


@dataclass(frozen=True)
class DryRun:
    """One dry run's inputs: ``tensors`` (KV, and queries when read), ``tokens`` and
    ``context``; call ``fn(run.tensors, run.tokens, context=run.context)``."""

    tensors: dict[Any, torch.Tensor]
    tokens: list[int]
    context: EditContext


def dry_run_inputs(
    layout: Any,
    num_tokens: int,
    needs: Needs,
    capture: QueryCapture,
    *,
    chunk_size: int | None = None,
    rope: Any = None,
    seed: int = 0,
) -> DryRun:
    """Random inputs of ``layout`` (anything with ``num_layers``, ``num_kv_heads``,
    ``num_heads`` and ``head_dim``: a model config) for a function that ``needs`` what it
    reads, as ``capture`` serves it (query rows only when the capture has them)."""
    gen = torch.Generator().manual_seed(seed)
    layers, d = layout.num_layers, layout.head_dim
    kv = torch.randn(2, layers, num_tokens, layout.num_kv_heads * d, generator=gen)
    tensors: dict[Any, torch.Tensor] = {CacheKind.KV: kv}
    served = capture.serves(needs)
    positions = None
    if served.reads_queries:
        rows = capture_positions(num_tokens, capture)
        positions = torch.tensor(rows)
        width = layout.num_heads * d
        tensors[CacheKind.QUERY] = torch.randn(1, layers, len(rows), width, generator=gen)
    scores = None
    if needs.token_scores:
        scores = torch.rand(layers, layout.num_kv_heads, num_tokens, generator=gen)
    context = EditContext(
        positions=torch.arange(num_tokens),
        query_positions=positions,
        rope=rope,
        prompt_tokens=num_tokens,
        head_dim=d,
        chunk_size=chunk_size,
        token_scores=scores,
        device="cpu",
    )
    return DryRun(tensors, list(range(num_tokens)), context)
