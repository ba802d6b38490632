"""Metrics: values, percentiles, table and JSON output, handler selection."""

from __future__ import annotations

import io
import json
import math

import pytest

from kvdrop_sdk.metrics import (
    JSONHandler,
    Metrics,
    TerminalHandler,
    get_handler,
    percentile,
    summarize,
)


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match=r"within \[0, 100\]"):
        percentile(values, 101)


def test_summarize_names_and_values() -> None:
    s = summarize("ttft", [0.1, 0.2, 0.3])
    assert list(s) == ["ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99"]
    assert s["ttft_mean"] == pytest.approx(0.2)
    assert s["ttft_p50"] == pytest.approx(0.2)
    assert s["ttft_p99"] == pytest.approx(0.298)
    assert all(math.isnan(v) for v in summarize("tpot", []).values())


def test_to_dict_is_json_and_keeps_order() -> None:
    m = Metrics("Batched Stream Metrics (prefill)", {"input_tokens": 1024, "input_tput": 512.5})
    m.add("ttft_mean", float("nan"))
    d = m.to_dict()
    assert d == {
        "title": "Batched Stream Metrics (prefill)",
        "metrics": {"input_tokens": 1024, "input_tput": 512.5, "ttft_mean": None},
    }
    assert json.loads(m.to_json()) == d
    assert m["input_tokens"] == 1024
    assert "input_tput" in m
    with pytest.raises(KeyError, match="known: input_tokens"):
        m["output_tokens"]


def test_bad_values_are_rejected() -> None:
    with pytest.raises(ValueError, match="title"):
        Metrics("")
    with pytest.raises(TypeError, match="metric 'x' must be int, float, str or None"):
        Metrics("t").add("x", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        Metrics("t").add_handler("terminal")  # type: ignore[arg-type]


def test_terminal_table_has_every_metric_and_unit() -> None:
    out = io.StringIO()
    m = Metrics("Decode", {"output_tokens": 96, "output_tput": 1234.5678, "duration": 0.5})
    m.emit(TerminalHandler(out))
    lines = out.getvalue().splitlines()
    assert lines[0] == "Decode"
    assert lines[1].split() == ["metric", "value", "unit"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:]}
    assert rows == {
        "output_tokens": ["96", "tokens"],
        "output_tput": ["1,234.6", "tokens/s"],
        "duration": ["0.5", "s"],
    }


def test_emit_uses_own_then_default_handlers() -> None:
    seen: list[str] = []
    m = Metrics("a", {"duration": 1.0})
    m.add_handler(lambda x: seen.append("own:" + x.title))
    m.emit()
    assert seen == ["own:a"]
    # An explicit handler replaces the registered ones for this call only.
    buf = io.StringIO()
    m.emit(handler=JSONHandler(buf))
    assert json.loads(buf.getvalue()) == {"title": "a", "metrics": {"duration": 1.0}}
    assert seen == ["own:a"]

    previous = Metrics.default_handlers()
    try:
        Metrics.set_default_handlers([lambda x: seen.append("default:" + x.title)])
        Metrics("b").emit()
        assert seen == ["own:a", "default:b"]
    finally:
        Metrics.set_default_handlers(previous)


def test_default_handler_prints_table_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    Metrics("Modify", {"duration": 2.0, "kept_fraction": 0.5}).emit()
    out = capsys.readouterr().out
    assert out.startswith("Modify\n")
    assert "kept_fraction" in out and "0.5" in out


def test_get_handler_by_name() -> None:
    buf = io.StringIO()
    get_handler("json", buf)(Metrics("x", {"n": 1}))
    assert json.loads(buf.getvalue())["metrics"] == {"n": 1}
    buf = io.StringIO()
    get_handler("terminal", buf)(Metrics("x", {"n": 1}))
    assert buf.getvalue().startswith("x\nmetric")
    with pytest.raises(ValueError, match="unknown metrics format 'yaml'; expected one of"):
        get_handler("yaml")


def test_sections_nest_in_to_dict_and_stay_reachable_by_name() -> None:
    m = Metrics("Batched Stream Metrics (decode)", {"note": "x"})
    m.add("num_streams", 30, section="config")
    m.add("duration", 2.0, section="results").add("output_tput", 236.5, section="results")
    # The shape upstream notebooks read: to_dict()["metrics"]["results"]["output_tput"].
    assert m.to_dict() == {
        "title": "Batched Stream Metrics (decode)",
        "metrics": {
            "note": "x",
            "config": {"num_streams": 30},
            "results": {"duration": 2.0, "output_tput": 236.5},
        },
    }
    # Bare names still resolve in the dict (code written against a flat report keeps working),
    # while iteration and JSON show only the nested structure.
    d = m.to_dict()["metrics"]
    assert d["output_tput"] == 236.5 and d.get("num_streams") == 30 and d.get("nope", 7) == 7
    assert list(d) == ["note", "config", "results"]
    assert json.loads(m.to_json()) == m.to_dict()
    with pytest.raises(KeyError):
        d["nope"]
    assert m["output_tput"] == 236.5 and m["results"] == {"duration": 2.0, "output_tput": 236.5}
    assert m.metrics == {"note": "x", "num_streams": 30, "duration": 2.0, "output_tput": 236.5}
    assert m.sections == {"config": {"num_streams": 30}, "results": m["results"]}
    assert "config" in m and "duration" in m and "missing" not in m
    m.add("duration", 3.0, section="results")  # updating in place is fine
    assert m["duration"] == 3.0
    with pytest.raises(ValueError, match="already in section 'results'"):
        m.add("duration", 1.0)
    with pytest.raises(ValueError, match="already in the top level"):
        m.add("note", "y", section="results")
    with pytest.raises(ValueError, match="already a section"):
        m.add("results", 1)
    with pytest.raises(ValueError, match="already a metric"):
        m.add("z", 1, section="note")
    lines = m.format().splitlines()
    assert lines[0] == "Batched Stream Metrics (decode)"
    assert "[config]" in lines and "[results]" in lines
    assert lines.index("[config]") < lines.index("[results]")
