"""Blocks allocated as requests grow, with preemption (issue 28 D): one request whose
``max_tokens`` is the whole KV budget does not hold the others up, and a preempted request is
recomputed to the same tokens."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer, generate
from kvdrop_sdk.edit import edit_salt
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.testing.server import ServerHandle

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def read_side_by_side(streams: list[Iterator[TokenEvent]]) -> list[list[int]]:
    """Each stream's token ids, read on a thread of its own (they decode side by side)."""
    got: list[list[int]] = [[] for _ in streams]
    readers = [
        threading.Thread(target=lambda i=i: got[i].extend(e.token_id for e in streams[i]))
        for i in range(len(streams))
    ]
    for r in readers:
        r.start()
    for r in readers:
        r.join(240)
    return got


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
        got = read_side_by_side(streams)
        st = eng.stats()
        assert got == want
        assert st.preemptions >= 1
        assert eng.num_free_blocks == eng.num_blocks and eng.load() == (0, 0)


def test_a_prompt_beside_its_tenants_edited_streams_gets_the_whole_prefill_budget(
    model: Transformer,
) -> None:
    """Issue 31 (the pipelined job): an SDK stream decodes its edited KV under a salt of its own
    (``edit_salt``), so while one decoded, its tenant's next prompt counted as another client's
    and got the per-client cap, a quarter of the step: 16 steps of 64 tokens for 1,024 tokens
    beside one decoding stream. They are one tenant: 4 steps of 256."""
    with Engine(model, num_blocks=128, max_prefill_tokens=256) as eng:
        edited = eng.post_completion(
            tokens(8, 3), {**GREEDY, "max_tokens": 400}, edit_salt("job", "stream-0")
        )
        next(edited)  # decoding: every step from now on carries it
        before = eng.stats().steps
        prompt = eng.post_completion(tokens(1024, 4), {**GREEDY, "max_tokens": 1}, "job")
        assert len(list(prompt)) == 1
        steps = eng.stats().steps - before
        edited.close()
    assert steps <= 4 + 2, f"{steps} steps for 1,024 prompt tokens at 256 a step"


def test_a_preempted_stream_reloads_its_edited_kv_and_keeps_its_answer(
    model: Transformer, kv_server: ServerHandle
) -> None:
    """Issue 31 (the pipelined job): an SDK stream decodes KV an edit stored under its edit salt
    (the kept rows, computed with the whole prompt's context), not the KV of its tokens alone.
    Preempted, it was recomputed from its tokens: another cache, another answer. Now it loads
    its cached prefix again, as on its first admission (vLLM asks its KV connector again too)."""
    cfg = model.config
    params = {**GREEDY, "max_tokens": 200}
    salts = [edit_salt("job", f"stream-{i}") for i in range(3)]

    def connector() -> ServerConnector:
        return ServerConnector(kv_server.url, kv_server.http_url, "reload", transfer_query=False)

    with Engine(model, num_blocks=1024, connector=(conn := connector())) as eng:
        chunk = conn.chunk_size
        kept = [tokens(chunk, 20 + i) for i in range(3)]
        for i, (toks, salt) in enumerate(zip(kept, salts, strict=True)):
            # "edited" KV: finite, and not what computing these tokens alone gives
            kv = torch.randn((2, cfg.num_layers, chunk, cfg.kv_dim),
                             generator=torch.Generator().manual_seed(40 + i))  # fmt: skip
            conn.store(kv, None, toks, salt)
        prompts = [[*toks, 7] for toks in kept]  # the stream's next token after its kept rows
        solo = [eng.generate(p, params, s) for p, s in zip(prompts, salts, strict=True)]
        assert eng.stats().tokens_loaded == 3 * chunk
    conn.close()
    # the three prompts fit in the budget, not their 200 tokens each: they grow into preemptions
    blocks = 3 * (chunk // 16 + 2) + 4
    with Engine(model, num_blocks=blocks, connector=(conn := connector())) as eng:
        streams = [eng.post_completion(p, params, s) for p, s in zip(prompts, salts, strict=True)]
        got = read_side_by_side(streams)
        st = eng.stats()
    conn.close()
    assert st.preemptions > 0, "the budget did not preempt: the test shows nothing"
    assert got == solo
    assert st.recomputed_tokens < st.preemptions * chunk  # reloaded, not recomputed
