"""kvdrop's pipeline on a REAL LMCache server: a batch of request streams through prefill ->
modify (snapkv, chunk-halving) -> decode on the reference engine, the same run on a kvdrop server
for comparison, ``kvdrop engine --cache-server lmcache`` over HTTP under ``lmcache.sdk``, and
``kvdrop demo --cache-server lmcache``."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests

import kvdrop
from kvdrop.cli import main
from kvdrop.experiments.prompts import random_prompts
from kvdrop.experiments.runner import RunResult, kept_count, run_pipeline
from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_sdk import kvcache, qcache
from kvdrop_sdk.query_capture import QueryCapture, QueryNeed
from kvdrop_sdk.testing.server import spawn_server, stop_process

pytestmark = pytest.mark.timeout(600)
CHUNK = 256
SAMPLING = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


def run_both(policy_name: str, lmcache_server: Any) -> tuple[RunResult, RunResult]:
    """The same dropped run (same model, prompts, policy) on the LMCache server and on a kvdrop
    server: ``(on_lmcache, on_kvdrop)``."""
    from kvdrop_engine.connectors.lmcache import LMCacheConnector, connect_sdk

    model = Transformer.random(preset_config("tiny"), seed=11)
    cfg = model.config
    params: dict[str, Any] = {"keep_ratio": 0.5, "chunk_size": CHUNK}
    if "head_dim" in {p.name for p in kvdrop.describe(policy_name).params}:
        params["head_dim"] = cfg.head_dim
    policy = kvdrop.get(policy_name, rerotate=cfg.rope, **params)
    prompts = random_prompts(cfg.vocab_size, 3, 3 * CHUNK + 20, seed=4)
    name = f"lmc-pipe-{uuid.uuid4().hex[:8]}"
    results = []
    for backend in ("lmcache", "kvdrop"):
        with contextlib.ExitStack() as stack:
            if backend == "lmcache":
                url, http_url = lmcache_server.url, lmcache_server.http_url
                conn: Any = LMCacheConnector(url, http_url, name)
            else:
                srv = stack.enter_context(
                    spawn_server(enable=["transfer_query"], chunk_size=CHUNK, l1_size_gb=0.05)
                )
                url, http_url = srv.url, srv.http_url
                # The full query mode, LMCache's: every prompt query in chunks.
                conn = ServerConnector(url, http_url, name, queries=QueryCapture(QueryNeed.FULL))
            stack.callback(conn.close)
            engine = stack.enter_context(Engine(model, num_blocks=512, connector=conn))
            if backend == "lmcache":  # lmcache.sdk's contexts under kvdrop's batch
                contexts = connect_sdk(url, http_url, name, query=True)
            else:
                contexts = [
                    kvcache.connect(url, http_url, name),
                    qcache.connect(url, http_url, name),
                ]
            for ctx in contexts:
                stack.callback(ctx.close)

            # A plain upstream-style edit function: both servers hand it the same chunk queries
            # (a kvdrop server's window rows of the uncached tail go only to functions that take
            # the edit context, so kvdrop.get's policy itself would see more there).
            def modify_fn(tensors: Any, tokens: list[int]) -> Any:
                return policy(tensors, tokens)

            kwargs = {"modify_fn": modify_fn, "cache_salt": policy_name}
            results.append(run_pipeline(backend, engine, contexts, prompts, SAMPLING, **kwargs))
    return results[0], results[1]


# Short prompts of whole chunks: alignment keeps less than asked and says so once (expected).
@pytest.mark.filterwarnings("ignore:.*chunk alignment keeps:kvdrop.errors.PolicyWarning")
@pytest.mark.parametrize("policy_name", ["snapkv", "chunk-halving"])
def test_batch_prefill_modify_decode_on_lmcache(policy_name: str, lmcache_server: Any) -> None:
    on_lmcache, on_kvdrop = run_both(policy_name, lmcache_server)
    n, cached = 3, 3 * CHUNK
    expected_kept = kept_count(cached, 0.5, CHUNK)  # 384 tokens floored to one chunk
    assert expected_kept == CHUNK
    for result in (on_lmcache, on_kvdrop):
        assert result.modify is not None
        assert result.modify["num_requests"] == n and result.modify["total_tokens"] == n * cached
        assert result.modify["kept_tokens"] == n * expected_kept
        # Decode read every edited cache: it loaded exactly the kept tokens and computed only
        # the suffix (the 20-token prompt tail + the prefill's token), then 5 more tokens each.
        assert result.engine["tokens_loaded"] == n * expected_kept
        assert result.engine["prefill_tokens_computed"] == n * 21
        assert result.decode_prompt_lengths == [expected_kept + 21] * n
    # Same model, same prompts, same policy: both servers give the same tokens.
    assert on_lmcache.outputs == on_kvdrop.outputs and any(on_lmcache.outputs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Short prompts of whole chunks: alignment keeps less than asked and says so once (expected).
@pytest.mark.filterwarnings("ignore:.*chunk alignment keeps:kvdrop.errors.PolicyWarning")
@pytest.mark.filterwarnings("ignore:.*kept keys stay at their old RoPE:kvdrop.errors.PolicyWarning")
def test_engine_cli_on_lmcache_under_lmcache_sdk(lmcache_server: Any, tmp_path: Path) -> None:
    """`kvdrop engine --cache-server lmcache` over HTTP, driven by upstream's own SDK batch with a
    kvdrop policy: the vLLM + LMCache setup with kvdrop's engine in vLLM's place."""
    import lmcache.sdk as lmc_sdk
    import lmcache.sdk.batch as lmc_batch
    import lmcache.sdk.request as lmc_request

    from kvdrop_sdk.adapters.openai import make_post_completion

    port, name = free_port(), f"lmc-cli-{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / "engine.log"
    flags = ["--random-preset", "tiny", "--return-tokens-as-token-ids", "--served-model-name"]
    flags += [name, "--cache-server", "lmcache", "--url", lmcache_server.url]
    flags += ["--http-url", lmcache_server.http_url, "--port", str(port)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvdrop", "engine", *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text(errors="replace")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.exceptions.ConnectionError:
                pass
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.2)
        assert "lmcache KV store" in log_path.read_text(errors="replace")
        kv_ctx = lmc_sdk.kvcache.connect(lmcache_server.url, lmcache_server.http_url, name, 30)
        q_ctx = lmc_sdk.qcache.connect(lmcache_server.url, lmcache_server.http_url, name, 30)
        post = make_post_completion(url, name, timeout=60)
        prompts = [[(k * 131 + i * 7) % 500 + 3 for i in range(800)] for k in range(2)]
        batch = lmc_batch.LMCacheBatchedStream()
        for p in prompts:
            batch.add(lmc_request.create_request([kv_ctx, q_ctx], post, p))
        batch.prefill({"temperature": 0}, fmt="json")
        batch.modify(kvdrop.get("snapkv", keep_ratio=0.5, head_dim=16), fmt="json")
        batch.decode({"temperature": 0, "max_tokens": 4, "ignore_eos": True}, fmt="json")
        for stream in batch.request_streams.values():
            assert stream.decoded_tokens == 5 and len(stream.tokens) == 256 + 32 + 1 + 4
        stats = requests.get(url + "/stats", timeout=10).json()
        assert stats["tokens_loaded"] == 2 * 256  # decode read each stream's kept chunk
        kv_ctx.close()
        q_ctx.close()
        assert stop_process(proc, 15, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_on_lmcache(lmcache_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--cache-server", "lmcache", "--url", lmcache_server.url]
    argv += ["--http-url", lmcache_server.http_url, "--random-preset", "tiny"]
    argv += ["--num-requests", "4", "--prompt-tokens", "600", "--max-tokens", "4"]
    argv += ["--policy", "snapkv", "--no-progress", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["setup"]["cache_server"] == "lmcache"
    # Of the whole sequence: 256 kept of 512 cached, the 88-token tail and the prefill's token.
    assert report["summary"]["kept_fraction"] == pytest.approx((256 + 88 + 1) / 601, abs=1e-3)
    assert report["dropped"]["engine"]["tokens_loaded"] == 4 * 256  # kept halves of 2 chunks
    assert report["baseline"]["decode"]["metrics"]["results"]["output_tokens"] == 16
