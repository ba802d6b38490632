"""``GET /metrics``: the server's counters in the Prometheus text format, named as vLLM names
them with the prefix ``kvdrop:`` (``kvdrop:num_requests_running``, ``kvdrop:prompt_tokens_total``
...), so dashboards built for vLLM need only the prefix changed.

:class:`ServerMetrics` counts what the HTTP layer sees (requests by finish reason, prompt and
generated tokens, latency, a recent generation rate); an :class:`EngineGauges` source adds what
only the engine knows (running and waiting requests, KV blocks, prefix-cache hits and loads).
Standard library only.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["EngineGauges", "EngineLoad", "LoadedEngine", "ServerMetrics", "engine_load", "render"]

#: Seconds over which ``kvdrop:generation_tokens_per_second`` is averaged.
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class EngineLoad:
    """What the engine says about itself now (see :class:`EngineGauges`)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int  # prompt tokens looked up in the cache server
    prefix_cache_hits: int  # of those, tokens loaded instead of computed
    cache_loads_failed: int  # loads that failed, timed out or were skipped (recomputed)
    prompt_tokens_kept: int = 0  # prompt tokens kept by the cut after prefill (--policy)
    prompt_tokens_dropped: int = 0  # and dropped by it


class EngineGauges(Protocol):
    """A callable giving the engine's :class:`EngineLoad` (``kvdrop engine`` passes one)."""

    def __call__(self) -> EngineLoad: ...


class _Counters(Protocol):
    tokens_loaded: int
    prefill_tokens_computed: int
    connector_fallbacks: int
    prompt_tokens_kept: int
    prompt_tokens_dropped: int


class LoadedEngine(Protocol):
    """What :func:`engine_load` reads (``kvdrop_engine.engine.Engine``)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    def load(self) -> tuple[int, int]: ...

    def stats(self) -> _Counters: ...


def engine_load(engine: LoadedEngine) -> EngineLoad:
    """The reference engine's :class:`EngineLoad`: its queues, blocks and cache counters (every
    prompt token is either loaded from the cache server or computed)."""
    running, waiting = engine.load()
    stats = engine.stats()
    return EngineLoad(
        running=running,
        waiting=waiting,
        kv_blocks_used=engine.num_blocks - engine.num_free_blocks,
        kv_blocks_total=engine.num_blocks,
        prefix_cache_queries=stats.tokens_loaded + stats.prefill_tokens_computed,
        prefix_cache_hits=stats.tokens_loaded,
        cache_loads_failed=stats.connector_fallbacks,
        prompt_tokens_kept=stats.prompt_tokens_kept,
        prompt_tokens_dropped=stats.prompt_tokens_dropped,
    )


class ServerMetrics:
    """Thread-safe counters of one HTTP server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}  # finish reason -> finished requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.latency_seconds = 0.0
        self._recent: deque[tuple[float, int]] = deque()

    def finished(self, finish: str, prompt_tokens: int, generated: int, seconds: float) -> None:
        """Account one finished request (``finish``: its reason, or "error"/"abort")."""
        now = time.monotonic()
        with self._lock:
            self.requests[finish] = self.requests.get(finish, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generated
            self.latency_seconds += seconds
            self._recent.append((now, generated))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def rate(self) -> float:
        """Generated tokens per second over the last ``RATE_WINDOW_S`` seconds."""
        with self._lock:
            self._trim(time.monotonic())
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self, model_name: str, engine: EngineLoad | None) -> str:
        """The Prometheus text exposition of these counters (and ``engine``'s gauges)."""
        label = {"model_name": model_name}
        with self._lock:
            rows: list[tuple[str, str, str, Mapping[str, str], float]] = [
                (name, "counter", about, {**label, "finished_reason": reason}, count)
                for name, about in [("request_success_total", "Finished requests by reason")]
                for reason, count in sorted(self.requests.items())
            ]
            rows += [
                ("prompt_tokens_total", "counter", "Prompt tokens", label, self.prompt_tokens),
                ("generation_tokens_total", "counter", "Generated tokens", label,
                 self.generation_tokens),
                ("e2e_request_latency_seconds_sum", "summary", "Request latency", label,
                 self.latency_seconds),
                ("e2e_request_latency_seconds_count", "summary", "Request latency", label,
                 sum(self.requests.values())),
            ]  # fmt: skip
        rows.append(
            ("generation_tokens_per_second", "gauge",
             f"Generated tokens per second over the last {RATE_WINDOW_S:g} s", label, self.rate())
        )  # fmt: skip
        if engine is not None:
            rows += _engine_rows(engine, label)
        return render(rows)


def _engine_rows(
    engine: EngineLoad, label: Mapping[str, str]
) -> list[tuple[str, str, str, Mapping[str, str], float]]:
    usage = engine.kv_blocks_used / engine.kv_blocks_total if engine.kv_blocks_total else 0.0
    return [
        ("num_requests_running", "gauge", "Requests admitted (prefill or decode)", label,
         engine.running),
        ("num_requests_waiting", "gauge", "Requests waiting for KV blocks", label,
         engine.waiting),
        ("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (1 = full)", label, usage),
        ("kv_blocks_used", "gauge", "KV blocks reserved by running requests", label,
         engine.kv_blocks_used),
        ("kv_blocks_total", "gauge", "KV blocks of the engine's budget", label,
         engine.kv_blocks_total),
        ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the cache server",
         label, engine.prefix_cache_queries),
        ("prefix_cache_hits_total", "counter", "Prompt tokens loaded from the cache server",
         label, engine.prefix_cache_hits),
        ("cache_load_failures_total", "counter", "Cache loads that failed and were recomputed",
         label, engine.cache_loads_failed),
        ("prompt_tokens_kept_total", "counter", "Prompt tokens kept by the cut after prefill",
         label, engine.prompt_tokens_kept),
        ("prompt_tokens_dropped_total", "counter", "Prompt tokens dropped by the cut after prefill",
         label, engine.prompt_tokens_dropped),
    ]  # fmt: skip


def render(rows: list[tuple[str, str, str, Mapping[str, str], float]]) -> str:
    """Rows ``(name, type, help, labels, value)`` as Prometheus text, ``kvdrop:`` prefixed; one
    HELP/TYPE header per metric family."""
    lines: list[str] = []
    seen: set[str] = set()
    for name, kind, about, labels, value in rows:
        full = f"kvdrop:{name}"
        family = full.removesuffix("_sum").removesuffix("_count")
        if family not in seen:
            seen.add(family)
            lines += [f"# HELP {family} {about}", f"# TYPE {family} {kind}"]
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        number = str(int(value)) if float(value).is_integer() else repr(float(value))
        lines.append(f"{full}{{{text}}} {number}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
