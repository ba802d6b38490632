"""continuation_logprobs: teacher-forced next-token log-probs through the engine, computed or read
from a server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import InvalidRequestError
from kvdrop_engine.loading import preset_config
from kvdrop_engine.logprobs import continuation_logprobs
from kvdrop_engine.model import DenseAttention, Transformer, generate
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import connect
from kvdrop_sdk.testing.server import ServerHandle, spawn_server

CHUNK = 16


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


@pytest.fixture(scope="module")
def engine(model: Transformer) -> Iterator[Engine]:
    with Engine(model, num_blocks=64) as eng:
        yield eng


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    with spawn_server(chunk_size=CHUNK) as handle:
        yield handle


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def dense_logprobs(model: Transformer, prompt: list[int], cont: list[int]) -> torch.Tensor:
    """The reference: one dense forward over prompt + continuation, rows predicting ``cont``."""
    seq = prompt + cont
    with torch.inference_mode():
        logits = model(torch.tensor(seq), torch.arange(len(seq)), DenseAttention(model.config))
    rows = logits[len(prompt) - 1 : len(seq) - 1]
    return torch.log_softmax(rows.float(), dim=-1)


def test_rows_predict_each_continuation_token(model: Transformer, engine: Engine) -> None:
    prompt, cont = tokens(40, 1), tokens(5, 2)
    (got,) = continuation_logprobs(engine, [(prompt, cont)])
    assert got.shape == (5, model.config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, dense_logprobs(model, prompt, cont), atol=1e-4, rtol=1e-4)
    assert torch.allclose(got.exp().sum(-1), torch.ones(5), atol=1e-4)


def test_greedy_continuation_is_its_own_argmax(model: Transformer, engine: Engine) -> None:
    prompt = tokens(30, 3)
    greedy = generate(model, prompt, 6, stop_at_eos=False)
    (got,) = continuation_logprobs(engine, [(prompt, greedy)])
    assert got.argmax(-1).tolist() == greedy


def test_batched_and_chunked_requests_equal_dense(model: Transformer, engine: Engine) -> None:
    """Many requests in one step, or each prompt cut in 7-token prefill chunks over many steps:
    the rows are the dense forward's either way."""
    reqs = [(tokens(37, 4), tokens(3, 5)), (tokens(5, 6), tokens(1, 7)), (tokens(64, 8), [9])]
    packed = continuation_logprobs(engine, reqs)
    with Engine(model, num_blocks=64, max_prefill_tokens=7) as small:
        chunked = continuation_logprobs(small, reqs)
        assert small.stats().steps >= (37 + 3 + 5 + 64) // 7
    for (prompt, cont), a, b in zip(reqs, packed, chunked):
        assert a.shape == (len(cont), model.config.vocab_size)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a, dense_logprobs(model, prompt, cont), atol=1e-4, rtol=1e-4)


def test_scoring_beside_generation_changes_neither(model: Transformer, engine: Engine) -> None:
    """A scoring request batched with generating ones: their tokens are those of a run alone,
    and its blocks come back when it ends."""
    prompt = tokens(50, 12)
    alone = engine.generate(prompt, {"max_tokens": 8, "temperature": 0})
    free = engine.num_free_blocks
    streams = [engine.post_completion(prompt, {"max_tokens": 8, "temperature": 0})]
    wait = engine.post_scoring(tokens(90, 13), 60)
    rows = wait()
    assert [e.token_id for e in streams[0]] == alone
    assert rows.shape == (30, model.config.vocab_size)
    assert engine.num_free_blocks == free


def test_reads_the_cache_the_server_holds(model: Transformer, server: ServerHandle) -> None:
    """With a connector the prompt's cached prefix comes from the server: the engine's own store
    gives the dense result; an edited cache stored under the same tokens changes it."""
    name = "scoring-model"
    conn = ServerConnector(server.url, server.http_url, name)
    engine = Engine(model, num_blocks=64, connector=conn).start()
    score = engine.post_scoring  # the call continuation_logprobs makes
    kv_ctx = connect(CacheKind.KV, server.url, server.http_url, name)
    try:
        prompt, cont = tokens(3 * CHUNK + 5, 10), tokens(4, 11)
        engine.generate(prompt, {"max_tokens": 1, "temperature": 0}, cache_salt="a")
        assert conn.lookup(prompt, "a") == 3 * CHUNK
        (stored,) = continuation_logprobs(engine, [(prompt, cont)], cache_salt="a")
        assert engine.stats().tokens_loaded == 3 * CHUNK  # loaded on admission, not computed
        want = dense_logprobs(model, prompt, cont)
        torch.testing.assert_close(stored, want, atol=1e-4, rtol=1e-4)
        # Another salt holds a different (scaled) cache under the same tokens: it is what is read.
        kv = kv_ctx.retrieve(prompt, "a")
        assert kv is not None
        kv_ctx.store(kv * 0.5, prompt[: 3 * CHUNK], "b")
        (edited,) = continuation_logprobs(engine, [(prompt, cont)], cache_salt="b")
        assert (edited - want).abs().max() > 1e-2
        # A prompt the server lacks is computed whole, like without a connector.
        (fresh,) = continuation_logprobs(engine, [(prompt, cont)], cache_salt="c")
        torch.testing.assert_close(fresh, want, atol=1e-4, rtol=1e-4)
        assert conn.lookup(prompt, "c") == 0  # scoring stores nothing
        # A cached chunk past the prompt (covering continuation tokens) is not loaded: every
        # scored row is computed.
        p2, c2 = tokens(3 * CHUNK + 13, 14), tokens(6, 15)
        engine.generate(p2 + c2, {"max_tokens": 1, "temperature": 0}, cache_salt="d")
        assert conn.lookup(p2 + c2, "d") == 4 * CHUNK  # the 4th chunk holds 3 scored positions
        longer = score(p2 + c2[:-1], len(p2) - 1, "d")()
        torch.testing.assert_close(longer, dense_logprobs(model, p2, c2), atol=1e-4, rtol=1e-4)
        # One salt per request: each reads its own cache (an edited stream's own salt).
        both = continuation_logprobs(
            engine, [(prompt, cont), (prompt, cont)], cache_salt=["b", "a"]
        )
        torch.testing.assert_close(both[0], edited, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(both[1], want, atol=1e-4, rtol=1e-4)
        with pytest.raises(InvalidRequestError, match="one str per request"):
            continuation_logprobs(engine, [(prompt, cont)], cache_salt=["a", "b"])
    finally:
        engine.stop()
        kv_ctx.close()
        conn.close()


@pytest.mark.parametrize(
    ("requests", "match"),
    [
        ([([], [1])], "must not be empty"),
        ([([1, 2], [])], "must not be empty"),
        ([([1, 2], [100000])], "vocab"),
        ([([1, 2.5], [3])], "prompt"),
    ],
)
def test_bad_requests_are_rejected(engine: Engine, requests: list, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        continuation_logprobs(engine, requests)


def test_bad_options_are_rejected(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        continuation_logprobs(engine, [([1, 2], [3])], cache_salt=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"score_from must be an int in 0\.\.2, got 3"):
        engine.post_scoring([1, 2, 3], 3)
