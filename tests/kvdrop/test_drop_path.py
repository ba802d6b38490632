"""The drop path end to end at the defaults: kvdrop policies, the SDK, a real kvdrop server
(subprocess) and the reference engine. Kept keys are re-rotated without being told; a request is
edited, decoded and edited again with every query policy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

import kvdrop
from kvdrop.rope import rerotate_keys
from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_sdk import kvcache, qcache
from kvdrop_sdk.adapters.openai import make_post_completion
from kvdrop_sdk.edit import EditContext, accepts_edit_context
from kvdrop_sdk.request import create_request
from kvdrop_sdk.testing.server import spawn_server, stop_process

pytestmark = pytest.mark.timeout(600)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def recording(fn: kvdrop.Policy) -> tuple[Any, list[dict[str, Any]]]:
    """``fn`` behind a spy that records what the SDK hands it (the spy changes nothing)."""
    seen: list[dict[str, Any]] = []

    @accepts_edit_context
    def spy(
        tensors: Mapping[Any, torch.Tensor], toks: Sequence[int], *, context: EditContext
    ) -> tuple[torch.Tensor, list[int]]:
        seen.append({"tensors": dict(tensors), "tokens": list(toks), "context": context})
        return fn(tensors, toks, context=context)

    spy.queries = fn.queries  # type: ignore[attr-defined]  # what the SDK reads
    return spy, seen


def test_readme_snapkv_example_rerotates_through_the_reference_engine() -> None:
    """``kvdrop.get("snapkv", keep_ratio=0.5)``, nothing else: the engine registered its RoPE with
    the layout, so the kept keys the server holds afterwards sit at positions 0..k-1."""
    model = Transformer.random(preset_config("tiny"), seed=0)
    rope = model.config.rope
    with spawn_server(enable=["transfer_query"], chunk_size=256, l1_size_gb=0.1) as srv:
        conn = ServerConnector(srv.url, srv.http_url, "readme")
        with Engine(model, connector=conn) as engine:
            kv_ctx = kvcache.connect(srv.url, srv.http_url, "readme")
            q_ctx = qcache.connect(srv.url, srv.http_url, "readme")
            prompt = tokens(900, seed=1)
            stream = create_request([kv_ctx, q_ctx], engine.post_completion, prompt)
            stream.generate({**GREEDY, "max_tokens": 1})
            original = kv_ctx.retrieve(prompt)
            assert original is not None and original.shape[2] == 768
            fn, seen = recording(kvdrop.get("snapkv", keep_ratio=0.5))
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "kept keys stay at their old positions"
                result = stream.modify_kv(fn)
            context = seen[0]["context"]
            assert context.rope == rope.to_json() and context.head_dim == 16
            assert context.prompt_tokens == 901 and context.query_lse is not None
            # The observation window is the prompt's last 64 tokens, tail included.
            assert context.query_positions[-64:].tolist() == list(range(836, 900))
            # Half of the 768 cached tokens, aligned down to one chunk; the 133-token tail stays.
            assert (result.total_tokens, result.kept_tokens) == (768, 256)
            assert result.kept_fraction == pytest.approx((256 + 133) / 901)
            _, index = kvdrop.get("snapkv", keep_ratio=0.5).select_indices(
                seen[0]["tensors"], seen[0]["tokens"], context=context
            )
            kept = stream.tokens[:256]
            assert kept == [prompt[i] for i in index.tolist()]
            edited = kv_ctx.retrieve(kept, stream.active_cache_salt)
            assert edited is not None
            expected = rerotate_keys(original[0][:, index], index, torch.arange(256), rope)
            torch.testing.assert_close(edited[0], expected)
            assert torch.equal(edited[1], original[1][:, index])
            out = stream.generate({**GREEDY, "max_tokens": 4})
            assert out.output_tokens == 4
            kv_ctx.close()
            q_ctx.close()
        conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_engine(tmp: Path, *flags: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    log = tmp / f"engine-{port}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvdrop", "engine", "--port", str(port), *flags],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"engine exited {proc.returncode}:\n{log.read_text()}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except requests.exceptions.ConnectionError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"engine not healthy:\n{log.read_text()}")


def test_edited_before_and_after_64_decoded_tokens_with_every_query_policy(
    tmp_path: Path,
) -> None:
    """snapkv, rkv and h2o: prefill, edit, decode 64 tokens, edit again, decode; the second
    edit observes the generated tokens' queries, drops from their KV, keeps the protected
    prefix, and the request decodes on from a contiguous, re-rotated cache."""
    chunk, protected = 32, 8
    with spawn_server(enable=["transfer_query"], chunk_size=chunk, l1_size_gb=0.1) as srv:
        proc, url, _ = start_engine(
            tmp_path,
            "--random-preset",
            "tiny",
            "--return-tokens-as-token-ids",
            "--kvdrop-url",
            srv.url,
            "--kvdrop-http-url",
            srv.http_url,
            "--kv-budget-tokens",
            "8192",
            "--store-decoded-kv",
        )
        try:
            kv_ctx = kvcache.connect(srv.url, srv.http_url, "random-tiny")
            q_ctx = qcache.connect(srv.url, srv.http_url, "random-tiny")
            post = make_post_completion(url, "random-tiny", timeout=120)
            for seed, name in enumerate(("snapkv", "rkv", "h2o")):
                prompt = tokens(300, seed=10 + seed)
                stream = create_request([kv_ctx, q_ctx], post, prompt, protected_tokens=protected)
                fn, seen = recording(kvdrop.get(name, keep_ratio=0.5, chunk_size=chunk))
                stream.generate({**GREEDY, "max_tokens": 1})
                first = stream.modify_kv(fn)
                # 301 tokens, 288 cached: half of them aligned down to 128; the tail of 13 stays.
                assert (first.total_tokens, first.kept_tokens) == (288, 128), name
                assert stream.tokens[:protected] == prompt[:protected]
                stream.generate({**GREEDY, "max_tokens": 64})
                n = len(stream.tokens)  # 128 kept + 13 + 64
                assert n == 205
                second = stream.modify_kv(fn)
                ctx = seen[1]["context"]
                # The engine stored the KV of the chunks the generated tokens completed (192),
                # and the queries of the last 64 computed tokens: generated ones included.
                assert second.total_tokens == 192 and ctx.prompt_tokens == n, name
                assert ctx.positions.tolist() == list(range(192))
                qpos = ctx.query_positions.tolist()
                assert qpos[-64:] == list(range(n - 65, n - 1)), name
                assert ctx.query_lse is not None and ctx.rope is not None
                assert second.kept_tokens == 96 and stream.tokens[:protected] == prompt[:protected]
                assert second.suffix_tokens == n - 192
                after = stream.generate({**GREEDY, "max_tokens": 8})
                assert after.output_tokens == 8 and after.input_tokens == 96 + n - 192
                assert len(stream.generated_tokens) == 1 + 64 + 8
            kv_ctx.close()
            q_ctx.close()
            assert stop_process(proc, signal.SIGTERM, 30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
