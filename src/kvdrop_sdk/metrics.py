"""Aggregated reports of a batch phase (prefill, modify, decode), printable as a table or JSON.

A ``Metrics`` is a title plus an ordered ``name -> value`` mapping. ``emit()`` sends it through
handlers: the instance's own (``add_handler``), else the process-wide defaults
(``Metrics.set_default_handlers``), which start as one terminal-table handler on stdout. A handler
is any callable taking the ``Metrics``; ``TerminalHandler`` and ``JSONHandler`` are provided and
``get_handler("terminal" | "json")`` builds one by name (for a CLI ``--format`` flag).
"""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, TextIO

from kvdrop_sdk.table import format_table

__all__ = [
    "UNITS",
    "JSONHandler",
    "Metrics",
    "MetricsDict",
    "MetricsHandler",
    "TerminalHandler",
    "get_handler",
    "percentile",
    "summarize",
]

MetricValue = int | float | str | None
MetricsHandler = Callable[["Metrics"], None]

#: Units shown in the terminal table, by metric name (or name prefix before ``_``).
UNITS: dict[str, str] = {
    "duration": "s",
    "input_tokens": "tokens",
    "output_tokens": "tokens",
    "kept_tokens": "tokens",
    "total_tokens": "tokens",
    "prompt_tokens": "tokens",
    "input_tput": "tokens/s",
    "output_tput": "tokens/s",
    "ttft": "s",
    "tpot": "s",
    "num_requests": "requests",
    "num_failed": "requests",
    "num_skipped": "requests",
}


def _unit(name: str) -> str:
    if name in UNITS:
        return UNITS[name]
    head = name.split("_", 1)[0]
    return UNITS.get(head, "")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated like numpy; nan if empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q!r}")
    if not values:
        return math.nan
    data = sorted(float(v) for v in values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(prefix: str, values: Sequence[float]) -> dict[str, float]:
    """``{prefix_mean, prefix_p50, prefix_p90, prefix_p99}`` of ``values`` (nan when empty)."""
    mean = sum(values) / len(values) if values else math.nan
    return {
        f"{prefix}_mean": mean,
        f"{prefix}_p50": percentile(values, 50),
        f"{prefix}_p90": percentile(values, 90),
        f"{prefix}_p99": percentile(values, 99),
    }


def _json_safe(value: Any) -> Any:
    """nan/inf are not JSON: report them as ``None`` so ``json.dumps(strict)`` never fails."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsDict(dict):  # type: ignore[type-arg]
    """The ``"metrics"`` dict of ``to_dict()``: sections nested, as upstream, and every metric
    also reachable by its bare name (``d["kept_fraction"]`` finds it in ``d["results"]``).

    Only lookups fall through; iteration, equality and JSON see the nested structure alone.
    """

    def __missing__(self, key: Any) -> Any:
        for value in self.values():
            if isinstance(value, dict) and key in value:
                return value[key]
        raise KeyError(key)

    def get(self, key: Any, default: Any = None) -> Any:
        """Like ``dict.get``, with the same fall-through into sections as ``d[key]``."""
        try:
            return self[key]
        except KeyError:
            return default


class Metrics:
    """A titled report of named values (token counts, throughputs, durations, percentiles).

    Values live in the top level or in named sections (``add(name, value, section="results")``).
    ``to_dict()`` nests each section under its key like the upstream report, so
    ``report.to_dict()["metrics"]["results"]["output_tput"]`` works as there; ``report[name]``
    finds a metric in any section (names are unique within a report) and ``report[section]``
    returns that section as a dict.
    """

    _default_handlers: ClassVar[list[MetricsHandler]] = []
    _defaults_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, title: str, metrics: Mapping[str, MetricValue] | None = None) -> None:
        if not isinstance(title, str) or not title:
            raise ValueError(f"Metrics title must be a non-empty string, got {title!r}")
        self.title = title
        # None = the top level; then named sections in the order they were first used.
        self._sections: dict[str | None, dict[str, MetricValue]] = {None: {}}
        self._handlers: list[MetricsHandler] = []
        for name, value in (metrics or {}).items():
            self.add(name, value)

    def add(self, name: str, value: MetricValue, section: str | None = None) -> Metrics:
        """Set one metric, at the top level or in ``section``; returns self for chaining."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"metric name must be a non-empty string, got {name!r}")
        if value is not None and not isinstance(value, (int, float, str)):
            raise TypeError(
                f"metric {name!r} must be int, float, str or None, got {type(value).__name__}"
            )
        if section is not None and (not isinstance(section, str) or not section):
            raise ValueError(f"section must be a non-empty string or None, got {section!r}")
        if name in self._sections:
            raise ValueError(f"metric name {name!r} is already a section of {self.title!r}")
        if section in self._sections[None]:
            raise ValueError(f"section name {section!r} is already a metric of {self.title!r}")
        for key, values in self._sections.items():
            if key != section and name in values:
                where = "the top level" if key is None else f"section {key!r}"
                raise ValueError(f"metric {name!r} is already in {where} of {self.title!r}")
        self._sections.setdefault(section, {})[name] = value
        return self

    @property
    def metrics(self) -> dict[str, MetricValue]:
        """Every metric by name, all sections flattened (a copy)."""
        out: dict[str, MetricValue] = {}
        for values in self._sections.values():
            out.update(values)
        return out

    @property
    def sections(self) -> dict[str, dict[str, MetricValue]]:
        """The named sections (a copy)."""
        return {k: dict(v) for k, v in self._sections.items() if k is not None}

    def __getitem__(self, name: str) -> Any:
        if name in self._sections and name is not None:
            return dict(self._sections[name])
        for values in self._sections.values():
            if name in values:
                return values[name]
        known = ", ".join(self.metrics) or "none"
        raise KeyError(f"no metric {name!r} in {self.title!r}; known: {known}")

    def __contains__(self, name: object) -> bool:
        return any(name in values for values in self._sections.values()) or (
            name is not None and name in self._sections
        )

    def __repr__(self) -> str:
        return f"Metrics(title={self.title!r}, metrics={self.to_dict()['metrics']!r})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable ``{"title": ..., "metrics": {...}}``: top-level metrics, then one
        nested dict per section (bare names still resolve, see ``MetricsDict``); nan/inf become
        ``None``."""
        metrics = MetricsDict((k, _json_safe(v)) for k, v in self._sections[None].items())
        for key, values in self._sections.items():
            if key is not None:
                metrics[key] = {k: _json_safe(v) for k, v in values.items()}
        return {"title": self.title, "metrics": metrics}

    def to_json(self, indent: int | None = None) -> str:
        """``to_dict()`` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def format(self) -> str:
        """The report as plain text: one metric/value/unit table per section, under the title."""
        parts = [self.title]
        for key, values in self._sections.items():
            if not values:
                continue
            rows = [{"metric": k, "value": v, "unit": _unit(k)} for k, v in values.items()]
            parts.append(format_table(rows, ["metric", "value", "unit"], title=key and f"[{key}]"))
        return "\n".join(parts)

    def add_handler(self, handler: MetricsHandler) -> Metrics:
        """Send this report's ``emit()`` to ``handler`` (instead of the defaults); returns self."""
        if not callable(handler):
            raise TypeError(f"metrics handler must be callable, got {type(handler).__name__}")
        self._handlers.append(handler)
        return self

    @classmethod
    def set_default_handlers(cls, handlers: Iterable[MetricsHandler]) -> None:
        """Replace the process-wide handlers used by reports without handlers of their own."""
        new = list(handlers)
        for h in new:
            if not callable(h):
                raise TypeError(f"metrics handler must be callable, got {type(h).__name__}")
        with cls._defaults_lock:
            cls._default_handlers = new

    @classmethod
    def default_handlers(cls) -> list[MetricsHandler]:
        """The process-wide handlers (a terminal table on stdout unless replaced)."""
        with cls._defaults_lock:
            return list(cls._default_handlers) or [TerminalHandler()]

    def emit(self, handler: MetricsHandler | None = None) -> None:
        """Send the report to ``handler`` if given, else to its own or the default handlers."""
        handlers = [handler] if handler is not None else (self._handlers or self.default_handlers())
        for h in handlers:
            h(self)


class TerminalHandler:
    """Prints the report as an aligned table (to stdout unless another stream is given)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def __call__(self, metrics: Metrics) -> None:
        out = self.stream if self.stream is not None else sys.stdout
        out.write(metrics.format() + "\n")
        out.flush()


class JSONHandler:
    """Writes the report as one JSON document per line (stdout unless another stream is given)."""

    def __init__(self, stream: TextIO | None = None, indent: int | None = None) -> None:
        self.stream = stream
        self.indent = indent

    def __call__(self, metrics: Metrics) -> None:
        out = self.stream if self.stream is not None else sys.stdout
        out.write(metrics.to_json(indent=self.indent) + "\n")
        out.flush()


_HANDLERS: dict[str, Callable[..., MetricsHandler]] = {
    "terminal": TerminalHandler,
    "table": TerminalHandler,
    "json": JSONHandler,
}


def get_handler(name: str, stream: TextIO | None = None) -> MetricsHandler:
    """A handler by name: "terminal" (alias "table") or "json", writing to ``stream``."""
    try:
        factory = _HANDLERS[name]
    except KeyError:
        known = ", ".join(sorted(_HANDLERS))
        raise ValueError(f"unknown metrics format {name!r}; expected one of {known}") from None
    return factory(stream=stream)
