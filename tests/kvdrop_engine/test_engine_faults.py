"""The engine and its HTTP server under faults: a hung or dead cache server, abandoned requests,
oversized and hostile requests, idle connections, disconnecting clients."""

from __future__ import annotations

import json
import logging
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import requests
import torch

from kvdrop_engine.connectors.base import KVConnector
from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.http import CompletionHTTPServer
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer, generate
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.query_capture import QueryCapture
from kvdrop_sdk.testing.server import spawn_server

pytestmark = pytest.mark.timeout(120)

CHUNK = 16
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=0)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- 4. a hung or dead cache server does not freeze the engine -----------------------------------
@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_cache_server_fault_does_not_stop_running_streams(model: Transformer, fault: str) -> None:
    with spawn_server(chunk_size=CHUNK, l1_size_gb=0.01, check_exit=False) as srv:
        conn = ServerConnector(srv.url, srv.http_url, f"fault-{fault}", timeout=30)
        eng = Engine(model, num_blocks=1024, connector=conn, load_timeout_s=1.0)
        try:
            running = eng.post_completion(tokens(5, 1), {**GREEDY, "max_tokens": 8000})
            next(running)
            if fault == "hang":
                srv.proc.send_signal(signal.SIGSTOP)
            else:
                srv.proc.kill()
            prompt = tokens(20 * CHUNK + 3, 2)  # 20 whole chunks: admission asks the server
            out: list[int] = []
            done = threading.Event()

            def newcomer() -> None:
                out.extend(eng.generate(prompt, {**GREEDY, "max_tokens": 3}))
                done.set()

            worker = threading.Thread(target=newcomer, daemon=True)
            gaps: list[float] = []
            last = time.monotonic()
            worker.start()
            for _ in running:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                if done.is_set() and len(gaps) > 20:
                    break
            running.close()
            worker.join(10)
            assert done.is_set(), "the new request did not finish"
            # Recomputed instead of loaded, and correct.
            assert out == generate(model, prompt, 3, stop_at_eos=False)
            assert max(gaps) < 5.0, f"a running stream stalled {max(gaps):.1f} s"
            stats = eng.stats()
            assert stats.connector_fallbacks >= 1
        finally:
            if fault == "hang":
                srv.proc.send_signal(signal.SIGCONT)
            eng.stop()
            conn.close()


def test_slow_load_falls_back_to_recompute(model: Transformer) -> None:
    """A load that takes longer than ``load_timeout_s`` is abandoned: the prompt is computed."""

    class SlowConnector(KVConnector):
        def __init__(self) -> None:
            super().__init__(QueryCapture())
            self.stored: list[int] = []

        def bind(self, config: Any, dtype: torch.dtype, *, device: Any = None) -> None:
            self.chunk_size = CHUNK

        def load(self, toks: Sequence[int], salt: str) -> torch.Tensor | None:
            time.sleep(3)
            raise AssertionError("too late: the engine must not use this")

        def lookup_queries(self, toks: Sequence[int], salt: str) -> int:
            return 0

        def store(self, kv: torch.Tensor, queries: Any, toks: Sequence[int], salt: str,
                  *, query_offset: int = 0) -> int:  # fmt: skip
            self.stored.append(len(toks))
            return 0

    conn = SlowConnector()
    prompt = tokens(4 * CHUNK, 3)
    with Engine(model, num_blocks=64, connector=conn, load_timeout_s=0.3) as eng:
        t0 = time.monotonic()
        out = eng.generate(prompt, {**GREEDY, "max_tokens": 2})
        assert time.monotonic() - t0 < 2.5
    assert out == generate(model, prompt, 2, stop_at_eos=False)


class SleepyConnector(KVConnector):
    """A connector whose loads take ``delay`` s and find nothing; counts loads in flight."""

    def __init__(self, delay: float) -> None:
        super().__init__(QueryCapture())
        self.delay = delay
        self.active = 0
        self.peak = 0
        self.lock = threading.Lock()

    def bind(self, config: Any, dtype: torch.dtype, *, device: Any = None) -> None:
        self.chunk_size = CHUNK

    def load(self, toks: Sequence[int], salt: str) -> torch.Tensor | None:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            time.sleep(self.delay)
            return None
        finally:
            with self.lock:
                self.active -= 1

    def lookup_queries(self, toks: Sequence[int], salt: str) -> int:
        return 0

    def store(self, kv: torch.Tensor, queries: Any, toks: Sequence[int], salt: str,
              *, query_offset: int = 0) -> int:  # fmt: skip
        return 0


def _run_all(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        outs[i] = eng.generate(prompts[i], {**GREEDY, "max_tokens": 2})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outs


def test_queued_loads_are_not_timed_out_by_their_wait(model: Transformer) -> None:
    """Loads wait for a connector thread without their deadline running: a healthy but busy
    server never makes queued requests recompute."""
    conn = SleepyConnector(delay=0.4)
    prompts = [tokens(2 * CHUNK, 10 + i) for i in range(6)]
    with Engine(
        model, num_blocks=256, connector=conn, load_timeout_s=1.0, load_concurrency=1
    ) as eng:  # type: ignore[arg-type]
        outs = _run_all(eng, prompts)
        st = eng.stats()
    assert conn.peak == 1 and st.connector_fallbacks == 0  # the last load started after 2 s
    assert outs == [generate(model, p, 2, stop_at_eos=False) for p in prompts]


def test_hung_load_gives_up_on_the_queued_ones_too(model: Transformer) -> None:
    conn = SleepyConnector(delay=6.0)
    prompts = [tokens(2 * CHUNK, 20 + i) for i in range(4)]
    with Engine(
        model, num_blocks=256, connector=conn, load_timeout_s=0.5, load_concurrency=1
    ) as eng:  # type: ignore[arg-type]
        t0 = time.monotonic()
        outs = _run_all(eng, prompts)
        took = time.monotonic() - t0
        st = eng.stats()
    assert took < 4.0, took  # one timeout, then the queued loads are skipped, not waited for
    assert st.connector_fallbacks == 4
    assert outs == [generate(model, p, 2, stop_at_eos=False) for p in prompts]


# -- 7. abandoned non-streaming requests are cancelled --------------------------------------------
def test_abandoned_non_streaming_request_is_cancelled() -> None:
    closed = threading.Event()
    produced: list[int] = []

    def slow(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        try:
            for i in range(params["max_tokens"]):
                produced.append(i)
                yield TokenEvent(i, "x")
                time.sleep(0.005)
        finally:
            closed.set()

    with CompletionHTTPServer(slow, model_name="m", port=0) as srv:
        body = json.dumps({"prompt": [1], "max_tokens": 20_000}).encode()
        sock = socket.create_connection((srv.host, srv.port), timeout=10)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.3)
        sock.close()  # the client gives up before the (non-streamed) answer
        assert closed.wait(5), "the engine kept generating for a client that left"
        assert len(produced) < 5_000


# -- 5. big text prompts are refused before tokenizing --------------------------------------------
class CountingTokenizer:
    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += len(text)
        return [ord(c) % 500 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def _echo(prompt: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
    yield TokenEvent(1, "a", "length")


@pytest.mark.parametrize("max_model_len", [None, 1000])
def test_huge_text_prompt_is_refused_before_tokenizing(max_model_len: int | None) -> None:
    tok = CountingTokenizer()
    with CompletionHTTPServer(
        _echo, model_name="m", port=0, tokenizer=tok, max_model_len=max_model_len
    ) as srv:
        t0 = time.monotonic()
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "y" * 3_000_000}, timeout=30)
        assert r.status_code == 400, r.text
        assert "characters" in r.json()["error"]["message"]
        assert tok.encoded == 0
        assert time.monotonic() - t0 < 10
        ok = requests.post(srv.url + "/v1/completions", json={"prompt": "hello"}, timeout=10)
        assert ok.status_code == 200


# -- 10. nested JSON, idle connections, disconnect logging ----------------------------------------
def test_deeply_nested_json_is_a_bad_request() -> None:
    with CompletionHTTPServer(_echo, model_name="m", port=0) as srv:
        r = requests.post(
            srv.url + "/v1/completions",
            data=b"[" * 1000 + b"]" * 1000,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200


def test_idle_connections_time_out() -> None:
    with CompletionHTTPServer(_echo, model_name="m", port=0, read_timeout=0.5) as srv:
        conns = []
        for i in range(20):
            s = socket.create_connection((srv.host, srv.port), timeout=10)
            # Half a request head, or a head whose body never comes.
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nContent-Length: 50\r\n\r\n{"
                if i % 2
                else b"GET /health HTTP/1.1\r\n"
            )
            conns.append(s)
        try:
            time.sleep(1.5)
            for s in conns:
                data = s.recv(65536)
                while data and not data.endswith(b"}") and b"\r\n\r\n" not in data:
                    data += s.recv(65536)
                assert data == b"" or b" 408 " in data or b"400" in data, data[:80]
            assert requests.get(srv.url + "/health", timeout=10).status_code == 200
        finally:
            for s in conns:
                s.close()


def test_client_reset_is_one_log_line_without_traceback(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    with CompletionHTTPServer(_echo, model_name="m", port=0) as srv:
        caplog.set_level(logging.INFO, logger="kvdrop_engine.http")
        s = socket.create_connection((srv.host, srv.port), timeout=10)
        s.sendall(b'POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"pro')
        time.sleep(0.2)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # RST: the server's read fails with ConnectionResetError
        time.sleep(0.5)
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert "reset" in lines[0].getMessage().lower()


def test_engine_client_disconnect_is_not_an_error_in_the_log(
    model: Transformer, caplog: pytest.LogCaptureFixture
) -> None:
    """A streaming client that leaves is cancelled in the engine (its blocks come back)."""
    with Engine(model, num_blocks=256) as eng:
        with CompletionHTTPServer(eng, model_name="m", port=0) as srv:
            r = requests.post(
                srv.url + "/v1/completions",
                json={"prompt": tokens(8, 4), "max_tokens": 2000, "stream": True},
                stream=True,
                timeout=30,
            )
            next(r.iter_lines())
            r.close()
            deadline = time.monotonic() + 10
            while eng.num_free_blocks != eng.num_blocks and time.monotonic() < deadline:
                time.sleep(0.05)
            assert eng.num_free_blocks == eng.num_blocks
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
