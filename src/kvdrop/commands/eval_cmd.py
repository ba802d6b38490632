"""``kvdrop eval``: the command over :mod:`kvdrop.experiments.eval`, its tables and its plot
(accuracy with its 95% Wilson band per policy).

Flags pick a preset grid (``default``: docs/quality.md's; ``quick``: CI's) and override any of
its axes. The terminal report has every row (for small grids), the rows pooled over tasks and
lengths per setting, and full KV per length and task (the ceiling); ``--json`` prints the rows
instead, ``--plot`` draws accuracy against keep ratio per policy (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvdrop.commands.args import add_model_arguments
from kvdrop.experiments.eval import (
    FULL,
    PRESETS,
    EvalConfig,
    EvalError,
    EvalReport,
    keep_ratio_value,
)
from kvdrop.experiments.tasks import SETTINGS, TASKS

__all__ = ["add_arguments", "config_from_args", "format_report", "plot_report", "run"]

PLOT_HINT = "--plot needs matplotlib: pip install 'kvdrop[plot]' (or leave out --plot)"
#: Marker and line-style cycles of the plot: with 20 colours, no two of the first 80 policies share
#: colour, marker and line style.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")


def _default(axis: str) -> str:
    """The default preset's value of a grid axis, as the flags take it."""
    value = PRESETS["default"][axis]
    if value is None:
        return "every registered policy"
    if isinstance(value, (tuple, list)):
        return " ".join(str(v) for v in value)
    return str(value)


def _keep_ratio_arg(text: str) -> float:
    """``--keep-ratios`` values, checked by the eval grid's own rule (``keep_ratio_value``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    try:
        return keep_ratio_value(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvdrop eval`` (heavy imports stay in ``run``)."""
    grid = parser.add_argument_group("grid (each flag overrides the --preset's value)")
    grid.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="'default': every registered policy x keep 0.75/0.5/0.25 x 1024 tokens x 4 tasks x "
        "2 settings x 6 samples (docs/quality.md); 'long': kvzip, snapkv, knorm x keep 0.5/0.25 "
        "x 1024/2048/4096 tokens x 12 samples (add 8192 with --lengths); 'quick': a CI smoke run",
    )
    grid.add_argument(
        "--policies",
        nargs="+",
        metavar="NAME",
        help="policies or spec strings (default: every registered one, plugins included)",
    )
    grid.add_argument(
        "--keep-ratios",
        nargs="+",
        type=_keep_ratio_arg,
        metavar="R",
        help=f"keep ratios in (0, 1); full KV is always a row (default: {_default('keep_ratios')})",
    )
    grid.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        metavar="N",
        help=f"prompt tokens (default: {_default('lengths')})",
    )
    grid.add_argument(
        "--tasks",
        nargs="+",
        metavar="TASK",
        help=f"of: {', '.join(TASKS)} (default: {_default('tasks')})",
    )
    grid.add_argument(
        "--settings",
        nargs="+",
        metavar="S",
        help=f"of: {', '.join(SETTINGS)} (default: {' '.join(SETTINGS)})",
    )
    grid.add_argument(
        "--num-samples",
        type=int,
        metavar="N",
        help=f"prompts per task and length (default: {_default('num_samples')})",
    )
    _output_arguments(parser)


def _output_arguments(parser: argparse.ArgumentParser) -> None:
    meas = parser.add_argument_group("measurement")
    meas.add_argument("--max-tokens", type=int, default=8, help="answer tokens (default 8)")
    meas.add_argument("--chunk-size", type=int, default=256, help="server chunk size (256)")
    meas.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    meas.add_argument(
        "--no-rerotate",
        action="store_true",
        help="leave kept keys at their old RoPE positions (default: re-rotate to 0..k-1)",
    )
    meas.add_argument(
        "--batch-tokens",
        type=int,
        default=8192,
        help="prompt tokens run at once (memory: about 0.4 MB per token, float32, with queries)",
    )
    dec = parser.add_argument_group(
        "decode-time mode (--decode-budget: what a budget while decoding costs, beside full KV; "
        "--policies, --tasks, --lengths (the first), --num-samples and --max-tokens apply)"
    )
    dec.add_argument(
        "--decode-budget",
        type=int,
        metavar="TOKENS",
        help="cut each sequence back to this many tokens while it decodes (kvdrop engine "
        "--decode-budget); policies default to rkv snapkv tova streaming",
    )
    dec.add_argument(
        "--decode-every", type=int, default=128, help="generated tokens between cuts (128)"
    )
    dec.add_argument(
        "--decode-tokens",
        type=int,
        default=2048,
        help="teacher-forced continuation per text for top-1 agreement and KL (2048)",
    )
    dec.add_argument(
        "--preface-tokens",
        type=int,
        default=0,
        help="tokens the model writes after the context before the question is asked "
        "(accuracy on the cut cache; 0 = fidelity only)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--results",
        metavar="FILE.jsonl",
        help="append each finished cell here; a rerun skips the cells already in it (resume)",
    )
    out.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    out.add_argument("--plot", metavar="FILE.png", help="accuracy vs keep ratio per policy")
    out.add_argument("--detail", action="store_true", help="print every row, even for big grids")
    out.add_argument("--no-progress", action="store_true", help="no progress bar or log lines")
    add_model_arguments(parser, random_preset=False)


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The preset's grid with every axis the flags give replaced."""
    grid = dict(PRESETS[args.preset])
    for axis in ("policies", "keep_ratios", "lengths", "tasks", "settings", "num_samples"):
        value = getattr(args, axis)
        if value is not None:
            grid[axis] = tuple(value) if isinstance(value, list) else value
    return EvalConfig(
        policies=grid["policies"],
        keep_ratios=tuple(grid["keep_ratios"]),
        lengths=tuple(grid["lengths"]),
        tasks=tuple(grid["tasks"]),
        settings=tuple(grid.get("settings", SETTINGS)),
        num_samples=grid["num_samples"],
        max_tokens=args.max_tokens,
        chunk_size=args.chunk_size,
        seed=args.seed,
        rerotate=not args.no_rerotate,
        batch_tokens=args.batch_tokens,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
    )


def run_decode(args: argparse.Namespace) -> int:
    """``kvdrop eval --decode-budget``: the decode-time fidelity (and accuracy after a preface)
    report (:mod:`kvdrop.experiments.decode_eval`)."""
    from kvdrop.experiments.decode_eval import (
        DEFAULT_DECODE_POLICIES,
        DecodeEvalConfig,
        format_decode_report,
        run_decode_eval,
    )
    from kvdrop.experiments.tasks import DEFAULT_TASKS

    config = DecodeEvalConfig(
        budget=args.decode_budget,
        every=args.decode_every,
        decode_tokens=args.decode_tokens,
        preface_tokens=args.preface_tokens,
        policies=tuple(args.policies or DEFAULT_DECODE_POLICIES),
        tasks=tuple(args.tasks or DEFAULT_TASKS),
        length=args.lengths[0] if args.lengths else 512,
        num_samples=args.num_samples or 2,
        max_tokens=args.max_tokens,
        seed=args.seed,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
    )
    log = (lambda msg: None) if args.no_progress else (lambda msg: print(msg, file=sys.stderr))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        report = run_decode_eval(config, log=log)
    except (ValueError, KeyError) as exc:
        print(f"kvdrop eval: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_decode_report(report))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the grid and print the report; 0 on success, 2 on bad flags or a missing extra."""
    if args.decode_budget is not None:
        return run_decode(args)
    import kvdrop
    from kvdrop.commands.progress import ProgressBar
    from kvdrop.experiments.eval import run_eval

    def fail(msg: str) -> int:
        print(f"kvdrop eval: error: {msg}", file=sys.stderr)
        return 2

    try:
        config = config_from_args(args)
        config.validate()
        for name in config.policies or ():
            kvdrop.describe(name)  # an unknown name fails before the model loads
    except (ValueError, KeyError, kvdrop.PolicyConflictError) as exc:
        return fail(str(exc))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return fail(PLOT_HINT)
    log = (lambda msg: None) if args.no_progress else (lambda msg: print(msg, file=sys.stderr))
    bar = ProgressBar(label="eval", unit="run", silent=args.no_progress)
    try:
        with bar:
            report = run_eval(config, results=args.results, progress=bar, log=log)
    except (EvalError, ValueError, KeyError) as exc:
        return fail(str(exc))
    if args.plot:
        plot_report(report, args.plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report, detail=args.detail or None))
        if args.plot:
            print(f"\nplot: {args.plot}")
    return 0


# ---------------------------------------------------------------------------------------------
# Tables and plot
# ---------------------------------------------------------------------------------------------


def _cells(rows: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> list[dict[str, Any]]:
    """Rows as table cells: the ``labels`` fields, then the measurements, formatted."""
    out = []
    for r in rows:
        row = {k: r[k] for k in labels}
        row.update(
            keep=f"{r['keep_ratio']:.2f}",
            correct=f"{r['correct']}/{r['n']}",
            accuracy=f"{r['accuracy']:.2f}",
            ci95=f"{r['ci_low']:.2f}-{r['ci_high']:.2f}",
            kl=f"{r['kl']:.3f}",
            top1=f"{r['top1_agreement']:.2f}",
            kept=f"{r['kept_fraction']:.2f}",
            modify_ms=f"{r['modify_ms']:.0f}",
            cost_s=f"{r.get('cost_s', 0.0):.1f}",
        )
        out.append(row)
    return out


def format_report(report: EvalReport, *, detail: bool | None = None) -> str:
    """The terminal report: every row (up to 80, or all with ``detail``), the rows pooled over
    tasks and lengths per setting, full KV per length and task, and the setup."""
    from kvdrop_sdk.table import format_table

    rows = report.rows
    parts = []
    if detail or (detail is None and len(rows) <= 80):
        labels = ("task", "setting", "length", "policy")
        parts.append(format_table(_cells(rows, labels), title="accuracy and fidelity per cell"))
    else:
        parts.append(f"{len(rows)} rows: --detail prints them, --json and --results keep them")
    parts.append(
        format_table(
            _cells(report.pooled(), ("setting", "policy")),
            title="pooled over tasks and lengths (accuracy over all answers; kl, top1 over all "
            "answer positions; kept: fraction of the prompt decoded from)",
        )
    )
    full = [
        r for r in report.pooled(("length", "task", "policy", "keep_ratio")) if r["policy"] == FULL
    ]
    parts.append(
        format_table(
            [
                {k: c[k] for k in ("length", "task", "correct", "accuracy", "ci95")}
                for c in _cells(full, ("length", "task"))
            ],
            title="full KV per length and task (the ceiling; both settings)",
        )
    )
    s = report.setup
    parts.append(
        f"model {s['model']} ({s['dtype']}); {s['num_samples']} samples per task and length; "
        f"chunk size {s['chunk_size']}; {s['max_tokens']} answer tokens; re-rotation "
        f"{'on' if s['rerotate'] else 'off'}; {s['machine']}, {s['torch_threads']} torch "
        f"threads; wall time {s['wall_seconds']:.0f} s"
    )
    if report.skipped:
        parts.append("left out: " + "; ".join(f"{k} ({v})" for k, v in report.skipped.items()))
    return "\n\n".join(parts)


def plot_style(i: int) -> dict[str, Any]:
    """The ``i``-th policy's colour index (of tab20), marker and line style: colours cycle every
    20, markers every 8, line styles every 20: no two of the first 80 policies look alike."""
    return {
        "color": i % 20,
        "marker": MARKERS[i % len(MARKERS)],
        "linestyle": LINESTYLES[(i // 20) % len(LINESTYLES)],
    }


def plot_report(report: EvalReport, path: str | Path) -> None:
    """Accuracy vs keep ratio per policy with its 95% Wilson band, pooled over tasks and lengths,
    one panel per setting, full KV as a dotted line; a PNG at ``path``. Needs matplotlib
    (``pip install 'kvdrop[plot]'``).
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise EvalError(PLOT_HINT) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pooled = report.pooled()
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in pooled)]
    policies = [p for p in report.setup["grid"]["policies"]]
    fig, axes = plt.subplots(
        1, len(settings), figsize=(5.5 * len(settings) + 2, 4.5), squeeze=False, sharey=True
    )
    cmap = plt.get_cmap("tab20")
    titles = {
        "inside": "question inside the compressed prompt",
        "after": "question after compression",
    }
    for ax, setting in zip(axes[0], settings):
        mine = [r for r in pooled if r["setting"] == setting]
        for i, policy in enumerate(policies):
            pts = sorted(
                (r["keep_ratio"], r["accuracy"], r["ci_low"], r["ci_high"])
                for r in mine
                if r["policy"] == policy
            )
            if pts:
                xs, ys, lo, hi = zip(*pts)
                style = plot_style(i)
                color = cmap(style["color"])
                ax.plot(
                    xs, ys, style["linestyle"], marker=style["marker"], label=policy, color=color
                )
                ax.fill_between(xs, lo, hi, color=color, alpha=0.12, linewidth=0)
        full = [r["accuracy"] for r in mine if r["policy"] == FULL]
        if full:
            ax.axhline(full[0], color="black", linestyle=":", label="full KV")
        ax.set_title(titles[setting])
        ax.set_xlabel("keep ratio")
        ax.set_xlim(1.0, 0.0)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (pooled over tasks and lengths)")
    axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize="small")
    fig.suptitle(f"{report.setup['model']}: accuracy vs keep ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
