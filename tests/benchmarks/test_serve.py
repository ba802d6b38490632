"""benchmarks/serve.py's mixed load and goodput: the load's shape and which requests count."""

from __future__ import annotations

import pathlib

import pytest
from _bench import load_benchmark

serve = load_benchmark("serve", "serve_bench")


def test_the_mixed_load_spans_its_ranges_the_same_way_every_run() -> None:
    args = serve.parse_args(["--load", "mixed", "--num-prompts", "200"])
    prompts, outputs = serve.make_mixed(args, 1000)
    lengths = [len(p) for p in prompts]
    assert 1024 <= min(lengths) < 2048 and 8192 < max(lengths) <= 14336  # log-uniform: both ends
    assert 128 <= min(outputs) and max(outputs) <= 2048 and len(set(outputs)) > 100
    again = serve.make_mixed(args, 1000)
    assert again == (prompts, outputs)


def test_goodput_counts_requests_that_meet_both_slos() -> None:
    def result(ttft: float, tpot_ms: float, tokens: int = 11) -> object:
        return serve.Result(0.0, ttft, ttft + tpot_ms * (tokens - 1) / 1e3, tokens)

    results = [result(1.0, 40.0), result(11.0, 10.0), result(2.0, 60.0), result(9.9, 49.0)]
    results.append(serve.Result(error="HTTP 500"))
    row = serve.summarise("run", results, 10.0, {}, (10.0, 50.0))
    assert row["good"] == "2/5" and row["goodput_req_s"] == pytest.approx(0.2)
    assert serve.summarise("run", results, 10.0, {})["good"] == "4/5"  # no SLOs: every answer


def test_the_mixed_budget_holds_every_request_after_its_cut_with_its_own_output() -> None:
    args = serve.parse_args(["--load", "mixed", "--block-size", "16", "--keep-ratio", "0.5"])
    # kept + output: 38 and 107 blocks; the 3,000-token prompt's prefill needs 81 more
    assert serve.default_budget([1000, 3000], args, [100, 200]) == (38 + 107 + 81) * 16
    assert serve.default_budget([1000, 3000], args) == (36 + 98 + 90) * 16  # --max-tokens 64


@pytest.mark.timeout(300)
def test_the_mixed_rate_is_the_factor_times_the_baselines_measured_capacity(
    tmp_path: pathlib.Path,
) -> None:
    out = tmp_path / "mixed.json"
    argv = ["--model-preset", "tiny", "--threads", "1", "--load", "mixed", "--num-prompts", "4"]
    argv += ["--mixed-prompt-tokens", "64", "160", "--mixed-max-tokens", "8", "16"]
    argv += ["--mixed-load-factor", "3", "--json", str(out)]
    assert serve.main(argv) == 0
    import json

    report = json.loads(out.read_text())["reports"][0]
    pilot = report["pilot"]
    assert pilot["tpot_s"] > 0 and pilot["prefill_tok_s"] > 0
    assert report["rate"] == pytest.approx(3 * pilot["capacity_req_s"])
    assert [row["ok"] for row in report["rows"][:2]] == ["4/4", "4/4"]
