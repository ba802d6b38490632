"""Next-token log-probabilities over a teacher-forced continuation, on the cache a server holds.

``kvdrop eval`` measures fidelity beside accuracy: with an edited (dropped) cache and with the full
cache, how close are the model's next-token distributions over the *same* continuation? Greedy
answers diverge at the first different token and then say nothing more; teacher forcing compares
every position. :func:`continuation_logprobs` is that measurement's engine half: for each
``(prompt, continuation)`` it loads the prompt's longest cached prefix through a connector (as
the engine does on admission, so an edited cache stored under the kept tokens is what it reads),
computes the rest of the prompt and the continuation in one forward pass (attending to the
loaded KV in place, no scratch cache), and returns the log-softmax of the rows that predict each
continuation token.

It runs on the caller's thread beside (not inside) a running
:class:`~kvdrop_engine.engine.Engine`: the model's weights are only read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from kvdrop_engine.connectors.base import KVConnector
from kvdrop_engine.errors import InvalidRequestError
from kvdrop_engine.model import causal_attention
from kvdrop_sdk.validate import positive_int, token_ids

__all__ = ["continuation_logprobs"]


def continuation_logprobs(
    model: nn.Module,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    connector: KVConnector | None = None,
    cache_salt: str | Sequence[str] = "",
    max_batch_tokens: int = 16384,
) -> list[Tensor]:
    """For each ``(prompt, continuation)``, float32 log-probabilities ``[len(continuation), V]``:
    row ``i`` is the model's distribution of the token after ``prompt + continuation[:i]``.

    With a ``connector`` the longest cached chunk-aligned prefix of each prompt is loaded (under
    ``cache_salt``, or, when it is a sequence of one salt per request, under the request's own:
    e.g. each edited stream's ``active_cache_salt``), at most all but the prompt's last token,
    exactly as the engine does; without one everything is computed. Requests are packed into
    forward passes of at most ``max_batch_tokens`` cached plus computed tokens (a longer request
    runs alone).
    Bad input raises :class:`~kvdrop_engine.errors.InvalidRequestError`.
    """
    cfg = model.config
    try:
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
    if isinstance(cache_salt, str):
        salts = [cache_salt] * len(checked)
    elif isinstance(cache_salt, Sequence):
        salts = list(cache_salt)
    else:
        salts = []
    if len(salts) != len(checked) or not all(isinstance(s, str) for s in salts):
        raise InvalidRequestError(
            "cache_salt must be a str or one str per request "
            f"({len(checked)} requests), got {cache_salt!r:.200}"
        )
    out: list[Tensor] = []
    group: list[tuple[list[int], list[int], str]] = []
    used = 0
    for (prompt, cont), salt in zip(checked, salts):
        size = len(prompt) + len(cont)
        if group and used + size > max_batch_tokens:
            out.extend(_forward(model, group, connector))
            group, used = [], 0
        group.append((prompt, cont, salt))
        used += size
    if group:
        out.extend(_forward(model, group, connector))
    return out


class _PrefixAttention:
    """``AttentionBackend`` for packed sequences, each a cached prefix (read from the loaded KV in
    place, no scratch cache) followed by new tokens that attend causally."""

    def __init__(self, prefixes: list[Tensor | None], lengths: list[int], config: Any) -> None:
        self.prefixes = prefixes  # per sequence: KV [2, L, T, Hkv*d] on the model device, or None
        self.lengths = lengths  # per sequence: new tokens in this forward
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        hkv, d = self.num_kv_heads, self.head_dim
        outs = []
        row = 0
        for prefix, n in zip(self.prefixes, self.lengths):
            kn, vn = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)
            start = 0
            if prefix is not None:
                start = prefix.shape[2]
                kp = prefix[0, layer].view(start, hkv, d).transpose(0, 1).to(kn.dtype)
                vp = prefix[1, layer].view(start, hkv, d).transpose(0, 1).to(vn.dtype)
                kn, vn = torch.cat([kp, kn], dim=1), torch.cat([vp, vn], dim=1)
            outs.append(causal_attention(q[row : row + n], kn, vn, start))
            row += n
        return torch.cat(outs)


def _forward(
    model: nn.Module,
    group: list[tuple[list[int], list[int], str]],
    connector: KVConnector | None,
) -> list[Tensor]:
    """One packed forward over ``group``; returns each request's continuation log-probs."""
    param = next(p for p in model.parameters() if p.is_floating_point())
    dev = param.device
    prefixes: list[Tensor | None] = []
    lengths: list[int] = []
    tokens: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    for prompt, cont, cache_salt in group:
        loaded = 0
        prefix = None
        if connector is not None:
            kv = connector.load(prompt, cache_salt)
            if kv is not None:
                # At least the prompt's last token is computed, as on the engine's admission.
                loaded = min(int(kv.shape[2]), len(prompt) - 1)
                if loaded:
                    prefix = kv[:, :, :loaded].to(dev)
        # Every token but the continuation's last one is run (the last is only predicted).
        seq = (prompt + cont[:-1])[loaded:]
        first = len(tokens)
        prefixes.append(prefix)
        lengths.append(len(seq))
        tokens.extend(seq)
        positions.extend(range(loaded, loaded + len(seq)))
        start = first + (len(prompt) - 1 - loaded)  # the row at position len(prompt) - 1
        rows.extend(range(start, start + len(cont)))
    with torch.inference_mode():
        logits = model(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            _PrefixAttention(prefixes, lengths, model.config),
            logits_rows=torch.tensor(rows, dtype=torch.long, device=dev),
        )
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
    return list(torch.split(logprobs, [len(c) for _, c, _ in group]))
