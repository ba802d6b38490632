"""Cancellation (issue 28 C): a request whose reader goes away costs nothing more.

Its iterator closed (from any thread, before or after its first token) or dropped, or its HTTP
client gone at any point (during a prefix load, during prefill, between tokens with nothing to
write): the request is cancelled at once, its blocks and its pending load are freed.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from kvdrop_engine.connectors.base import KVConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import ModelConfig, Transformer
from kvdrop_sdk.query_capture import QueryCapture

pytestmark = pytest.mark.timeout(120)

CHUNK = 8  # prefill chunk: a long prompt takes hundreds of steps
LONG = 3000  # prompt tokens of a request that is cancelled mid-prefill
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


@pytest.fixture
def engine(model: Transformer) -> Iterator[Engine]:
    with Engine(model, num_blocks=512, max_prefill_tokens=CHUNK) as eng:
        yield eng


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def idle(eng: Engine) -> bool:
    return eng.load() == (0, 0) and eng.num_free_blocks == eng.num_blocks


def test_closing_before_the_first_next_computes_nothing(engine: Engine) -> None:
    # Posted and closed while the loop cannot take it: not one chunk of it is computed.
    with engine._cv:
        events = engine.post_completion(tokens(400, 1), {**GREEDY, "max_tokens": 400})
        events.close()
    wait_for(lambda: idle(engine), "the request to be dropped")
    st = engine.stats()
    assert (st.prefill_tokens_computed, st.decode_tokens_computed) == (0, 0)
    assert list(events) == []  # a closed stream ends


def test_dropping_the_iterator_cancels_the_request(engine: Engine) -> None:
    with engine._cv:
        engine.post_completion(tokens(400, 2), {**GREEDY, "max_tokens": 400})
        gc.collect()
    wait_for(lambda: idle(engine), "the dropped request to be freed")
    assert engine.stats().prefill_tokens_computed == 0


def test_close_from_another_thread_wakes_a_blocked_reader(engine: Engine) -> None:
    """The HTTP server's watcher closes a stream its handler waits on (mid-prefill)."""
    events = engine.post_completion(tokens(LONG, 3), {**GREEDY, "max_tokens": 5})
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.extend(events), daemon=True)
    reader.start()
    wait_for(lambda: engine.stats().prefill_tokens_computed >= 4 * CHUNK, "prefill to start")
    events.close()
    reader.join(10)
    assert not reader.is_alive() and got == []
    wait_for(lambda: idle(engine), "the cancelled request to be freed")
    st = engine.stats()
    assert st.prefill_tokens_computed < LONG and st.decode_tokens_computed == 0


def test_a_cancelled_request_leaves_the_others_exact(engine: Engine, model: Transformer) -> None:
    prompt = tokens(40, 4)
    alone = engine.generate(prompt, {**GREEDY, "max_tokens": 12})
    doomed = engine.post_completion(tokens(LONG, 5), {**GREEDY, "max_tokens": 50})
    kept = engine.post_completion(prompt, {**GREEDY, "max_tokens": 12})
    first = next(kept)
    doomed.close()
    assert [first.token_id] + [e.token_id for e in kept] == alone
    wait_for(lambda: idle(engine), "both requests to end")


class HangingConnector(KVConnector):
    """A cache server whose lookups hang until released (a hung server)."""

    def __init__(self) -> None:
        super().__init__(QueryCapture())
        self.entered = threading.Event()
        self.release = threading.Event()

    def bind(
        self, config: ModelConfig, dtype: torch.dtype, *, device: torch.device | None = None
    ) -> None:
        self.chunk_size = 16

    def load(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None:
        self.entered.set()
        self.release.wait(60)
        return None

    def store(self, kv, queries, tokens, cache_salt="", *, query_offset=0) -> int:  # type: ignore[no-untyped-def]
        return 0


def test_closing_during_a_hung_prefix_load_frees_the_request(model: Transformer) -> None:
    conn = HangingConnector()
    with Engine(model, num_blocks=256, connector=conn, load_timeout_s=60) as eng:
        events = eng.post_completion(tokens(100, 6), {**GREEDY, "max_tokens": 100})
        assert conn.entered.wait(30)
        events.close()  # long before the 60 s load deadline
        wait_for(lambda: idle(eng), "the request waiting on its load to be freed", timeout=10)
        assert eng.stats().prefill_tokens_computed == 0
        conn.release.set()


def _post(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_http_client_gone_mid_prefill_is_cancelled(engine: Engine, stream: bool) -> None:
    """A client that leaves before its first token: its prompt is not prefilled to the end."""
    with CompletionHTTPServer(engine, model_name="m", port=0, max_model_len=4096) as srv:
        body = {"prompt": tokens(LONG, 7), "max_tokens": 5, "stream": stream}
        sock = _post(srv.port, body)
        wait_for(lambda: engine.stats().prefill_tokens_computed >= 4 * CHUNK, "prefill")
        sock.close()
        wait_for(lambda: idle(engine), "the gone client's request to be freed")
    st = engine.stats()
    assert st.prefill_tokens_computed < LONG and st.decode_tokens_computed == 0


class SilentTokenizer:
    """Every token decodes to no text: a stream has nothing to write until it ends."""

    def decode(self, ids: Sequence[int]) -> str:
        return ""


def test_http_client_gone_with_nothing_to_write_is_cancelled(model: Transformer) -> None:
    """A stream whose tokens write nothing notices its client leaving without a write failing."""
    eng = Engine(model, num_blocks=512, tokenizer=SilentTokenizer())
    with eng, CompletionHTTPServer(eng, model_name="m", port=0, max_model_len=4096) as srv:
        body = {"prompt": tokens(8, 8), "max_tokens": 4000, "stream": True, "ignore_eos": True}
        sock = _post(srv.port, body)
        wait_for(lambda: eng.stats().decode_tokens_computed >= 20, "decoding to start")
        sock.close()
        wait_for(lambda: idle(eng), "the gone client's request to be freed")
        assert eng.stats().decode_tokens_computed < 2000  # of 3999 without the cancel
