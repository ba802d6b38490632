"""benchmarks/step_host.py at a tiny shape: every part runs and prints its table."""

from __future__ import annotations

import pytest
from _bench import load_benchmark


def test_step_host_prints_the_table_loop_and_slice_parts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    step_host = load_benchmark("step_host")
    args = "--rows 3 --blocks 10 --width 16 --prompt-tokens 20 --max-tokens 4 --slices 256"
    step_host.main(args.split())
    out = capsys.readouterr().out
    assert "changed_rows_ms" in out and "whole_ms" in out
    loop = out.split("engine loop")[1].split("3,000-token")[0].strip().splitlines()
    assert int(loop[-1].split()[1]) >= 4  # at least one step per decoded token
    # 2,999 scored rows at 256 a step (the scoring bound, SCORE_ROWS_PER_STEP): 12 steps
    assert out.strip().splitlines()[-1].split()[:2] == ["256", "12"]
