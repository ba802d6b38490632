"""Next-token log-probabilities over a teacher-forced continuation, on the cache a server holds.

``kvdrop eval`` measures fidelity beside accuracy: with an edited (dropped) cache and with the full
cache, how close are the model's next-token distributions over the *same* continuation? Greedy
answers diverge at the first different token and then say nothing more; teacher forcing compares
every position. :func:`continuation_logprobs` is that measurement's engine half: for each
``(prompt, continuation)`` it loads the prompt's longest cached prefix through a connector (as
the engine does on admission, so an edited cache stored under the kept tokens is what it reads),
computes the rest of the prompt and the continuation in one forward pass with the engine's paged
attention, and returns the log-softmax of the rows that predict each continuation token.

It runs on the caller's thread with its own scratch cache, beside (not inside) a running
:class:`~kvdrop_engine.engine.Engine`: the model's weights are only read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from kvdrop_engine.connector import EngineConnector
from kvdrop_engine.errors import InvalidRequestError
from kvdrop_engine.paged import PagedAttention, PagedKVCache, SeqStep, blocks_needed
from kvdrop_sdk.validate import positive_int, token_ids

__all__ = ["continuation_logprobs"]


def continuation_logprobs(
    model: nn.Module,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    connector: EngineConnector | None = None,
    cache_salt: str = "",
    block_size: int = 16,
    max_batch_tokens: int = 32768,
) -> list[Tensor]:
    """For each ``(prompt, continuation)``, float32 log-probabilities ``[len(continuation), V]``:
    row ``i`` is the model's distribution of the token after ``prompt + continuation[:i]``.

    With a ``connector`` the longest cached chunk-aligned prefix of each prompt (under
    ``cache_salt``) is loaded, at most all but the prompt's last token, exactly as the engine does;
    without one everything is computed. Requests are packed into forward passes of at most
    ``max_batch_tokens`` cached plus computed tokens (a longer request runs alone).
    Bad input raises :class:`~kvdrop_engine.errors.InvalidRequestError`.
    """
    cfg = model.config
    try:
        positive_int(block_size, "block_size")
        positive_int(max_batch_tokens, "max_batch_tokens")
        checked = []
        for i, (prompt, cont) in enumerate(requests):
            p = token_ids(prompt, f"requests[{i}] prompt", vocab_size=cfg.vocab_size)
            c = token_ids(cont, f"requests[{i}] continuation", vocab_size=cfg.vocab_size)
            if not p or not c:
                raise ValueError(f"requests[{i}]: prompt and continuation must not be empty")
            checked.append((p, c))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(str(exc)) from None
    if not isinstance(cache_salt, str):
        raise InvalidRequestError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
    out: list[Tensor] = []
    group: list[tuple[list[int], list[int]]] = []
    used = 0
    for prompt, cont in checked:
        size = len(prompt) + len(cont)
        if group and used + size > max_batch_tokens:
            out.extend(_forward(model, group, connector, cache_salt, block_size))
            group, used = [], 0
        group.append((prompt, cont))
        used += size
    if group:
        out.extend(_forward(model, group, connector, cache_salt, block_size))
    return out


def _forward(
    model: nn.Module,
    group: list[tuple[list[int], list[int]]],
    connector: EngineConnector | None,
    cache_salt: str,
    block_size: int,
) -> list[Tensor]:
    """One packed forward over ``group``; returns each request's continuation log-probs."""
    cfg = model.config
    param = next(p for p in model.parameters() if p.is_floating_point())
    # Every token but the continuation's last one is in the cache (the last is only predicted).
    lengths = [len(p) + len(c) - 1 for p, c in group]
    cache = PagedKVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_blocks=sum(blocks_needed(n, block_size) for n in lengths),
        block_size=block_size,
        dtype=param.dtype,
        device=param.device,
    )
    seqs: list[SeqStep] = []
    tokens: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    for i, ((prompt, cont), n) in enumerate(zip(group, lengths)):
        table = cache.allocator.allocate(blocks_needed(n, block_size))
        loaded = 0
        if connector is not None:
            kv = connector.load(prompt, cache_salt)
            if kv is not None:
                # At least the prompt's last token is computed, as on the engine's admission.
                loaded = min(int(kv.shape[2]), len(prompt) - 1)
                if loaded:
                    cache.load(table, kv[:, :, :loaded])
        seq = (prompt + cont)[loaded:n]
        first = len(tokens)
        seqs.append(SeqStep(i, table, loaded, len(seq)))
        tokens.extend(seq)
        positions.extend(range(loaded, n))
        # Position len(prompt) - 1 predicts cont[0]; its row in this step:
        start = first + (len(prompt) - 1 - loaded)
        rows.extend(range(start, start + len(cont)))
    dev = param.device
    with torch.inference_mode():
        logits = model(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            PagedAttention(cache, seqs),
            logits_rows=torch.tensor(rows, dtype=torch.long, device=dev),
        )
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
    return list(torch.split(logprobs, [len(c) for _, c in group]))
