"""What an engine call streams back: one ``TokenEvent`` per generated token.

Kept in its own small module so engines (reference engine, HTTP adapter, toy engine) and the request
streams share one definition without importing each other.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["PostCompletion", "TokenEvent", "kept_prompt_tokens"]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id (required to key the cache), text, and why generation stopped.

    ``finish_reason`` is ``None`` while generating, then "stop" (EOS / stop token) or "length"
    (``max_tokens`` reached) on the last event, as in the OpenAI completions API. ``logprob`` and
    ``top_logprobs`` (``(token_id, logprob)`` pairs, most likely first) are set when the request
    asked for logprobs and the engine computes them. ``kept_prompt_tokens`` is
    how many prompt tokens the engine's cache kept after cutting the prompt by a drop policy,
    on one event only: the first that knows it (the first event when the prompt is not cut, the
    second when it is: the first token comes from the prefill's logits and is handed over while
    the cut runs). None on every event: the engine does not drop while serving.
    """

    token_id: int
    text: str = ""
    finish_reason: str | None = None
    time: float = field(default_factory=time.perf_counter)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    kept_prompt_tokens: int | None = None


def kept_prompt_tokens(events: Iterable[TokenEvent]) -> int | None:
    """The prompt tokens a request's cache kept after its drop policy's cut, read from its
    events (the one event that reports it); None: the engine does not drop while serving."""
    return next((e.kept_prompt_tokens for e in events if e.kept_prompt_tokens is not None), None)


class PostCompletion(Protocol):
    """Submits one request to an engine and streams its generated tokens.

    The engine stores the prompt's KV cache (and query tensors) in the kvdrop server as a side
    effect of prefill, and looks up the longest cached prefix before computing.
    """

    def __call__(
        self, prompt_token_ids: list[int], sampling_params: dict[str, Any], cache_salt: str
    ) -> Iterator[TokenEvent]: ...
