"""benchmarks/kvpress_side.py's table: kvpress, kvdrop at chunk 1 and kvdrop eval's records of
the same prompts, joined by seed, task, index and setting (and only from runs of as many prompts
a task, which are the same prompts)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from _bench import load_benchmark

side: Any = load_benchmark("kvpress_side")


def _record(index: int, setting: str, **correct: bool) -> dict[str, Any]:
    return {"seed": 1, "task": "kv", "index": index, "setting": setting, "correct": correct}


def _eval_line(policy: str, keep: float, correct: list[bool], num_samples: int = 8) -> str:
    return json.dumps({
        "policy": policy, "keep_ratio": keep, "setting": "inside", "task": "kv", "length": 1024,
        "samples": list(range(len(correct))), "correct": correct,
        "config": {"seed": 1, "num_samples": num_samples},
    })  # fmt: skip


def test_the_table_joins_eval_records_of_the_same_prompts(tmp_path: pathlib.Path) -> None:
    def answers(c1: bool) -> dict[str, bool]:
        return {"full": True, "kvpress:kvzip:0.25": True, "kvdrop c1:kvzip:0.25": c1}

    records = [_record(0, "inside", **answers(False)), _record(1, "inside", **answers(True))]
    evals = tmp_path / "eval.jsonl"
    lines = [
        _eval_line("full", 1.0, [True, False]),
        _eval_line("kvzip", 0.25, [True, True]),
        _eval_line("kvzip", 0.25, [False, False], num_samples=4),  # other prompts: left out
    ]
    evals.write_text("\n".join(lines) + "\n")
    joined = side.load_eval([evals], 1024, 8)
    assert joined[("kvdrop c256:kvzip:0.25", 1, "kv", 0, "inside")] is True
    rows = {line.split(" | ")[2]: line for line in side.table(records, joined) if "kvzip" in line}
    assert "| 2/2 [" in rows["kvpress"] and "| 1/2 [" in rows["kvdrop c1"]
    assert "| 2/2 [" in rows["kvdrop c256"]
    full = [line for line in side.table(records, joined) if "| eval |" in line]
    assert full and "| 1/2 |" in full[0]  # eval's own full KV on the same prompts


def test_variants_of_one_policy_get_a_row_each() -> None:
    # --no-kvpress --kvdrop-policies: full KV and kvdrop's specs only, one row per spec.
    args = side.parser().parse_args(
        ["--no-kvpress", "--kvdrop-policies", "kvzip", "kvzip(kernel=3,window=64)"]
    )
    assert args.no_kvpress and args.kvdrop_policies == ["kvzip", "kvzip(kernel=3,window=64)"]
    answers = {
        "full": True,
        "kvdrop c1:kvzip:0.25": False,
        "kvdrop c1:kvzip(kernel=3,window=64):0.25": True,
    }
    rows = list(side.table([_record(0, "inside", **answers)], {}))
    names = [line.split(" | ")[0].lstrip("| ") for line in rows[2:]]
    assert names == ["full KV", "kvzip", "kvzip(kernel=3,window=64)"]
    assert "| 1/1 [" in rows[-1] and "| 0/1 [" in rows[-2]
