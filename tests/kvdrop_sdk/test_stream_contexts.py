"""Where an edit's tensors go (kvdrop_sdk.stream_contexts.edit_transfer): DMA only for a kvdrop
context and a GPU, host-then-``.to(device)`` for another SDK's context, the host path unchanged.
The GPU cases run only where CUDA is (the decision itself is tested everywhere)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import Context
from kvdrop_sdk.foreign import ForeignContext
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.request import create_request
from kvdrop_sdk.stream_contexts import EditTransfer, StreamContexts, edit_device, edit_transfer
from kvdrop_sdk.testing.server import spawn_server
from kvdrop_sdk.testing.toy import ToyEngine

CHUNK = 16
LAYOUT = CacheLayout(num_layers=1, num_heads=1, head_dim=4, dtype=torch.float32)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

pytestmark = pytest.mark.timeout(120)


class UpstreamShaped:
    """An ``lmcache.sdk``-shaped context (kind, chunk_size, retrieve, store; no ``device=``)
    over a real kvdrop context, recording the devices of the tensors it is asked to store."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self.kind = "kv"
        self.chunk_size = ctx.chunk_size
        self.stored_on: list[torch.device] = []

    def retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None:
        return self._ctx.retrieve(tokens, cache_salt)

    def store(self, tensor: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> bool:
        self.stored_on.append(tensor.device)
        return self._ctx.store(tensor, tokens, cache_salt)


@pytest.fixture(scope="module")
def engine() -> Iterator[ToyEngine]:
    with spawn_server(chunk_size=CHUNK, l1_size_gb=0.05) as srv:
        toy = ToyEngine.connect(srv.url, srv.http_url, "edit-device", LAYOUT)
        try:
            yield toy
        finally:
            toy.close()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def keep_first_chunk_recording(seen: list[torch.device]) -> Any:
    def fn(
        tensors: Mapping[CacheKind, torch.Tensor], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, list[int]]:
        kv = tensors[CacheKind.KV]
        seen.append(kv.device)
        return kv[:, :, :CHUNK].clone(), list(tokens[:CHUNK])

    return fn


def test_dma_is_chosen_only_for_a_kvdrop_context_on_a_cuda_device(engine: ToyEngine) -> None:
    ours = engine.kv_ctx
    foreign = ForeignContext(UpstreamShaped(ours))
    for host in (None, "cpu", torch.device("cpu")):
        assert edit_transfer(ours, host) is EditTransfer.HOST
        assert edit_transfer(foreign, host) is EditTransfer.HOST
    for gpu in ("cuda", "cuda:1", torch.device("cuda", 0)):
        assert edit_transfer(ours, gpu) is EditTransfer.DMA
        assert edit_transfer(foreign, gpu) is EditTransfer.COPY
    # Another accelerator: no DMA path, so a copy (kvdrop's own context as well).
    assert edit_transfer(ours, "meta") is EditTransfer.COPY
    assert edit_transfer(foreign, "mps") is EditTransfer.COPY


def test_a_foreign_context_is_retrieved_on_the_host_then_moved(engine: ToyEngine) -> None:
    """The fallback never passes ``device=`` to another SDK (its retrieve has no such keyword);
    the host tensor is moved afterwards (here to the meta device, so that it runs without a
    GPU: shape and dtype are kept, the device changes)."""
    tokens = prompt(2 * CHUNK, seed=1)
    engine.kv_ctx.store(torch.randn(2, 1, 2 * CHUNK, 4), tokens)
    contexts = StreamContexts([UpstreamShaped(engine.kv_ctx)], "s")
    got = contexts.retrieve_all(tokens, "", (CacheKind.KV,), "meta")
    assert got is not None
    tensors, cached = got
    assert cached == 2 * CHUNK
    assert tensors[CacheKind.KV].device.type == "meta"
    assert tensors[CacheKind.KV].shape == (2, 1, 2 * CHUNK, 4)
    host = contexts.retrieve_all(tokens, "", (CacheKind.KV,))
    assert host is not None and host[0][CacheKind.KV].device.type == "cpu"


@pytest.mark.parametrize("device", [None, "cpu"])
def test_the_host_path_is_unchanged(engine: ToyEngine, device: str | None) -> None:
    foreign = UpstreamShaped(engine.kv_ctx)
    for ctx in (engine.kv_ctx, foreign):
        seen: list[torch.device] = []
        stream = create_request(ctx, engine, prompt(3 * CHUNK + 3, seed=2))
        stream.generate({"max_tokens": 1})
        result = stream.modify_kv(keep_first_chunk_recording(seen), timeout=5, device=device)
        assert (result.total_tokens, result.kept_tokens) == (3 * CHUNK, CHUNK)
        assert seen == [torch.device("cpu")]
    assert foreign.stored_on == [torch.device("cpu")]


def test_a_device_torch_cannot_parse_is_a_type_error(engine: ToyEngine) -> None:
    stream = create_request(engine.kv_ctx, engine, prompt(2 * CHUNK, seed=3))
    with pytest.raises(TypeError, match="device must be None or a torch device"):
        stream.modify_kv(keep_first_chunk_recording([]), device="gpu-please")
    assert edit_device("cpu") == torch.device("cpu") and edit_device(None) is None
    if torch.cuda.is_available():
        assert edit_device("cuda:0") == torch.device("cuda", 0)


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_a_device_that_cannot_hold_the_cache_is_refused_before_any_stream_runs(
    engine: ToyEngine, device: str
) -> None:
    """``retrieve(device="meta")`` returned a tensor with no data, ``modify(device="cuda")`` on
    a host without CUDA a raw torch error naming no stream."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    stream = create_request(engine.kv_ctx, engine, prompt(2 * CHUNK, seed=3))
    fragment = "has no data" if device == "meta" else "CUDA is not available"
    with pytest.raises(ValueError, match=fragment):
        stream.modify_kv(keep_first_chunk_recording([]), device=device)
    with pytest.raises(ValueError, match=fragment):
        engine.kv_ctx.retrieve(list(range(CHUNK)), device=device)


@needs_cuda
def test_an_edit_on_cuda_reads_and_writes_the_gpu(engine: ToyEngine) -> None:
    """kvdrop's context: the edit gets the KV on the GPU and its kept rows are stored from there
    (what the server then holds is exactly them); another SDK's: it stores a host copy."""
    foreign = UpstreamShaped(engine.kv_ctx)
    for ctx in (engine.kv_ctx, foreign):
        seen: list[torch.device] = []
        tokens = prompt(3 * CHUNK + 3, seed=4 if ctx is foreign else 5)
        stream = create_request(ctx, engine, tokens)
        stream.generate({"max_tokens": 1})
        before = engine.kv_ctx.retrieve(tokens)
        assert before is not None
        stream.modify_kv(keep_first_chunk_recording(seen), timeout=5, device="cuda")
        assert [d.type for d in seen] == ["cuda"]
        after = engine.kv_ctx.retrieve(stream.tokens, stream.active_cache_salt)
        assert after is not None and torch.equal(after[:, :, :CHUNK], before[:, :, :CHUNK])
    assert [d.type for d in foreign.stored_on] == ["cpu"]
