"""Run many request streams together: prefill, modify (edit the cached KV), decode.

Differences from the upstream batched stream, on purpose:

* A bounded thread pool: at most ``max_concurrency`` engine calls and ``modify_concurrency``
  edits run at once (upstream starts one thread per stream and large batches ran out of memory).
* A failing stream does not lose the others: every stream runs to completion, the successful
  ones keep their results (``perf_metrics``, ``modify_results``, their tokens), then one
  ``BatchedStreamFailures`` (a ``BatchedStreamError``) lists every failed stream id with its
  error and carries the phase's ``Metrics`` of the successful streams.
* An optional ``progress(done, total, phase)`` callback, called from the calling thread with
  ``done == 0`` when a phase starts and again as each stream finishes (``ProgressBar`` fits).
* Streams that are done (the engine said "stop") are skipped by prefill and decode.

Each phase returns a ``Metrics`` with a "config" section (``num_request_streams``: streams in
the batch, as upstream) and a "results" section (counts, ``duration``, token totals, throughputs,
TTFT/TPOT percentiles). The signatures match upstream's ``LMCacheBatchedStream`` (including its
building blocks ``run_request_streams``, ``modify_request_streams`` and ``get_perf_metrics``);
kvdrop's additions are keyword-only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any, TypeVar

from kvdrop_sdk.edit import ModifyFnType
from kvdrop_sdk.errors import BatchedStreamError
from kvdrop_sdk.keep import KV_PATH_CHOICES
from kvdrop_sdk.metrics import Metrics, get_handler, summarize
from kvdrop_sdk.request import ModifyResult, RequestStream, StreamPerfMetrics
from kvdrop_sdk.validate import edit_device, positive_int

__all__ = ["BatchedStream", "BatchedStreamError", "BatchedStreamFailures", "ProgressCallback"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: ``progress(done, total, phase)``: ``done`` of ``total`` streams finished in ``phase``.
ProgressCallback = Callable[[int, int, str], None]

DEFAULT_MAX_CONCURRENCY = 64
# Report sections, named as upstream so ``to_dict()["metrics"]["results"]["output_tput"]`` works.
CONFIG = "config"
RESULTS = "results"
#: Upstream's name for the number of streams in the batch (the "config" section's one entry).
NUM_STREAMS = "num_request_streams"


class BatchedStreamFailures(BatchedStreamError):
    """Some streams of a phase failed; ``failures`` maps stream id -> error, ``metrics`` reports
    the streams that succeeded."""

    def __init__(self, phase: str, failures: dict[str, BaseException], metrics: Metrics) -> None:
        self.phase = phase
        self.failures = failures
        self.metrics = metrics
        lines = [f"{len(failures)} stream(s) failed during {phase}:"]
        lines += [f"  {sid}: {type(e).__name__}: {e}" for sid, e in failures.items()]
        super().__init__("\n".join(lines))


class BatchedStream:
    """A set of request streams run together, with bounded concurrency and metrics per phase.

    ``max_concurrency`` bounds engine calls (prefill/decode); ``modify_concurrency`` bounds edits
    (default ``min(4, cpu count, max_concurrency)``: edits are CPU- and memory-heavy). Drive a
    batch from one thread; the streams' own work runs on the batch's pool.
    """

    def __init__(
        self,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        *,
        modify_concurrency: int | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        self.max_concurrency = positive_int(max_concurrency, "max_concurrency")
        if modify_concurrency is None:
            modify_concurrency = min(4, os.cpu_count() or 1, self.max_concurrency)
        self.modify_concurrency = positive_int(modify_concurrency, "modify_concurrency")
        if progress is not None and not callable(progress):
            raise TypeError(f"progress must be callable, got {type(progress).__name__}")
        self.progress = progress
        self.request_streams: dict[str, RequestStream] = {}
        self.perf_metrics: dict[str, StreamPerfMetrics] = {}
        self.modify_results: dict[str, ModifyResult] = {}
        #: The last ``job``'s timeline: stream id -> {event: seconds since the job started}
        #: (``prefill_start``, ``prefill_end``, ``modify_start``, ``modify_end``,
        #: ``decode_start``, ``decode_first`` (its first token), ``decode_end``; a stream
        #: without ``fn`` has only the decode's).
        self.timeline: dict[str, dict[str, float]] = {}

    # ----------------------------------------------------------------- membership
    def add(self, request_stream: RequestStream) -> None:
        """Register a stream under its ``request_stream_id`` (duplicates are an error)."""
        sid = getattr(request_stream, "request_stream_id", None)
        if not isinstance(sid, str):
            raise TypeError(f"add() takes a RequestStream, got {type(request_stream).__name__}")
        if sid in self.request_streams:
            raise BatchedStreamError(f"request stream {sid} is already in the batch")
        self.request_streams[sid] = request_stream

    def get_request_stream(self, stream_id: str) -> RequestStream:
        """The stream registered as ``stream_id``; ``BatchedStreamError`` if unknown."""
        try:
            return self.request_streams[stream_id]
        except (KeyError, TypeError):
            raise BatchedStreamError(
                f"no request stream {stream_id!r} in the batch ({len(self)} registered)"
            ) from None

    def __len__(self) -> int:
        return len(self.request_streams)

    def __iter__(self) -> Iterator[RequestStream]:
        return iter(list(self.request_streams.values()))

    # ----------------------------------------------------------------- phases
    def prefill(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        fmt: str | None = None,
        width: int = 80,
        stream_ids: Sequence[str] | None = None,
    ) -> Metrics:
        """Run every stream once with ``max_tokens`` forced to 1; report input tokens and TTFT.

        ``fmt`` ("terminal" or "json") attaches that handler to the returned report (None: the
        process-wide default handlers, a terminal table unless replaced); ``width`` is accepted
        for upstream compatibility and unused.
        """
        params = {**(sampling_params or {}), "max_tokens": 1}
        return self._generate_phase("prefill", params, fmt, stream_ids)

    def decode(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        fmt: str | None = None,
        width: int = 80,
        stream_ids: Sequence[str] | None = None,
    ) -> Metrics:
        """Generate on every stream that is not done; report output tokens and TPOT."""
        return self._generate_phase("decode", dict(sampling_params or {}), fmt, stream_ids)

    def modify(
        self,
        fn: ModifyFnType,
        fmt: str | None = None,
        width: int = 80,
        timeout: float = 30.0,
        poll_interval: float = 0.2,
        stream_ids: Sequence[str] | None = None,
        *,
        device: str | None = None,
        kv_path: str = "auto",
    ) -> Metrics:
        """Apply ``fn`` to every stream's cached chunk-aligned prefix and store the result.

        ``timeout`` bounds each stream's steps, each on its own: waiting for its cache (polling
        every ``poll_interval``, as in ``RequestStream.modify_kv``), the edit function ``fn``
        (a call still running after ``timeout`` seconds is abandoned and that stream fails with
        ``EditTimeoutError``, unchanged; the others go on), and the store. Reports the
        wall-clock duration, the kept / total edited (cached) tokens, and ``kept_fraction``: the
        kept share of the WHOLE prompts (the uncached tails, never dropped, count as kept).
        ``device`` reaches ``fn`` as ``EditContext.device``. ``kv_path`` is
        ``RequestStream.modify_kv``'s (``auto``: move only what ``fn`` reads); ``kv_bytes`` is
        the KV the edits moved between the server and this process, ``kv_bytes_per_edit`` its
        mean and ``edit_path`` the paths taken.
        """
        results, failures, duration = self._modify(
            fn, stream_ids, timeout, poll_interval, device, kv_path
        )
        edited = [r for r in results.values() if not r.skipped]
        kept = sum(r.kept_tokens for r in edited)
        total = sum(r.total_tokens for r in edited)
        tail = sum(r.suffix_tokens for r in edited)
        metrics = Metrics("Batched Stream Modify Metrics")
        metrics.add(NUM_STREAMS, len(self.request_streams), CONFIG)
        metrics.add("num_requests", len(edited), RESULTS)
        metrics.add("num_skipped", len(results) - len(edited), RESULTS)
        metrics.add("num_failed", len(failures), RESULTS)
        metrics.add("duration", duration, RESULTS)
        metrics.add("kept_tokens", kept, RESULTS)
        metrics.add("total_tokens", total, RESULTS)
        metrics.add("prompt_tokens", total + tail, RESULTS)
        metrics.add(
            "kept_fraction", (kept + tail) / (total + tail) if total else float("nan"), RESULTS
        )
        metrics.add("cached_kept_fraction", kept / total if total else float("nan"), RESULTS)
        _add_kv_bytes(metrics, edited)
        return self._finish("modify", metrics, failures, fmt)

    def job(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        fn: ModifyFnType | None = None,
        *,
        prefill_params: Mapping[str, Any] | None = None,
        timeout: float = 30.0,
        poll_interval: float = 0.2,
        device: str | None = None,
        stream_ids: Sequence[str] | None = None,
        fmt: str | None = None,
        kv_path: str = "auto",
    ) -> Metrics:
        """Every stream's whole request at once, pipelined: its prefill (``prefill_params``,
        default ``sampling_params``, with ``max_tokens`` 1), then ``fn``'s edit of its cache as
        soon as that prefill is stored, then its decode (``sampling_params``) as soon as its
        edit is back, while the other streams' prefills, edits and decodes run (at most
        ``max_concurrency`` streams and ``modify_concurrency`` edits at once). Without ``fn``
        each stream is one call with ``sampling_params``: what a user sends when nothing is
        dropped.

        Reports ``duration``, the job's wall time (first prompt sent to last token received),
        beside each stage's time summed over streams (``prefill_s``, ``modify_s``,
        ``decode_s``: they overlap, so they add up to more than the wall time), the output
        tokens and their rate over the wall time, and the kept share of the prompts. A stream's
        failure does not stop the others (``BatchedStreamFailures`` at the end). ``timeout``,
        ``poll_interval`` and ``device`` are ``modify``'s; the decode's ``StreamPerfMetrics``
        and the edits' results land in ``perf_metrics`` and ``modify_results``.
        """
        if fn is not None and not callable(fn):
            raise TypeError(f"modify function must be callable, got {type(fn).__name__}")
        params = dict(sampling_params or {})
        first = dict(params if prefill_params is None else prefill_params)
        first["max_tokens"] = 1
        edits = threading.BoundedSemaphore(self.modify_concurrency)
        stages: dict[str, dict[str, float]] = {}
        edited: dict[str, ModifyResult] = {}

        def whole(s: RequestStream) -> StreamPerfMetrics:
            sid = s.request_stream_id
            spent = stages.setdefault(sid, {"prefill_s": 0.0, "modify_s": 0.0, "decode_s": 0.0})
            marks = timeline.setdefault(sid, {})

            def mark(event: str) -> float:
                now = time.perf_counter()
                marks[event] = now - started
                return now

            if fn is not None:
                t = mark("prefill_start")
                s.generate(first)
                spent["prefill_s"] = mark("prefill_end") - t
                with edits:
                    t = mark("modify_start")
                    edited[sid] = s.modify_kv(
                        fn,
                        timeout,
                        poll_interval,
                        device=device,
                        edit_timeout=timeout,
                        kv_path=kv_path,
                    )
                    spent["modify_s"] = mark("modify_end") - t
                if s.is_done:  # the engine stopped it at its first token
                    return StreamPerfMetrics()
            t = mark("decode_start")
            perf = s.generate(params)
            spent["decode_s"] = mark("decode_end") - t
            if perf.output_tokens:
                marks["decode_first"] = t - started + perf.ttft
            return perf

        streams = [s for s in self._select(stream_ids) if not s.is_done]
        self.perf_metrics.clear()
        self.modify_results.clear()
        self.timeline.clear()
        timeline = self.timeline
        started = time.perf_counter()
        results, failures, duration = self._run("job", streams, whole, self.max_concurrency)
        self.perf_metrics.update(results)
        self.modify_results.update(edited)
        done = [r for r in edited.values() if not r.skipped]
        kept = sum(r.kept_tokens + r.suffix_tokens for r in done)
        total = sum(r.prompt_tokens for r in done)
        output_tokens = sum(p.output_tokens for p in results.values())
        metrics = Metrics("Batched Stream Job Metrics")
        metrics.add(NUM_STREAMS, len(self.request_streams), CONFIG)
        metrics.add("num_requests", len(results), RESULTS)
        metrics.add("num_failed", len(failures), RESULTS)
        metrics.add("duration", duration, RESULTS)
        for stage in ("prefill_s", "modify_s", "decode_s"):
            metrics.add(stage, sum(st[stage] for st in stages.values()), RESULTS)
        metrics.add("output_tokens", output_tokens, RESULTS)
        metrics.add("output_tput", output_tokens / duration if duration > 0 else 0.0, RESULTS)
        metrics.add("kept_fraction", kept / total if total else 1.0, RESULTS)
        if fn is not None:
            _add_kv_bytes(metrics, done)
        return self._finish("job", metrics, failures, fmt)

    # ----------------------------------------------------------------- upstream's building blocks
    def run_request_streams(
        self, sampling_params: Mapping[str, Any], stream_ids: Sequence[str] | None = None
    ) -> float:
        """Generate once on every selected stream that is not done, keep each one's
        ``StreamPerfMetrics`` in ``perf_metrics``; returns the wall-clock seconds.

        Raises ``BatchedStreamFailures`` (after the others finished) if any stream failed.
        """
        _, _, failures, duration = self._generate("generate", dict(sampling_params), stream_ids)
        if failures:
            metrics = self.get_perf_metrics(duration, None, 80, "decode", stream_ids)
            raise BatchedStreamFailures("generate", failures, metrics)
        return duration

    def modify_request_streams(
        self,
        fn: ModifyFnType,
        stream_ids: Sequence[str] | None = None,
        timeout: float = 30.0,
        poll_interval: float = 0.2,
    ) -> float:
        """Apply ``fn`` to every selected stream (see ``modify``); returns the wall-clock seconds.

        Raises ``BatchedStreamFailures`` (after the others finished) if any stream failed.
        """
        _, failures, duration = self._modify(fn, stream_ids, timeout, poll_interval)
        if failures:
            metrics = Metrics("Batched Stream Modify Metrics").add("duration", duration, RESULTS)
            raise BatchedStreamFailures("modify", failures, metrics)
        return duration

    def get_perf_metrics(
        self,
        duration: float,
        fmt: str | None,
        width: int,
        mode: str,
        stream_ids: Sequence[str] | None = None,
    ) -> Metrics:
        """The report of the streams' latest ``perf_metrics``: ``mode`` "prefill" (input tokens,
        throughput, TTFT) or "decode" (output tokens, throughput, TPOT) over ``duration``."""
        if mode not in ("prefill", "decode"):
            raise BatchedStreamError(f"mode must be 'prefill' or 'decode', got {mode!r}")
        wanted = None if stream_ids is None else set(stream_ids)
        perf = [m for sid, m in self.perf_metrics.items() if wanted is None or sid in wanted]
        metrics = Metrics(f"Batched Stream Metrics ({mode})")
        metrics.add(NUM_STREAMS, len(self.request_streams), CONFIG)
        metrics.add("num_requests", len(perf), RESULTS)
        metrics.add("duration", duration, RESULTS)
        if mode == "prefill":
            input_tokens = sum(p.input_tokens for p in perf)
            metrics.add("input_tokens", input_tokens, RESULTS)
            metrics.add("input_tput", input_tokens / duration if duration > 0 else 0.0, RESULTS)
            for name, value in summarize("ttft", [p.ttft for p in perf]).items():
                metrics.add(name, value, RESULTS)
        else:
            output_tokens = sum(p.output_tokens for p in perf)
            metrics.add("output_tokens", output_tokens, RESULTS)
            metrics.add("output_tput", output_tokens / duration if duration > 0 else 0.0, RESULTS)
            tpot = [gap for p in perf for gap in p.tpot]
            for name, value in summarize("tpot", tpot).items():
                metrics.add(name, value, RESULTS)
        if fmt is not None:
            metrics.add_handler(get_handler(fmt))
        return metrics

    # ----------------------------------------------------------------- internals
    def _select(self, stream_ids: Sequence[str] | None) -> list[RequestStream]:
        if stream_ids is None:
            return list(self.request_streams.values())
        if isinstance(stream_ids, str):
            raise TypeError("stream_ids must be a sequence of ids, not a single string")
        dupes = sorted({sid for sid in stream_ids if list(stream_ids).count(sid) > 1})
        if dupes:
            raise BatchedStreamError(f"stream_ids lists {dupes} more than once")
        return [self.get_request_stream(sid) for sid in stream_ids]

    def _generate(
        self, phase: str, params: dict[str, Any], stream_ids: Sequence[str] | None
    ) -> tuple[list[RequestStream], list[RequestStream], dict[str, BaseException], float]:
        streams = self._select(stream_ids)
        active = [s for s in streams if not s.is_done]
        self.perf_metrics.clear()
        results, failures, duration = self._run(
            phase, active, lambda s: s.generate(params), self.max_concurrency
        )
        self.perf_metrics.update(results)
        return streams, active, failures, duration

    def _modify(
        self,
        fn: ModifyFnType,
        stream_ids: Sequence[str] | None,
        timeout: float,
        poll_interval: float,
        device: str | None = None,
        kv_path: str = "auto",
    ) -> tuple[dict[str, ModifyResult], dict[str, BaseException], float]:
        if not callable(fn):
            raise TypeError(f"modify function must be callable, got {type(fn).__name__}")
        edit_device(device)  # refused once here, not as a torch error from every stream
        if kv_path not in KV_PATH_CHOICES:
            raise ValueError(f"kv_path must be one of {KV_PATH_CHOICES}, got {kv_path!r}")
        streams = self._select(stream_ids)
        self.modify_results.clear()
        results, failures, duration = self._run(
            "modify",
            streams,
            lambda s: s.modify_kv(
                fn, timeout, poll_interval, device=device, edit_timeout=timeout, kv_path=kv_path
            ),
            self.modify_concurrency,
        )
        self.modify_results.update(results)
        return results, failures, duration

    def _generate_phase(
        self,
        phase: str,
        params: dict[str, Any],
        fmt: str | None,
        stream_ids: Sequence[str] | None,
    ) -> Metrics:
        streams, active, failures, duration = self._generate(phase, params, stream_ids)
        metrics = self.get_perf_metrics(duration, None, 80, phase, stream_ids)
        metrics.add("num_skipped", len(streams) - len(active), RESULTS)
        metrics.add("num_failed", len(failures), RESULTS)
        return self._finish(phase, metrics, failures, fmt)

    def _finish(
        self, phase: str, metrics: Metrics, failures: dict[str, BaseException], fmt: str | None
    ) -> Metrics:
        if fmt is not None:
            metrics.add_handler(get_handler(fmt))
        if failures:
            raise BatchedStreamFailures(phase, failures, metrics)
        return metrics

    def _run(
        self,
        phase: str,
        streams: list[RequestStream],
        work: Callable[[RequestStream], T],
        bound: int,
    ) -> tuple[dict[str, T], dict[str, BaseException], float]:
        """Run ``work`` on every stream (at most ``bound`` at once); never stop at a failure."""
        results: dict[str, T] = {}
        failures: dict[str, BaseException] = {}
        total = len(streams)
        report = self._progress_reporter(phase, total)
        start = time.perf_counter()
        if not streams:
            return results, failures, 0.0
        report(0)
        pool = ThreadPoolExecutor(
            max_workers=min(bound, total), thread_name_prefix=f"kvdrop-{phase}"
        )
        try:
            futures: dict[Future[T], str] = {
                pool.submit(work, s): s.request_stream_id for s in streams
            }
            for done, future in enumerate(as_completed(futures), start=1):
                sid = futures[future]
                try:
                    results[sid] = future.result()
                except Exception as exc:
                    failures[sid] = exc
                report(done)
        finally:
            # On Ctrl-C, drop what has not started; running streams finish their call.
            pool.shutdown(wait=True, cancel_futures=True)
        # Report in the order the streams were given, not the order they finished.
        order = {s.request_stream_id: i for i, s in enumerate(streams)}
        failures = dict(sorted(failures.items(), key=lambda kv: order[kv[0]]))
        return results, failures, time.perf_counter() - start

    def _progress_reporter(self, phase: str, total: int) -> Callable[[int], None]:
        callback = self.progress
        broken = False

        def report(done: int) -> None:
            nonlocal broken
            if callback is None or broken:
                return
            try:
                callback(done, total, phase)
            except Exception:
                broken = True
                logger.warning("progress callback failed; disabled for this phase", exc_info=True)

        return report


def _add_kv_bytes(metrics: Metrics, edited: Sequence[ModifyResult]) -> None:
    """The KV bytes ``edited`` moved (sum and per edit), the paths they took, and each edit's
    mean fetch / edit / store time (``ModifyResult.fetch_s`` ...)."""
    moved = sum(r.kv_bytes for r in edited)
    metrics.add("kv_bytes", moved, RESULTS)
    metrics.add("kv_bytes_per_edit", moved / len(edited) if edited else 0.0, RESULTS)
    metrics.add("edit_path", ",".join(sorted({r.path for r in edited})) or "-", RESULTS)
    for part in ("fetch_s", "edit_s", "store_s"):  # per edit, mean (edits overlap)
        spent = sum(getattr(r, part) for r in edited)
        metrics.add(f"{part}_per_edit", spent / len(edited) if edited else 0.0, RESULTS)
