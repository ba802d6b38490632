"""Contexts and events from other SDKs, wrapped once (kvdrop_sdk.foreign) for the request stream."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest
import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import Context
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.foreign import ForeignContext, as_token_event, wrap_contexts
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.request import create_request
from kvdrop_sdk.testing.server import spawn_server
from kvdrop_sdk.testing.toy import ToyEngine

CHUNK = 16
LAYOUT = CacheLayout(num_layers=1, num_heads=1, head_dim=4, dtype=torch.float32)

pytestmark = pytest.mark.timeout(120)


class UpstreamShaped:
    """An ``lmcache.sdk``-shaped context: kind, chunk_size, retrieve and store only (no lookup,
    no layout), here over a real kvdrop context."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self.kind = "kv"
        self.chunk_size = ctx.chunk_size
        self.stores = 0

    def retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None:
        return self._ctx.retrieve(tokens, cache_salt)

    def store(self, tensor: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> bool:
        self.stores += 1
        return self._ctx.store(tensor, tokens, cache_salt)


def test_an_upstream_shaped_context_drives_a_stream_through_modify() -> None:
    with spawn_server(chunk_size=CHUNK, l1_size_gb=0.05) as srv:
        engine = ToyEngine.connect(srv.url, srv.http_url, "foreign", LAYOUT)
        try:
            foreign = UpstreamShaped(engine.kv_ctx)
            stream = create_request(foreign, engine, list(range(1, 3 * CHUNK + 5)))
            assert stream.contexts == {CacheKind.KV: foreign}  # given back as passed
            stream.generate({"max_tokens": 1})

            def keep_first_two_chunks(
                tensors: Mapping[CacheKind, torch.Tensor], tokens: Sequence[int]
            ) -> tuple[torch.Tensor, list[int]]:
                return tensors[CacheKind.KV][:, :, : 2 * CHUNK], list(tokens[: 2 * CHUNK])

            result = stream.modify_kv(keep_first_two_chunks, timeout=5)
            assert (result.total_tokens, result.kept_tokens) == (3 * CHUNK, 2 * CHUNK)
            assert foreign.stores == 1 and result.stored
            assert stream.tokens[: 2 * CHUNK] == list(range(1, 2 * CHUNK + 1))
        finally:
            engine.close()


def test_a_context_without_store_is_refused_naming_what_is_missing() -> None:
    class NoStore:
        kind = "kv"
        chunk_size = 16

        def retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> None:
            return None

    with pytest.raises(TypeError, match="has no 'store'"):
        wrap_contexts([NoStore()])
    with pytest.raises(TypeError, match="has no 'kind'"):
        ForeignContext(object())


@dataclass
class OtherEvent:
    token_id: int
    text: str = ""
    finish_reason: str | None = None


def test_events_of_another_engine_become_token_events() -> None:
    event = as_token_event(OtherEvent(7, "x", "stop"))
    assert (event.token_id, event.text, event.finish_reason) == (7, "x", "stop")
    same = TokenEvent(3)
    assert as_token_event(same) is same
    with pytest.raises(TypeError, match="without an int token_id"):
        as_token_event(OtherEvent("7"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="without an int token_id"):
        as_token_event(object())
