"""Results of ``kvdrop eval``: Wilson intervals, aggregation of per-batch records into rows, the
report order, and the JSONL results file an interrupted grid resumes from."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvdrop.experiments.tasks import SETTINGS, TASKS

__all__ = [
    "FULL",
    "KEY",
    "EvalError",
    "aggregate",
    "append_results",
    "load_results",
    "sort_rows",
    "wilson",
]

#: The policy name of the full-KV rows.
FULL = "full"


class EvalError(RuntimeError):
    """The evaluation cannot run as configured, or its measurement would be wrong."""


# ---------------------------------------------------------------------------------------------
# Statistics and aggregation
# ---------------------------------------------------------------------------------------------


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``correct`` successes in ``n`` trials (95% for z=1.96)."""
    if n <= 0:
        return (0.0, 1.0)
    if not 0 <= correct <= n:
        raise ValueError(f"correct must be in [0, n={n}], got {correct}")
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


KEY = ("task", "setting", "length", "policy", "keep_ratio")


def aggregate(
    records: Iterable[Mapping[str, Any]], by: Sequence[str] = KEY
) -> list[dict[str, Any]]:
    """Rows from per-batch records, grouped by the fields ``by`` (the others pooled).

    Accuracy pools the answers; ``kl`` and ``top1_agreement`` are means over every scored
    position; ``kept_fraction`` is the tokens decoded from (kept plus any uncompressed tail) over
    the prompt tokens; ``modify_ms`` the modify phase's wall time per prompt; ``cost_s`` what one
    prompt of the cell cost in wall time: its share of the run's prefill (KVzip's reconstruction
    pass included), modify and decode (the fidelity scoring, eval's own work, left out). A sample
    measured twice (an interrupted batch run again) counts once.
    """
    groups: dict[tuple[Any, ...], dict[tuple[Any, ...], dict[str, Any]]] = defaultdict(dict)
    for rec in records:
        key = tuple(rec[f] for f in by)
        seconds = rec.get("seconds", {})
        share = seconds.get("modify", 0.0) / max(1, len(rec["samples"]))
        cost = sum(seconds.get(k, 0.0) for k in ("prefill", "modify", "decode"))
        cost /= max(1, len(rec["samples"]))
        for i, idx in enumerate(rec["samples"]):
            groups[key][(*(rec[f] for f in KEY), idx)] = {
                "correct": bool(rec["correct"][i]),
                "kl": rec["kl"][i],
                "top1": rec["top1"][i],
                "positions": rec["positions"][i],
                "kept": rec["kept"][i],
                "prompt": rec["prompt"][i],
                "modify_s": share,
                "cost_s": cost,
            }
    rows = []
    for key, samples in groups.items():
        vals = list(samples.values())
        n = len(vals)
        correct = sum(v["correct"] for v in vals)
        positions = sum(v["positions"] for v in vals)
        lo, hi = wilson(correct, n)
        row: dict[str, Any] = dict(zip(by, key))
        row.update(
            n=n,
            correct=correct,
            accuracy=correct / n,
            ci_low=lo,
            ci_high=hi,
            kl=sum(v["kl"] * v["positions"] for v in vals) / positions if positions else 0.0,
            top1_agreement=(
                sum(v["top1"] * v["positions"] for v in vals) / positions if positions else 1.0
            ),
            kept_fraction=sum(v["kept"] for v in vals) / max(1, sum(v["prompt"] for v in vals)),
            modify_ms=1000 * sum(v["modify_s"] for v in vals) / n,
            cost_s=sum(v["cost_s"] for v in vals) / n,
        )
        rows.append(row)
    return rows


def sort_rows(rows: list[dict[str, Any]], policy_order: Sequence[str]) -> list[dict[str, Any]]:
    """Rows in report order: task, setting, length, then full KV and ``policy_order``, keep ratio
    falling (fields a row lacks sort first)."""
    order = {p: i for i, p in enumerate([FULL, *policy_order])}
    tasks = {t: i for i, t in enumerate(TASKS)}
    settings = {s: i for i, s in enumerate(SETTINGS)}
    return sorted(
        rows,
        key=lambda r: (
            tasks.get(r.get("task", ""), -1),
            settings.get(r.get("setting", ""), -1),
            r.get("length", 0),
            order.get(r.get("policy", ""), len(order)),
            -r.get("keep_ratio", 1.0),
        ),
    )


# ---------------------------------------------------------------------------------------------
# Results file
# ---------------------------------------------------------------------------------------------


def load_results(path: Path, fingerprint: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The records of ``path`` (a missing file has none). A line cut short by an interrupted run is
    ignored (its cell runs again); ``EvalError`` when the file holds another configuration's."""
    if not path.exists():
        return []
    records = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict) or "config" not in rec or "samples" not in rec:
                raise EvalError(f"{path}:{lineno} is not a kvdrop eval record")
            if rec["config"] != dict(fingerprint):
                raise EvalError(
                    f"{path} holds results of another configuration ({rec['config']}); this "
                    f"run is {dict(fingerprint)}. Use another --results file or remove it."
                )
            records.append(rec)
    return records


def append_results(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Append ``records`` as JSON lines (after ending a line an interrupted run left open)."""
    cut = False
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    with path.open("a") as f:
        if cut:
            f.write("\n")
        for rec in records:
            f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())
