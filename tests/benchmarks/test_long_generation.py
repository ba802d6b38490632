"""benchmarks/long_generation.py end to end on the tiny preset: one row per run, the cut row
within budget + every, the full row not."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark

long_generation = load_benchmark("long_generation")

pytestmark = pytest.mark.timeout(300)


def test_rows_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model-preset", "tiny", "--num-requests", "3", "--prompt-tokens", "40", "60"]
    flags += ["--max-tokens", "80", "--kv-budget-tokens", "512", "--decode-budget", "32"]
    flags += ["--decode-every", "8", "--decode-policy", "rkv", "knorm", "--json"]
    assert long_generation.main(flags) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["run"] for r in rows] == ["full", "rkv", "knorm"]
    assert all(r["output_tokens"] == 3 * 80 and not r["partial"] for r in rows)
    full, *cut = rows
    assert full["decode_cuts"] == 0 and full["peak_kv_per_request"] > 100
    for row in cut:
        assert row["decode_cuts"] > 0 and row["peak_kv_per_request"] <= 40
        assert row["kv_tokens_per_step"] < full["kv_tokens_per_step"]
