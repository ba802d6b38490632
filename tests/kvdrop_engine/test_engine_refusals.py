"""A request the cache server refuses (bad input) must not back the engine off from the server for
everyone (issue 20, item 8); only an unreachable server does."""

from __future__ import annotations

import time

import pytest

from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.errors import EngineError, InvalidRequestError
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_engine.transfer import refused
from kvdrop_sdk.errors import SDKError, ServerUnavailableError
from kvdrop_sdk.protocol import RpcError
from kvdrop_sdk.testing.server import spawn_server

pytestmark = pytest.mark.timeout(120)


def _wrapped(cause: Exception) -> EngineError:
    try:
        raise EngineError("storing the prompt in the server failed") from cause
    except EngineError as exc:
        return exc


def test_only_an_unavailable_server_counts_as_down() -> None:
    assert refused(_wrapped(RpcError("bad_field", "salt")))  # the server answered
    assert refused(_wrapped(SDKError("cache_salt is 100000 characters")))
    assert not refused(_wrapped(ServerUnavailableError("no reply")))
    assert not refused(RuntimeError("a connector of another kind"))


def test_a_huge_cache_salt_is_refused_before_it_reaches_the_server() -> None:
    model = Transformer.random(preset_config("tiny"), seed=0)
    with spawn_server(chunk_size=16, l1_size_gb=0.01) as srv:
        conn = ServerConnector(srv.url, srv.http_url, "salted", timeout=30)
        with Engine(model, num_blocks=256, connector=conn) as eng:
            greedy = {"temperature": 0, "ignore_eos": True, "max_tokens": 2}
            started = time.monotonic()
            with pytest.raises(InvalidRequestError, match="cache_salt"):
                eng.generate(list(range(3, 40)), greedy, cache_salt="x" * 100_000)
            assert time.monotonic() - started < 5
            prompt = list(range(3, 40))
            eng.generate(prompt, greedy)
            transfers = eng._transfers
            assert transfers is not None and transfers.io_ok()
            assert eng.stats().store_failures == 0
            transfers.io_failed("store failed:", "refused", _wrapped(RpcError("bad_field", "x")))
            assert transfers.io_ok()  # a refusal: no back-off for everyone
            transfers.io_failed("store failed:", "down", _wrapped(ServerUnavailableError("x")))
            assert not transfers.io_ok()
        conn.close()
