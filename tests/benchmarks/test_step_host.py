"""benchmarks/step_host.py at a tiny shape: both parts run and print their tables."""

from __future__ import annotations

import pytest
from _bench import load_benchmark


def test_step_host_prints_the_table_and_loop_parts(capsys: pytest.CaptureFixture[str]) -> None:
    step_host = load_benchmark("step_host")
    step_host.main(
        [
            "--rows",
            "3",
            "--blocks",
            "10",
            "--width",
            "16",
            "--prompt-tokens",
            "20",
            "--max-tokens",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert "changed_rows_ms" in out and "whole_ms" in out
    steps = int(out.strip().splitlines()[-1].split()[1])
    assert steps >= 4  # at least one step per decoded token
