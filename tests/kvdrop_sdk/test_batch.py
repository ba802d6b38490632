"""Batched streams against a real kvdrop server (subprocess) with the toy engine.

A batch goes through prefill, a chunk-dropping modify and decode; every stream's suffix, what the
engine was sent on decode, which rows it reused and what it generated are checked exactly.
"""

from __future__ import annotations

import random
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvdrop_sdk.batch import BatchedStream, BatchedStreamFailures, LMCacheBatchedStream
from kvdrop_sdk.cache_kind import CacheKind
from kvdrop_sdk.context import Context, connect
from kvdrop_sdk.edit import EditContext, accepts_edit_context
from kvdrop_sdk.errors import BatchedStreamError, EditTimeoutError, RequestStreamError
from kvdrop_sdk.events import TokenEvent
from kvdrop_sdk.layout import CacheLayout
from kvdrop_sdk.metrics import Metrics
from kvdrop_sdk.request import RequestStream, create_request
from kvdrop_sdk.testing.server import spawn_server
from kvdrop_sdk.testing.toy import ToyEngine, positions_of

CHUNK = 16
LAYOUT = CacheLayout(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float32)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=["shm", "socket"])
def server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One server per transport: with a shared-memory pool, and socket-only."""
    shm = True if request.param == "shm" else None
    with spawn_server(chunk_size=CHUNK, l1_size_gb=0.05, shm_name=shm) as handle:
        handle.transport = request.param
        yield handle


@pytest.fixture
def engine_and_ctx(server: Any) -> Iterator[tuple[ToyEngine, Context]]:
    model = f"toy-{uuid.uuid4().hex[:8]}"
    engine = ToyEngine.connect(server.url, server.http_url, model, LAYOUT, default_max_tokens=4)
    ctx = connect(CacheKind.KV, server.url, server.http_url, model)
    assert ctx.transfer_ctx.mode == engine.kv_ctx.transfer_ctx.mode == server.transport
    yield engine, ctx
    ctx.close()
    engine.close()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def keep_rows(n_chunks: int) -> list[int]:
    """Rows kept by dropping every other middle chunk (chunks 1, 3, 5, ... but never the last)."""
    dropped = {c for c in range(1, n_chunks - 1) if c % 2 == 1}
    return [i for i in range(n_chunks * CHUNK) if i // CHUNK not in dropped]


def drop_every_other_middle_chunk(
    tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]
) -> tuple[torch.Tensor, list[int]]:
    kv = tensors[CacheKind.KV]
    keep = keep_rows(kv.shape[2] // CHUNK)
    return kv[:, :, keep], [tokens[i] for i in keep]


class Recorder:
    """A progress callback that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, str]] = []

    def __call__(self, done: int, total: int, phase: str) -> None:
        self.calls.append((done, total, phase))

    def phase(self, name: str) -> list[tuple[int, int]]:
        return [(d, t) for d, t, p in self.calls if p == name]


def test_prefill_modify_decode_batch(engine_and_ctx: tuple[ToyEngine, Context]) -> None:
    engine, ctx = engine_and_ctx
    # 7 prompts of 3..6 whole chunks with tails of 0..15 tokens, and one shorter than a chunk.
    lengths = [3 * CHUNK, 3 * CHUNK + 5, 4 * CHUNK + 15, 4 * CHUNK + 1, 5 * CHUNK + 8, 5 * CHUNK]
    lengths += [6 * CHUNK + 3, CHUNK - 4]
    prompts = [prompt(n, seed=i) for i, n in enumerate(lengths)]
    progress = Recorder()
    batch = BatchedStream(max_concurrency=4, progress=progress)
    streams = [create_request([ctx], engine, p) for p in prompts]
    for s in streams:
        batch.add(s)
    assert isinstance(batch, LMCacheBatchedStream) and len(batch) == 8
    assert list(batch.request_streams) == [s.request_stream_id for s in streams]

    pre = batch.prefill({"max_tokens": 16, "temperature": 0.0})
    assert isinstance(pre, Metrics) and pre.title == "Batched Stream Metrics (prefill)"
    assert pre["num_requests"] == 8 and pre["num_failed"] == 0
    assert pre["input_tokens"] == sum(lengths)
    assert pre["input_tput"] == pytest.approx(sum(lengths) / pre["duration"])
    for key in ("ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99"):
        assert 0 < pre[key] <= pre["duration"]  # type: ignore[operator]
    assert set(batch.perf_metrics) == set(batch.request_streams)
    assert all(m.output_tokens == 1 for m in batch.perf_metrics.values())
    assert all(c.sampling_params["max_tokens"] == 1 for c in engine.calls)  # forced to 1
    g1 = {s.request_stream_id: s.generated_tokens[0] for s in streams}

    mod = batch.modify(drop_every_other_middle_chunk)
    aligned = [(n // CHUNK) * CHUNK for n in lengths]
    kept = [len(keep_rows(a // CHUNK)) if a else 0 for a in aligned]
    assert mod.title == "Batched Stream Modify Metrics"
    assert mod["num_requests"] == 7 and mod["num_skipped"] == 1
    assert mod["total_tokens"] == sum(aligned) and mod["kept_tokens"] == sum(kept)
    # kept_fraction is of the whole prompts: the uncached tails (and g1) are never dropped.
    tails = sum(n + 1 - a for n, a in zip(lengths, aligned, strict=True) if a)
    assert mod["prompt_tokens"] == sum(aligned) + tails
    assert mod["kept_fraction"] == pytest.approx((sum(kept) + tails) / (sum(aligned) + tails))
    assert mod["cached_kept_fraction"] == pytest.approx(sum(kept) / sum(aligned))
    assert mod["duration"] > 0  # type: ignore[operator]
    for s, p, a in zip(streams, prompts, aligned, strict=True):
        sid = s.request_stream_id
        if a == 0:  # the short stream was left as it was
            assert s.suffix_tokens == [] and s.tokens == [*p, g1[sid]]
            continue
        rows = keep_rows(a // CHUNK)
        assert s.suffix_tokens == [*p[a:], g1[sid]]
        assert s.tokens == [p[i] for i in rows] + p[a:] + [g1[sid]]
        got = s.retrieve_all()
        assert got is not None and positions_of(got[CacheKind.KV]) == rows

    decode_before = len(engine.calls)
    dec = batch.decode({"max_tokens": 4})
    assert dec.title == "Batched Stream Metrics (decode)"
    assert dec["num_requests"] == 8 and dec["output_tokens"] == 32
    assert dec["output_tput"] == pytest.approx(32 / dec["duration"])
    assert all(m.output_tokens == 4 and len(m.tpot) == 3 for m in batch.perf_metrics.values())
    assert dec["tpot_p50"] is not None and dec["tpot_p99"] >= dec["tpot_p50"]  # type: ignore[operator]
    decode_calls = engine.calls[decode_before:]
    assert len(decode_calls) == 8
    for s, p, a in zip(streams, prompts, aligned, strict=True):
        sid = s.request_stream_id
        rows = keep_rows(a // CHUNK) if a else []
        sent = [p[i] for i in rows] + p[a:] + [g1[sid]]
        (call,) = [c for c in decode_calls if c.prompt == sent]  # exactly what was re-sent
        assert call.reused_positions == rows  # the edited KV, found under the kept tokens
        assert s.generated_tokens == [g1[sid], *call.generated] and len(call.generated) == 4
        assert s.suffix_tokens == [] and s.tokens == sent + call.generated
        assert batch.get_request_stream(sid) is s

    # Progress: 0 at each phase start, then one increasing count per finished stream.
    for phase in ("prefill", "modify", "decode"):
        assert progress.phase(phase) == [(i, 8) for i in range(9)]
    # Every report prints as a table and converts to the upstream-shaped dict.
    for m in (pre, mod, dec):
        d = m.to_dict()
        assert set(d) == {"title", "metrics"} and d["title"] == m.title
        assert set(d["metrics"]) == {"config", "results"}
        assert d["metrics"]["config"] == {"num_request_streams": 8}
        assert m.format().splitlines()[:2] == [m.title, "[config]"]
    assert dec.to_dict()["metrics"]["results"]["output_tput"] == dec["output_tput"]
    assert pre.to_dict()["metrics"]["results"]["input_tokens"] == sum(lengths)


def test_failing_stream_does_not_lose_the_others(
    engine_and_ctx: tuple[ToyEngine, Context],
) -> None:
    engine, ctx = engine_and_ctx
    prompts = [prompt(3 * CHUNK + i, seed=100 + i) for i in range(6)]
    bad_prompt = prompts[2]

    def post(ids: list[int], params: dict[str, Any], salt: str) -> Iterator[TokenEvent]:
        if ids[: len(bad_prompt)] == bad_prompt:
            raise RuntimeError("engine rejected the request")
        return engine(ids, params, salt)

    batch = BatchedStream(max_concurrency=3)
    streams = [create_request([ctx], post, p) for p in prompts]
    for s in streams:
        batch.add(s)
    bad_id = streams[2].request_stream_id

    with pytest.raises(BatchedStreamFailures) as info:
        batch.prefill({})
    err = info.value
    assert isinstance(err, BatchedStreamError) and err.phase == "prefill"
    assert list(err.failures) == [bad_id]
    assert isinstance(err.failures[bad_id], RequestStreamError)
    assert "1 stream(s) failed during prefill" in str(err)
    assert f"{bad_id}: RequestStreamError" in str(err) and "engine rejected" in str(err)
    assert err.metrics["num_requests"] == 5 and err.metrics["num_failed"] == 1
    assert set(batch.perf_metrics) == {s.request_stream_id for s in streams} - {bad_id}
    for s in streams:
        assert len(s.generated_tokens) == (0 if s.request_stream_id == bad_id else 1)

    # An edit that fails for one stream: the others are edited, the failure is listed.
    def picky(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple:
        if list(tokens[:CHUNK]) == prompts[4][:CHUNK]:
            raise ValueError("no budget for this one")
        return drop_every_other_middle_chunk(tensors, tokens)

    with pytest.raises(BatchedStreamFailures) as info:
        batch.modify(picky)
    failed = info.value.failures
    picky_id = streams[4].request_stream_id
    assert list(failed) == [bad_id, picky_id]  # in batch order
    assert "no cached chunk" in str(failed[bad_id]) and "no budget" in str(failed[picky_id])
    assert info.value.metrics["num_requests"] == 4
    for s in streams:
        if s.request_stream_id in failed:
            assert s.suffix_tokens == []
        else:
            assert len(s.suffix_tokens) == len(s.tokens) - 32  # 48 cached -> 32 kept
            assert batch.modify_results[s.request_stream_id].kept_tokens == 32


def test_modify_timeout_bounds_a_hung_edit_function(
    engine_and_ctx: tuple[ToyEngine, Context],
) -> None:
    """Issue 20 item 12: an edit that never returns fails its own stream after ``timeout``
    (EditTimeoutError, stream unchanged, its late result dropped); the others are edited."""
    engine, ctx = engine_and_ctx
    prompts = [prompt(3 * CHUNK + i, seed=300 + i) for i in range(3)]
    release, returned = threading.Event(), threading.Event()

    def hangs_on_one(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple:
        if list(tokens[:CHUNK]) == prompts[1][:CHUNK]:
            release.wait(20)  # hung until the test lets it go (bounded: no fix, no hang)
            try:
                return drop_every_other_middle_chunk(tensors, tokens)
            finally:
                returned.set()
        return drop_every_other_middle_chunk(tensors, tokens)

    batch = BatchedStream(max_concurrency=3)
    streams = [create_request([ctx], engine, p) for p in prompts]
    for s in streams:
        batch.add(s)
    batch.prefill({})
    hung = streams[1]
    before = hung.tokens
    try:
        with pytest.raises(BatchedStreamFailures) as info:
            batch.modify(hangs_on_one, timeout=0.5)
    finally:
        release.set()
    assert list(info.value.failures) == [hung.request_stream_id]
    err = info.value.failures[hung.request_stream_id]
    assert isinstance(err, EditTimeoutError) and isinstance(err, RequestStreamError)
    assert "did not return within 0.5s" in str(err)
    assert info.value.metrics["num_requests"] == 2
    assert returned.wait(30), "the abandoned edit returns once released"
    assert hung.tokens == before and hung.suffix_tokens == []  # its late result was dropped
    for s in (streams[0], streams[2]):
        assert batch.modify_results[s.request_stream_id].kept_tokens == 32


def test_max_concurrency_bounds_engine_calls_and_edits(
    engine_and_ctx: tuple[ToyEngine, Context],
) -> None:
    engine, ctx = engine_and_ctx
    engine.token_delay = 0.02
    batch = BatchedStream(max_concurrency=3, modify_concurrency=2)
    for i in range(10):
        batch.add(create_request([ctx], engine, prompt(2 * CHUNK + i, seed=200 + i)))
    batch.prefill({})
    assert engine.max_active == 3

    lock = threading.Lock()
    active = peak = 0

    def slow_edit(tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int]) -> tuple:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.03)
        with lock:
            active -= 1
        return drop_every_other_middle_chunk(tensors, tokens)

    batch.modify(slow_edit)
    assert peak == 2


def test_decode_skips_streams_that_stopped(engine_and_ctx: tuple[ToyEngine, Context]) -> None:
    engine, ctx = engine_and_ctx
    prompts = [prompt(CHUNK + i, seed=300 + i) for i in range(3)]
    firsts = [engine.next_token(p[-1], len(p)) for p in prompts]
    assert len(set(firsts)) == 3
    batch = BatchedStream()
    streams = [create_request([ctx], engine, p) for p in prompts]
    for s in streams:
        batch.add(s)
    batch.prefill({"stop_token_ids": [firsts[1]]})
    assert [s.is_done for s in streams] == [False, True, False]
    dec = batch.decode({"max_tokens": 2})
    assert dec["num_requests"] == 2 and dec["num_skipped"] == 1 and dec["output_tokens"] == 4
    assert streams[1].request_stream_id not in batch.perf_metrics
    assert len(streams[1].generated_tokens) == 1


def test_membership_and_arguments(engine_and_ctx: tuple[ToyEngine, Context]) -> None:
    engine, ctx = engine_and_ctx
    batch = BatchedStream()
    s = create_request([ctx], engine, prompt(CHUNK, seed=400))
    t = create_request([ctx], engine, prompt(CHUNK, seed=401))
    batch.add(s)
    batch.add(t)
    with pytest.raises(BatchedStreamError, match="already in the batch"):
        batch.add(s)
    with pytest.raises(BatchedStreamError, match="no request stream 'nope' in the batch"):
        batch.get_request_stream("nope")
    with pytest.raises(TypeError, match="add\\(\\) takes a RequestStream"):
        batch.add("stream")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_concurrency must be an int >= 1, got 0"):
        BatchedStream(max_concurrency=0)
    with pytest.raises(ValueError, match="modify_concurrency must be an int >= 1"):
        BatchedStream(modify_concurrency=-2)
    with pytest.raises(BatchedStreamError, match="no request stream 'x'"):
        batch.decode({}, stream_ids=["x"])
    with pytest.raises(BatchedStreamError, match="more than once"):
        batch.prefill({}, stream_ids=[s.request_stream_id, s.request_stream_id])
    with pytest.raises(TypeError, match="not a single string"):
        batch.prefill({}, stream_ids=s.request_stream_id)
    # A subset runs only the chosen streams; perf_metrics holds only the latest phase.
    batch.prefill({}, stream_ids=[t.request_stream_id])
    assert list(batch.perf_metrics) == [t.request_stream_id]
    assert s.generated_tokens == [] and len(t.generated_tokens) == 1
    batch.decode({"max_tokens": 2})
    assert set(batch.perf_metrics) == {s.request_stream_id, t.request_stream_id}
    assert isinstance(batch.get_request_stream(s.request_stream_id), RequestStream)


def test_broken_progress_callback_does_not_stop_the_batch(
    engine_and_ctx: tuple[ToyEngine, Context], caplog: pytest.LogCaptureFixture
) -> None:
    engine, ctx = engine_and_ctx

    def broken(done: int, total: int, phase: str) -> None:
        raise OSError("terminal closed")

    batch = BatchedStream(progress=broken)
    for i in range(3):
        batch.add(create_request([ctx], engine, prompt(CHUNK + i, seed=500 + i)))
    m = batch.prefill({})
    assert m["num_requests"] == 3
    assert "progress callback failed" in caplog.text


def test_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The runnable example in docs/sdk/streams.md runs and prints the three reports."""
    doc = (Path(__file__).parents[2] / "docs" / "sdk" / "streams.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert blocks, "docs/sdk/streams.md lost its python example"
    exec(compile(blocks[0], "docs/sdk/streams.md", "exec"), {"__name__": "docs_example"})
    out, err = capsys.readouterr()
    assert "Batched Stream Metrics (prefill)" in out and "Batched Stream Modify Metrics" in out
    assert '"title": "Batched Stream Metrics (decode)"' in out
    assert out.count("decoded 17:") == 4  # 1 token of prefill + 16 of decode, per stream
    assert "decode [" in err  # the progress bar writes to stderr


def test_upstream_building_blocks(engine_and_ctx: tuple[ToyEngine, Context]) -> None:
    """run_request_streams / modify_request_streams / get_perf_metrics, as upstream calls them."""
    engine, ctx = engine_and_ctx
    batch = BatchedStream()
    streams = [create_request([ctx], engine, prompt(3 * CHUNK + 3, seed=900 + i)) for i in range(3)]
    for s in streams:
        batch.add(s)
    duration = batch.run_request_streams({"max_tokens": 1})
    assert isinstance(duration, float) and duration > 0 and len(batch.perf_metrics) == 3
    report = batch.get_perf_metrics(duration, "json", 80, "prefill")
    assert report["num_request_streams"] == 3 and report["num_requests"] == 3
    assert report["input_tokens"] == 3 * (3 * CHUNK + 3) and "ttft_p50" in report
    first = streams[0].request_stream_id
    only = batch.get_perf_metrics(duration, None, 80, "decode", [first])
    assert only["num_requests"] == 1 and only["output_tokens"] == 1
    with pytest.raises(BatchedStreamError, match="mode must be 'prefill' or 'decode'"):
        batch.get_perf_metrics(duration, None, 80, "modify")
    # Positional as upstream: (fn, stream_ids, timeout, poll_interval).
    took = batch.modify_request_streams(drop_every_other_middle_chunk, [first], 1.0, 0.01)
    assert took > 0 and list(batch.modify_results) == [first]
    assert batch.modify_results[first].kept_tokens == 2 * CHUNK  # chunk 1 of 3 dropped

    def broken(tensors: Any, tokens: Any) -> Any:
        raise ValueError("nope")

    with pytest.raises(BatchedStreamFailures, match="ValueError: nope") as err:
        batch.modify_request_streams(broken, [streams[1].request_stream_id])
    assert err.value.phase == "modify"
    # upstream's modify positional order: fn, fmt, width, timeout, poll_interval, stream_ids
    m = batch.modify(
        drop_every_other_middle_chunk, None, 80, 1.0, 0.01, [streams[2].request_stream_id]
    )
    assert m["num_requests"] == 1 and m["num_request_streams"] == 3


def test_a_job_pipelines_each_stream_through_prefill_edit_and_decode(
    engine_and_ctx: tuple[ToyEngine, Context],
) -> None:
    """A stream's decode starts as soon as its own edit is back: the first stream's edit waits
    until another stream is decoding, which phase by phase (every edit before any decode)
    could never happen. The streams end exactly as after the three phases."""
    engine, ctx = engine_and_ctx
    lengths = [3 * CHUNK + 5, 4 * CHUNK, 4 * CHUNK + 9, CHUNK - 3]
    prompts = [prompt(n, seed=300 + i) for i, n in enumerate(lengths)]
    streams = [create_request([ctx], engine, p) for p in prompts]
    batch = BatchedStream(max_concurrency=4, modify_concurrency=2)
    for s in streams:
        batch.add(s)
    gated = streams[0].request_stream_id
    saw_decode = threading.Event()

    @accepts_edit_context
    def gated_edit(
        tensors: Mapping[Any, torch.Tensor], tokens: Sequence[int], context: EditContext
    ) -> tuple[torch.Tensor, list[int]]:
        if context.request_id == gated:
            deadline = time.monotonic() + 30
            while not any(c.sampling_params["max_tokens"] == 4 for c in list(engine.calls)):
                assert time.monotonic() < deadline, "no other stream decoded while this edited"
                time.sleep(0.01)
            saw_decode.set()
        return drop_every_other_middle_chunk(tensors, tokens)

    job = batch.job({"max_tokens": 4}, gated_edit, timeout=60)
    assert saw_decode.is_set()
    # The timeline (seconds since the job started) shows it: each stream's stages in order,
    # and another stream decoding before the gated edit ended.
    marks = batch.timeline
    assert set(marks) == set(batch.request_streams)
    stages = ["prefill_start", "prefill_end", "modify_start", "modify_end", "decode_start"]
    stages += ["decode_first", "decode_end"]
    for m in marks.values():
        assert [m[e] for e in stages] == sorted(m[e] for e in stages)
    assert (
        min(m["decode_start"] for sid, m in marks.items() if sid != gated)
        < (marks[gated]["modify_end"])
    )
    assert job.title == "Batched Stream Job Metrics"
    assert job["num_requests"] == 4 and job["num_failed"] == 0
    assert job["output_tokens"] == 16 and job["output_tput"] == pytest.approx(16 / job["duration"])
    assert 0 < job["modify_s"] and 0 < job["decode_s"] and 0 < job["prefill_s"]  # type: ignore[operator]
    assert set(batch.perf_metrics) == set(batch.modify_results) == set(batch.request_streams)
    for s, p, n in zip(streams, prompts, lengths, strict=True):
        a = (n // CHUNK) * CHUNK
        rows = keep_rows(a // CHUNK) if a else []
        g1, *rest = s.generated_tokens
        assert len(rest) == 4
        assert s.tokens == [p[i] for i in rows] + p[a:] + [g1, *rest]
        assert batch.modify_results[s.request_stream_id].skipped == (a == 0)

    # Without an edit, each stream is one call with the job's sampling parameters.
    fresh = BatchedStream(max_concurrency=4)
    plain = [create_request([ctx], engine, p, "plain") for p in prompts]
    for s in plain:
        fresh.add(s)
    before = len(engine.calls)
    report = fresh.job({"max_tokens": 3})
    assert report["num_requests"] == 4 and report["output_tokens"] == 12
    assert report["kept_fraction"] == 1.0 and len(engine.calls) == before + 4
    assert all(
        set(m) == {"decode_start", "decode_first", "decode_end"} for m in fresh.timeline.values()
    )
    assert all(len(s.generated_tokens) == 3 for s in plain)
