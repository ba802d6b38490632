"""Every kvdrop policy as the edit function of the REAL ``lmcache.sdk`` batched stream, against a
real LMCache server with ``--enable transfer_query`` (the reference engine prefills and stores KV
and queries through its LMCache backend): kept counts chunk aligned, stored back, read back
bit-exactly, and decode continues on the kept tokens."""

from __future__ import annotations

import random
import re
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer

CHUNK = 256
LENGTHS = (4 * CHUNK + 40, 5 * CHUNK + 3)  # 4 and 5 whole chunks: a 50% budget of 2 chunks

# Every registered policy, the bare combinators as a spec of their own, and the cases.
BARE = {
    "compose": "streaming+snapkv",
    "chunk": "chunk(policy=snapkv)",
    "budget": "budget(policy=knorm)",
}
CASES = list(dict.fromkeys([*(BARE.get(n, n) for n in kvdrop.available()), "snapkv+rerotate"]))


@dataclass
class Setup:
    engine: Engine
    contexts: list[Any]
    cfg: Any


@pytest.fixture(scope="module")
def setup(lmcache_server: Any) -> Iterator[Setup]:
    from kvdrop_engine.connectors.lmcache import LMCacheConnector, connect_sdk

    model = Transformer.random(preset_config("tiny"), seed=5)
    model_name = f"lmc-sdk-{uuid.uuid4().hex[:8]}"
    conn = LMCacheConnector(lmcache_server.url, lmcache_server.http_url, model_name)
    engine = Engine(model, num_blocks=512, connector=conn).start()
    contexts = connect_sdk(lmcache_server.url, lmcache_server.http_url, model_name, query=True)
    try:
        yield Setup(engine, contexts, model.config)
    finally:
        for ctx in contexts:
            ctx.close()
        engine.stop()
        conn.close()


def build(case: str, cfg: Any) -> Any:
    params = {"keep_ratio": 0.5, "chunk_size": CHUNK}
    name = "snapkv" if case == "snapkv+rerotate" else case
    if "head_dim" in {p.name for p in kvdrop.describe(name).params}:
        params["head_dim"] = cfg.head_dim
    return kvdrop.get(name, rerotate=cfg.rope if case == "snapkv+rerotate" else None, **params)


# lmcache.sdk registers no RoPE with the layout: a re-rotating policy says so once (expected here).
@pytest.mark.filterwarnings("ignore:.*kept keys stay at their old RoPE:kvdrop.errors.PolicyWarning")
@pytest.mark.parametrize("case", CASES)
def test_policy_inside_lmcache_sdk_batch(case: str, setup: Setup) -> None:
    import lmcache.sdk.batch as lmc_batch
    import lmcache.sdk.request as lmc_request
    from lmcache.sdk.cache_kind import LMCacheSDKCacheKind

    policy = build(case, setup.cfg)
    if policy.token_scores:
        # kvzip reads the kvdrop engine's reconstruction scores, which LMCache cannot store:
        # inside lmcache.sdk it fails with the one error that says so.
        # Four chunks: over the 50% budget, so the policy must score (one chunk is kept whole).
        kv = torch.randn(2, setup.cfg.num_layers, 4 * CHUNK, setup.cfg.kv_dim)
        with pytest.raises(kvdrop.MissingTokenScoresError, match="LMCache server has no store"):
            policy({"kv": kv}, list(range(4 * CHUNK)))
        return
    needs_query = kvdrop.describe(
        "snapkv" if case == "snapkv+rerotate" else case
    ).needs.reads_queries
    seen: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}

    def edit(tensors: Any, tokens: Any) -> tuple[torch.Tensor, Any]:
        # LMCache hands its own enum as keys, and query tensors [1, L, T, Hq*d] with them.
        assert set(tensors) == {LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY}
        q = tensors[LMCacheSDKCacheKind.QUERY]
        assert tuple(q.shape) == (1, 2, len(tokens), 64) and q.abs().sum() > 0
        kv, kept = policy(tensors, tokens)
        seen[tuple(tokens)] = (kv, list(kept))
        return kv, kept

    rng = random.Random(zlib.crc32(case.encode()))
    salt = f"policy-{case}"
    batch = lmc_batch.LMCacheBatchedStream()
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    for p in prompts:
        batch.add(lmc_request.create_request(setup.contexts, setup.engine, p, salt))
    batch.prefill({"temperature": 0.0}, fmt="json")
    batch.modify(edit, fmt="json")
    assert len(seen) == len(prompts), f"{case}: needs_query={needs_query}"
    kv_ctx = setup.contexts[0]
    for stream, p in zip(batch.request_streams.values(), prompts, strict=True):
        cached = len(p) // CHUNK * CHUNK
        new_kv, kept = seen[tuple(p[:cached])]
        assert len(kept) % CHUNK == 0 and 0 < len(kept) < cached, (case, len(kept))
        assert stream.tokens == kept  # upstream: the stream now stands for the kept tokens
        assert torch.equal(kv_ctx.retrieve(kept, salt), new_kv)  # stored, read back bit-exactly
    before = setup.engine.stats().tokens_loaded
    batch.decode({"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}, fmt="json")
    kept_total = sum(len(k) for _, k in seen.values())
    assert setup.engine.stats().tokens_loaded - before == kept_total  # decode read the edits
    for stream in batch.request_streams.values():
        assert stream.decoded_tokens == 3


def test_the_lmcache_docs_examples_run(
    lmcache_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/lmcache.md's python blocks, each alone (as the page promises), against the session's
    LMCache server."""
    doc = (Path(__file__).parents[2] / "docs" / "lmcache.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    where = (
        'URL, HTTP_URL, MODEL = "tcp://127.0.0.1:6555", "http://127.0.0.1:8080", "kvdrop-docs-tiny"'
    )
    assert len(blocks) == 2 and all(block.count(where) == 1 for block in blocks)
    for block in blocks:
        model = f"docs-{uuid.uuid4().hex[:8]}"
        block = block.replace(
            where,
            f"URL, HTTP_URL, MODEL = {lmcache_server.url!r}, {lmcache_server.http_url!r}, "
            f"{model!r}",
        )
        exec(compile(block, "docs/lmcache.md", "exec"), {"__name__": "docs_lmcache"})
    out = capsys.readouterr().out
    for n in (461, 405, 605):
        assert f"kept + tail + generated = {n}, decoded 17" in out
    assert out.strip().splitlines()[-1] == "512 1280 512"
