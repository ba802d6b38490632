"""One step's token per sampled request: the postprocess half of a step that reads logits.

Drawn from the edited logits (logit bias, ``min_tokens`` bans, penalties: :mod:`penalties`), its
log-probs from the model's raw ones (vLLM's default); a row whose logits are not finite, or a
token that cannot be drawn, fails only its own request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from kvdrop_engine.errors import EngineError
from kvdrop_engine.sampling import TokenLogprobs, sample_row, token_logprobs
from kvdrop_engine.sequence import Request

__all__ = ["draw_tokens"]


def draw_tokens(
    sampled: Sequence[Request | None],
    logits: Tensor,
    picked: Sequence[int | None],
    edited: Tensor,
    fail: Callable[[Request, BaseException], None],
) -> dict[int, tuple[int, TokenLogprobs | None]]:
    """``{rid: (token, log-probs)}`` for row ``i`` of each request in ``sampled`` (None: a row
    whose request is gone); ``picked`` is each raw row's argmax, None where it is not finite.
    A failure is handed to ``fail`` and that request gets no token."""
    out: dict[int, tuple[int, TokenLogprobs | None]] = {}
    for i, req in enumerate(sampled):
        if req is None:
            continue
        argmax = picked[i]
        try:
            if argmax is None:
                raise EngineError(
                    "the model's logits for this request are not finite (NaN or inf: "
                    "corrupt cached KV or weights?); the request is stopped, others go on"
                )
            params = req.params
            tok = argmax if params.greedy else sample_row(edited[i], params, req.generator)
            logprobs = None
            if params.logprobs is not None:
                logprobs = token_logprobs(logits[i][None], [tok], [params.logprobs])[0]
            out[req.rid] = (tok, logprobs)
        except Exception as exc:
            fail(req, exc)
    return out
