"""Merge ``kvdrop eval --decode-budget ... --json`` reports of disjoint texts (e.g. one per task,
run side by side) into one table: top-1 agreement over every position with its 95% Wilson band,
the mean of the per-text agreements with a 95% band over texts (normal approximation: the
positions of one text are not independent, its texts are), KL and cuts.

    python benchmarks/decode_eval_merge.py out/passkey.json out/kv.json ... [--json]
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from kvdrop.experiments.results import wilson


def merge(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per policy (the reports' order) over all their texts."""
    rows: dict[str, dict[str, Any]] = {}
    for report in reports:
        for r in report["rows"]:
            acc = rows.setdefault(
                r["policy"], {"positions": 0, "agree": 0, "kl": 0.0, "cuts": 0.0, "texts": []}
            )
            acc["positions"] += r["positions"]
            acc["agree"] += round(r["top1_agreement"] * r["positions"])
            acc["kl"] += r["kl_nats"] * r["positions"]
            acc["cuts"] += r["cuts_per_text"] * len(r["per_text"])
            acc["texts"] += r["per_text"]
    out = []
    for policy, a in rows.items():
        lo, hi = wilson(a["agree"], a["positions"])
        texts = a["texts"]
        n = len(texts)
        mean = sum(texts) / n
        sd = math.sqrt(sum((t - mean) ** 2 for t in texts) / (n - 1)) if n > 1 else 0.0
        half = 1.96 * sd / math.sqrt(n)
        out.append(
            {
                "policy": policy,
                "texts": n,
                "positions": a["positions"],
                "top1_agreement": a["agree"] / a["positions"],
                "top1_low": lo,
                "top1_high": hi,
                "text_mean": mean,
                "text_low": max(0.0, mean - half),
                "text_high": min(1.0, mean + half),
                "worst_text": min(texts),
                "kl_nats": a["kl"] / a["positions"],
                "cuts_per_text": a["cuts"] / n,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("reports", nargs="+")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path, encoding="utf-8") as fh:
            reports.append(json.load(fh))
    rows = merge(reports)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    setup = reports[0]["setup"]
    tasks = sorted({t for r in reports for t in r["setup"]["tasks"]})
    print(
        f"{setup['model']} on {setup['device']} ({setup['dtype']}), budget {setup['budget']} "
        f"every {setup['every']}, {setup['decode_tokens']} teacher-forced tokens, prompts of "
        f"{setup['length']} tokens, tasks {' '.join(tasks)}"
    )
    print(
        "policy     texts  top-1   95% band (positions)  per-text mean  95% band (texts)  "
        "worst text  KL nats/token  cuts/text"
    )
    for r in rows:
        print(
            f"{r['policy']:<10} {r['texts']:>5}  {r['top1_agreement']:.3f}  "
            f"{r['top1_low']:.3f}-{r['top1_high']:.3f}           {r['text_mean']:.3f}          "
            f"{r['text_low']:.3f}-{r['text_high']:.3f}       {r['worst_text']:.3f}       "
            f"{r['kl_nats']:.4f}         {r['cuts_per_text']:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
