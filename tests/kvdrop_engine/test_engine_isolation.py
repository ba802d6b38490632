"""One bad request must not take down the others (issue 20, items 4 and 10, engine side): a step
failure fails only the requests that caused it, non-finite logits fail only their row, a tiny
positive temperature samples greedily, and stop ids are checked with a set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import EngineError
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import AttentionBackend, Transformer, generate
from kvdrop_engine.sampling import SamplingParams, finish_reason
from kvdrop_engine.sequence import LoadState
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.testing.server import ServerHandle

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0, "ignore_eos": True}
#: Sampled, so that a NaN row would make ``torch.multinomial`` raise (greedy argmax would not).
HOT = {"temperature": 1.0, "seed": 3, "ignore_eos": True}
POISON = 7  # the test models below misbehave on this token id at position AT
AT = 12


def poisoned(tokens: Tensor, positions: Tensor) -> Tensor:
    """Which rows feed POISON at AT (a victim's last prompt token; never a good stream's row)."""
    return (tokens == POISON) & (positions == AT)


class RaisesOnPoison(Transformer):
    """A model whose forward raises whenever the batch holds a poisoned row."""

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        attn: AttentionBackend,
        logits_rows: Tensor | None = None,
    ) -> Tensor:
        if bool(poisoned(tokens, positions).any()):
            raise RuntimeError("poisoned batch")
        return super().forward(tokens, positions, attn, logits_rows)


class NaNOnPoison(Transformer):
    """A model whose logits are NaN for every sampled row that is poisoned."""

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        attn: AttentionBackend,
        logits_rows: Tensor | None = None,
    ) -> Tensor:
        logits = super().forward(tokens, positions, attn, logits_rows)
        bad = poisoned(tokens, positions)
        bad = bad if logits_rows is None else bad[logits_rows]
        return logits.masked_fill(bad[:, None], float("nan"))


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids that never hold POISON."""
    ids = torch.randint(10, 512, (n,), generator=torch.Generator().manual_seed(seed))
    return ids.tolist()


def survives(stream: Iterator[TokenEvent], victim: Iterator[TokenEvent]) -> tuple[list[int], str]:
    """Read one token of ``stream``, then run ``victim`` (which must fail with EngineError), then
    the rest of ``stream``; returns ``stream``'s tokens and the victim's error."""
    out = [next(stream).token_id]
    with pytest.raises(EngineError) as err:
        list(victim)
    out += [e.token_id for e in stream]
    return out, str(err.value)


def test_a_failing_forward_fails_only_the_request_that_caused_it() -> None:
    model = RaisesOnPoison.random(preset_config("tiny"), seed=0)
    eng = Engine(model, num_blocks=256)
    try:
        good = prompt(20, 1)
        stream = eng.post_completion(good, {**GREEDY, "max_tokens": 300})
        out, error = survives(stream, eng.post_completion([*prompt(AT, 2), POISON], GREEDY))
        assert out == generate(model, good, 300, stop_at_eos=False)
        assert "poisoned batch" in error
        assert eng.num_free_blocks == 256  # the failed request gave its blocks back
    finally:
        eng.stop()


@pytest.mark.parametrize("params", [GREEDY, HOT], ids=["greedy", "sampled"])
def test_non_finite_logits_fail_only_their_request(params: dict) -> None:
    model = NaNOnPoison.random(preset_config("tiny"), seed=0)
    eng = Engine(model, num_blocks=256)
    try:
        good = prompt(20, 1)
        alone = eng.generate(good, {**params, "max_tokens": 300})
        stream = eng.post_completion(good, {**params, "max_tokens": 300})
        out, error = survives(stream, eng.post_completion([*prompt(AT, 2), POISON], params))
        assert out == alone
        assert "not finite" in error
    finally:
        eng.stop()


def test_a_tiny_positive_temperature_samples_greedily() -> None:
    model = Transformer.random(preset_config("tiny"), seed=0)
    eng = Engine(model, num_blocks=256)
    try:
        p = prompt(20, 4)
        other = eng.post_completion(prompt(9, 5), {**GREEDY, "max_tokens": 50})
        tiny = eng.generate(p, {"temperature": 1e-39, "ignore_eos": True, "max_tokens": 20})
        assert tiny == generate(model, p, 20, stop_at_eos=False)
        assert len(list(other)) == 50  # the batch it shared went on
    finally:
        eng.stop()
    assert SamplingParams(temperature=1e-39).greedy and not SamplingParams(temperature=0.5).greedy


def test_nan_kv_under_a_shared_prefix_fails_only_the_request_that_loads_it(
    kv_server: ServerHandle,
) -> None:
    model = Transformer.random(preset_config("tiny"), seed=0)
    cfg = model.config
    conn = ServerConnector(
        kv_server.url, kv_server.http_url, "nan-prefix", transfer_query=False, timeout=30
    )
    eng = Engine(model, num_blocks=1024, connector=conn)
    try:
        shared = prompt(conn.chunk_size, 6)
        nan_kv = torch.full((2, cfg.num_layers, len(shared), cfg.kv_dim), float("nan"))
        conn.store(nan_kv, None, shared, "system")
        stream = eng.post_completion(prompt(9, 7), {**HOT, "max_tokens": 8000})
        victim = eng.post_completion(shared + prompt(5, 8), HOT, cache_salt="system")
        out = [next(stream).token_id]
        with pytest.raises(EngineError, match="not finite"):
            list(victim)
        out += [next(stream).token_id for _ in range(20)]  # still streaming after the failure
        stream.close()
        assert len(out) == 21 and eng.stats().tokens_loaded == len(shared)
    finally:
        eng.stop()
        conn.close()


def test_stop_ids_are_checked_with_a_set() -> None:
    many = list(range(100, 200_100))
    params = SamplingParams.from_dict({"stop_token_ids": many, "max_tokens": 5})
    assert params.stop_set == frozenset(many)
    assert finish_reason(200_099, 1, params, ()) == "stop"
    assert finish_reason(99, 1, params, ()) is None
    assert params.stop_token_ids == tuple(many)  # the field keeps its order and type


def test_load_state_is_an_enum_of_the_five_states() -> None:
    assert [s.value for s in LoadState] == ["queued", "io", "copy", "copied", "abandoned"]
