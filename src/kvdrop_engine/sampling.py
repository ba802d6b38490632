"""How the engine picks tokens: validated sampling parameters and small top-level functions.

``SamplingParams.from_dict`` validates an OpenAI/vLLM-style dict once, when a request enters the
engine; :func:`sample` then picks one token per row of a step's logits (greedy rows in one
``argmax``), :func:`token_logprobs` gives the log-probabilities a request asked for, and
:func:`finish_reason` says whether a token ends its request.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from kvdrop_engine.errors import InvalidRequestError
from kvdrop_sdk.validate import is_int, is_number

__all__ = [
    "BOUNDS",
    "GREEDY_BELOW",
    "MAX_LOGPROBS",
    "MIN_TEMPERATURE",
    "Bound",
    "PromptScores",
    "SamplingParamError",
    "SamplingParams",
    "ScoreSlice",
    "TokenLogprobs",
    "finish_reason",
    "make_generator",
    "pick_tokens",
    "prompt_scores",
    "reduce_rows",
    "sample",
    "sample_row",
    "scores_of",
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
#: Largest ``logit_bias`` magnitude (OpenAI's range) and most biased tokens per request.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024

#: One token's log-probability and its ``top`` alternatives as ``(token_id, logprob)``.
TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]
#: A prompt's tokens after the first, each as ``(token_id, (logprob, rank), alternatives)``
#: (rank 1: the most likely token), what vLLM's ``prompt_logprobs`` lists.
PromptScores = list[tuple[int, tuple[float, int], tuple[tuple[int, float], ...]]]


@dataclass(frozen=True)
class Bound:
    """One sampling value's rule: its kind (``int``, ``number``, ``bool``, ``ids``: token ids,
    ``bias``: token id -> number), its range, and whether None is allowed."""

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    optional: bool = False

    @property
    def expected(self) -> str:
        """What a valid value looks like, in words."""
        base = {
            "int": "an int",
            "number": "a finite number",
            "bool": "true or false",
            "ids": "a list of token ids (ints >= 0)",
            "bias": f"an object of token id -> number in [-{MAX_LOGIT_BIAS:g}, "
            f"{MAX_LOGIT_BIAS:g}], at most {MAX_LOGIT_BIAS_TOKENS} entries",
        }[self.kind]
        low, high = self._shown(self.low), self._shown(self.high)
        if low is not None and high is not None:
            base += f" in {'(' if self.low_open else '['}{low}, {high}]"
        elif low is not None:
            base += f" {'>' if self.low_open else '>='} {low}"
        return base + (" or null" if self.optional else "")

    def _shown(self, limit: float | None) -> str | None:
        if limit is None:
            return None
        return str(int(limit)) if self.kind == "int" else f"{limit:g}"

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` follows this rule."""
        if value is None:
            return self.optional
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "ids":
            return isinstance(value, tuple) and all(is_int(t) and t >= 0 for t in value)
        if self.kind == "bias":
            return (
                isinstance(value, tuple)
                and len(value) <= MAX_LOGIT_BIAS_TOKENS
                and all(_bias_entry(e) for e in value)
            )
        ok = is_int(value) if self.kind == "int" else is_number(value) and math.isfinite(value)
        if not ok:
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value <= self.high


def _bias_entry(entry: Any) -> bool:
    return (
        isinstance(entry, tuple)
        and len(entry) == 2
        and is_int(entry[0])
        and entry[0] >= 0
        and is_number(entry[1])
        and abs(entry[1]) <= MAX_LOGIT_BIAS
    )


#: The one table of sampling rules: every layer (the engine's ``submit``, the OpenAI server)
#: validates through ``SamplingParams`` and so through this table.
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound("int", 1),
    "min_tokens": Bound("int", 0),
    "temperature": Bound("number", 0),
    "top_p": Bound("number", 0, 1, low_open=True),
    "top_k": Bound("int", -1),
    "min_p": Bound("number", 0, 1),
    "presence_penalty": Bound("number", -2, 2),
    "frequency_penalty": Bound("number", -2, 2),
    # Logits are divided or multiplied by it in float32: 1e-300 is 0 there (inf logits, NaN
    # probabilities); HF and vLLM users pick values near 1.
    "repetition_penalty": Bound("number", 0.01, 100),
    "logit_bias": Bound("bias"),
    "seed": Bound("int", -(2**63), 2**64 - 1, optional=True),
    "ignore_eos": Bound("bool"),
    "stop_token_ids": Bound("ids"),
    "logprobs": Bound("int", 0, MAX_LOGPROBS, optional=True),
}


class SamplingParamError(InvalidRequestError):
    """One sampling value breaks its rule in :data:`BOUNDS`; ``field`` names it."""

    def __init__(self, field_name: str, value: Any) -> None:
        shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
        super().__init__(f"'{field_name}' must be {BOUNDS[field_name].expected}, got {shown}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature <= GREEDY_BELOW`` (0 included) is greedy; ``top_k <= 0``
    and ``top_p == 1`` are off. ``stop_set`` holds ``stop_token_ids`` for O(1) checks.
    ``logprobs`` (None: none) asks for each sampled token's log-probability and that many top
    alternatives. The penalties, ``min_p``, ``min_tokens`` and ``logit_bias`` (``(token_id,
    bias)`` pairs) mean what they mean in vLLM; at their neutral values they cost nothing.
    Every value follows its rule in :data:`BOUNDS`."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
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

    @property
    def edits_logits(self) -> bool:
        """Whether the logits change before sampling (penalties, bias, ``min_tokens``)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def changed(self) -> dict[str, Any]:
        """``max_tokens`` and every value that is not the default, as plain JSON values (what a
        log line or a test compares; :meth:`from_dict` reads it back)."""
        default = SamplingParams()
        out: dict[str, Any] = {"max_tokens": self.max_tokens}
        for f in fields(self):
            value = getattr(self, f.name)
            if not f.init or f.name == "max_tokens" or value == getattr(default, f.name):
                continue
            if f.name == "logit_bias":
                value = {str(t): float(b) for t, b in value}
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | SamplingParams | None) -> SamplingParams:
        """Validate an OpenAI/vLLM-style dict; unknown keys and bad values raise with the reason
        (:class:`SamplingParamError` naming the field)."""
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
        if isinstance(kw.get("stop_token_ids"), (list, tuple)):
            kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
        if "logit_bias" in kw:
            kw["logit_bias"] = _bias_pairs(kw["logit_bias"])
        sp = cls(**kw)
        sp._check()
        return sp

    def _check(self) -> None:
        for name, bound in BOUNDS.items():
            if not bound.accepts(getattr(self, name)):
                raise SamplingParamError(name, getattr(self, name))
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"'min_tokens' ({self.min_tokens}) must be at most 'max_tokens' ({self.max_tokens})"
            )

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ``logit_bias`` token ids outside ``[0, vocab_size)``."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"'logit_bias' names token id {bad[0]}, outside the vocabulary [0, {vocab_size})"
            )


def _bias_pairs(value: Any) -> Any:
    """``logit_bias`` as sorted ``(token_id, bias)`` pairs (a mapping's string keys such as
    OpenAI's ``{"50256": -100}`` read as ints); anything else is returned for the rule to
    refuse."""
    if isinstance(value, tuple):
        return value
    if not isinstance(value, Mapping):
        return value
    pairs = []
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 19:
            key = int(key)
        pairs.append((key, bias))
    try:
        return tuple(sorted(pairs))
    except TypeError:
        return tuple(pairs)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's random generator (seeded from ``params.seed``, else at random); None when
    sampling is greedy."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return torch.Generator().manual_seed(seed)


def sample_row(row: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits with temperature, ``min_p``, top-k and top-p
    (non-greedy; vLLM's order)."""
    row = row.float().cpu() / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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


def pick_tokens(
    logits: Tensor, greedy: Tensor | None = None, *, raw: Tensor | None = None
) -> list[int | None]:
    """Each row's argmax (``greedy [R]`` when the caller has it on the device), or None for a
    row whose model logits (``raw``, before bans set some to -inf; default ``logits``) are not
    all finite; one host sync for both."""
    finite = torch.isfinite(logits if raw is None else raw).all(dim=-1)
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


def prompt_scores(logprobs: Tensor, tokens: Sequence[int], top: int) -> PromptScores:
    """Each of ``tokens`` (a prompt after its first token) with its log-probability, rank and
    ``top`` alternatives, from ``logprobs [len(tokens), V]`` (row ``i`` predicts ``tokens[i]``):
    one ``gather``, one comparison and one ``topk`` for the whole prompt."""
    return scores_of([reduce_rows(logprobs, tokens, top)], tokens)


#: One slice of a prompt's scores, reduced as it is computed (:func:`reduce_rows`): each row's
#: log-probability of its token, its rank, and the ``top`` best ``(logprobs, ids)``.
ScoreSlice = tuple[Tensor, Tensor, Tensor, Tensor]


def reduce_rows(logprobs: Tensor, tokens: Sequence[int], top: int) -> ScoreSlice:
    """``logprobs [k, V]`` (row ``i`` predicts ``tokens[i]``) reduced to ``O(k * top)``: what
    ``prompt_logprobs`` answers, so a prompt's ``[T, V]`` rows never exist at once."""
    if len(tokens) != logprobs.shape[0]:
        raise ValueError(f"{len(tokens)} tokens for {logprobs.shape[0]} rows of logprobs")
    logp = logprobs.float()
    index = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)[:, None]
    chosen = logp.gather(1, index)
    ranks = (logp > chosen).sum(dim=-1) + 1
    if top:
        top_lp, top_ids = torch.topk(logp, top, dim=-1)
    else:
        top_lp = top_ids = torch.empty(len(tokens), 0)
    return chosen[:, 0].cpu(), ranks.cpu(), top_lp.cpu(), top_ids.cpu()


def scores_of(slices: Sequence[ScoreSlice], tokens: Sequence[int]) -> PromptScores:
    """The :data:`PromptScores` of ``tokens`` from their reduced slices, in order."""
    out: PromptScores = []
    for chosen, ranks, top_lp, top_ids in slices:
        alts_lp, alts_ids = top_lp.tolist(), top_ids.tolist()
        for i, (lp, rank) in enumerate(zip(chosen.tolist(), ranks.tolist(), strict=True)):
            alts = tuple((int(t), float(v)) for t, v in zip(alts_ids[i], alts_lp[i], strict=True))
            out.append((int(tokens[len(out)]), (float(lp), int(rank)), alts))
    if len(out) != len(tokens):
        raise ValueError(f"{len(out)} scored rows for {len(tokens)} tokens")
    return out
