"""KVzip's reconstruction pass: how much each cached token matters for repeating the context.

KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction") scores a prefilled cache without knowing the question: the model is asked to
repeat its context, teacher-forced over the cached prefix, and a cached token's importance is the
largest attention any reconstruction query pays it. Whatever the model needs to reproduce the
context is what a later question can need.

For a prompt of ``N`` tokens whose KV is in the engine (positions ``0..N-1`` of a sequence of
``S >= N`` computed tokens), the context is cut into chunks of ``chunk_tokens``; chunk ``i`` is
fed as ``repeat prompt + suffix + chunk`` at positions ``S, S+1, ...`` (each chunk separately,
after the whole cache, as the paper and kvpress do), the later chunks' prompt continuing from the
last ``overlap`` tokens of the chunk before. Every reconstruction token attends to the whole
cache and causally to its own chunk (so the hidden states are the model's own); its scores are
softmax probabilities over the keys KVzip scores against: the first ``n_sink`` cached tokens,
the chunk's own cached tokens and the reconstruction tokens themselves. Per layer and KV head a
cached token of the chunk keeps the maximum over the reconstruction queries and the GQA group.

The result, ``[L, Hkv, N]`` float32, is small (a few MB where the queries would be hundreds): the
engine stores it through the server's window store (:func:`kvdrop_sdk.window.store_scores`) and
the ``kvzip`` policy reads it from the edit context. Nothing is written to the paged cache.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvdrop_engine.model import Transformer
from kvdrop_engine.tokenizer import ChatTurns
from kvdrop_sdk.validate import check_fields

__all__ = [
    "REPEAT_CONTINUE",
    "REPEAT_FIRST",
    "ReconstructionAttention",
    "ReconstructionPass",
    "ReconstructionPrompt",
    "ScorePrompt",
    "chunk_scores",
    "reconstruction_scores",
    "scored_max",
    "split_attention",
]

#: The paper's reconstruction prompt for the first chunk, and for the later ones (which go on
#: from the last ``overlap`` tokens of the chunk before).
REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with"

#: Bound of one float32 logit tile (query rows are blocked under it): on the host, and on a GPU,
#: where a whole 2K-token chunk's logits (about 1 GB at 32 heads over 4K keys) take few launches.
SCORE_TILE_BYTES = 64 << 20
SCORE_TILE_BYTES_CUDA = 2 << 30


@dataclass(frozen=True)
class ReconstructionPrompt:
    """Token ids of the reconstruction prompt: ``first`` (chunk 0), ``later`` (chunks 1..), the
    ``suffix`` that closes the user turn and opens the assistant's (the chat template's, or a
    newline); ``chunk_tokens`` context tokens per chunk, ``overlap`` tokens of the previous chunk
    repeated in a later chunk's prompt, ``n_sink`` first tokens every score is normalised with."""

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...] = ()
    chunk_tokens: int = 2048
    overlap: int = 8
    n_sink: int = 4

    def __post_init__(self) -> None:
        for name in ("first", "later", "suffix"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise ValueError(f"ReconstructionPrompt.{name} must be a tuple of token ids >= 0")
        if not self.first:
            raise ValueError("ReconstructionPrompt.first must not be empty")
        check_fields(self, ints={"chunk_tokens": 1, "overlap": 0, "n_sink": 0})

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **options: Any) -> ReconstructionPrompt:
        """The paper's prompts in ``tokenizer``'s ids; the suffix is the chat template's end of a
        user turn (assistant turn opened) when it has one, else a newline."""

        def encode(text: str) -> tuple[int, ...]:
            try:
                return tuple(int(t) for t in tokenizer.encode(text, add_bos=False))
            except TypeError:  # tokenizers without the flag never add BOS
                return tuple(int(t) for t in tokenizer.encode(text))

        suffix = encode("\n")
        turn = tokenizer.user_turn() if isinstance(tokenizer, ChatTurns) else None
        if turn is not None and turn[1]:
            suffix = tuple(turn[1])
        return cls(encode(REPEAT_FIRST), encode(REPEAT_CONTINUE), suffix, **options)

    @classmethod
    def synthetic(cls, vocab_size: int, **options: Any) -> ReconstructionPrompt:
        """Fixed ids for a model without a tokenizer (random weights): the pass's cost is the
        same as with the real prompt, its scores mean nothing."""
        ids = tuple(range(1, min(vocab_size, 12)))
        return cls(ids, ids, ids[:2], **options)

    def chunks(self, num_tokens: int) -> list[tuple[int, int]]:
        """``(start, end)`` of each context chunk over ``num_tokens`` tokens."""
        step = self.chunk_tokens
        return [(s, min(s + step, num_tokens)) for s in range(0, num_tokens, step)]

    def input_ids(self, context: Sequence[int], start: int, end: int) -> list[int]:
        """The reconstruction input of chunk ``context[start:end]``."""
        head = (
            list(self.first)
            if start == 0
            else [*self.later, *context[max(0, start - self.overlap) : start]]
        )
        return [*head, *self.suffix, *context[start:end]]


class ReconstructionAttention:
    """The model's attention backend for one piece of a reconstruction chunk: reads the cache
    (never writes it), attends the piece's ``M`` tokens over ``S`` cached keys, the chunk's
    earlier pieces (``own``: per layer the K/V of its rows so far, extended here) and
    themselves, and records the piece's scores of cached tokens ``start..end-1`` into
    ``scores`` ``[L, Hkv, N]`` (the max with what earlier pieces recorded).

    The attention is split by keys into the ones KVzip scores against (the first ``n_sink``
    cached tokens, the chunk's cached tokens, the reconstruction's own: causal) and the rest of
    the cache (seen by every row), each part with its log-normaliser, merged by those
    (:func:`split_attention`): the scored part's normaliser is the one the scores need, so the
    keys are read once and no softmax over the whole cache is formed.

    ``keys(layer)``/``values(layer)`` give the cached ``[S, Hkv, d]`` of a layer."""

    def __init__(
        self,
        keys: Callable[[int], Tensor],
        values: Callable[[int], Tensor],
        scores: Tensor,
        start: int,
        end: int,
        n_sink: int,
        own: dict[int, tuple[Tensor, Tensor]] | None = None,
    ) -> None:
        self.keys, self.values, self.scores = keys, values, scores
        self.start, self.end, self.n_sink = start, end, n_sink
        self.own = {} if own is None else own

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention output ``[M, Hq, d]``; scores of this layer as a side effect."""
        kc, vc = self.keys(layer), self.values(layer)
        k, v = k.to(kc.dtype), v.to(vc.dtype)
        if layer in self.own:
            prev_k, prev_v = self.own[layer]
            k, v = torch.cat([prev_k, k]), torch.cat([prev_v, v])
        self.own[layer] = (k, v)
        out, lse, scored = split_attention(q, kc, vc, k, v, self.start, self.end, self.n_sink)
        region = self.scores[layer, :, self.start : self.end]
        sink = min(self.n_sink, self.start)
        piece = scored_max(q, scored, sink, self.end - self.start, lse)
        torch.maximum(region, piece, out=region)
        return out


def split_attention(
    q: Tensor,
    kc: Tensor,
    vc: Tensor,
    k_own: Tensor,
    v_own: Tensor,
    start: int,
    end: int,
    n_sink: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention of a reconstruction piece ``q [M, Hq, d]`` over the cache ``kc``/``vc [S,
    Hkv, d]`` and the chunk's own ``k_own``/``v_own [R, Hkv, d]`` (its last ``M`` rows are
    ``q``'s, causal): ``(out [M, Hq, d], lse [M, Hq], scored [Hkv, sink + W + R, d])``, where
    ``lse`` is the rows' float32 log-normaliser over the ``scored`` keys alone (the first
    ``min(n_sink, start)`` cached, the chunk's ``W = end - start``, the own ``R``). The rest of
    the cache is attended without a mask and merged through the log-normalisers."""
    sink = min(n_sink, start)
    scored_k = torch.cat([kc[:sink], kc[start:end], k_own]).transpose(0, 1)
    scored_v = torch.cat([vc[:sink], vc[start:end], v_own]).transpose(0, 1)
    scored = _partial(q, scored_k, scored_v, causal=True)
    parts = [scored]
    for a, b in ((sink, start), (end, kc.shape[0])):
        if b > a:
            parts.append(_partial(q, kc[a:b].transpose(0, 1), vc[a:b].transpose(0, 1)))
    return _merge(parts, q.dtype), scored[1], scored_k


def _grouped(q: Tensor, hkv: int) -> Tensor:
    """``q [M, Hq, d]`` as ``[Hkv, M * G, d]``: the ``G`` query heads of a KV head as its rows,
    ordered (token, group member)."""
    m, hq, d = q.shape
    return q.reshape(m, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, m * (hq // hkv), d)


def _ungrouped(t: Tensor, m: int) -> Tensor:
    """:func:`_grouped`'s inverse on ``[Hkv, M * G, ...]``: ``[M, Hkv * G, ...]``."""
    hkv, rows = t.shape[:2]
    g = rows // m
    return t.view(hkv, m, g, *t.shape[2:]).transpose(0, 1).reshape(m, hkv * g, *t.shape[2:])


def _partial(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> tuple[Tensor, Tensor]:
    """Attention of ``q [M, Hq, d]`` over head-major ``k``/``v [Hkv, K, d]``: ``(out [M, Hq,
    d], lse [M, Hq] float32)``; ``causal``: bottom-right (row ``j`` sees keys ``0 .. K - M +
    j``). A flash kernel where there is one (CUDA in half precision; the host's, the causal part
    in float32 so that its log-normaliser is that of the exact products), else float32 tiles."""
    m, hq, d = q.shape
    hkv, total = k.shape[0], k.shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d)
    if _flash_lse_ok(q):
        if causal:  # bottom-right causal needs the heads unstacked (small: the scored keys)
            qh = q.transpose(0, 1).unsqueeze(0)
            kh = k.repeat_interleave(group, dim=0).unsqueeze(0).to(q.dtype)
            vh = v.repeat_interleave(group, dim=0).unsqueeze(0).to(q.dtype)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                qh, kh, vh, 0.0, True, False, scale=scale
            )[:2]
            return out[0].transpose(0, 1), lse[0].transpose(0, 1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            _grouped(q, hkv).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, False, False,
            scale=scale,
        )[:2]  # fmt: skip
        return _ungrouped(out[0], m), _ungrouped(lse[0], m)
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        qg, mask = _grouped(q, hkv).unsqueeze(0), None
        kh, vh = k.unsqueeze(0), v.unsqueeze(0)
        if causal:
            qg, kh, vh = qg.float(), kh.float(), vh.float()
            mask = _host_causal_mask(m, total, group)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, kh.to(qg.dtype), vh.to(qg.dtype), 0.0, False, attn_mask=mask, scale=scale
        )[:2]
        return _ungrouped(out[0], m), _ungrouped(lse[0], m)
    return _partial_tiled(q, k, v, causal)


@functools.lru_cache(maxsize=2)
def _host_causal_mask(m: int, total: int, group: int) -> Tensor:
    """The float32 bottom-right causal mask ``[M * G, K]`` of grouped rows (0 or -inf), kept
    for the next layers of the same piece (building it costs a third of the attention)."""
    seen = torch.arange(total)[None, :] <= (total - m + torch.arange(m))[:, None]
    mask = torch.zeros(seen.shape).masked_fill_(~seen, -torch.inf)
    return mask.repeat_interleave(group, dim=0)


def _partial_tiled(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """:func:`_partial` in float32 tiles of rows (any device and dtype)."""
    m, hq, d = q.shape
    hkv, total = k.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(d)
    qg, kt, vf = _grouped(q, hkv), k.transpose(1, 2), v.float()
    tile = SCORE_TILE_BYTES_CUDA if q.device.type == "cuda" else SCORE_TILE_BYTES
    step = max(1, tile // (4 * hkv * total))  # rows of qg per tile
    group = hq // hkv
    outs, lses = [], []
    for i in range(0, qg.shape[1], step):
        logits = _logits(qg[:, i : i + step], kt).mul_(scale)  # [Hkv, r, K]
        if causal:
            token = torch.arange(i, i + logits.shape[1], device=q.device) // group
            hidden = torch.arange(total, device=q.device)[None, :] > (total - m + token)[:, None]
            logits.masked_fill_(hidden, -torch.inf)
        lse = torch.logsumexp(logits, dim=-1)
        outs.append(torch.bmm(logits.sub_(lse[..., None]).exp_(), vf))
        lses.append(lse)
    return _ungrouped(torch.cat(outs, dim=1), m), _ungrouped(torch.cat(lses, dim=1), m)


def _merge(parts: Sequence[tuple[Tensor, Tensor]], dtype: torch.dtype) -> Tensor:
    """The attention over the union of the parts' keys, from each part's ``(out, lse)``."""
    if len(parts) == 1:
        return parts[0][0].to(dtype)
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    out = torch.zeros(parts[0][0].shape, dtype=torch.float32, device=lse.device)
    for o, part_lse in parts:
        out.addcmul_(o.float(), (part_lse - lse).exp_().unsqueeze(-1))
    return out.to(dtype)


def chunk_scores(
    q: Tensor, keys: Tensor, start: int, end: int, n_sink: int, cached: int | None = None
) -> Tensor:
    """KVzip's scoring rule for one chunk, ``[Hkv, end - start]``: ``q [M, Hq, d]`` are the
    chunk's post-RoPE reconstruction queries, ``keys [Hkv, S + R, d]`` the ``S = cached``
    cached keys then the reconstruction's own ``R`` (earlier pieces of the chunk, then the
    ``M`` rows of ``q``; ``cached`` defaults to ``S + R - M``, one piece); each cached token
    ``start..end-1`` gets the max softmax probability any query (and GQA head) pays it over the
    first ``n_sink`` cached tokens, the chunk's cached tokens and the reconstruction's own
    (causal). Shared by the engine (through :func:`split_attention` and :func:`scored_max`)
    and the transformers integration, so both score alike."""
    if cached is None:
        cached = keys.shape[1] - q.shape[0]
    sink = min(n_sink, start)
    scored = torch.cat([keys[:, :sink], keys[:, start:end], keys[:, cached:]], dim=1)
    return _max_probs(q, scored, sink, end - start)


def _logits(qh: Tensor, kt: Tensor) -> Tensor:
    """``qh [H, R, d] @ kt [H, d, K]`` in float32. On CUDA, half-precision operands go to the
    matrix units with float32 accumulation and output (``out_dtype``): the same products as
    upcasting first, since the cache's values are exact in either type, at the tensor-core rate."""
    if qh.device.type == "cuda" and qh.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(qh, kt.to(qh.dtype), out_dtype=torch.float32)
    return torch.bmm(qh.to(torch.float32), kt.to(torch.float32))


def _max_probs(q: Tensor, keys: Tensor, sink: int, width: int) -> Tensor:
    """``[Hkv, width]``: per KV head, the max over query rows and the GQA group of the softmax
    probability (over all of ``keys``, the last ``M`` of which are the rows' own, causal) of keys
    ``sink .. sink+width-1``: :func:`scored_max` with the rows' log-normalisers over ``keys``."""
    lse = _partial(q, keys, keys, causal=True)[1]
    return scored_max(q, keys, sink, width, lse)


def _flash_lse_ok(q: Tensor) -> bool:
    """Whether the flash kernel gives :func:`_partial`: CUDA, half precision, a flash head."""
    return (
        q.device.type == "cuda"
        and q.dtype in (torch.bfloat16, torch.float16)
        and (q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)
    )


def scored_max(q: Tensor, keys: Tensor, sink: int, width: int, lse: Tensor) -> Tensor:
    """``[Hkv, width]``: per KV head, the max over ``q [M, Hq, d]``'s rows and the GQA group of
    ``exp(l - lse)``, ``l`` the scaled logit of key ``sink + i`` of ``keys [Hkv, K, d]`` and
    ``lse [M, Hq]`` the row's float32 log-normaliser. Only the scored keys' logits are formed
    (float32, rows blocked under the tile bound) and the softmax is never written:
    ``max_rows exp(s * l' - lse) = exp(s * max_rows (l' - lse / s))`` for the scale ``s > 0``
    (one pass less over the logits than scaling them)."""
    hkv = keys.shape[0]
    scale = 1.0 / math.sqrt(q.shape[-1])
    rows = _grouped(q, hkv)  # [Hkv, M * G, d]
    norm = _grouped(lse.unsqueeze(-1), hkv).squeeze(-1).div(scale)  # [Hkv, M * G]
    kt = keys[:, sink : sink + width].transpose(1, 2)  # [Hkv, d, width]
    tile = SCORE_TILE_BYTES_CUDA if q.device.type == "cuda" else SCORE_TILE_BYTES
    step = max(1, tile // (4 * hkv * max(width, 1)))
    best = torch.full((hkv, width), -torch.inf, dtype=torch.float32, device=q.device)
    for i in range(0, rows.shape[1], step):
        logits = _logits(rows[:, i : i + step], kt)
        logits.sub_(norm[:, i : i + step, None])
        best = torch.maximum(best, logits.amax(dim=1))
    return best.mul_(scale).exp_()


@dataclass(frozen=True)
class ScorePrompt:
    """(after the last token) Score the prompt with KVzip's reconstruction pass
    (``reconstruct=true``): the last event is held until the pass, run in pieces by later
    steps, has stored its scores (``Engine._reconstruct``). A plan action
    (:class:`~kvdrop_engine.plan.RequestPlan`)."""

    def run(self, host: Any, req: Any, step: Any) -> bool:
        req.held = step.event
        req.reconstruction = host.runner.reconstruction_pass(
            req.prompt, req.blocks, len(req.prompt + req.output) - 1, host.reconstruction
        )
        return True


class ReconstructionPass:
    """KVzip's pass over the ``N = len(context)`` first cached tokens of a sequence with
    ``num_computed`` tokens in the cache, run in pieces (:meth:`step`) so that the engine can
    interleave it with other requests' decode steps under its prefill budget.

    A reconstruction chunk's rows split over several pieces attend to the earlier pieces' keys
    (kept here), so the scores are those of the whole pass at once. ``keys(layer)`` /
    ``values(layer)`` return that layer's ``[num_computed, Hkv, d]`` cached KV (post-RoPE
    keys); :attr:`scores` ``[L, Hkv, N]`` (float32, on the model's device) is final once
    :attr:`done`. The first ``prompt.n_sink`` tokens score 1 (always worth keeping)."""

    def __init__(
        self,
        model: Transformer,
        context: Sequence[int],
        num_computed: int,
        keys: Callable[[int], Tensor],
        values: Callable[[int], Tensor],
        prompt: ReconstructionPrompt,
    ) -> None:
        n = len(context)
        if not 0 < n <= num_computed:
            raise ValueError(
                f"context of {n} tokens must be non-empty and within the {num_computed} cached"
            )
        cfg = model.config
        self.model, self.context, self.prompt = model, list(context), prompt
        self.num_computed = num_computed
        self._keys = lambda layer: keys(layer)[:num_computed]
        self._values = lambda layer: values(layer)[:num_computed]
        self.scores = torch.zeros(
            cfg.num_layers, cfg.num_kv_heads, n, dtype=torch.float32, device=model.device
        )
        self._chunks = prompt.chunks(n)
        self._chunk = 0  # the chunk in progress
        self._row = 0  # its rows computed so far
        self._own: dict[int, tuple[Tensor, Tensor]] = {}
        self.total_rows = sum(len(prompt.input_ids(self.context, s, e)) for s, e in self._chunks)

    @property
    def done(self) -> bool:
        return self._chunk == len(self._chunks)

    @property
    def keys_before(self) -> int:
        """The keys the next row attends to besides its own chunk's earlier rows: the cache
        and the rows of the chunk in progress computed so far."""
        return self.num_computed + self._row

    def next_rows(self) -> int:
        """Rows left in the chunk in progress (the most one :meth:`step` computes)."""
        if self.done:
            return 0
        start, end = self._chunks[self._chunk]
        return len(self.prompt.input_ids(self.context, start, end)) - self._row

    @torch.inference_mode()
    def step(self, max_rows: int) -> int:
        """Compute up to ``max_rows`` (>= 1) rows of the chunk in progress; returns how many."""
        if self.done:
            return 0
        start, end = self._chunks[self._chunk]
        ids = self.prompt.input_ids(self.context, start, end)
        piece = ids[self._row : self._row + max(1, max_rows)]
        attn = ReconstructionAttention(
            self._keys, self._values, self.scores, start, end, self.prompt.n_sink, self._own
        )
        first = self.num_computed + self._row
        positions = torch.arange(first, first + len(piece), dtype=torch.int64)
        tokens = torch.tensor(piece, dtype=torch.int64)
        self.model(tokens, positions, attn, logits_rows=torch.tensor([len(piece) - 1]))
        self._row += len(piece)
        if self._row == len(ids):
            self._chunk, self._row, self._own = self._chunk + 1, 0, {}
            if self.done:
                self.scores[:, :, : self.prompt.n_sink] = 1.0
        return len(piece)


def reconstruction_scores(
    model: Transformer,
    context: Sequence[int],
    num_computed: int,
    keys: Callable[[int], Tensor],
    values: Callable[[int], Tensor],
    prompt: ReconstructionPrompt,
) -> Tensor:
    """KVzip scores ``[L, Hkv, N]`` of :class:`ReconstructionPass`, the whole pass at once."""
    run = ReconstructionPass(model, context, num_computed, keys, values, prompt)
    while not run.done:
        run.step(run.next_rows())
    return run.scores
