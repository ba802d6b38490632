"""How the engine picks tokens: validated sampling parameters and small top-level functions.

``SamplingParams.from_dict`` validates an OpenAI/vLLM-style dict once, when a request enters the
engine; :func:`sample` then picks one token per row of a step's logits (greedy rows in one
``argmax``), :func:`token_logprobs` gives the log-probabilities a request asked for, and
:func:`finish_reason` says whether a token ends its request.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from kvdrop_engine.errors import InvalidRequestError
from kvdrop_sdk.validate import is_int, is_number

__all__ = [
    "GREEDY_BELOW",
    "MAX_LOGPROBS",
    "MIN_TEMPERATURE",
    "SamplingParams",
    "TokenLogprobs",
    "finish_reason",
    "make_generator",
    "pick_tokens",
    "sample",
    "sample_row",
    "token_logprobs",
]

#: A temperature at or below this samples greedily: dividing logits by a tinier one overflows
#: them to inf (softmax then gives NaN and ``multinomial`` raises), and its distribution is the
#: argmax anyway.
GREEDY_BELOW = 1e-5

#: OpenAI fields a request may carry that do not change sampling here.
_TOLERATED_KEYS = frozenset({"stream", "model", "user", "echo", "n"})
#: The smallest positive temperature the OpenAI server passes on: lower ones are raised to it,
#: as vLLM does (the engine itself samples greedily at or below ``GREEDY_BELOW``).
MIN_TEMPERATURE = 1e-2
#: Most alternatives per token a request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20

#: One token's log-probability and its ``top`` alternatives as ``(token_id, logprob)``.
TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature <= GREEDY_BELOW`` (0 included) is greedy; ``top_k <= 0``
    and ``top_p == 1`` are off. ``stop_set`` holds ``stop_token_ids`` for O(1) checks.
    ``logprobs`` (None: none) asks for each sampled token's log-probability and that many top
    alternatives."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    #: kvdrop's extension: score this prompt with KVzip's reconstruction pass when the request
    #: ends (needs an engine built with ``reconstruction``; the ``kvzip`` policy reads them).
    reconstruct: bool = False
    stop_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            stops = frozenset(self.stop_token_ids)
        except TypeError:  # unhashable ids: ``_check`` refuses them with the reason
            stops = frozenset()
        object.__setattr__(self, "stop_set", stops)

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax (temperature 0 or tiny)."""
        return self.temperature <= GREEDY_BELOW

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | SamplingParams | None) -> SamplingParams:
        """Validate an OpenAI/vLLM-style dict; unknown keys and bad values raise with the reason."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, Mapping):
            raise InvalidRequestError(
                f"sampling_params must be a dict, got {type(params).__name__}"
            )
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(params) - known - _TOLERATED_KEYS)
        if unknown:
            raise InvalidRequestError(
                f"unsupported sampling parameter(s) {unknown}; supported: {sorted(known)}"
            )
        if params.get("n", 1) != 1:
            raise InvalidRequestError("only n=1 is supported")
        kw = {k: params[k] for k in known if k in params and params[k] is not None}
        if "stop_token_ids" in kw:
            kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
        sp = cls(**kw)
        sp._check()
        return sp

    def _check(self) -> None:
        def bad(name: str, expected: str) -> InvalidRequestError:
            value = getattr(self, name)
            return InvalidRequestError(f"sampling parameter {name}={value!r}; expected {expected}")

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not isinstance(self.reconstruct, bool):
            raise bad("reconstruct", "a bool")
        if not is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a number >= 0")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k):
            raise bad("top_k", "an int (<= 0 disables)")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "an int or None")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        if not all(is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of ints")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's random generator (seeded from ``params.seed``, else at random); None when
    sampling is greedy."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return torch.Generator().manual_seed(seed)


def sample_row(row: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits with temperature, top-k and top-p (non-greedy)."""
    row = row.float().cpu() / params.temperature
    if 0 < params.top_k < row.numel():
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        row = row.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    greedy: Tensor | None = None,
) -> list[int]:
    """One token per row of ``logits [R, V]``: row ``i`` follows ``params[i]`` and draws from
    ``generators[i]``. Greedy rows share one ``argmax`` (``greedy [R]``, when the caller already
    has it on the device)."""
    if not params:
        return []
    greedy = (logits.argmax(dim=-1) if greedy is None else greedy).tolist()
    return [
        int(greedy[i]) if p.greedy else sample_row(logits[i], p, gen)
        for i, (p, gen) in enumerate(zip(params, generators, strict=True))
    ]


def pick_tokens(logits: Tensor, greedy: Tensor | None = None) -> list[int | None]:
    """Each row's argmax (``greedy [R]`` when the caller has it on the device), or None for a
    row whose logits are not all finite; one host sync for both."""
    finite = torch.isfinite(logits).all(dim=-1)
    picked = logits.argmax(dim=-1) if greedy is None else greedy
    rows = torch.where(finite, picked, torch.full_like(picked, -1)).tolist()
    return [None if t < 0 else int(t) for t in rows]


def token_logprobs(
    logits: Tensor, tokens: Sequence[int], tops: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Row ``i``'s log-probability of ``tokens[i]`` and its ``tops[i]`` most likely tokens, from
    the model's raw logits (as vLLM's default ``raw_logprobs``); None where ``tops[i]`` is None."""
    rows = [i for i, top in enumerate(tops) if top is not None]
    out: list[TokenLogprobs | None] = [None] * len(tops)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    k = max(int(tops[i] or 0) for i in rows)
    top_lp, top_ids = (t.cpu().tolist() for t in torch.topk(logp, k, dim=-1)) if k else ([], [])
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logp.device))
    for j, (i, lp) in enumerate(zip(rows, chosen[:, 0].cpu().tolist(), strict=True)):
        n = int(tops[i] or 0)
        alts = tuple(zip(top_ids[j][:n], top_lp[j][:n], strict=True)) if n else ()
        out[i] = (float(lp), alts)
    return out


def finish_reason(
    token: int, num_generated: int, params: SamplingParams, eos_token_ids: Collection[int]
) -> str | None:
    """ "stop" for a stop token (or EOS unless ``ignore_eos``), "length" once ``max_tokens``
    tokens were generated (``token`` included), else None."""
    if token in params.stop_set or (not params.ignore_eos and token in eos_token_ids):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
