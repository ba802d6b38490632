"""What a request stream reads of the queries follows the capture its query context was told:
counted in the real server's calls (subprocess), per modify."""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import connect
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.query_capture import QueryCapture, QueryNeed
from kvdrop_sdk.request import create_request
from kvdrop_sdk.testing.server import ServerHandle, spawn_server
from kvdrop_sdk.testing.toy import ToyEngine, encode_rows
from kvdrop_sdk.window import QueryWindow, store_window

CHUNK = 16
KV_LAYOUT = CacheLayout(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float32)
Q_LAYOUT = CacheLayout(num_layers=2, num_heads=4, head_dim=4, dtype=torch.float32)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    with spawn_server(chunk_size=CHUNK, l1_size_gb=0.05, enable=["transfer_query"]) as handle:
        yield handle


class DropSecondChunk:
    """An edit function declaring what it reads (as a kvdrop policy does): a query window."""

    accepts_edit_context = True
    queries = QueryNeed.WINDOW
    token_scores = False

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def __call__(
        self, tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], *, context: Any
    ) -> tuple[torch.Tensor, list[int]]:
        self.seen = {"query": tensors.get(CacheKind.QUERY), "context": context}
        kv = tensors[CacheKind.KV]
        keep = [i for i in range(kv.shape[2]) if i // CHUNK != 1]
        return kv[:, :, keep], [tokens[i] for i in keep]


def query_calls(server: ServerHandle) -> Counter[str]:
    """The server's answered calls on the query store, by op."""
    calls = server.status()["calls"]
    return Counter({k.split("/")[0]: v for k, v in calls.items() if k.endswith("/query")})


def modify_counting(server: ServerHandle, mode: QueryNeed) -> tuple[Counter[str], Any]:
    """Prefill a prompt (its chunk queries stored by the engine), store the call's window, then
    count the query calls of one modify through a query context told ``mode``."""
    model = f"toy-{uuid.uuid4().hex[:8]}"
    engine = ToyEngine.connect(
        server.url, server.http_url, model, KV_LAYOUT, query_layout=Q_LAYOUT, default_max_tokens=1
    )
    capture = QueryCapture(mode)
    kv_ctx = connect(CacheKind.KV, server.url, server.http_url, model)
    q_ctx = connect(CacheKind.QUERY, server.url, server.http_url, model, capture=capture)
    try:
        rng = random.Random(7)
        prompt = [rng.randrange(1, 30000) for _ in range(3 * CHUNK + 5)]
        stream = create_request([kv_ctx, q_ctx], engine, prompt)
        stream.generate({"max_tokens": 1})
        rows = torch.tensor([0, 16, 32, 50, 51, 52])
        queries = encode_rows(CacheKind.QUERY, [prompt[i] for i in rows], rows.tolist(), Q_LAYOUT)
        assert store_window(q_ctx, stream.tokens, QueryWindow(queries, rows))
        fn = DropSecondChunk()
        before = query_calls(server)
        result = stream.modify_kv(fn)
        after = query_calls(server)
        assert result.kept_tokens == 2 * CHUNK and fn.seen["query"] is not None
        return after - before, fn.seen
    finally:
        for ctx in (q_ctx, kv_ctx):
            ctx.close()
        engine.close()


def test_window_mode_makes_no_chunk_query_call(server: ServerHandle) -> None:
    """Told the engine keeps a window, a modify reads the window alone: one get_window, no chunk
    lookup or retrieve on the query store (each used to come back empty)."""
    calls, seen = modify_counting(server, QueryNeed.WINDOW)
    assert calls == Counter({"get_window": 1}), calls
    assert seen["context"].query_positions.tolist() == [0, 16, 32, 50, 51, 52]


def test_full_mode_reads_the_chunk_queries_and_the_window_past_them(server: ServerHandle) -> None:
    """Told every query is stored in chunks (the default, upstream's), the same modify reads the
    chunk queries too: rows 0..47 from the chunks, then the window's rows past them."""
    calls, seen = modify_counting(server, QueryNeed.FULL)
    assert calls["get_window"] == 1 and sum(calls.values()) > 1, calls
    positions = seen["context"].query_positions.tolist()
    assert positions == [*range(3 * CHUNK), 50, 51, 52]
