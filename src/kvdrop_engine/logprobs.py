"""Next-token log-probabilities over a teacher-forced continuation, through the engine.

``kvdrop eval`` measures fidelity beside accuracy: with an edited (dropped) cache and with the full
cache, how close are the model's next-token distributions over the *same* continuation? Greedy
answers diverge at the first different token and then say nothing more; teacher forcing compares
every position. :func:`continuation_logprobs` is that measurement's engine half: each
``(prompt, continuation)`` goes into the engine as a scoring request
(:meth:`~kvdrop_engine.engine.Engine.post_scoring`): admitted like any other, its prompt's longest
cached prefix loaded through the engine's connector (so an edited cache stored under the kept
tokens is what it reads), the rest computed in the engine's steps with the one paged attention
backend, and the log-softmax of the rows that predict each continuation token kept. Nothing is
sampled or stored.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import InvalidRequestError
from kvdrop_sdk.validate import token_ids

__all__ = ["continuation_logprobs"]


def continuation_logprobs(
    engine: Engine,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    cache_salt: str | Sequence[str] = "",
) -> list[Tensor]:
    """For each ``(prompt, continuation)``, float32 log-probabilities ``[len(continuation), V]``:
    row ``i`` is the model's distribution of the token after ``prompt + continuation[:i]``.

    The engine loads the longest cached chunk-aligned prefix of each prompt through its connector
    (under ``cache_salt``, or, when it is a sequence of one salt per request, under the request's
    own: e.g. each edited stream's ``active_cache_salt``), at most all but the prompt's last
    token, as on any admission; without a connector everything is computed. Every request is
    submitted at once: the engine batches them under its own prefill and KV budgets.
    Bad input raises :class:`~kvdrop_engine.errors.InvalidRequestError`.
    """
    checked = _checked(requests, cache_salt, engine.config.vocab_size)
    waits = [
        engine.post_scoring(prompt + cont[:-1], len(prompt) - 1, salt)
        for prompt, cont, salt in checked
    ]
    return [wait() for wait in waits]


def _checked(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    cache_salt: str | Sequence[str],
    vocab_size: int,
) -> list[tuple[list[int], list[int], str]]:
    """``(prompt, continuation, salt)`` per request; ``InvalidRequestError`` says what is wrong."""
    try:
        pairs = []
        for i, (prompt, cont) in enumerate(requests):
            p = token_ids(prompt, f"requests[{i}] prompt", vocab_size=vocab_size)
            c = token_ids(cont, f"requests[{i}] continuation", vocab_size=vocab_size)
            if not p or not c:
                raise ValueError(f"requests[{i}]: prompt and continuation must not be empty")
            pairs.append((p, c))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(str(exc)) from None
    if isinstance(cache_salt, str):
        salts = [cache_salt] * len(pairs)
    elif isinstance(cache_salt, Sequence):
        salts = list(cache_salt)
    else:
        salts = []
    if len(salts) != len(pairs) or not all(isinstance(s, str) for s in salts):
        raise InvalidRequestError(
            "cache_salt must be a str or one str per request "
            f"({len(pairs)} requests), got {cache_salt!r:.200}"
        )
    return [(p, c, s) for (p, c), s in zip(pairs, salts)]
