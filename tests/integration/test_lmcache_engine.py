"""The reference engine's LMCache backend against a REAL ``lmcache server``: registration, KV and
query stores, prefix loads, windowed transfers, and what the SDKs of both projects read back."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_sdk.errors import SDKError
from kvdrop_sdk.testing.server import spawn_server

CHUNK = 256
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.random(preset_config("tiny"), seed=3)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def name() -> str:
    return f"lmc-engine-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def connector(lmcache_server: Any) -> Iterator[Any]:
    from kvdrop_engine.connectors.lmcache import LMCacheConnector

    conn = LMCacheConnector(lmcache_server.url, lmcache_server.http_url, name())
    yield conn
    conn.close()


def test_prefill_stores_kv_and_queries_the_sdk_reads_back(
    lmcache_server: Any, model: Transformer, connector: Any
) -> None:
    from kvdrop_engine.connectors.lmcache import connect_sdk

    p = prompt(2 * CHUNK + 40, seed=1)
    with Engine(model, num_blocks=128, connector=connector) as eng:
        assert connector.chunk_size == CHUNK and connector.transfer_query
        first = eng.generate(p, GREEDY)
        st = eng.stats()
        assert (st.kv_tokens_stored, st.query_tokens_stored, st.tokens_loaded) == (512, 512, 0)
        assert connector.lookup(p) == 512 and connector.lookup_queries(p) == 512
        assert connector.lookup(p, cache_salt="other") == 0
        kv = connector.load(p)
        assert kv is not None and tuple(kv.shape) == (2, 2, 512, 2 * 16)
        # lmcache.sdk reads the same bytes (HND [2, L, T, Hkv*d]) and all query heads.
        kv_ctx, q_ctx = connect_sdk(
            lmcache_server.url, lmcache_server.http_url, connector.model_name, query=True
        )
        try:
            assert torch.equal(kv_ctx.retrieve(p), kv)
            q = q_ctx.retrieve(p)
            assert tuple(q.shape) == (1, 2, 512, 4 * 16) and q.abs().sum() > 0
        finally:
            kv_ctx.close()
            q_ctx.close()
        # The second run loads the cached prefix and decodes exactly as the first.
        assert eng.generate(p, GREEDY) == first
        assert eng.stats().tokens_loaded == 512
    with Engine(model, num_blocks=128) as plain:
        assert plain.generate(p, GREEDY) == first  # the same as computing everything


def test_store_and_load_are_bit_exact_across_windows(lmcache_server: Any) -> None:
    from kvdrop_engine.connectors.lmcache import LMCacheConnector, connect_sdk

    cfg = preset_config("tiny")
    # A staging area of one chunk: every 4-chunk transfer runs in 4 windows.
    conn = LMCacheConnector(lmcache_server.url, lmcache_server.http_url, name(), staging_tokens=300)
    with conn:
        conn.bind(cfg, torch.bfloat16)
        toks = prompt(4 * CHUNK + 7, seed=2)
        gen = torch.Generator().manual_seed(0)
        kv = torch.randn(2, 2, 4 * CHUNK, 32, generator=gen).to(torch.bfloat16)
        q = torch.randn(1, 2, 4 * CHUNK, 64, generator=gen).to(torch.bfloat16)
        assert conn.store(kv, q, toks) == 4 * CHUNK
        loaded = conn.load(toks)
        assert loaded is not None and torch.equal(loaded, kv)
        # A prompt sharing the first two chunks stores only its own queries (query_offset).
        other = toks[: 2 * CHUNK] + prompt(2 * CHUNK, seed=3)
        kv2 = torch.cat([kv[:, :, : 2 * CHUNK], kv[:, :, : 2 * CHUNK] + 1], dim=2)
        q2 = q[:, :, : 2 * CHUNK] - 1
        assert conn.store(kv2, q2, other, query_offset=2 * CHUNK) == 4 * CHUNK
        assert conn.lookup_queries(other) == 4 * CHUNK
        kv_ctx, q_ctx = connect_sdk(
            lmcache_server.url, lmcache_server.http_url, conn.model_name, query=True
        )
        try:
            assert torch.equal(kv_ctx.retrieve(other), kv2)
            got_q = q_ctx.retrieve(other)
            assert torch.equal(got_q[:, :, : 2 * CHUNK], q[:, :, : 2 * CHUNK])
            assert torch.equal(got_q[:, :, 2 * CHUNK :], q2)
        finally:
            kv_ctx.close()
            q_ctx.close()
        assert conn.load(toks[:200]) is None  # shorter than a chunk
        assert conn.store(kv[:, :, :100], None, toks[:100]) == 0


def test_no_transfer_query_means_kv_only(lmcache_server: Any, model: Transformer) -> None:
    from kvdrop_engine.connectors.lmcache import LMCacheConnector

    conn = LMCacheConnector(
        lmcache_server.url, lmcache_server.http_url, name(), transfer_query=False
    )
    with Engine(model, num_blocks=128, connector=conn) as eng:
        p = prompt(CHUNK + 3, seed=4)
        eng.generate(p, GREEDY)
        assert not conn.transfer_query and conn.lookup_queries(p) == 0 and conn.lookup(p) == CHUNK
    conn.close()


def test_the_two_servers_are_told_apart(lmcache_server: Any) -> None:
    import kvdrop_sdk
    from kvdrop_engine.connectors.lmcache import LMCacheConnector

    # kvdrop_sdk pointed at an LMCache server says what it is and what to use instead.
    with pytest.raises(SDKError, match=r"is an LMCache server.*lmcache\.sdk\.kvcache\.connect"):
        kvdrop_sdk.kvcache.connect(lmcache_server.url, lmcache_server.http_url, "m", 10)
    with pytest.raises(SDKError, match=r"lmcache\.sdk\.qcache\.connect"):
        kvdrop_sdk.qcache.connect(lmcache_server.url, lmcache_server.http_url, "m", 10)
    # And the LMCache backend pointed at a kvdrop server.
    with spawn_server(l1_size_gb=0.01) as srv:
        conn = LMCacheConnector(srv.url, srv.http_url, "m")
        with pytest.raises(SDKError, match="looks like a kvdrop server: use --cache-server kvdrop"):
            conn.bind(preset_config("tiny"), torch.float32)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        LMCacheConnector("localhost:1", lmcache_server.http_url, "m")
