"""benchmarks/reconstruct_cost.py on the tiny preset: the pass and the prefill of the same prompt
are timed whole and part by part, over several reconstruction chunks."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark

reconstruct_cost = load_benchmark("reconstruct_cost")

pytestmark = pytest.mark.timeout(300)


def test_parts_of_the_pass_and_the_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model-preset", "tiny", "--prompt-tokens", "40", "70", "--chunk-tokens", "32"]
    flags += ["--max-prefill-tokens", "24", "--repeat", "1", "--json"]
    assert reconstruct_cost.main(flags) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt_tokens"] for r in rows] == [40, 70]
    for r in rows:
        assert r["device"] == "cpu" and r["dtype"] == "float32" and r["threads"] >= 1
        assert r["pass_rows"] > r["prompt_tokens"]  # the context again, plus the prompts
        for part in ("total_s", "proj_mlp_s", "attention_s", "scores_s", "gather_s"):
            assert r[f"pass_{part}"] > 0, part
        assert r["prefill_total_s"] > 0 and r["prefill_attention_s"] > 0
        assert r["pass_x_prefill"] == pytest.approx(r["pass_total_s"] / r["prefill_total_s"])


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--prompt-tokens", "20", "--chunk-tokens", "16", "--repeat", "1"]
    assert reconstruct_cost.main(flags) == 0
    out = capsys.readouterr().out
    assert "x_prefill" in out and "attention_s" in out and "tiny" in out
    assert len([line for line in out.splitlines() if line.strip().startswith("20 ")]) == 2
