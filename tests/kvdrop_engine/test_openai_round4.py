"""The OpenAI server's edge, round 4 (issue 33), against the real server on 127.0.0.1: text no
store or tokenizer could encode is a 400 naming the field, API keys a client cannot send are
refused at start, and a 401 says it closes the connection."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_sdk.events import TokenEvent

pytestmark = pytest.mark.timeout(120)


def _one(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
    yield TokenEvent(1, "a", "length")


# -- G: lone surrogates ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('{"prompt": [1], "cache_salt": "\\ud800"}', "'cache_salt'"),
        ('{"prompt": [1], "model": "m\\udfff"}', "'model'"),
        ('{"prompt": [1], "stop": ["a", "\\ud800b"]}', "'stop[1]'"),
        ('{"prompt": [1], "user": "\\ud83d\\ude00\\ud800"}', "'user'"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(body: str, field: str) -> None:
    """Was 200 (its loads and stores then failed) or a 500."""
    with CompletionHTTPServer(_one, model_name="m", port=0) as srv:
        r = requests.post(
            srv.url + "/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert f"field {field} holds a lone UTF-16 surrogate" in message, message
        ok = requests.post(srv.url + "/v1/completions", json={"prompt": [1]}, timeout=30)
        assert ok.status_code == 200  # a pair (one code point) passes, and the server serves on
        emoji = requests.post(
            srv.url + "/v1/completions", json={"prompt": [1], "user": "\U0001f600"}, timeout=30
        )
        assert emoji.status_code == 200, emoji.text


# -- I: API keys and connections ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "fragment"),
    [("k\n", "leading or trailing whitespace"), (" k", "leading or trailing"), ("k\x00", "holds")],
)
def test_api_keys_no_client_can_send_are_refused(key: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        CompletionHTTPServer(_one, model_name="m", port=0, api_key=key)


def test_a_401_says_connection_close_and_the_next_request_gets_a_fresh_one() -> None:
    """The server closes a refused connection; it now says so (``Connection: close``), so a
    keep-alive client opens a new one instead of sending into the closed one."""
    with CompletionHTTPServer(_one, model_name="m", port=0, api_key="secret") as srv:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
        try:
            body = json.dumps({"prompt": [1]})
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            refused = conn.getresponse()
            refused.read()
            assert refused.status == 401
            assert refused.getheader("Connection") == "close"
            assert refused.will_close
        finally:
            conn.close()
        with requests.Session() as session:  # a pooled client: 30 refusals, then a good one
            for _ in range(30):
                r = session.post(srv.url + "/v1/completions", json={"prompt": [1]}, timeout=30)
                assert r.status_code == 401
            good = session.post(
                srv.url + "/v1/completions",
                json={"prompt": [1]},
                headers={"Authorization": "Bearer secret"},
                timeout=30,
            )
            assert good.status_code == 200


# -- H: sampling values that made NaN probabilities -----------------------------------------------
def test_a_repetition_penalty_that_underflows_float32_is_a_400() -> None:
    """``repetition_penalty: 1e-300`` at temperature 1 was a 500 (sampling on NaN); the bounds
    [0.01, 100] keep the penalised float32 logits finite, and their ends sample fine."""
    from kvdrop_engine.engine import Engine
    from kvdrop_engine.loading import preset_config
    from kvdrop_engine.model import Transformer

    model = Transformer.random(preset_config("tiny"), seed=0)
    with Engine(model, num_blocks=16) as engine:
        with CompletionHTTPServer(engine.post_completion, model_name="m", port=0) as srv:
            body = {"prompt": [5, 6, 7, 5, 6], "max_tokens": 4, "temperature": 1}
            r = requests.post(
                srv.url + "/v1/completions", json={**body, "repetition_penalty": 1e-300}, timeout=60
            )
            assert r.status_code == 400, r.text
            assert "'repetition_penalty' must be a finite number in [0.01, 100]" in r.text
            for ends in (0.01, 100):
                ok = requests.post(
                    srv.url + "/v1/completions",
                    json={**body, "repetition_penalty": ends, "seed": 1},
                    timeout=60,
                )
                assert ok.status_code == 200, ok.text
