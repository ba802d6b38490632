"""Logits edits before sampling, batched over a step's rows: ``logit_bias``, ``min_tokens``,
and the presence, frequency and repetition penalties (vLLM's order and meaning).

Every edit is a tensor operation over the rows that ask for one (no Python loop over the
vocabulary): token counts are one ``index_add_`` over the flattened ``[rows, V]`` grid, the bias
one ``index_put_``. Rows whose parameters edit nothing, and steps where none does, cost nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import Tensor

from kvdrop_engine.sampling import SamplingParams

__all__ = ["RowHistory", "edit_logits"]

#: One sampled row's parameters, prompt and tokens generated so far.
RowHistory = tuple[SamplingParams, Sequence[int], Sequence[int]]


def _grid_index(lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> Tensor:
    """Flat indices ``row * vocab + token`` of every token of every row."""
    rows = [i for i, ids in enumerate(lists) for _ in ids]
    flat = [t for ids in lists for t in ids]
    if not flat:
        return torch.empty(0, dtype=torch.long, device=device)
    row_t = torch.tensor(rows, dtype=torch.long, device=device)
    return row_t * vocab + torch.tensor(flat, dtype=torch.long, device=device)


def _counts(lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> Tensor:
    """``[len(lists), vocab]`` float32: how often each token occurs in each row's list."""
    index = _grid_index(lists, vocab, device)
    counts = torch.zeros(len(lists) * vocab, dtype=torch.float32, device=device)
    counts.index_add_(0, index, torch.ones(index.numel(), dtype=torch.float32, device=device))
    return counts.view(len(lists), vocab)


def _column(values: Sequence[float], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _bias(sub: Tensor, params: Sequence[SamplingParams]) -> None:
    pairs = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
    if not pairs:
        return
    rows, toks, bias = zip(*pairs, strict=True)
    dev = sub.device
    index = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))
    sub.index_put_(index, torch.tensor(bias, dtype=sub.dtype, device=dev), accumulate=True)


def _min_tokens(sub: Tensor, hist: Sequence[RowHistory], eos: Collection[int]) -> None:
    """Rows short of ``min_tokens`` cannot pick EOS or a stop token yet."""
    banned = [
        sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)))
        if len(out) < p.min_tokens
        else []
        for p, _, out in hist
    ]
    index = _grid_index(banned, sub.shape[1], sub.device)
    if index.numel():
        sub.view(-1).index_fill_(0, index, float("-inf"))


def _penalties(sub: Tensor, hist: Sequence[RowHistory]) -> None:
    params = [p for p, _, _ in hist]
    vocab, dev = sub.shape[1], sub.device
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 for p in params):
        counts = _counts([out for _, _, out in hist], vocab, dev)
        seen = counts > 0
        rep = _column([p.repetition_penalty for p in params], dev)
        if bool((rep != 1).any()):
            in_prompt = _counts([prompt for _, prompt, _ in hist], vocab, dev) > 0
            hit = seen | in_prompt
            scaled = torch.where(sub > 0, sub / rep, sub * rep)
            sub.copy_(torch.where(hit, scaled, sub))
        sub -= _column([p.frequency_penalty for p in params], dev) * counts
        sub -= _column([p.presence_penalty for p in params], dev) * seen.float()


def edit_logits(logits: Tensor, hist: Sequence[RowHistory], eos: Collection[int]) -> Tensor:
    """``logits [R, V]`` after each row's bias, ``min_tokens`` ban and penalties (row ``i``
    follows ``hist[i]``); ``logits`` itself when no row edits anything."""
    rows = [i for i, (p, _, _) in enumerate(hist) if p.edits_logits]
    if not rows:
        return logits
    out = logits.float().clone()
    index = torch.tensor(rows, dtype=torch.long, device=out.device)
    sub = out.index_select(0, index)
    picked = [hist[i] for i in rows]
    _bias(sub, [p for p, _, _ in picked])
    _min_tokens(sub, picked, eos)
    _penalties(sub, picked)
    out.index_copy_(0, index, sub)
    return out
