"""continuation_logprobs: teacher-forced next-token log-probs, computed or read from a server."""

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


def test_rows_predict_each_continuation_token(model: Transformer) -> None:
    prompt, cont = tokens(40, 1), tokens(5, 2)
    (got,) = continuation_logprobs(model, [(prompt, cont)])
    assert got.shape == (5, model.config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, dense_logprobs(model, prompt, cont), atol=1e-4, rtol=1e-4)
    assert torch.allclose(got.exp().sum(-1), torch.ones(5), atol=1e-4)


def test_greedy_continuation_is_its_own_argmax(model: Transformer) -> None:
    prompt = tokens(30, 3)
    greedy = generate(model, prompt, 6, stop_at_eos=False)
    (got,) = continuation_logprobs(model, [(prompt, greedy)])
    assert got.argmax(-1).tolist() == greedy


def test_packed_requests_equal_lone_ones(model: Transformer) -> None:
    reqs = [(tokens(37, 4), tokens(3, 5)), (tokens(5, 6), tokens(1, 7)), (tokens(64, 8), [9])]
    packed = continuation_logprobs(model, reqs)
    split = continuation_logprobs(model, reqs, max_batch_tokens=1)  # one request per forward
    for (prompt, cont), a, b in zip(reqs, packed, split):
        assert a.shape == (len(cont), model.config.vocab_size)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a, dense_logprobs(model, prompt, cont), atol=1e-4, rtol=1e-4)


def test_reads_the_cache_the_server_holds(model: Transformer, server: ServerHandle) -> None:
    """With a connector the prompt's cached prefix comes from the server: the engine's own store
    gives the dense result; an edited cache stored under the same tokens changes it."""
    name = "scoring-model"
    conn = ServerConnector(server.url, server.http_url, name)
    engine = Engine(model, num_blocks=64, connector=conn).start()
    kv_ctx = connect(CacheKind.KV, server.url, server.http_url, name)
    try:
        prompt, cont = tokens(3 * CHUNK + 5, 10), tokens(4, 11)
        engine.generate(prompt, {"max_tokens": 1, "temperature": 0}, cache_salt="a")
        assert conn.lookup(prompt, "a") == 3 * CHUNK
        (stored,) = continuation_logprobs(model, [(prompt, cont)], connector=conn, cache_salt="a")
        want = dense_logprobs(model, prompt, cont)
        torch.testing.assert_close(stored, want, atol=1e-4, rtol=1e-4)
        # Another salt holds a different (scaled) cache under the same tokens: it is what is read.
        kv = kv_ctx.retrieve(prompt, "a")
        assert kv is not None
        kv_ctx.store(kv * 0.5, prompt[: 3 * CHUNK], "b")
        (edited,) = continuation_logprobs(model, [(prompt, cont)], connector=conn, cache_salt="b")
        assert (edited - want).abs().max() > 1e-2
        # A prompt the server lacks is computed whole, like without a connector.
        (fresh,) = continuation_logprobs(model, [(prompt, cont)], connector=conn, cache_salt="c")
        torch.testing.assert_close(fresh, want, atol=1e-4, rtol=1e-4)
        # One salt per request: each reads its own cache (an edited stream's own salt).
        both = continuation_logprobs(
            model, [(prompt, cont), (prompt, cont)], connector=conn, cache_salt=["b", "a"]
        )
        torch.testing.assert_close(both[0], edited, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(both[1], want, atol=1e-4, rtol=1e-4)
        with pytest.raises(InvalidRequestError, match="one str per request"):
            continuation_logprobs(model, [(prompt, cont)], connector=conn, cache_salt=["a", "b"])
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
def test_bad_requests_are_rejected(model: Transformer, requests: list, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        continuation_logprobs(model, requests)


def test_bad_options_are_rejected(model: Transformer) -> None:
    with pytest.raises(InvalidRequestError, match="max_batch_tokens"):
        continuation_logprobs(model, [([1, 2], [3])], max_batch_tokens=0)
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        continuation_logprobs(model, [([1, 2], [3])], cache_salt=None)  # type: ignore[arg-type]
