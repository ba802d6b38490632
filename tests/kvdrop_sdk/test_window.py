"""Query windows through a real server (subprocess): stored and read back for exactly one call."""

from __future__ import annotations

import pytest
import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import connect
from kvdrop_sdk.errors import SDKError
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.testing.server import ServerHandle
from kvdrop_sdk.window import (
    QueryWindow,
    TokenScores,
    retrieve_scores,
    retrieve_window,
    store_scores,
    store_window,
)

Q_LAYOUT = CacheLayout(num_layers=2, num_heads=4, head_dim=8, dtype=torch.bfloat16)


def window(positions: list[int], lse: bool = True) -> QueryWindow:
    gen = torch.Generator().manual_seed(len(positions))
    rows = len(positions)
    q = torch.randn(1, 2, rows, 32, generator=gen).to(torch.bfloat16)
    norms = torch.randn(1, 2, rows, 4, generator=gen) if lse else None
    return QueryWindow(q, torch.tensor(positions), norms)


def test_store_and_retrieve_exactly_that_call(kv_server: ServerHandle, model_name: str) -> None:
    with connect(
        CacheKind.QUERY, kv_server.url, kv_server.http_url, model_name, layout=Q_LAYOUT
    ) as ctx:
        tokens = list(range(100, 140))
        w = window([0, 16, 30, 38])
        assert store_window(ctx, tokens, w, "salt")
        got = retrieve_window(ctx, tokens, "salt")
        assert got is not None and torch.equal(got.queries, w.queries)
        assert got.positions.tolist() == [0, 16, 30, 38] and torch.equal(got.lse, w.lse)
        # Another salt, one token more or less, another model: nothing.
        assert retrieve_window(ctx, tokens, "") is None
        assert retrieve_window(ctx, tokens[:-1], "salt") is None
        assert retrieve_window(ctx, [*tokens, 1], "salt") is None
        # A poorer record for the same call does not replace it; a window without lse is fine.
        assert not store_window(ctx, tokens, window([38], lse=False), "salt")
        assert retrieve_window(ctx, tokens, "salt").num_rows == 4
        assert store_window(ctx, tokens, window([38], lse=False), "other")
        assert retrieve_window(ctx, tokens, "other").lse is None


def test_bad_windows_are_refused(kv_server: ServerHandle, model_name: str) -> None:
    with connect(
        CacheKind.QUERY, kv_server.url, kv_server.http_url, model_name, layout=Q_LAYOUT
    ) as ctx:
        with pytest.raises(SDKError, match="past the call"):
            store_window(ctx, list(range(10)), window([3, 10]))
        with pytest.raises(SDKError, match="strictly increasing"):
            QueryWindow(torch.zeros(1, 2, 2, 32), torch.tensor([4, 4]))
        with pytest.raises(SDKError, match="expected"):
            store_window(
                ctx, list(range(10)), QueryWindow(torch.zeros(1, 2, 1, 32), torch.tensor([1]))
            )
    with connect(
        CacheKind.KV,
        kv_server.url,
        kv_server.http_url,
        model_name + "-kv",
        layout=CacheLayout(2, 1, 8, torch.float32),
    ) as kv:
        with pytest.raises(SDKError, match="query context"):
            retrieve_window(kv, [1, 2])


def test_token_scores_are_a_record_of_their_own(kv_server: ServerHandle, model_name: str) -> None:
    """Scores of a call are stored beside (not instead of) its query window, and read back
    exactly; a bad record is refused with what was expected."""
    with connect(
        CacheKind.QUERY, kv_server.url, kv_server.http_url, model_name, layout=Q_LAYOUT
    ) as ctx:
        tokens = list(range(200, 240))
        scores = TokenScores(torch.rand(2, 2, 32, generator=torch.Generator().manual_seed(1)))
        assert retrieve_scores(ctx, tokens, "s") is None
        assert store_window(ctx, tokens, window([0, 39]), "s")
        assert store_scores(ctx, tokens, scores, "s")
        got = retrieve_scores(ctx, tokens, "s")
        assert got is not None and torch.equal(got.scores, scores.scores)
        w = retrieve_window(ctx, tokens, "s")
        assert w is not None and w.positions.tolist() == [0, 39]
        assert retrieve_scores(ctx, tokens[:-1], "s") is None
        assert retrieve_scores(ctx, tokens, "") is None
        with pytest.raises(SDKError, match="heads dividing 4"):
            store_scores(ctx, tokens, TokenScores(torch.zeros(2, 3, 8)), "s")
        with pytest.raises(SDKError, match="the call has 40"):
            store_scores(ctx, tokens, TokenScores(torch.zeros(2, 4, 41)), "s")
        with pytest.raises(SDKError, match="float32"):
            TokenScores(torch.zeros(2, 4, 8, dtype=torch.float16))
