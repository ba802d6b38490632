"""Rebuild docs/quality.md's accuracy tables from ``kvdrop eval --results`` JSONL files.

Several files (one per seed and length, as docs/data/ holds them) are pooled: a sample is keyed
by its seed, task, setting, length and index, so seed 1's sample 0 and seed 2's sample 0 both
count. Each cell is ``correct/total (fraction of full KV on the same prompts) [Wilson 95%]``;
the fraction divides the policy's correct answers by full KV's on exactly the prompts the policy
was measured on.

    python benchmarks/quality_tables.py docs/data/dev-s1-1024.jsonl docs/data/dev-s2-1024.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvdrop.experiments.results import FULL, wilson

Cell = tuple[str, float, str, int]  # policy, keep ratio, setting, length
Sample = tuple[int, str, int]  # seed, task, index


def load(paths: Iterable[Path]) -> dict[Cell, dict[Sample, bool]]:
    """Every answer, ``{(policy, keep, setting, length): {(seed, task, index): correct}}``."""
    cells: dict[Cell, dict[Sample, bool]] = defaultdict(dict)
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            cell = (rec["policy"], float(rec["keep_ratio"]), rec["setting"], int(rec["length"]))
            seed = int(rec["config"]["seed"])
            for idx, ok in zip(rec["samples"], rec["correct"]):
                cells[cell][(seed, rec["task"], int(idx))] = bool(ok)
    return cells


def cell_text(answers: dict[Sample, bool], full: dict[Sample, bool]) -> str:
    """``c/n (0.93x full) [0.71-0.98]`` for one policy cell."""
    n, c = len(answers), sum(answers.values())
    base = sum(full.get(s, False) for s in answers)
    lo, hi = wilson(c, n)
    frac = f"{c / base:.2f}x" if base else "-"
    return f"{c}/{n} ({frac} full) [{lo:.2f}-{hi:.2f}]"


def fraction(answers: dict[Sample, bool], full: dict[Sample, bool]) -> float:
    base = sum(full.get(s, False) for s in answers)
    return sum(answers.values()) / base if base else 0.0


def table(cells: dict[Cell, dict[Sample, bool]], length: int, keeps: Sequence[float]) -> str:
    """The markdown table of one prompt length: a row per policy, a column per setting x keep."""
    columns = [(s, k) for s in ("inside", "after") for k in keeps]
    full = {s: cells.get((FULL, 1.0, s, length), {}) for s in ("inside", "after")}
    policies = sorted({c[0] for c in cells if c[3] == length and c[0] != FULL})
    head = "| policy | " + " | ".join(f"{s} {k}" for s, k in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    base = [f"{sum(full[s].values())}/{len(full[s])}" for s, _ in columns]
    lines.append("| full KV | " + " | ".join(base) + " |")

    def worst(p: str) -> float:  # sort by the worse of the two settings at the lowest keep
        k = min(keeps)
        return -min(fraction(cells.get((p, k, s, length), {}), full[s]) for s in full)

    for p in sorted(policies, key=worst):
        row = [
            cell_text(cells[(p, k, s, length)], full[s]) if (p, k, s, length) in cells else "-"
            for s, k in columns
        ]
        lines.append(f"| {p} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--keeps", nargs="+", type=float, default=[0.5, 0.25])
    args = parser.parse_args(argv)
    cells = load(args.files)
    for length in sorted({c[3] for c in cells}):
        print(f"\n#### {length} tokens\n")
        print(table(cells, length, args.keeps))


if __name__ == "__main__":
    main()
