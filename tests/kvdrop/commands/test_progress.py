"""ProgressBar: rendering, TTY vs log-line output, throttling, phases, silence."""

from __future__ import annotations

import io

import pytest

from kvdrop.commands.progress import ProgressBar, format_duration


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_format_duration() -> None:
    assert format_duration(0) == "0:00"
    assert format_duration(75.2) == "1:15"
    assert format_duration(3725) == "1:02:05"
    assert format_duration(float("inf")) == "?"
    assert format_duration(float("nan")) == "?"
    assert format_duration(-1) == "?"


def test_render_rate_and_eta() -> None:
    clock = FakeClock()
    bar = ProgressBar(10, label="decode", width=10, clock=clock, stream=io.StringIO())
    clock.now += 1.0
    bar.update(1)
    assert bar.render().endswith("ETA ?")  # one completion: no rate to extrapolate yet
    clock.now += 3.0
    bar.update(4)
    assert bar.render() == "decode [####......] 4/10 1.00 req/s ETA 0:06"
    bar.done = 10
    assert bar.render().endswith("10/10 2.50 req/s in 0:04")


def test_non_tty_prints_lines_at_most_every_interval_plus_final() -> None:
    clock = FakeClock()
    out = io.StringIO()
    bar = ProgressBar(stream=out, is_tty=False, line_interval=5.0, clock=clock)
    bar(0, 100, "prefill")
    for done in range(1, 101):
        clock.now += 0.1  # 10 s in total
        bar(done, 100, "prefill")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("prefill [") and " 0/100 " in lines[0]
    assert lines[-1].startswith("prefill [" + "#" * 30 + "] 100/100")
    assert 2 <= len(lines) <= 4  # start, one or two throttled lines, final


def test_tty_redraws_in_place_and_ends_line_on_completion() -> None:
    clock = FakeClock()
    out = io.StringIO()
    bar = ProgressBar(stream=out, is_tty=True, min_interval=0.0, clock=clock)
    for done in range(4):
        clock.now += 1
        bar(done, 3, "modify")
    text = out.getvalue()
    assert text.count("\r") == 4
    assert text.endswith("3/3 1.00 req/s in 0:03\n")
    assert text.count("\n") == 1


def test_phase_change_restarts_clock_and_line() -> None:
    clock = FakeClock()
    out = io.StringIO()
    bar = ProgressBar(stream=out, is_tty=True, min_interval=0.0, clock=clock)
    bar(0, 2, "prefill")
    clock.now += 1
    bar(1, 2, "prefill")
    clock.now += 10
    bar(0, 4, "decode")
    clock.now += 1
    bar(1, 4, "decode")
    clock.now += 1
    bar(2, 4, "decode")
    last = out.getvalue().split("\r")[-1]
    assert last.startswith("\x1b[2Kdecode [")
    assert "2/4 1.00 req/s ETA 0:02" in last
    # The unfinished prefill line was closed before decode began.
    assert "1/2" in out.getvalue().split("\n")[0]


def test_eta_follows_the_rate_after_the_first_completion() -> None:
    """Batched work: the first request takes the pipeline's latency (here 60 s), the rest come
    one a second. A rate since the start said "ETA 4:20" for a phase that ended in 0:34."""
    clock = FakeClock()
    bar = ProgressBar(16, clock=clock, stream=io.StringIO())
    clock.now += 60.0
    bar.update(1)
    clock.now += 2.0
    bar.update(3)
    assert bar.render().endswith("ETA 0:13")  # 13 left at 1 req/s (start-based: 4:29)


def test_label_and_phase_make_the_title() -> None:
    clock = FakeClock()
    bar = ProgressBar(label="baseline: prefill", stream=io.StringIO(), clock=clock)
    assert bar.title == "baseline: prefill"
    bar(0, 2, "prefill")  # the label already names the phase
    assert bar.render().startswith("baseline: prefill [")
    bar(0, 2, "decode")
    assert bar.render().startswith("baseline: prefill decode [")
    assert ProgressBar(stream=io.StringIO()).title == ""


def test_silent_writes_nothing() -> None:
    out = io.StringIO()
    with ProgressBar(stream=out, silent=True, is_tty=True, min_interval=0.0) as bar:
        for i in range(5):
            bar(i, 4, "x")
    assert out.getvalue() == ""


def test_unknown_total_and_bad_arguments() -> None:
    bar = ProgressBar(stream=io.StringIO(), clock=FakeClock())
    bar.done = 3
    assert bar.render().startswith("3 0.00 req/s")
    with pytest.raises(ValueError, match="width"):
        ProgressBar(width=0)
    with pytest.raises(ValueError, match="total"):
        ProgressBar(total=-1)
