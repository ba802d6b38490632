"""Request streams against a real kvdrop server (subprocess) and the toy engine.

Chunk size 16 keeps the tensors tiny; the toy engine's rows encode (token, position), so every
check below is exact: which rows were kept, under which tokens the engine found them, and what it
was sent.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import Context, connect
from kvdrop_sdk.edit import EditContext, ModifyFnType, accepts_edit_context
from kvdrop_sdk.errors import RequestStreamError, SDKError
from kvdrop_sdk.events import PostCompletion, TokenEvent
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.request import (
    LMCacheRequestStream,
    RequestStream,
    StreamPerfMetrics,
    create_request,
)
from kvdrop_sdk.testing.server import spawn_server
from kvdrop_sdk.testing.toy import ToyEngine, encode_rows, positions_of
from kvdrop_sdk.window import QueryWindow, store_window

CHUNK = 16
KV_LAYOUT = CacheLayout(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float32)
Q_LAYOUT = CacheLayout(num_layers=2, num_heads=4, head_dim=4, dtype=torch.float32)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with spawn_server(chunk_size=CHUNK, l1_size_gb=0.05, enable=["transfer_query"]) as handle:
        yield handle


class Setup:
    """An engine (registering the layouts) and the SDK's own contexts for one fresh model."""

    def __init__(self, server: Any, query: bool) -> None:
        self.model = f"toy-{uuid.uuid4().hex[:8]}"
        self.engine = ToyEngine.connect(
            server.url,
            server.http_url,
            self.model,
            KV_LAYOUT,
            query_layout=Q_LAYOUT if query else None,
            default_max_tokens=4,
        )
        self.kv_ctx: Context = connect(CacheKind.KV, server.url, server.http_url, self.model)
        self.q_ctx: Context | None = None
        if query:
            self.q_ctx = connect(CacheKind.QUERY, server.url, server.http_url, self.model)

    @property
    def contexts(self) -> list[Context]:
        return [self.kv_ctx] + ([self.q_ctx] if self.q_ctx is not None else [])

    def close(self) -> None:
        for ctx in self.contexts:
            ctx.close()
        self.engine.close()


@pytest.fixture
def setup(server: Any) -> Iterator[Setup]:
    s = Setup(server, query=False)
    yield s
    s.close()


@pytest.fixture
def qsetup(server: Any) -> Iterator[Setup]:
    s = Setup(server, query=True)
    yield s
    s.close()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def drop_chunk(index: int) -> ModifyFnType:
    """An edit that drops one whole chunk (by index) from the cached prefix."""

    def fn(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple[torch.Tensor, list]:
        kv = tensors[CacheKind.KV]
        keep = [i for i in range(kv.shape[2]) if i // CHUNK != index]
        return kv[:, :, keep], [tokens[i] for i in keep]

    return fn


def test_prefill_modify_decode_token_bookkeeping(setup: Setup) -> None:
    p = prompt(4 * CHUNK + 6, seed=1)  # 4 whole chunks + a 6-token tail
    s = create_request(setup.contexts, setup.engine, p)
    assert isinstance(s, LMCacheRequestStream) and s.tokens == p and s.suffix_tokens == []

    m = s.generate({"max_tokens": 1, "temperature": 0.0})
    assert isinstance(m, StreamPerfMetrics)
    assert (m.input_tokens, m.output_tokens, m.tpot) == (70, 1, [])
    assert 0 <= m.ttft <= m.duration
    call = setup.engine.calls[-1]
    assert call.prompt == p and call.reused_positions == [] and call.stored_tokens == 64
    assert call.sampling_params == {"max_tokens": 1, "temperature": 0.0}
    g1 = call.generated[0]
    assert s.generated_tokens == [g1] and s.decoded_tokens == 1 and s.output_text == f" t{g1}"
    assert s.tokens == [*p, g1] and not s.is_done and s.finish_reason == "length"

    # The cache holds the prompt's whole chunks only, computed at positions 0..63.
    got = s.retrieve_all()
    assert got is not None and list(got) == [CacheKind.KV]
    assert torch.equal(got[CacheKind.KV], encode_rows(CacheKind.KV, p[:64], range(64), KV_LAYOUT))

    seen: list[list[int]] = []

    def fn(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple[torch.Tensor, list]:
        seen.append(list(tokens))
        return drop_chunk(1)(tensors, tokens)

    result = s.modify_kv(fn)
    kept = p[:16] + p[32:64]
    assert seen == [p[:64]]  # fn sees exactly the cached chunk-aligned prefix
    assert (result.total_tokens, result.kept_tokens, result.stored) == (64, 48, True)
    assert s.suffix_tokens == [*p[64:], g1] and result.suffix_tokens == 7
    assert s.tokens == kept + p[64:] + [g1]
    edited = s.retrieve_all()
    assert edited is not None
    assert positions_of(edited[CacheKind.KV]) == [*range(16), *range(32, 64)]

    m = s.generate({"max_tokens": 5})
    call = setup.engine.calls[-1]
    sent = kept + p[64:] + [g1]
    assert call.prompt == sent  # kept + un-cached prompt tail + decoded so far
    assert call.reused_positions == [*range(16), *range(32, 64)]  # found the edited KV
    # Generated tokens follow the engine's chain from the last prompt token at position 55.
    expected, prev = [], sent[-1]
    for pos in range(len(sent), len(sent) + 5):
        prev = setup.engine.next_token(prev, pos)
        expected.append(prev)
    assert call.generated == expected
    assert s.generated_tokens == [g1, *expected] and s.decoded_tokens == 6
    assert s.suffix_tokens == [] and s.tokens == sent + expected
    assert (m.input_tokens, m.output_tokens, len(m.tpot)) == (len(sent), 5, 4)
    assert s.output_text == "".join(f" t{t}" for t in [g1, *expected])

    # A second edit composes: the cache now holds the kept 48 tokens (the 55-token prompt had no
    # new whole chunk), so the edit sees those and the rest becomes the suffix.
    result = s.modify_kv(drop_chunk(0))
    assert (result.total_tokens, result.kept_tokens) == (48, 32)
    assert s.suffix_tokens == sent[48:] + expected
    s.generate({"max_tokens": 1})
    assert setup.engine.calls[-1].prompt == p[32:64] + sent[48:] + expected
    assert setup.engine.calls[-1].reused_positions == list(range(32, 64))


def test_prompt_of_whole_chunks_keeps_only_the_generated_token_as_suffix(setup: Setup) -> None:
    p = prompt(3 * CHUNK, seed=2)
    s = create_request([setup.kv_ctx], setup.engine, p)
    s.generate({"max_tokens": 1})
    g1 = s.generated_tokens[0]
    s.modify_kv(drop_chunk(1))
    assert s.suffix_tokens == [g1]
    assert s.tokens == p[:16] + p[32:] + [g1]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unaligned", r"T=45 tokens, not a non-zero multiple of the chunk size 16"),
        ("wrong_layers", r"L=1, D=8; expected L=2, D=8"),
        ("wrong_width", r"L=2, D=4; expected L=2, D=8"),
        ("wrong_dtype", r"dtype torch.float64; expected torch.float32"),
        ("token_mismatch", r"47 tokens for a kv tensor of T=48"),
        ("empty", r"must not be empty"),
        ("not_tensor", r"kv must be a torch.Tensor, got list"),
        ("rank", r"kv tensor must be \[2, L, T, D\], got \[2, 2, 48\]"),
        ("negative_token", r"must be a non-negative token id, got -1"),
        ("float_token", r"must be an int token id, got float"),
        ("not_tuple", r"edit function must return \(kv, tokens\), got Tensor"),
        ("raises", r"edit function failed: ZeroDivisionError: boom"),
    ],
)
def test_invalid_edit_raises_and_loses_nothing(setup: Setup, case: str, message: str) -> None:
    p = prompt(4 * CHUNK + 3, seed=3)
    s = create_request([setup.kv_ctx], setup.engine, p)
    s.generate({"max_tokens": 1})
    before_tokens, before_suffix = s.tokens, s.suffix_tokens
    before = s.retrieve_all()
    assert before is not None

    def bad(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> Any:
        kv, toks = tensors[CacheKind.KV], list(tokens)
        ok_kv, ok_toks = kv[:, :, :48], toks[:48]
        if case == "unaligned":
            return kv[:, :, :45], toks[:45]
        if case == "wrong_layers":
            return ok_kv[:, :1], ok_toks
        if case == "wrong_width":
            return ok_kv[..., :4], ok_toks
        if case == "wrong_dtype":
            return ok_kv.double(), ok_toks
        if case == "token_mismatch":
            return ok_kv, ok_toks[:47]
        if case == "empty":
            return kv[:, :, :0], []
        if case == "not_tensor":
            return ok_kv.tolist(), ok_toks
        if case == "rank":
            return ok_kv[..., 0], ok_toks
        if case == "negative_token":
            return ok_kv, [-1, *ok_toks[1:]]
        if case == "float_token":
            return ok_kv, [float(t) for t in ok_toks]
        if case == "not_tuple":
            return ok_kv
        raise ZeroDivisionError("boom")

    with pytest.raises(RequestStreamError, match=message) as info:
        s.modify_kv(bad)
    assert s.request_stream_id in str(info.value)
    # Nothing changed: same tokens, same suffix, the cache still has the original prefix.
    assert s.tokens == before_tokens and s.suffix_tokens == before_suffix
    after = s.retrieve_all()
    assert after is not None and torch.equal(after[CacheKind.KV], before[CacheKind.KV])
    # ... and a valid edit still works afterwards.
    assert s.modify_kv(drop_chunk(2)).kept_tokens == 48


def test_query_context_is_retrieved_with_kv(qsetup: Setup) -> None:
    p = prompt(3 * CHUNK + 15, seed=4)  # tail + g1 fill one chunk after the edit
    s = create_request(qsetup.contexts, qsetup.engine, p)
    s.generate({"max_tokens": 1})
    got: dict[Any, torch.Tensor] = {}

    def fn(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple[torch.Tensor, list]:
        got.update(tensors)
        return drop_chunk(1)(tensors, tokens)

    s.modify_kv(fn)
    assert set(got) == {CacheKind.KV, CacheKind.QUERY}
    assert got[CacheKind.KV].shape == (2, 2, 48, 8)
    assert torch.equal(
        got[CacheKind.QUERY], encode_rows(CacheKind.QUERY, p[:48], range(48), Q_LAYOUT)
    )
    # The decode prompt (32 kept + 16 new) has a new whole chunk: the engine stores KV and
    # queries for the kept chain, the new rows at the positions it gave them (32..47 again).
    s.generate({"max_tokens": 2})
    again = s.retrieve_all()
    assert again is not None
    assert again[CacheKind.QUERY].shape == (1, 2, 48, 16)
    assert positions_of(again[CacheKind.QUERY]) == [*range(16), *range(32, 48), *range(32, 48)]
    assert positions_of(again[CacheKind.KV]) == positions_of(again[CacheKind.QUERY])


def test_retrieve_cuts_every_kind_to_the_common_length(qsetup: Setup) -> None:
    p = prompt(4 * CHUNK, seed=5)
    # Store 4 chunks of KV but only 2 of queries, as an engine could leave them.
    qsetup.kv_ctx.store(encode_rows(CacheKind.KV, p, range(64), KV_LAYOUT), p)
    assert qsetup.q_ctx is not None
    qsetup.q_ctx.store(encode_rows(CacheKind.QUERY, p[:32], range(32), Q_LAYOUT), p[:32])
    s = create_request(qsetup.contexts, qsetup.engine, p)
    got = s.retrieve_all()
    assert got is not None
    assert got[CacheKind.KV].shape[2] == got[CacheKind.QUERY].shape[2] == 32
    assert torch.equal(got[CacheKind.KV], encode_rows(CacheKind.KV, p[:32], range(32), KV_LAYOUT))
    # A stream whose queries are missing entirely (an engine in the lean query mode) retrieves
    # its KV alone; one without KV retrieves nothing.
    other = prompt(2 * CHUNK, seed=6)
    qsetup.kv_ctx.store(encode_rows(CacheKind.KV, other, range(32), KV_LAYOUT), other)
    got = create_request(qsetup.contexts, qsetup.engine, other).retrieve_all()
    assert got is not None and set(got) == {CacheKind.KV} and got[CacheKind.KV].shape[2] == 32
    third = prompt(2 * CHUNK, seed=16)
    qsetup.q_ctx.store(encode_rows(CacheKind.QUERY, third, range(32), Q_LAYOUT), third)
    assert create_request(qsetup.contexts, qsetup.engine, third).retrieve_all() is None


def test_update_stores_under_new_tokens_and_keeps_tail(setup: Setup) -> None:
    p = prompt(4 * CHUNK + 2, seed=7)
    s = create_request([setup.kv_ctx], setup.engine, p)
    s.generate({"max_tokens": 1})
    g1 = s.generated_tokens[0]
    got = s.retrieve_all()
    assert got is not None
    kv = got[CacheKind.KV]
    with pytest.raises(RequestStreamError, match="31 tokens for a kv tensor of T=32"):
        s.update(CacheKind.KV, kv[:, :, 32:], p[32:63])
    with pytest.raises(RequestStreamError, match=r"kv must be a torch\.Tensor, got list"):
        s.update(CacheKind.KV, [1, 2], p[:16])  # type: ignore[arg-type]
    with pytest.raises(RequestStreamError, match="unknown cache kind 'v'"):
        s.update("v", kv, p[:64])
    assert s.update("kv", kv[:, :, 16:], p[16:64]) is True  # drop the first chunk
    assert s.tokens == p[16:64] + p[64:] + [g1] and s.suffix_tokens == [*p[64:], g1]
    s.generate({"max_tokens": 1})
    assert setup.engine.calls[-1].reused_positions == list(range(16, 64))


def test_edits_go_to_the_streams_own_salt_where_the_first_copy_wins(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    p = prompt(2 * CHUNK + 4, seed=8)
    s = create_request([setup.kv_ctx], setup.engine, p)
    s.generate({"max_tokens": 1})

    def zero_values(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple:
        return torch.zeros_like(tensors[CacheKind.KV]), list(tokens)

    # The first edit goes to the stream's own salt, where nothing was cached yet: it is stored.
    assert s.modify_kv(zero_values).stored is True
    got = s.retrieve_all()
    assert got is not None and not got[CacheKind.KV].any()

    # A second edit keeping the same tokens finds its own first copy: not stored.
    def ones(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple:
        return torch.ones_like(tensors[CacheKind.KV]), list(tokens)

    with caplog.at_level(logging.WARNING, logger="kvdrop_sdk.request"):
        result = s.modify_kv(ones)
    assert result.stored is False and "first copy wins" in caplog.text
    got = s.retrieve_all()  # the first copy is still there, unchanged
    assert got is not None and not got[CacheKind.KV].any()
    # The shared (unedited) prefix under the original salt is untouched.
    shared = setup.kv_ctx.retrieve(p)
    assert shared is not None
    assert torch.equal(shared, encode_rows(CacheKind.KV, p[:32], range(32), KV_LAYOUT))


def test_cache_salt_isolates_streams(setup: Setup) -> None:
    p = prompt(2 * CHUNK + 1, seed=9)
    a = create_request([setup.kv_ctx], setup.engine, p, cache_salt="alice")
    a.generate({"max_tokens": 1})
    a.modify_kv(drop_chunk(0))
    b = create_request([setup.kv_ctx], setup.engine, p, cache_salt="bob")
    assert b.retrieve_all() is None
    b.generate({"max_tokens": 1})
    assert setup.engine.calls[-1].cache_salt == "bob"
    assert setup.engine.calls[-1].reused_positions == []
    got = b.retrieve_all()
    assert got is not None and positions_of(got[CacheKind.KV]) == list(range(32))


def test_modify_without_cache_or_whole_chunk(setup: Setup) -> None:
    short = create_request([setup.kv_ctx], setup.engine, prompt(CHUNK - 1, seed=10))
    short.generate({"max_tokens": 1})
    r = short.modify_kv(drop_chunk(0))
    assert r.skipped and r.kept_tokens == 0 and short.suffix_tokens == []
    never = create_request([setup.kv_ctx], setup.engine, prompt(3 * CHUNK, seed=11))
    with pytest.raises(RequestStreamError, match="holds no cached chunk of its 48 tokens"):
        never.modify_kv(drop_chunk(0))
    no_kv = create_request([], setup.engine, prompt(3 * CHUNK, seed=11))
    with pytest.raises(RequestStreamError, match="has no 'kv' context"):
        no_kv.modify_kv(drop_chunk(0))


def test_engine_failure_keeps_received_tokens(setup: Setup) -> None:
    def flaky(ids: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        yield TokenEvent(5, "a")
        yield TokenEvent(6, "b")
        raise ConnectionError("engine went away")

    s = create_request([setup.kv_ctx], flaky, prompt(20, seed=12))
    with pytest.raises(
        RequestStreamError, match=r"after 2 token\(s\): ConnectionError: engine went"
    ):
        s.generate({"max_tokens": 8})
    assert s.generated_tokens == [5, 6] and s.output_text == "ab"
    assert s.tokens[-2:] == [5, 6]

    closed: list[bool] = []

    def not_events(ids: list[int], params: dict[str, Any], salt: str) -> Iterator[Any]:
        try:
            yield 7
            yield TokenEvent(8)
        finally:
            closed.append(True)

    s = create_request([setup.kv_ctx], not_events, prompt(20, seed=12))
    with pytest.raises(RequestStreamError, match="without an int token_id; expected TokenEvent"):
        s.generate({})
    assert closed == [True]  # the engine's stream was closed at once (e.g. to cancel it)


def test_done_rules(setup: Setup) -> None:
    p = prompt(20, seed=13)
    first = setup.engine.next_token(p[-1], len(p))
    s = create_request([setup.kv_ctx], setup.engine, p)
    s.generate({"max_tokens": 4, "stop_token_ids": [first]})
    assert s.is_done and s.finish_reason == "stop" and s.generated_tokens == [first]
    with pytest.raises(RequestStreamError, match="is done"):
        s.generate({"max_tokens": 1})

    # Without a finish_reason the upstream rule applies: fewer tokens than max_tokens -> done.
    def bare(n: int) -> PostCompletion:
        def call(ids: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
            for i in range(n):
                yield TokenEvent(i)

        return call

    full = create_request([], bare(3), p)
    full.generate({"max_tokens": 3})
    assert not full.is_done
    short = create_request([], bare(2), p)
    short.generate({"max_tokens": 3})
    assert short.is_done


def test_create_request_validates_arguments(setup: Setup) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        create_request([setup.kv_ctx], setup.engine, [])
    with pytest.raises(TypeError, match=r"prompt_token_ids\[1\] must be an int token id"):
        create_request([setup.kv_ctx], setup.engine, [1, "2"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="two contexts for cache kind 'kv'"):
        create_request([setup.kv_ctx, setup.kv_ctx], setup.engine, [1])
    with pytest.raises(TypeError, match="post_completion must be callable"):
        create_request([setup.kv_ctx], None, [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens'\\] must be an int >= 1"):
        create_request([setup.kv_ctx], setup.engine, [1]).generate({"max_tokens": 0})
    one = create_request(setup.kv_ctx, setup.engine, torch.tensor([3, 4]))
    assert isinstance(one, RequestStream) and one.tokens == [3, 4]
    ids = {create_request([], setup.engine, [1]).request_stream_id for _ in range(50)}
    assert len(ids) == 50


def test_generate_appends_extra_suffix_tokens(setup: Setup) -> None:
    p = prompt(2 * CHUNK + 3, seed=14)
    s = create_request([setup.kv_ctx], setup.engine, p)
    s.generate({"max_tokens": 1})
    g1 = s.generated_tokens[0]
    s.modify_kv(drop_chunk(0))
    s.generate({"max_tokens": 1}, suffix_tokens=[11, 12])  # e.g. the next user turn
    assert setup.engine.calls[-1].prompt == [*p[16:32], *p[32:], g1, 11, 12]
    with pytest.raises(TypeError, match=r"suffix_tokens\[0\] must be an int token id"):
        s.generate({}, suffix_tokens=["x"])  # type: ignore[list-item]


def test_properties_do_not_wait_for_a_running_generate(setup: Setup) -> None:
    release = threading.Event()
    first_sent = threading.Event()

    def slow(ids: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        yield TokenEvent(1, "x")
        first_sent.set()
        release.wait(10)
        yield TokenEvent(2, "y", finish_reason="length")

    s = create_request([setup.kv_ctx], slow, [5, 6, 7])
    worker = threading.Thread(target=s.generate, args=({"max_tokens": 2},))
    worker.start()
    try:
        assert first_sent.wait(10)
        # Readable mid-generation: the first token is already there.
        assert s.generated_tokens == [1] and s.tokens == [5, 6, 7, 1] and s.output_text == "x"
    finally:
        release.set()
        worker.join(10)
    assert s.generated_tokens == [1, 2] and not s.is_done


class CacheModel:
    """What the server should hold for one salt: chunk-prefix -> positions of that chunk's rows."""

    def __init__(self) -> None:
        self.chunks: dict[tuple[int, ...], list[int]] = {}
        self.edited = False  # the model of the stream's own edit salt

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        positions: list[int] = []
        for end in range(CHUNK, len(tokens) + 1, CHUNK):
            rows = self.chunks.get(tuple(tokens[:end]))
            if rows is None:
                break
            positions += rows
        return positions

    def store(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        for end in range(CHUNK, len(tokens) + 1, CHUNK):
            self.chunks.setdefault(tuple(tokens[:end]), list(positions[end - CHUNK : end]))


def kept_rows(keep_mask: Sequence[bool], t: int) -> list[int]:
    """Rows of the chunks chosen by ``keep_mask`` among ``t // CHUNK`` (the first if none)."""
    chunks = [c for c in range(t // CHUNK) if keep_mask[c]] or [0]
    return [i for c in chunks for i in range(c * CHUNK, (c + 1) * CHUNK)]


def keep_chunks(
    expected_tokens: list[int], expected_positions: list[int], keep_mask: list[bool]
) -> ModifyFnType:
    """An edit keeping the masked chunks that first checks what it is handed."""

    def fn(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple:
        assert list(tokens) == expected_tokens
        kv = tensors[CacheKind.KV]
        assert positions_of(kv) == expected_positions
        rows = kept_rows(keep_mask, len(tokens))
        return kv[:, :, rows], [tokens[i] for i in rows]

    return fn


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    n=st.integers(1, 6 * CHUNK),
    rounds=st.lists(
        st.tuples(st.lists(st.booleans(), min_size=6, max_size=6), st.integers(1, 3)),
        min_size=1,
        max_size=3,
    ),
    seed=st.integers(0, 2**16),
)
def test_bookkeeping_matches_a_model(
    setup: Setup, n: int, rounds: list[tuple[list[bool], int]], seed: int
) -> None:
    """Random prompts, random chunk subsets kept, several modify/decode rounds: the stream, the
    engine's prompts and the rows it reuses always match a plain model of the server. The first
    edit moves the stream to its own salt, whose cache starts empty."""
    p = prompt(n, seed)
    model = CacheModel()
    s = create_request([setup.kv_ctx], setup.engine, p, cache_salt=uuid.uuid4().hex)
    edit_salt = f"{s.cache_salt}.edit.{s.request_stream_id}"

    def generate(max_tokens: int) -> None:
        sent = s.tokens
        reused = model.lookup(sent)
        s.generate({"max_tokens": max_tokens})
        call = setup.engine.calls[-1]
        assert call.prompt == sent and call.reused_positions == reused
        model.store(sent, reused + list(range(len(reused), len(sent))))
        assert s.tokens == sent + call.generated and s.suffix_tokens == []

    generate(1)
    for keep_mask, max_tokens in rounds:
        before = s.tokens
        cached = model.lookup(before)
        t = len(cached)
        result = s.modify_kv(keep_chunks(before[:t], cached, keep_mask))
        if t == 0:
            assert result.skipped and s.tokens == before
        else:
            rows = kept_rows(keep_mask, t)
            kept = [before[i] for i in rows]
            assert s.tokens == kept + before[t:] and s.suffix_tokens == before[t:]
            assert (result.kept_tokens, result.total_tokens) == (len(rows), t)
            if s.active_cache_salt != edit_salt or not model.edited:
                assert s.active_cache_salt == edit_salt
                model = CacheModel()
                model.edited = True
            model.store(kept, [cached[i] for i in rows])
        generate(max_tokens)
    mine = [c for c in setup.engine.calls if c.cache_salt in (s.cache_salt, edit_salt)]
    assert s.generated_tokens == [tok for c in mine for tok in c.generated]


def test_two_requests_whose_kept_tokens_coincide_read_their_own_edits(setup: Setup) -> None:
    """The same kept tokens at different original positions: with one shared salt the second
    edit would be skipped (first copy wins) and its request would read the first one's rows."""
    x, tail = prompt(CHUNK, seed=30), prompt(5, seed=31)
    a = create_request([setup.kv_ctx], setup.engine, x + prompt(CHUNK, seed=32) + tail)
    b = create_request([setup.kv_ctx], setup.engine, prompt(CHUNK, seed=33) + x + tail)
    for s in (a, b):
        s.generate({"max_tokens": 1})
        assert s.active_cache_salt == s.cache_salt == ""  # unedited: the shared salt
    assert a.modify_kv(drop_chunk(1)).stored and b.modify_kv(drop_chunk(0)).stored
    assert a.tokens[:CHUNK] == b.tokens[:CHUNK] == x
    assert a.active_cache_salt == f".edit.{a.request_stream_id}" != b.active_cache_salt
    a.generate({"max_tokens": 2})
    assert setup.engine.calls[-1].reused_positions == list(range(CHUNK))
    assert setup.engine.calls[-1].cache_salt == a.active_cache_salt
    b.generate({"max_tokens": 2})
    assert setup.engine.calls[-1].reused_positions == list(range(CHUNK, 2 * CHUNK))
    # Unedited prefixes keep sharing: a new request with a's prompt reuses a's prefill chunks.
    c = create_request([setup.kv_ctx], setup.engine, a.prompt_token_ids)
    c.generate({"max_tokens": 1})
    assert setup.engine.calls[-1].reused_positions == list(range(2 * CHUNK))


def test_edit_context_goes_only_to_functions_that_ask(qsetup: Setup) -> None:
    p = prompt(3 * CHUNK + 5, seed=40)
    s = create_request(qsetup.contexts, qsetup.engine, p, protected_tokens=4)
    s.generate({"max_tokens": 1})
    plain: dict[str, Any] = {}

    def plain_fn(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple:
        plain["keys"] = set(tensors)
        return tensors[CacheKind.KV], list(tokens)

    s.modify_kv(plain_fn)  # called with two arguments; the chunk queries come along
    assert plain["keys"] == {CacheKind.KV, CacheKind.QUERY}
    s = create_request(qsetup.contexts, qsetup.engine, p, protected_tokens=4)
    s.generate({"max_tokens": 1})
    seen: dict[str, Any] = {}

    @accepts_edit_context
    def fn(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], *, context: Any) -> tuple:
        seen["context"], seen["query"] = context, tensors[CacheKind.QUERY]
        return drop_chunk(1)(tensors, tokens)

    s.modify_kv(fn, device="cpu")
    ctx = seen["context"]
    assert isinstance(ctx, EditContext)
    assert ctx.positions.tolist() == list(range(48)) and ctx.prompt_tokens == len(p) + 1
    assert (ctx.protected, ctx.device, ctx.head_dim, ctx.chunk_size) == (4, "cpu", 4, CHUNK)
    assert ctx.request_id == s.request_stream_id and ctx.rope is None  # the toy registers none
    assert ctx.query_positions.tolist() == list(range(48)) and ctx.query_lse is None
    assert seen["query"].shape == (1, 2, 48, 16)


def test_protected_prefix_must_survive_the_edit(setup: Setup) -> None:
    p = prompt(3 * CHUNK + 2, seed=41)
    s = create_request([setup.kv_ctx], setup.engine, p, protected_tokens=20)
    s.generate({"max_tokens": 1})
    before = s.tokens
    with pytest.raises(RequestStreamError, match="protected"):
        s.modify_kv(drop_chunk(1))  # chunk 1 holds protected tokens 16..19
    assert s.tokens == before and s.active_cache_salt == ""
    assert s.modify_kv(drop_chunk(2)).kept_tokens == 2 * CHUNK
    with pytest.raises(ValueError, match="protected_tokens"):
        create_request([setup.kv_ctx], setup.engine, p, protected_tokens=-1)


def test_query_window_reaches_functions_that_can_place_it(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine in the lean mode stores only a window (simulated here with store_window): a
    context-taking function gets it with its positions and log-normalisers, a plain one gets no
    query tensor (and a log line says why)."""
    q_ctx = connect(
        CacheKind.QUERY, setup.kv_ctx.url, setup.kv_ctx.http_url, setup.model, layout=Q_LAYOUT
    )
    try:
        p = prompt(3 * CHUNK + 5, seed=42)
        s = create_request([setup.kv_ctx, q_ctx], setup.engine, p)
        s.generate({"max_tokens": 1})
        rows = torch.tensor([0, 16, 32, 49, 50, 51, 52])  # strided + the call's last tokens
        queries = encode_rows(CacheKind.QUERY, [p[i] for i in rows], rows.tolist(), Q_LAYOUT)
        lse = torch.arange(2 * 7 * 4, dtype=torch.float32).view(1, 2, 7, 4)
        assert store_window(q_ctx, s.tokens, QueryWindow(queries, rows, lse))
        seen: dict[str, Any] = {}

        @accepts_edit_context
        def fn(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], *, context: Any):
            seen["query"], seen["context"] = tensors[CacheKind.QUERY], context
            return drop_chunk(1)(tensors, tokens)

        s.modify_kv(fn)
        assert torch.equal(seen["query"], queries)
        assert seen["context"].query_positions.tolist() == rows.tolist()
        assert torch.equal(seen["context"].query_lse, lse)
        # After the edit the stream holds other tokens: that window is not its any more.
        other = create_request([setup.kv_ctx, q_ctx], setup.engine, p, cache_salt="other")
        other.generate({"max_tokens": 1})
        assert store_window(q_ctx, other.tokens, QueryWindow(queries, rows, lse), "other")
        plain: dict[str, Any] = {}

        def plain_fn(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple:
            plain["keys"] = set(tensors)
            return drop_chunk(1)(tensors, tokens)

        with caplog.at_level(logging.WARNING, logger="kvdrop_sdk.request"):
            other.modify_kv(plain_fn)
        assert plain["keys"] == {CacheKind.KV}
    finally:
        q_ctx.close()


def test_upstream_signatures_and_output_tokens(qsetup: Setup) -> None:
    """The per-stream calls as upstream spells them, and output_tokens as upstream means it."""
    p = prompt(3 * CHUNK + 5, seed=31)
    s = create_request(qsetup.contexts, qsetup.engine, p)
    with pytest.raises(RequestStreamError, match=r"no cached query .* after 0\.05s"):
        s.retrieve("query", 0.05, 0.01)  # nothing stored yet: polls, then gives up
    s.generate({"max_tokens": 1})
    g1 = s.generated_tokens[0]
    assert s.output_tokens == [*p, g1]  # the whole sequence, as upstream
    kv = s.retrieve(CacheKind.KV, 1.0, 0.01)  # (kind, timeout, poll_interval)
    q = s.retrieve("query")
    assert tuple(kv.shape) == (2, 2, 3 * CHUNK, 8) and tuple(q.shape) == (1, 2, 3 * CHUNK, 16)
    result = s.modify_kv(drop_chunk(1), 1.0, 0.01)  # positional (fn, timeout, poll_interval)
    kept = p[:CHUNK] + p[2 * CHUNK : 3 * CHUNK]
    assert result.kept_tokens == 2 * CHUNK and s.suffix_tokens == [*p[3 * CHUNK :], g1]
    # After an edit the sequence is the kept tokens; the tail waits as suffix, outside it.
    assert s.output_tokens == kept and s.tokens == [*kept, *p[3 * CHUNK :], g1]
    s.generate({"max_tokens": 2})
    assert s.output_tokens == [*kept, *p[3 * CHUNK :], *s.generated_tokens]
    assert len(s.generated_tokens) == 3


def test_done_without_finish_reason_follows_upstream_default(setup: Setup) -> None:
    def bare(n: int) -> PostCompletion:
        def call(ids: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
            for i in range(n):
                yield TokenEvent(i)

        return call

    one = create_request([], bare(1), [1, 2])
    one.generate({})  # no max_tokens: upstream's default of 1, so one token is not done
    assert not one.is_done
    none = create_request([], bare(0), [1, 2])
    none.generate({})
    assert none.is_done


def test_context_lookup_sessions_and_request_configs(setup: Setup) -> None:
    p = prompt(2 * CHUNK + 1, seed=32)
    create_request([setup.kv_ctx], setup.engine, p).generate({"max_tokens": 1})
    ctx = setup.kv_ctx
    ctx.maybe_submit_lookup_request("r1", p)
    assert ctx.check_lookup_result("r1") == 2 * CHUNK and ctx.check_lookup_result("r2") == 0
    ctx.end_session("r1")
    assert ctx.check_lookup_result("r1") == 0 and ctx.mq_timeout == ctx.timeout
    got = ctx.retrieve(p, "", {"tag": "x"})  # request_configs: accepted, not part of the key
    assert got is not None and ctx.store(got, p[: 2 * CHUNK], "", request_configs=None) is False
    with pytest.raises(SDKError, match="request_configs must be a dict or None, got list"):
        ctx.retrieve(p, request_configs=[1])  # type: ignore[arg-type]


def test_edit_salt_is_accepted_by_every_server() -> None:
    """LMCache refuses salts with "@", "/", "\\" or NUL, and over 128 characters."""
    from kvdrop_sdk.request import edit_salt

    sid = "0" * 32
    assert edit_salt("user-1", sid) == f"user-1.edit.{sid}"
    assert edit_salt("", sid) == f".edit.{sid}"
    long_a, long_b = edit_salt("a" * 200, sid), edit_salt("b" * 200, sid)
    assert len(long_a) <= 128 and long_a != long_b and long_a.endswith(f".edit.{sid}")
    for salt in (edit_salt("x", sid), long_a):
        assert not set(salt) & set("@/\\\x00")
