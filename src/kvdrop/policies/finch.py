"""``finch``: keep what the question attends to, the question found after a delimiter token
(Corallo & Papotti, 2024, "FINCH: Prompt-guided Key-Value Cache Compression for Large Language
Models", TACL, https://doi.org/10.1162/tacl_a_00716; kvpress's ``FinchPress``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvdrop.attention import heads_f32
from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import (
    HEAD_AGG,
    check_query_shapes,
    group_heads,
    last_rows,
    layer_agg_param,
    layer_lse,
    query_head_dim,
    reduce,
    window_fill,
)
from kvdrop.policy import QueryNeed, Scorer, ScorerPolicy
from kvdrop.selector import Selection
from kvdrop_sdk.edit import EditContext

__all__ = ["FinchPolicy", "FinchScorer", "finch", "position_weighted_mass"]

#: Float32 elements of one block of attention logits (rows x keys x heads).
_BLOCK_ELEMENTS = 1 << 24


def position_weighted_mass(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """``[Hq, Tk]``: causal softmax attention of each query row times its position, summed.

    ``q`` ``[Hq, r, d]``, ``k`` ``[Hkv, Tk, d]`` (float32), ``q_pos`` ``[r]``: a row at ``p``
    sees keys ``0..p`` and counts ``p`` times (FINCH's normalisation by the number of keys
    before it). ``lse`` ``[Hq, r]``: the rows' true log-normalisers (NaN: softmax over ``k``).
    """
    num_q, rows, head_dim = q.shape
    group = num_q // k.shape[0]
    keys = k.repeat_interleave(group, dim=0)
    out = torch.zeros(num_q, k.shape[1], dtype=torch.float32, device=k.device)
    step = max(1, _BLOCK_ELEMENTS // max(1, num_q * k.shape[1]))
    key_pos = torch.arange(k.shape[1], device=k.device)
    for start in range(0, rows, step):
        pos = q_pos[start : start + step].to(k.device)
        logits = q[:, start : start + step] @ keys.transpose(1, 2) / math.sqrt(head_dim)
        logits = logits.masked_fill(key_pos[None, None, :] > pos[None, :, None], -math.inf)
        norm = torch.logsumexp(logits, dim=-1)
        if lse is not None:
            given = lse[:, start : start + step].to(norm)
            norm = torch.where(torch.isnan(given), norm, given)
        probs = torch.exp(logits - norm[..., None]) * pos.to(torch.float32)[None, :, None]
        out += probs.sum(dim=1)
    return out


@dataclass(frozen=True)
class FinchScorer(Scorer):
    """FINCH (Corallo & Papotti, 2024): what the question's queries attend to.

    The question is the prompt after the last ``delimiter`` token in the cached tokens (the
    policy sets the observation window to it and keeps it); with no ``delimiter`` (the default),
    none cached or nothing after it, the uncached tail is the question, as engines cache the
    context and the question follows (with no tail: the last token). Per layer and query
    head, each question row's causal softmax attention over the cached keys before the
    question, times the row's position (the reference's normalisation by the keys it could
    see), averaged over the rows; averaged over each GQA group; no pooling; combined over KV
    heads (``head_agg``) and layers (``layer_agg``). As SnapKV, a row's attention is its true
    one when the engine recorded its log-normaliser.
    """

    queries = QueryNeed.WINDOW
    reads_query_sample = False  # the last rows only (last_rows)
    needs_selection = True  # observes the selector's window (the question)
    reads_values = False
    head_dim: int | None = query_head_dim()
    delimiter: int | None = param(
        None,
        "token id after which the question starts (its last occurrence in the cached tokens); "
        "None: the uncached tail is the question",
        allowed="None or a token id >= 0",
        check=lambda t: t >= 0,
    )
    head_agg: str = param("mean", "how KV heads combine", choices=HEAD_AGG)
    layer_agg: str = layer_agg_param("mean", "how layers combine")

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        assert self.head_dim is not None
        check_query_shapes("finch", kv, query, self.head_dim)

    def head_scores(
        self, kv: torch.Tensor, query: torch.Tensor, selection: Selection
    ) -> torch.Tensor:
        """``[L, Hkv, obs]`` scores of the cached tokens before the question."""
        assert self.head_dim is not None
        window = selection.window if selection.window > 0 else max(selection.tail, 1)
        obs = max(min(kv.shape[2], selection.total_tokens - window), 0)
        rows, positions, lse = last_rows("finch", query, selection, window)
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)  # the question's own keys normalise too
            q = heads_f32(rows[0, layer], self.head_dim)
            mass = position_weighted_mass(q, keys, positions, layer_lse(lse, layer))[:, :obs]
            per_layer.append(group_heads(mass / max(q.shape[1], 1), keys.shape[0], "mean"))
        return torch.stack(per_layer)

    def score(
        self, kv: torch.Tensor, query: torch.Tensor | None, selection: Selection
    ) -> torch.Tensor:
        assert query is not None
        per_head = self.head_scores(kv, query, selection)
        if per_head.shape[2] == 0:
            return torch.zeros(kv.shape[2], device=kv.device)
        combined = reduce(reduce(per_head, 1, self.head_agg), 0, self.layer_agg)
        return window_fill(combined, kv.shape[2])


class FinchPolicy(ScorerPolicy):
    """The finch scorer under a selector whose recent window is the question (the tokens after
    the delimiter), found in each request's tokens."""

    def question_length(self, tokens: Sequence[int], prompt_tokens: int) -> int | None:
        """Tokens after the last delimiter (None: no delimiter set, none cached, or nothing
        after it)."""
        delimiter = getattr(self.scorer, "delimiter", None)
        if delimiter is None:
            return None
        hits = [i for i, t in enumerate(tokens) if int(t) == delimiter]
        if not hits:
            return None
        length = prompt_tokens - hits[-1] - 1
        return length if length > 0 else None  # it ends the prompt: no question after it

    def select_indices(
        self,
        tensors: Mapping[Any, torch.Tensor],
        tokens: Sequence[int],
        *,
        context: EditContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prompt = len(tokens)
        if context is not None and context.prompt_tokens is not None:
            prompt = max(int(context.prompt_tokens), prompt)
        length = self.question_length(tokens, prompt)
        if length is None:
            return super().select_indices(tensors, tokens, context=context)
        policy = self.with_selector(dataclasses.replace(self.selector, window=length))
        return ScorerPolicy.select_indices(policy, tensors, tokens, context=context)


class _FinchFactory(ScorerFactory):
    def __call__(self, **params: Any) -> FinchPolicy:
        built = super().__call__(**params)
        return FinchPolicy(built.name, built.scorer, built.selector)


finch = _FinchFactory(
    "finch",
    FinchScorer,
    "FINCH: keep what the question (after a delimiter token, or the uncached tail) attends to",
    hidden=("window",),
)
