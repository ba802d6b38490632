"""Blocks allocated as requests grow, with preemption (issue 28 D): one request whose
``max_tokens`` is the whole KV budget does not hold the others up, and a preempted request is
recomputed to the same tokens."""

from __future__ import annotations

import threading

import pytest
import torch

from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer, generate

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_request_of_the_whole_budget_does_not_hold_short_ones(model: Transformer) -> None:
    with Engine(model, num_blocks=32) as eng:  # 512 tokens
        long = eng.post_completion(tokens(8, 1), {**GREEDY, "max_tokens": 500})  # 507 tokens
        seen: list[int] = []
        reader = threading.Thread(target=lambda: seen.extend(e.token_id for e in long))
        next(long)
        reader.start()
        short = eng.generate(tokens(8, 2), {**GREEDY, "max_tokens": 8})
        at_short = len(seen)
        reader.join(120)
        assert len(short) == 8 and len(seen) == 499
        assert at_short < 400, f"the short request waited for {at_short} of 500 long tokens"


@pytest.mark.parametrize("salts", [("", "", ""), ("light", "heavy", "heavy")])
def test_preempted_requests_are_recomputed_to_the_same_tokens(
    model: Transformer, salts: tuple[str, ...]
) -> None:
    """One client (unsalted), and two (the KV budget shared per client: the heavy one's
    requests are the victims and the light one's reclaims blocks from them)."""
    prompts = [tokens(20, 10 + i) for i in range(3)]
    want = [generate(model, p, 100, stop_at_eos=False) for p in prompts]
    # 12 blocks of 16: each request (120 tokens, 8 blocks) fits alone, not all three at once.
    with Engine(model, num_blocks=12) as eng:
        streams = [
            eng.post_completion(p, {**GREEDY, "max_tokens": 100}, salt)
            for p, salt in zip(prompts, salts, strict=True)
        ]
        got: list[list[int]] = [[] for _ in prompts]
        readers = [
            threading.Thread(target=lambda i=i: got[i].extend(e.token_id for e in streams[i]))
            for i in range(3)
        ]
        for r in readers:
            r.start()
        for r in readers:
            r.join(240)
        st = eng.stats()
        assert got == want
        assert st.preemptions >= 1
        assert eng.num_free_blocks == eng.num_blocks and eng.load() == (0, 0)
