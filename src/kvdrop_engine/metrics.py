"""``GET /metrics``: the server's counters in the Prometheus text format, twice named.

vLLM's own families (``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``
and ``vllm:e2e_request_latency_seconds`` as histograms with vLLM's buckets,
``vllm:num_requests_running``/``waiting``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total``, ``vllm:kv_cache_usage_perc``)
come from ``prometheus_client`` (the exposition format's reference library, so a vLLM Grafana
dashboard reads them unchanged), and kvdrop's own beside them under ``kvdrop:`` (KV blocks,
prefix-cache hits and loads, a recent generation rate).

:class:`ServerMetrics` counts what the HTTP layer sees (requests by finish reason, prompt and
generated tokens, first-token and per-token latency); an :class:`EngineGauges` source adds what
only the engine knows (running and waiting requests, KV blocks, prefix-cache hits and loads).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = [
    "E2E_BUCKETS",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "EngineGauges",
    "EngineLoad",
    "LoadedEngine",
    "ServerMetrics",
    "engine_load",
    "render",
]

#: Seconds over which ``kvdrop:generation_tokens_per_second`` is averaged.
RATE_WINDOW_S = 10.0
#: vLLM's histogram buckets (``vllm/v1/metrics/loggers.py``), so its dashboards' quantiles match.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


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


class _EngineCollector(Collector):
    """vLLM's engine gauges, read from the engine at scrape time."""

    def __init__(self, model_name: str, source: EngineGauges | None) -> None:
        self.model_name = model_name
        self.source = source

    def collect(self):  # type: ignore[no-untyped-def]
        if self.source is None:
            return
        load = self.source()
        usage = load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0
        for name, about, value in (
            ("vllm:num_requests_running", "Requests admitted (prefill or decode)", load.running),
            ("vllm:num_requests_waiting", "Requests waiting for KV blocks", load.waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", usage),
        ):
            family = GaugeMetricFamily(name, about, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    """Thread-safe counters of one HTTP server, in a registry of its own (two servers in one
    process do not share counts)."""

    def __init__(self, model_name: str = "model", gauges: EngineGauges | None = None) -> None:
        self._lock = threading.Lock()
        self.model_name = model_name
        self.gauges = gauges
        self.requests: dict[str, int] = {}  # finish reason -> finished requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.latency_seconds = 0.0
        self._recent: deque[tuple[float, int]] = deque()
        self.registry = CollectorRegistry(auto_describe=True)
        label = ["model_name"]
        self._vllm_prompt = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed", label, registry=self.registry
        )
        self._vllm_generated = Counter(
            "vllm:generation_tokens", "Generated tokens", label, registry=self.registry
        )
        self._vllm_success = Counter(
            "vllm:request_success", "Finished requests by reason",
            [*label, "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Seconds from request to its first token",
            label, buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Seconds per output token after the first (one observation per request)",
            label, buckets=TPOT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Seconds from request to its last token",
            label, buckets=E2E_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_EngineCollector(model_name, gauges))

    def finished(
        self,
        finish: str,
        prompt_tokens: int,
        generated: int,
        seconds: float,
        first_token_s: float | None = None,
    ) -> None:
        """Account one finished request (``finish``: its reason, or "error"/"abort";
        ``first_token_s``: seconds to its first token, None when none came)."""
        now = time.monotonic()
        with self._lock:
            self.requests[finish] = self.requests.get(finish, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generated
            self.latency_seconds += seconds
            self._recent.append((now, generated))
            self._trim(now)
        name = self.model_name
        self._vllm_prompt.labels(name).inc(prompt_tokens)
        self._vllm_generated.labels(name).inc(generated)
        self._vllm_success.labels(name, finish).inc()
        self._e2e.labels(name).observe(seconds)
        if first_token_s is not None:
            self._ttft.labels(name).observe(first_token_s)
            if generated > 1:
                self._tpot.labels(name).observe((seconds - first_token_s) / (generated - 1))

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def rate(self) -> float:
        """Generated tokens per second over the last ``RATE_WINDOW_S`` seconds."""
        with self._lock:
            self._trim(time.monotonic())
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self) -> str:
        """The Prometheus text exposition: vLLM's families, then kvdrop's own."""
        vllm = generate_latest(self.registry).decode()
        engine = None if self.gauges is None else self.gauges()
        return vllm + self._kvdrop_text(engine)

    def _kvdrop_text(self, engine: EngineLoad | None) -> str:
        label = {"model_name": self.model_name}
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
