"""benchmarks/decode_gain.py's end-to-end table: every run charged its own prefill."""

from __future__ import annotations

import math
from typing import Any

import pytest
from _bench import load_benchmark

decode_gain = load_benchmark("decode_gain")


def _row(run: str, prefill: float, decode: float, **kw: Any) -> dict[str, Any]:
    return {
        "run": run,
        "prefill_s": prefill,
        "reconstruct_s": kw.get("recon"),
        "modify_s": kw.get("modify"),
        "decode_s": decode,
        "gain": kw.get("gain", 1.0),
        "shared_prefill": kw.get("shared", False),
    }


@pytest.mark.parametrize("share", [False, True])
def test_totals_add_up_and_shared_prefill_is_charged(share: bool) -> None:
    rows = [
        _row("baseline", 20.0, 24.0),
        _row("chunk-halving", 3.0, 11.0, modify=2.0, gain=2.1, shared=share),
        _row("kvzip", 90.0, 11.0, recon=70.0, modify=1.0, gain=2.2),
    ]
    e2e = decode_gain.end_to_end(rows, share_prefill=share)
    for out, row in zip(e2e, rows, strict=True):
        parts = out["prefill_s"] + out["reconstruct_s"] + out["modify_s"] + out["decode_s"]
        assert out["total_s"] == pytest.approx(parts)
        assert out["decode_gain"] == row["gain"]
    assert e2e[0]["total_s"] == 44.0 and e2e[0]["e2e_gain"] == 1.0
    # A run whose prefill only loaded the baseline's KV pays the baseline's prefill, not 3 s.
    assert e2e[1]["prefill_s"] == (20.0 if share else 3.0)
    assert e2e[1]["prefill_charged"] == ("baseline's (shared)" if share else "own")
    # kvzip's pass is reported apart from its prefill and charged once.
    assert (e2e[2]["prefill_s"], e2e[2]["reconstruct_s"]) == (20.0, 70.0)
    assert e2e[2]["e2e_gain"] == pytest.approx(44.0 / 102.0)
    assert not math.isnan(e2e[1]["e2e_gain"])


def test_decode_phases_sum_to_the_phase() -> None:
    engine = {
        "decode_step_seconds": 5.0,
        "graph_capture_seconds": 0.5,
        "prefill_step_seconds": 1.0,
        "load_apply_seconds": 0.25,
        "ship_seconds": 1.0,
        "window_seconds": 0.75,
        "idle_seconds": 2.0,
    }
    phases = decode_gain.decode_phases(engine, 10.0)
    assert phases["ship_s"] == 0.25 and phases["window_s"] == 0.75  # window apart from ship
    parts = sum(v for k, v in phases.items() if k != "decode_s")
    assert phases["decode_s"] == 10.0 and parts == pytest.approx(10.0)
    assert phases["other_s"] == pytest.approx(0.25)


def test_idle_time_outside_the_phase_is_not_a_part_of_it() -> None:
    """The engine's counters cover a little more than the phase (from its reset to its
    snapshot); the loop was idle for that difference, so it comes off ``idle_s``."""
    engine = {
        "decode_step_seconds": 5.0,
        "graph_capture_seconds": 0.0,
        "prefill_step_seconds": 1.0,
        "load_apply_seconds": 0.0,
        "ship_seconds": 1.0,
        "window_seconds": 0.5,
        "idle_seconds": 3.0,
        "seconds": 10.5,
    }
    phases = decode_gain.decode_phases(engine, 10.0)
    assert phases["idle_s"] == pytest.approx(2.5) and phases["other_s"] == pytest.approx(0.5)


def test_a_real_runs_decode_parts_are_never_negative_and_sum_to_the_phase() -> None:
    """A whole (tiny, CPU) run: every part of every run's decode phase is >= 0 (ship_s once
    came out -0.6 s on a GPU: window time counted outside ship time was taken off it) and the
    parts sum to ``decode_s``."""
    args = decode_gain.parse_args(
        "--model-preset tiny --num-requests 3 --prompt-tokens 600 --max-tokens 6 "
        "--policy chunk-halving snapkv --no-warmup".split()
    )
    report = decode_gain.measure(args, decode_gain.build_model(args))
    for row in report["runs"]:
        phases = row["phases"]
        parts = {k: v for k, v in phases.items() if k != "decode_s"}
        assert all(v >= 0 for v in parts.values()), (row["run"], parts)
        assert sum(parts.values()) == pytest.approx(phases["decode_s"])
        assert row["job_failed"] == 0 and row["job_s"] > 0  # the pipelined job ran whole
        assert len(row["job_timeline"]) == 3 and row["job_engine"]["steps"] > 0
    e2e = report["end_to_end"]
    assert e2e[1]["e2e_gain"] == pytest.approx(e2e[0]["job_s"] / e2e[1]["job_s"])
    # By default each edit moves only what its policy reads: chunk-halving no KV byte (the
    # server keeps the rows), snapkv the keys.
    paths = {row["run"]: (row["edit_path"], row["kv_MB_per_edit"]) for row in report["runs"]}
    assert paths["chunk-halving"] == ("index", 0.0)
    assert paths["snapkv"][0] == "keys" and paths["snapkv"][1] > 0


def test_job_spans_say_how_long_decodes_ran_before_the_last_prefill_and_edit_ended() -> None:
    timeline = {
        "a": {"prefill_start": 0.0, "prefill_end": 1.0, "modify_start": 1.0, "modify_end": 1.5,
              "decode_start": 1.5, "decode_end": 4.0},
        "b": {"prefill_start": 0.0, "prefill_end": 3.0, "modify_start": 3.0, "modify_end": 3.25,
              "decode_start": 3.25, "decode_end": 5.0},
    }  # fmt: skip
    spans = decode_gain.job_spans(timeline)
    assert spans["last_prefill_end"] == 3.0 and spans["first_decode_start"] == 1.5
    assert spans["decode_before_prefill_end"] == 1.5
    assert spans["decode_before_modify_end"] == 1.75
    assert spans["last_decode_end"] == 5.0
    # the baseline's job: decodes only
    plain = decode_gain.job_spans({"a": {"decode_start": 0.0, "decode_end": 2.0}})
    assert plain["last_prefill_end"] is None and plain["decode_before_prefill_end"] is None


def test_prefill_phases_put_the_capture_apart_and_leave_the_wait() -> None:
    """The prefill phase's split (issue 31: where a query engine's prefill time goes): the
    window finalising apart from the rest of shipping, and what the loop did not spend working
    (waiting for the stores the phase awaits) as ``rest_s``, never negative."""
    engine = {
        "prefill_step_seconds": 16.0,
        "window_seconds": 0.5,
        "ship_seconds": 1.0,
        "load_apply_seconds": 0.25,
        "reconstruction_seconds": 0.0,
        "steps": 40,
    }
    phases = decode_gain.prefill_phases(engine, 20.0, 10)
    assert phases["window_s"] == 0.5 and phases["ship_s"] == 0.5
    assert phases["rest_s"] == pytest.approx(2.75) and phases["window_ms_per_req"] == 50.0
    parts = ("steps_s", "window_s", "ship_s", "load_apply_s", "reconstruct_s", "rest_s")
    assert sum(phases[p] for p in parts) == pytest.approx(20.0)
    assert decode_gain.prefill_phases(engine, 10.0, 10)["rest_s"] == 0.0


def test_the_query_engine_is_built_after_the_first_engine_is_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine sits in reference cycles: ``del`` alone kept the baseline engine's KV cache (and
    on a GPU its decode graphs) alive while the query engine was built beside it (issue 31)."""
    import weakref

    from kvdrop_engine.engine import Engine

    built: list[weakref.ref[Engine]] = []
    alive_at_build: list[bool] = []
    init = Engine.__init__

    def recording(self: Engine, *args: Any, **kwargs: Any) -> None:
        alive_at_build.append(any(ref() is not None for ref in built))
        init(self, *args, **kwargs)
        built.append(weakref.ref(self))

    monkeypatch.setattr(Engine, "__init__", recording)
    args = decode_gain.parse_args(
        "--model-preset tiny --prompt-tokens 300 600 --max-prefill-tokens 1024 --share-prefill "
        "--num-requests 2 --max-tokens 4 --policy snapkv --no-job --no-warmup".split()
    )
    report = decode_gain.measure(args, decode_gain.build_model(args))
    assert [r["run"] for r in report["runs"]] == ["baseline", "snapkv"]
    assert alive_at_build == [False, False]
    base, snapkv = report["runs"]
    assert base["query_B_per_tok"] == 0 < snapkv["query_B_per_tok"]
    assert snapkv["prefill_phases"]["window_s"] > 0
    assert snapkv["prefill_phases"]["window_store_s_per_req"] > 0
    assert base["prefill_phases"]["window_store_s_per_req"] == 0
