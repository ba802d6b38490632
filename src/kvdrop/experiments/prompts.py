"""Prompt generators of the experiments: pass-key retrieval for a real model (a checkable
answer), random tokens for random weights."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

__all__ = ["Prompt", "passkey_prompts", "random_prompts"]

_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids and, when checkable, the answer a correct output contains."""

    token_ids: list[int]
    answer: str | None = None
    depth: float | None = None  # where the answer was hidden (0 = start, 1 = end)


def passkey_prompts(tokenizer: Any, n: int, prompt_tokens: int, seed: int = 0) -> list[Prompt]:
    """Pass-key retrieval prompts (a 5-digit key hidden at a random depth in filler text).

    Each prompt is at least ``prompt_tokens`` long after the chat template (at most one filler
    sentence group more), so its cached chunk count is predictable; the answer is the key.
    """
    rng = random.Random(seed)
    filler_ids = len(tokenizer.encode(_FILLER, add_bos=False))
    question = "What is the pass key? Answer with the number only."
    prompts = []
    for _ in range(n):
        key = str(rng.randint(10000, 99999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        repeats = max(1, (prompt_tokens - 80) // filler_ids)
        depth = rng.random()
        while True:
            at = round(depth * repeats)
            text = (
                "There is important information hidden in this text. Find it and remember it. "
                + _FILLER * at
                + needle
                + _FILLER * (repeats - at)
                + question
            )
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            if len(ids) >= prompt_tokens:
                break
            repeats += 1
        prompts.append(Prompt(ids, key, depth))
    return prompts


def random_prompts(vocab_size: int, n: int, prompt_tokens: int, seed: int = 0) -> list[Prompt]:
    """Random token prompts (for random-weight models; no checkable answer)."""
    rng = random.Random(seed)
    return [Prompt([rng.randrange(vocab_size) for _ in range(prompt_tokens)]) for _ in range(n)]
