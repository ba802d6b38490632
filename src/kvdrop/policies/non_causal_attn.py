"""``non-causal-attn``: attention received inside non-causal chunks (Chari & Van Durme, 2025).

The attention scorer of Compactor ("Compactor: Calibrated Query-Agnostic KV Cache Compression
with Approximate Leverage Scores", https://arxiv.org/abs/2507.08143), kvpress's
``NonCausalAttnPress``: the prompt is cut into chunks of ``chunk_length`` tokens; inside each
chunk every query attends to every key of the chunk (no causal mask), and a key's score is the
attention it receives summed over the chunk's queries, times its value's norm, pooled over 3
tokens and z-normalised per layer.

A partial last chunk (``T`` not a multiple of ``chunk_length``) is padded as kvpress 0.5.5
pads it (``partial="kvpress"``, the default, so the scores are kvpress's on every length):
zero queries and zero keys fill it to ``chunk_length``, the padded keys keep logit ``-1e-9``
(kvpress fills them with ``-1e-9``, not ``-1e9``: they are not masked) and the padded queries
attend near-uniformly to the whole chunk. ``partial="mask"`` attends within the real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrop.attention import heads_f32, pool1d
from kvdrop.factories import ScorerFactory
from kvdrop.params import param
from kvdrop.policies._common import (
    check_query_shapes,
    group_heads,
    head_agg_param,
    layer_agg_param,
    query_head_dim,
    reduce,
)
from kvdrop.policy import QueryNeed, Scorer

__all__ = ["PARTIAL", "NonCausalAttnScorer", "chunk_column_sums", "non_causal_attn"]

#: How a partial last chunk is scored: as kvpress pads it, or within its real tokens.
PARTIAL = ("kvpress", "mask")
#: The logit kvpress 0.5.5 gives its padded keys (``masked_fill(..., -1e-9)``).
PAD_LOGIT = -1e-9


def chunk_column_sums(
    q: torch.Tensor, k: torch.Tensor, chunk: int, partial: str = "kvpress"
) -> torch.Tensor:
    """``[Hq, T]``: per key, the softmax attention summed over the queries of its chunk.

    ``q`` ``[Hq, T, d]`` and ``k`` ``[Hkv, T, d]`` (float32, GQA: ``Hq`` a multiple of ``Hkv``);
    tokens ``[c*i, c*(i+1))`` form chunk ``i``; logits are ``q.k`` unscaled (as the reference).
    A partial last chunk of ``m < c`` tokens: with ``partial="kvpress"`` its queries also see
    ``c - m`` padded keys of logit ``-1e-9`` and each of the ``c - m`` padded queries adds its
    near-uniform row (logit 0 on real keys, ``-1e-9`` on padded ones), as kvpress's
    ``NonCausalAttnPress``; with ``"mask"`` it attends over its own tokens only.
    """
    if partial not in PARTIAL:
        raise ValueError(f"partial must be one of {PARTIAL}, got {partial!r}")
    num_q, num_tokens, _ = q.shape
    group = num_q // k.shape[0]
    out = torch.empty(num_q, num_tokens, dtype=torch.float32, device=q.device)
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        keys = k[:, start:end].repeat_interleave(group, dim=0)
        logits = q[:, start:end] @ keys.transpose(1, 2)  # [Hq, m, m]
        pad = chunk - (end - start)
        if pad == 0 or partial == "mask":
            out[:, start:end] = torch.softmax(logits, dim=-1).sum(dim=1)
            continue
        padded = logits.new_full((num_q, end - start, pad), PAD_LOGIT)
        real = torch.softmax(torch.cat([logits, padded], dim=-1), dim=-1)[..., : end - start]
        row = torch.cat([logits.new_zeros(end - start), logits.new_full((pad,), PAD_LOGIT)])
        out[:, start:end] = real.sum(dim=1) + pad * torch.softmax(row, dim=0)[: end - start]
    return out


@dataclass(frozen=True)
class NonCausalAttnScorer(Scorer):
    """Non-causal chunked attention (Chari & Van Durme, 2025; kvpress ``NonCausalAttnPress``).

    Per layer and query head, :func:`chunk_column_sums` of the cached tokens' queries over
    their keys; averaged over each GQA group; times ``||v||``; average-pooled over 3 tokens
    (zero padding counted); z-normalised over the layer's heads and tokens (std >= 1e-6). Then
    combined over KV heads (``head_agg``) and layers (``layer_agg``). Reads every cached token's
    query (``QueryNeed.FULL``: the engine's ``--query-capture full``). The reference's defaults,
    its padding of a partial last chunk included (``partial``; the module docstring).
    """

    queries = QueryNeed.FULL
    head_dim: int | None = query_head_dim()
    chunk_length: int = param(
        256,
        "tokens per non-causal attention chunk",
        allowed="an int >= 1",
        check=lambda n: n >= 1,
        serve_max=4096,  # attention memory grows with its square
    )
    partial: str = param(
        "kvpress",
        "a partial last chunk: 'kvpress' pads it as NonCausalAttnPress 0.5.5 (zero queries and "
        "unmasked zero keys), 'mask' attends within its real tokens",
        choices=PARTIAL,
    )
    head_agg: str = head_agg_param("mean", "how the KV heads of a layer combine")
    layer_agg: str = layer_agg_param("mean", "how layers combine")

    def check(self, kv: torch.Tensor, query: torch.Tensor | None) -> None:
        assert self.head_dim is not None
        check_query_shapes("non-causal-attn", kv, query, self.head_dim)

    def head_scores(self, kv: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """``[L, Hkv, T]`` z-normalised scores, before heads and layers combine."""
        assert self.head_dim is not None
        per_layer = []
        for layer in range(kv.shape[1]):
            keys = heads_f32(kv[0, layer], self.head_dim)
            q = heads_f32(query[0, layer], self.head_dim)
            mass = chunk_column_sums(q, keys, self.chunk_length, self.partial)
            grouped = group_heads(mass, keys.shape[0], "mean")
            scores = pool1d(grouped * heads_f32(kv[1, layer], self.head_dim).norm(dim=-1), 3, "avg")
            std = scores.std() if scores.numel() > 1 else torch.ones((), device=scores.device)
            per_layer.append((scores - scores.mean()) / std.clamp_min(1e-6))
        return torch.stack(per_layer)

    def score(self, kv: torch.Tensor, query: torch.Tensor | None) -> torch.Tensor:
        assert query is not None
        return reduce(reduce(self.head_scores(kv, query), 1, self.head_agg), 0, self.layer_agg)


non_causal_attn = ScorerFactory(
    "non-causal-attn",
    NonCausalAttnScorer,
    "NonCausalAttn: attention received inside non-causal chunks, times ||v|| (Compactor's scorer)",
)
