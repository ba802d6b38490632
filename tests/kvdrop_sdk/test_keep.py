"""Edits that move only the bytes they read (:mod:`kvdrop_sdk.keep`), against a real server.

For every registered policy the automatic path (index-only / keys-only: the server keeps the
rows) must store exactly what the full path (fetch everything, store what the policy returns)
stores: the same kept tokens and the same bytes; and it must move what ``Needs.kv`` says: no KV
byte for chunk-halving, the keys only for snapkv. The ``keep`` op refuses bad requests without
writing anything.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kvdrop
from kvdrop.registry import describe
from kvdrop_rope import RopeConfig
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import Context, connect
from kvdrop_sdk.errors import RequestStreamError, SDKError
from kvdrop_sdk.keep import EditPath, KeepPlan, edit_path
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.protocol import RpcError
from kvdrop_sdk.query_capture import KVNeed, QueryCapture, QueryNeed, needs_of
from kvdrop_sdk.request import create_request
from kvdrop_sdk.testing.server import spawn_server
from kvdrop_sdk.window import TokenScores, store_scores

CHUNK = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 8
TOKENS = 8 * CHUNK
ROPE = RopeConfig(head_dim=HEAD_DIM, theta=10000.0)
LAYOUT = CacheLayout(LAYERS, HEADS, HEAD_DIM, torch.bfloat16, rope=ROPE.to_json())
Q_LAYOUT = CacheLayout(LAYERS, 2 * HEADS, HEAD_DIM, torch.bfloat16)


@pytest.fixture(scope="module", params=["shm", "socket"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Any, str]]:
    shm = True if request.param == "shm" else None
    with spawn_server(
        shm_name=shm, chunk_size=CHUNK, l1_size_gb=0.05, enable=["transfer_query"]
    ) as handle:
        yield handle, request.param


@pytest.fixture
def contexts(server: tuple[Any, str], model_name: str) -> Iterator[tuple[Context, Context]]:
    """A KV context and a query context whose engine stores every query and KVzip's scores."""
    handle, transport = server
    capture = QueryCapture(QueryNeed.FULL, scores=True)
    with (
        connect(
            CacheKind.KV,
            handle.url,
            handle.http_url,
            model_name,
            layout=LAYOUT,
            transport=transport,
        ) as kv_ctx,
        connect(
            CacheKind.QUERY,
            handle.url,
            handle.http_url,
            model_name,
            layout=Q_LAYOUT,
            transport=transport,
            capture=capture,
        ) as q_ctx,
    ):
        yield kv_ctx, q_ctx


@pytest.fixture
def ctx(contexts: tuple[Context, Context]) -> Context:
    return contexts[0]


def _never_called(*args: Any) -> Any:
    raise AssertionError("these tests never generate")


def _prefill(ctx: Context, salt: str, seed: int = 0, q_ctx: Context | None = None) -> list[int]:
    """Store what an engine's prefill stores: the KV (and every query and token scores)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (TOKENS,), generator=gen).tolist()
    kv = torch.randn(LAYOUT.shape(CacheKind.KV, TOKENS), generator=gen).to(LAYOUT.dtype)
    assert ctx.store(kv, tokens, salt)
    if q_ctx is not None:
        q = torch.randn(Q_LAYOUT.shape(CacheKind.QUERY, TOKENS), generator=gen)
        assert q_ctx.store(q.to(Q_LAYOUT.dtype), tokens, salt)
        scores = torch.rand(LAYERS, HEADS, TOKENS, generator=gen)
        assert store_scores(q_ctx, tokens, TokenScores(scores), salt)
    return tokens


def _policy(name: str) -> Any:
    params = dict(describe(name).example)
    if any(p.name == "chunk_size" for p in describe(name).params):
        params.setdefault("chunk_size", CHUNK)
    if any(p.name == "keep_ratio" for p in describe(name).params):
        params.setdefault("keep_ratio", 0.5)
    return kvdrop.get(name, **params)


def _edit(
    ctx: Context, tokens: list[int], salt: str, fn: Any, kv_path: str, q_ctx: Context | None = None
) -> tuple[Any, ...]:
    stream = create_request([ctx] if q_ctx is None else [ctx, q_ctx], _never_called, tokens, salt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = stream.modify_kv(fn, kv_path=kv_path)
        except RequestStreamError as exc:
            return ("error", type(exc.__cause__).__name__)
    stored = ctx.retrieve(stream.tokens, stream.active_cache_salt)
    return result, stream.tokens, stored


@pytest.mark.parametrize("kv_path", ["auto", "client"])
@pytest.mark.parametrize("name", kvdrop.available())
def test_every_policy_stores_the_same_through_the_path_that_moves_less(
    contexts: tuple[Context, Context], name: str, kv_path: str
) -> None:
    """``auto`` on the host: the server keeps the rows, re-rotating kept keys on its CPU;
    ``client`` (a GPU edit's ``least``, here on the host): this process re-rotates them and the
    values are gathered by index in shared memory. Both store the full path's bytes exactly."""
    ctx, q_ctx = contexts
    fn = _policy(name)
    salt = f"p-{name}-{kv_path}"
    tokens = _prefill(ctx, salt, q_ctx=q_ctx)
    auto = _edit(ctx, tokens, salt, fn, kv_path, q_ctx)
    full = _edit(ctx, tokens, salt, fn, "full", q_ctx)
    reads = needs_of(fn).kv
    on_server = {KVNeed.NONE: EditPath.INDEX, KVNeed.KEYS: EditPath.KEYS, KVNeed.ALL: EditPath.FULL}
    client = kv_path == "client" and ctx.client_keep and reads is not KVNeed.ALL
    assert edit_path(fn, ctx, kv_path) is (EditPath.CLIENT if client else on_server[reads])
    if reads is KVNeed.ALL and auto[0] == "error":  # a plugin wanting other inputs: same path
        assert full == auto
        return
    assert auto[0] != "error", auto
    (a, a_tokens, a_kv), (f, f_tokens, f_kv) = auto, full
    assert a.path == edit_path(fn, ctx, kv_path).value and f.path == "full"
    assert a_tokens == f_tokens and a.kept_tokens == f.kept_tokens
    assert a_kv is not None and f_kv is not None and torch.equal(a_kv, f_kv)
    kv_bytes = LAYOUT.nbytes(CacheKind.KV, TOKENS)
    assert f.kv_bytes == kv_bytes + f_kv.nbytes
    least = {KVNeed.NONE: 0, KVNeed.KEYS: kv_bytes // 2, KVNeed.ALL: f.kv_bytes}[reads]
    if client:  # at most: the keys read (all of them) and the kept keys stored back
        assert least <= a.kv_bytes <= kv_bytes // 2 + f_kv.nbytes // 2
    else:
        assert a.kv_bytes == least
    assert a.fetch_s >= 0 and a.edit_s >= 0 and a.store_s >= 0
    assert a.fetch_s + a.edit_s + a.store_s <= a.duration + 1e-6


def test_chunk_halving_moves_no_kv_byte_and_snapkv_only_the_keys(
    contexts: tuple[Context, Context],
) -> None:
    ctx, q_ctx = contexts
    tokens = _prefill(ctx, "counts", q_ctx=q_ctx)
    halved, _, kv = _edit(
        ctx, tokens, "counts", kvdrop.get("chunk-halving", chunk_size=CHUNK), "auto"
    )
    assert (halved.path, halved.kv_bytes) == ("index", 0)
    assert 0 < halved.kept_tokens < TOKENS and kv.shape[2] == halved.kept_tokens
    snapkv = kvdrop.get("snapkv", keep_ratio=0.5, chunk_size=CHUNK)
    snap, _, _ = _edit(ctx, tokens, "counts", snapkv, "auto", q_ctx)
    assert (snap.path, snap.kv_bytes) == ("keys", LAYOUT.nbytes(CacheKind.KV, TOKENS) // 2)


def test_the_kept_keys_are_re_rotated_by_the_server(ctx: Context) -> None:
    """Server-kept rows equal the policy's own call on the whole KV (gather + re-rotation)."""
    tokens = _prefill(ctx, "rot")
    kv = ctx.retrieve(tokens, "rot")
    fn = kvdrop.get("streaming", keep_tokens=3 * CHUNK, chunk_size=CHUNK, n_sink=CHUNK)
    context = kvdrop_sdk_context(TOKENS)
    expected, kept = fn({CacheKind.KV: kv}, tokens, context=context)
    result, new_tokens, stored = _edit(ctx, tokens, "rot", fn, "auto")
    assert result.path == "index" and new_tokens == kept
    assert torch.equal(stored, expected)
    assert not torch.equal(stored[0], kv[0][:, [*range(CHUNK), *range(TOKENS - 2 * CHUNK, TOKENS)]])


def kvdrop_sdk_context(num_tokens: int) -> Any:
    from kvdrop_sdk.edit import EditContext

    return EditContext.of(num_tokens, rope=ROPE.to_json(), chunk_size=CHUNK)


@pytest.mark.parametrize(
    ("index", "match"),
    [
        (torch.arange(CHUNK - 1), "multiple of the chunk size"),
        (torch.arange(CHUNK).flip(0), "strictly increasing"),
        (torch.arange(CHUNK) + TOKENS, r"lie in \[0, "),
    ],
)
def test_a_bad_keep_is_refused_and_stores_nothing(
    ctx: Context, index: torch.Tensor, match: str
) -> None:
    tokens = _prefill(ctx, "bad")
    plan = KeepPlan(index, ROPE.to_json())
    with pytest.raises(RpcError, match=match) as err:
        ctx.keep(tokens, plan, "bad", dst_salt="bad.dst")
    assert err.value.code == "bad_index"
    assert ctx.lookup(tokens, "bad.dst") == 0
    with pytest.raises(SDKError, match="non-negative"):  # refused before it is sent
        ctx.keep(tokens, KeepPlan(torch.arange(CHUNK) - 1), "bad", dst_salt="bad.dst")
    # Nothing cached under the source salt: refused, nothing written.
    with pytest.raises(RpcError, match="cached") as err:
        ctx.keep(tokens, KeepPlan(torch.arange(CHUNK)), "other", dst_salt="bad.dst")
    assert err.value.code == "not_cached"
    with pytest.raises(RpcError, match="rope") as err:
        ctx.keep(tokens, KeepPlan(torch.arange(CHUNK), {"head_dim": 3}), "bad", dst_salt="d2")
    assert err.value.code == "bad_rope"


def test_keys_only_fetch_is_the_first_half_of_the_kv(ctx: Context) -> None:
    tokens = _prefill(ctx, "keys")
    keys = ctx.retrieve_keys(tokens, "keys")
    kv = ctx.retrieve(tokens, "keys")
    assert keys is not None and kv is not None
    assert keys.shape == (1, LAYERS, TOKENS, HEADS * HEAD_DIM)
    assert torch.equal(keys[0], kv[0])


def test_least_re_rotates_where_the_edit_runs(contexts: tuple[Context, Context]) -> None:
    """``least``: the server keeps the rows of a host edit (re-rotating on its CPU); a GPU
    edit re-rotates the kept keys on the GPU (``client``) where the shared memory is mapped;
    ``auto`` follows it but for a keys-reading GPU edit (``full``); ``server`` and ``client``
    force either; ``full`` moves everything."""
    ctx, _ = contexts
    halve = kvdrop.get("chunk-halving", chunk_size=CHUNK)
    gpu = EditPath.CLIENT if ctx.client_keep else EditPath.INDEX
    assert ctx.client_keep == (ctx.transfer_ctx.mode == "shm")
    assert edit_path(halve, ctx) is EditPath.INDEX
    assert edit_path(halve, ctx, "auto", "cpu") is EditPath.INDEX
    assert edit_path(halve, ctx, "auto", "cuda") is gpu
    assert edit_path(halve, ctx, "least", "cuda") is gpu
    assert edit_path(halve, ctx, "server", "cuda") is EditPath.INDEX
    assert edit_path(halve, ctx, "client", None) is gpu
    knorm = kvdrop.get("knorm", keep_ratio=0.5, chunk_size=CHUNK)  # reads the keys
    assert edit_path(knorm, ctx, "auto", "cpu") is EditPath.KEYS
    assert edit_path(knorm, ctx, "auto", "cuda") is EditPath.FULL  # faster there, measured
    assert edit_path(knorm, ctx, "least", "cuda") is (
        EditPath.CLIENT if ctx.client_keep else EditPath.KEYS
    )
    assert edit_path(halve, ctx, "full", None) is EditPath.FULL
    with pytest.raises(ValueError, match="kv_path must be one of"):
        edit_path(halve, ctx, "fast")


def test_the_client_path_reads_only_the_kept_chunks_keys(
    contexts: tuple[Context, Context],
) -> None:
    """chunk-halving keeps whole chunks: the client path reads those chunks' keys and writes
    their re-rotated keys back (a quarter of the KV each way at keep 0.5); snapkv reads every
    key and writes the kept ones."""
    ctx, q_ctx = contexts
    if not ctx.client_keep:
        pytest.skip("the client path needs the shared-memory transport")
    tokens = _prefill(ctx, "client", q_ctx=q_ctx)
    row = LAYERS * HEADS * HEAD_DIM * 2  # one token's keys, bf16
    halved, _, _ = _edit(
        ctx, tokens, "client", kvdrop.get("chunk-halving", chunk_size=CHUNK), "client"
    )
    assert halved.path == "client" and halved.kv_bytes == 2 * halved.kept_tokens * row
    snapkv = kvdrop.get("snapkv", keep_ratio=0.5, chunk_size=CHUNK)
    snap, _, _ = _edit(ctx, tokens, "client", snapkv, "client", q_ctx)
    assert snap.path == "client" and snap.kv_bytes == (TOKENS + snap.kept_tokens) * row


def test_keep_rows_refuses_a_bad_plan_and_stores_nothing(ctx: Context) -> None:
    if not ctx.client_keep:
        with pytest.raises(SDKError, match="shared-memory"):
            ctx.keep_rows([1] * TOKENS, KeepPlan(torch.arange(CHUNK)), "x", dst_salt="x.dst")
        return
    tokens = _prefill(ctx, "rows")
    for index in (torch.arange(CHUNK - 1), torch.arange(CHUNK).flip(0)):
        with pytest.raises(SDKError, match="bad keep plan"):
            ctx.keep_rows(tokens, KeepPlan(index, ROPE.to_json()), "rows", dst_salt="rows.dst")
    with pytest.raises(SDKError, match="cached"):  # nothing under that salt
        ctx.keep_rows(tokens, KeepPlan(torch.arange(CHUNK) + CHUNK), "none", dst_salt="rows.dst")
    assert ctx.lookup(tokens, "rows.dst") == 0
    kept = [tokens[i] for i in range(CHUNK, 2 * CHUNK)]
    assert ctx.lookup(kept, "rows.dst") == 0


@pytest.mark.parametrize(("heads", "offset_step"), [(2, 4096), (3, 1024)])
def test_the_client_keep_gathers_values_by_index_at_any_slot_alignment(
    heads: int, offset_step: int
) -> None:
    """The values a client keep copies are the kept rows of the source slots, whole chunks and
    scattered rows alike, also where a row (``3 * 8`` bf16 here) does not divide the offsets."""
    from kvdrop_sdk.transport.contiguous import _gather_values

    layout = CacheLayout(LAYERS, heads, HEAD_DIM, torch.bfloat16)
    nbytes = layout.nbytes(CacheKind.KV, CHUNK)
    step = -(-nbytes // offset_step) * offset_step  # slots start on offset_step boundaries
    n_src, gen = 6, torch.Generator().manual_seed(3)
    pool = torch.zeros(offset_step + (n_src + 2) * step, dtype=torch.uint8)
    src = [offset_step + j * step for j in range(n_src)]
    dst = [(i, offset_step + (n_src + i) * step) for i in range(2)]

    def slot(off: int) -> torch.Tensor:
        return pool[off : off + nbytes].view(torch.bfloat16).view(layout.shape(CacheKind.KV, CHUNK))

    for off in src:
        slot(off).copy_(torch.randn(layout.shape(CacheKind.KV, CHUNK), generator=gen))
    whole = torch.arange(2 * CHUNK, 3 * CHUNK)  # source chunk 2, kept whole: new chunk 0
    others = torch.arange(3 * CHUNK, n_src * CHUNK)  # new chunk 1: rows of three chunks
    scattered = others[torch.randperm(others.numel(), generator=gen)[:CHUNK]]
    index = torch.cat([whole, scattered]).sort().values  # 2 new chunks of kept rows
    _gather_values(pool, layout, CHUNK, src, dst, index, nbytes)
    values = torch.cat([slot(off)[1] for off in src], dim=1).index_select(1, index)
    got = torch.cat([slot(off)[1] for _, off in dst], dim=1)
    assert torch.equal(got.view(torch.int16), values.view(torch.int16))
    assert not slot(dst[0][1])[0].any()  # the keys' half is the caller's, untouched
