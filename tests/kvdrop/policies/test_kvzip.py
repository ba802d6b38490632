"""kvzip: scores from the engine's reconstruction pass, combined into one kept-token list; end to
end through a real kvdrop server (subprocess) and the reference engine."""

from __future__ import annotations

import pytest
import torch

import kvdrop
from kvdrop_engine.connectors.kvdrop import ServerConnector
from kvdrop_engine.engine import Engine
from kvdrop_engine.loading import preset_config
from kvdrop_engine.model import Transformer
from kvdrop_engine.reconstruct import ReconstructionPrompt
from kvdrop_sdk import CacheKind, kvcache, qcache
from kvdrop_sdk.edit import EditContext
from kvdrop_sdk.query_capture import QueryCapture
from kvdrop_sdk.request import create_request
from kvdrop_sdk.testing.server import spawn_server
from kvdrop_sdk.window import retrieve_scores

pytestmark = pytest.mark.timeout(600)


def _kv(layers: int, tokens: int) -> torch.Tensor:
    return torch.randn(2, layers, tokens, 8, generator=torch.Generator().manual_seed(0))


def test_scores_combine_max_over_heads_then_mean_over_layers() -> None:
    scores = torch.zeros(2, 2, 8)
    scores[0, 0, 5] = 0.9  # one head of one layer needs token 5
    scores[1, 1, 2] = 0.5
    scores[:, :, 7] = 0.3  # every head of every layer, a little
    fn = kvdrop.get("kvzip", keep_tokens=3, chunk_size=1, n_sink=0, rerotate=False)
    _, index = fn.select_indices(
        {CacheKind.KV: _kv(2, 8)}, list(range(8)), context=EditContext.of(8, token_scores=scores)
    )
    assert index.tolist() == [2, 5, 7]  # means 0.25, 0.45 and 0.3 beat zeros
    maxed = kvdrop.get(
        "kvzip", keep_tokens=1, chunk_size=1, n_sink=0, layer_agg="max", rerotate=False
    )
    _, index = maxed.select_indices(
        {CacheKind.KV: _kv(2, 8)}, list(range(8)), context=EditContext.of(8, token_scores=scores)
    )
    assert index.tolist() == [5]


def test_tokens_past_the_scored_ones_are_kept_and_layers_must_match() -> None:
    fn = kvdrop.get("kvzip", keep_tokens=2, chunk_size=1, n_sink=0, rerotate=False)
    kv = {CacheKind.KV: _kv(1, 6)}
    short = EditContext.of(6, token_scores=torch.full((1, 1, 4), 0.1))
    _, index = fn.select_indices(kv, list(range(6)), context=short)
    assert index.tolist() == [4, 5]  # decoded after the pass: scored as the largest attention
    with pytest.raises(kvdrop.PolicyInputError, match="2 layers but the KV has 1"):
        fn.select_indices(
            kv, list(range(6)), context=EditContext.of(6, token_scores=torch.zeros(2, 1, 6))
        )
    with pytest.raises(kvdrop.MissingTokenScoresError, match="LMCache server has no store"):
        fn(kv, list(range(6)))


def test_declares_its_need_and_compositions_forward_it() -> None:
    assert (
        kvdrop.get("kvzip").token_scores and not kvdrop.needs_of(kvdrop.get("kvzip")).reads_queries
    )
    assert kvdrop.get("streaming+kvzip").token_scores
    assert not kvdrop.get("snapkv").token_scores
    capture = QueryCapture.for_policies([kvdrop.get("knorm"), kvdrop.get("kvzip")])
    assert capture.scores and not capture.enabled and capture.uses_query_context
    assert not QueryCapture.for_policies([kvdrop.get("snapkv")]).scores


def test_kvzip_through_the_engine_and_a_real_server() -> None:
    """The prefill with reconstruct=true stores the pass's scores beside the window; modify
    hands them to kvzip, which keeps the best-scored tokens."""
    model = Transformer.random(preset_config("tiny"), seed=0)
    cfg = model.config
    prompt_ids = ReconstructionPrompt.synthetic(cfg.vocab_size, chunk_tokens=256)
    prompt = torch.randint(3, 500, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    with spawn_server(enable=["transfer_query"], chunk_size=256, l1_size_gb=0.1) as srv:
        conn = ServerConnector(srv.url, srv.http_url, "kvzip")
        with Engine(model, connector=conn, reconstruction=prompt_ids) as engine:
            kv_ctx = kvcache.connect(srv.url, srv.http_url, "kvzip")
            q_ctx = qcache.connect(srv.url, srv.http_url, "kvzip")
            stream = create_request([kv_ctx, q_ctx], engine.post_completion, prompt)
            stream.generate({"temperature": 0.0, "max_tokens": 1, "reconstruct": True})
            stats = engine.stats()
            assert stats.reconstructions == 1 and stats.reconstruction_tokens == 600
            found = retrieve_scores(q_ctx, stream.tokens, stream.active_cache_salt)
            assert found is not None
            assert found.scores.shape == (cfg.num_layers, cfg.num_kv_heads, 600)
            fn = kvdrop.get("kvzip", keep_ratio=0.5)
            result = stream.modify_kv(fn)
            assert (result.total_tokens, result.kept_tokens) == (512, 256)
            per_token = found.scores[:, :, :512].amax(1).mean(0)
            per_token[:4] = float("inf")  # n_sink
            best = sorted(torch.topk(per_token, 256).indices.tolist())
            assert stream.tokens[:256] == [prompt[i] for i in best]
            assert stream.generate({"temperature": 0.0, "max_tokens": 4}).output_tokens == 4
            kv_ctx.close()
            q_ctx.close()
        conn.close()


def test_reconstruct_needs_an_engine_that_can_run_it() -> None:
    model = Transformer.random(preset_config("tiny"), seed=0)
    with Engine(model) as engine:
        with pytest.raises(Exception, match="reconstruct=true needs an engine"):
            engine.generate([5, 6, 7], {"max_tokens": 1, "reconstruct": True})


def test_kernel_pools_each_layer_so_the_span_around_a_needed_token_is_kept() -> None:
    scores = torch.zeros(1, 1, 8)
    scores[0, 0, 4] = 1.0
    context = EditContext.of(8, token_scores=scores)
    kept = {}
    for kernel in (1, 3):
        fn = kvdrop.get(
            "kvzip", keep_tokens=3, chunk_size=1, n_sink=0, kernel=kernel, rerotate=False
        )
        kept[kernel] = fn.select_indices({CacheKind.KV: _kv(1, 8)}, list(range(8)), context=context)
    assert kept[1][1].tolist() == [0, 1, 4]  # ties among the zeros: the earlier tokens
    assert kept[3][1].tolist() == [3, 4, 5]  # max pooling over 3 tokens keeps 4's neighbours


def test_vote_keeps_the_tokens_most_heads_need_over_one_head_that_needs_one_more() -> None:
    """select='vote' (KVzipPress's one budget over every head and layer): token 2 holds a
    top entry in three of four heads, token 5 the largest score of one head only. The pooled
    rule (max over heads, mean over layers) ranks 5 first; the vote ranks 2 first."""
    scores = torch.zeros(2, 2, 8)
    scores[0, 0, 5] = 1.0
    scores[0, 0, 2] = scores[0, 1, 2] = scores[1, 0, 2] = 0.3
    scores[1, 1, 6] = 0.2
    context = EditContext.of(8, token_scores=scores)
    kept = {}
    for select in ("pool", "vote"):
        fn = kvdrop.get("kvzip", keep_tokens=1, chunk_size=1, n_sink=0, select=select)
        kept[select] = fn.select_indices(
            {CacheKind.KV: _kv(2, 8)}, list(range(8)), context=context
        )[1].tolist()
    assert kept == {"pool": [5], "vote": [2]}
    # Tokens decoded after the pass outrank every vote; budget 2 x 2 x 2 = 8 entries.
    fn = kvdrop.get("kvzip", keep_tokens=2, chunk_size=1, n_sink=0, select="vote")
    short = EditContext.of(10, token_scores=scores)
    _, index = fn.select_indices({CacheKind.KV: _kv(2, 10)}, list(range(10)), context=short)
    assert index.tolist() == [8, 9]
