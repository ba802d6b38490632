"""benchmarks/decode_cut_cost.py on the tiny preset: every policy's batched ranking keeps the
library's rows, and the engine's whole cut of the same requests is timed."""

from __future__ import annotations

import json

import pytest
from _bench import load_benchmark

decode_cut_cost = load_benchmark("decode_cut_cost")

pytestmark = pytest.mark.timeout(300)


def test_rows_per_policy_and_batch(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model-preset", "tiny", "--budget", "96", "--every", "32", "--batch", "1", "3"]
    flags += ["--policies", "rkv", "snapkv", "knorm", "--repeat", "1", "--json"]
    assert decode_cut_cost.main(flags) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["policy"], r["requests"]) for r in rows] == [
        (p, b) for p in ("rkv", "snapkv", "knorm") for b in (1, 3)
    ]
    for r in rows:
        assert r["rows_differing"] == 0 and r["tokens"] == 128
        assert r["cut_ms_per_request"] > 0 and r["batched_ms"] > 0
