"""run_pipeline's decode modes against a REAL server and the reference engine (tiny random model):
continue after the prefill's token (upstream's way), decode fresh from the (edited) prompt, and
append a suffix after the edit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.experiments.prompts import Prompt
from kvdrop.experiments.runner import run_pipeline
from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer, generate
from kvdrop_sdk import kvcache
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.edit import EditContext, accepts_edit_context
from kvdrop_sdk.testing.server import ServerHandle, spawn_server

CHUNK = 16
GREEDY = {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True}
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    with spawn_server(chunk_size=CHUNK) as handle:
        yield handle


@pytest.fixture(scope="module")
def setup(server: ServerHandle) -> Iterator[tuple[Transformer, Engine, Any]]:
    model = Transformer.random(preset_config("tiny"), seed=0)
    conn = ServerConnector(server.url, server.http_url, "pipeline-model")
    engine = Engine(model, num_blocks=256, connector=conn).start()
    ctx = kvcache.connect(server.url, server.http_url, "pipeline-model")
    try:
        yield model, engine, ctx
    finally:
        engine.stop()
        ctx.close()
        conn.close()


def prompts(n: int, length: int, seed: int) -> list[Prompt]:
    gen = torch.Generator().manual_seed(seed)
    return [Prompt(torch.randint(3, 512, (length,), generator=gen).tolist()) for _ in range(n)]


def test_default_decode_continues_after_the_prefill_token(setup: Any) -> None:
    model, engine, ctx = setup
    ps = prompts(2, 40, 1)
    run = run_pipeline("base", engine, [ctx], ps, GREEDY, cache_salt="base")
    for p, prompt, out in zip(ps, run.decode_prompts, run.outputs):
        assert prompt[:-1] == p.token_ids and len(prompt) == len(p.token_ids) + 1
        # the outputs are the prefill's token (from the full cache) and 5 decoded after it
        assert out == generate(model, p.token_ids, 6, stop_at_eos=False)
        assert out[0] == prompt[-1]


def test_fresh_decode_starts_from_the_prompt(setup: Any) -> None:
    model, engine, ctx = setup
    ps = prompts(2, 40, 2)
    run = run_pipeline("fresh", engine, [ctx], ps, GREEDY, cache_salt="fresh", fresh_decode=True)
    for p, prompt, out in zip(ps, run.decode_prompts, run.outputs):
        assert prompt == p.token_ids
        assert out == generate(model, p.token_ids, 5, stop_at_eos=False)


def test_suffixes_follow_the_edited_prompt(setup: Any) -> None:
    model, engine, ctx = setup
    ps = prompts(2, 4 * CHUNK + 3, 3)
    suffixes = [[7, 8, 9], [10]]
    policy = kvdrop.get("knorm", keep_ratio=0.5, chunk_size=CHUNK)
    run = run_pipeline(
        "edit", engine, [ctx], ps, GREEDY, modify_fn=policy, cache_salt="edit", suffixes=suffixes
    )
    assert run.modify is not None and run.modify["kept_tokens"] == 2 * 2 * CHUNK
    for p, prompt, suffix in zip(ps, run.decode_prompts, suffixes):
        # kept chunk-aligned prefix, then the uncached tail of the prompt, then the suffix
        assert len(prompt) == 2 * CHUNK + 3 + len(suffix)
        assert prompt[-len(suffix) :] == suffix
        assert prompt[2 * CHUNK : 2 * CHUNK + 3] == p.token_ids[-3:]
        assert set(prompt[: 2 * CHUNK]) <= set(p.token_ids[: 4 * CHUNK])
    # The decode loaded both edits from the server (not recomputed from the kept tokens).
    assert run.engine["tokens_loaded"] == 2 * 2 * CHUNK
    # Each edit lives under its stream's own salt, which the run reports for later readers
    # (kvdrop eval's fidelity scoring loads the edited prefix through it).
    assert len(set(run.decode_salts)) == 2 and all(".edit." in s for s in run.decode_salts)
    for prompt, salt in zip(run.decode_prompts, run.decode_salts):
        assert engine.connector.lookup(prompt, salt) == 2 * CHUNK
    # Without an edit the suffix simply follows the prompt.
    run = run_pipeline("plain", engine, [ctx], ps, GREEDY, cache_salt="plain", suffixes=suffixes)
    for p, prompt, suffix, out in zip(ps, run.decode_prompts, suffixes, run.outputs):
        assert prompt == p.token_ids + suffix
        assert out == generate(model, prompt, 5, stop_at_eos=False)


def test_one_suffix_per_prompt(setup: Any) -> None:
    _, engine, ctx = setup
    with pytest.raises(ValueError, match="1 suffixes for 2 prompts"):
        run_pipeline("bad", engine, [ctx], prompts(2, 20, 4), GREEDY, suffixes=[[1]])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
def test_modify_device_is_where_every_edit_runs(setup: Any, device: str) -> None:
    """``modify_device`` reaches ``batch.modify(device=)``: each edit gets the KV there and the
    edit context names it (a GPU: by DMA; ``tests/kvdrop_sdk/test_stream_contexts.py``)."""
    _, engine, ctx = setup
    seen: list[tuple[str, str | None]] = []
    policy = kvdrop.get("knorm", keep_ratio=0.5, chunk_size=CHUNK)

    @accepts_edit_context
    def spy(tensors: Any, toks: Any, *, context: EditContext) -> Any:
        seen.append((tensors[CacheKind.KV].device.type, context.device))
        return policy(tensors, toks, context=context)

    ps = prompts(2, 4 * CHUNK + 3, 5)
    salt = f"on-{device}"
    run = run_pipeline(
        "dev", engine, [ctx], ps, GREEDY, modify_fn=spy, cache_salt=salt, modify_device=device
    )
    assert run.modify is not None and run.modify["kept_tokens"] == 2 * 2 * CHUNK
    assert seen == [(device, device)] * 2
